"""The device augmentation's guards against what crashed it on an H100: uninitialised memory, gather
indices outside their source, a CUDA error taken for a bad file, the decoder racing queued kernels."""

from __future__ import annotations

import pytest
import torch

import yolokit.data.augment.device_augment as device_augment
import yolokit.data.augment.pass_stream as pass_stream
from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader
from yolokit.data.augment.device_augment import augment_batch

CASES = {"mosaic": {}, "mixup": dict(mixup=1.0), "no-mosaic": dict(mosaic=0.0, degrees=10.0, shear=2.0)}


def _batch(yaml, *, seed=0, batch=8, imgsz=64, hyp=None, **kw):
    ds = DetectionDataset(yaml, "train", imgsz=imgsz, augment=True, hyp=AugmentConfig(**(hyp or {})), **kw)
    return next(iter(build_dataloader(ds, batch, workers=0, seed=seed, uint8_images=True, augment_on="device")))


@pytest.fixture
def deterministic_fill():
    """PyTorch's own detector of uninitialised memory: with deterministic algorithms on and
    ``fill_uninitialized_memory``, every ``torch.empty`` comes filled with NaN (floats) or the
    largest value (integers), so a read of memory nothing wrote changes the result."""
    import torch.utils.deterministic as det

    before = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before[0])
    det.fill_uninitialized_memory = before[1]


@pytest.mark.parametrize("batch,imgsz,chunk", [(1, 64, None), (5, 96, 3000), (8, 64, None)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_no_uninitialised_memory_and_every_index_inside(shapes_yaml, case, seed, batch, imgsz, chunk, monkeypatch):
    """The pass's images are the same with every torch.empty filled (NaN, the largest integer) and every
    gather index checked; ``chunk``: the resize and the warp cut into many chunks (one image per warp
    step), whose edges are where a slice left unwritten would show, and the same images as in one."""
    b = _batch(shapes_yaml, seed=seed, batch=batch, imgsz=imgsz, hyp=CASES[case])
    plain = augment_batch(b, "cpu")
    if chunk:
        monkeypatch.setattr(device_augment, "CHUNK", chunk)
        assert torch.equal(augment_batch(b, "cpu"), plain)
    import torch.utils.deterministic as det

    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = True
    monkeypatch.setattr(device_augment, "CHECK_INDICES", True)    # every gather index read back and checked
    try:
        filled = augment_batch(b, "cpu")
    finally:
        torch.use_deterministic_algorithms(False)
        det.fill_uninitialized_memory = False
    assert filled.shape == (batch, 3, imgsz, imgsz) and torch.equal(filled, plain)


def test_the_fill_does_show_a_read_of_unwritten_memory(deterministic_fill):
    """The detector above is live: an empty tensor read before it is written is not zeros."""
    assert torch.empty(4).isnan().all() and bool((torch.empty(4, dtype=torch.uint8) == 255).all())


def test_a_tile_outside_its_source_is_refused_with_the_files(shapes_yaml):
    b = _batch(shapes_yaml)
    tiles = b["aug_tiles"].copy()
    image, view, tile = next(zip(*(tiles[..., 0] >= 0).nonzero(), strict=True))
    tiles[image, view, tile, 5] += 10_000                        # sx: the tile's columns far past its source
    with pytest.raises(ValueError, match=rf"image {image} of the batch reads outside its source.*{b['paths'][0]}"):
        augment_batch({**b, "aug_tiles": tiles}, "cpu")


def test_the_debug_switch_checks_each_gather_and_names_the_files(shapes_yaml, monkeypatch):
    """With the host's tile check out of the way, a tile that reads past the atlas: the debug switch
    raises naming the gather and the files; without it the indices are clamped (no device assert)."""
    b = _batch(shapes_yaml, hyp=dict(mosaic=0.0))
    tiles = b["aug_tiles"].copy()
    tiles[..., 6] = torch.where(torch.from_numpy(tiles[..., 0] >= 0), 10**6, -1).numpy()    # sy: far below
    monkeypatch.setattr(device_augment, "_check_tiles", lambda *a: None)
    bad = {**b, "aug_tiles": tiles}
    monkeypatch.setattr(device_augment, "CHECK_INDICES", True)
    with pytest.raises(IndexError, match=rf"warp index \d+ outside its source of [\d,]+ pixels.*{b['paths'][0]}"):
        augment_batch(bad, "cpu")
    monkeypatch.setattr(device_augment, "CHECK_INDICES", False)
    assert augment_batch(bad, "cpu").shape == (8, 3, 64, 64)      # clamped into the atlas: wrong pixels, no crash


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: device-side assert triggered"),
    RuntimeError("Error while decoding JPEG images: Failed to synchronize CUDA stream: 710"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
])
def test_a_device_error_is_never_taken_for_a_bad_file(shapes_yaml, monkeypatch, caplog, error):
    import torchvision.io

    b = _batch(shapes_yaml)

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(torchvision.io, "decode_jpeg", failing)
    with caplog.at_level("WARNING", logger="yolokit.data"), pytest.raises(type(error)) as raised:
        augment_batch(b, "cpu")
    assert raised.value is error and "rejects it" not in caplog.text   # no file was blamed


def test_a_bad_file_is_still_decoded_another_way(shapes_yaml, monkeypatch, caplog):
    import torchvision.io

    b, real = _batch(shapes_yaml), torchvision.io.decode_jpeg
    expected = augment_batch(b, "cpu")
    calls = []

    def batch_refused(data, *args, **kwargs):     # the batched call fails as for a damaged file; one by one works
        calls.append(len(data) if isinstance(data, list) else 1)
        if isinstance(data, list):
            raise RuntimeError("Error while decoding JPEG images: Corrupt JPEG data")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", batch_refused)
    with caplog.at_level("WARNING", logger="yolokit.data"):
        got = augment_batch(b, "cpu")
    files = len(b["aug_files"])
    assert calls == [files] + [1] * files                         # the batch, then each file on its own
    assert torch.equal(got, expected) and "rejects it" not in caplog.text


class _Log:
    """Fakes of the CUDA stream API, writing what is called, in order, into one list."""

    def __init__(self):
        self.calls, self.pending = [], set()

    def stream_cls(self):
        class Stream:
            def __init__(self, device=None):
                self.name = "pass"

        return Stream

    def event_cls(self):
        log = self

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.id = Event.count

            def record(self, stream=None):
                log.calls.append(f"record e{self.id} on {getattr(stream, 'name', 'current')}")
                log.pending.add(self.id)

            def query(self):
                return self.id not in log.pending

            def synchronize(self):
                log.calls.append(f"wait e{self.id}")
                log.pending.discard(self.id)

        return Event


def test_the_pass_runs_on_its_own_stream_after_the_previous_pass(monkeypatch):
    """On CUDA (faked here): before a pass the host waits for the previous pass's event if it has not run,
    then the pass runs with its stream current, the caller's stream waits for the pass's event, its
    outputs are marked as used by the caller's stream, and the batch's host arrays are held until the
    next pass has waited for this one."""
    log = _Log()
    caller = type("Caller", (), {"name": "caller",
                                 "wait_event": lambda self, e: log.calls.append(f"caller waits e{e.id}")})()
    current = ["caller"]

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream.name)

        def __exit__(self, *exc):
            current.pop()

    class Out:
        is_cuda = True

        def record_stream(self, stream):
            log.calls.append(f"output used on {stream.name}")

    monkeypatch.setattr(torch.cuda, "Stream", log.stream_cls())
    monkeypatch.setattr(torch.cuda, "Event", log.event_cls())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(pass_stream, "_STREAMS", {})
    device = torch.device("cuda", 0)
    host = torch.zeros(3)

    def the_pass(batch, dev):
        log.calls.append(f"pass on {current[-1]}")
        return Out()

    pass_stream.on_pass_stream(the_pass, {"aug_jpeg": host}, device)
    own = pass_stream._STREAMS[device]
    assert own.held == (host,)
    pass_stream.on_pass_stream(the_pass, {"aug_jpeg": torch.ones(1)}, device)
    assert log.calls == ["pass on pass", "record e1 on pass", "caller waits e1", "output used on caller",
                         "wait e1",                               # the second pass: the first had not run yet
                         "pass on pass", "record e2 on pass", "caller waits e2", "output used on caller"]
    assert own.held[0] is not host                                # the first batch's bytes let go after its wait
    log.pending.clear()                                           # e2 has run: the next pass does not wait
    pass_stream.on_pass_stream(the_pass, {}, device)
    assert "wait e2" not in log.calls
