"""The device augmentation through torch.compile (``compiled=True``, `yolokit.data.augment.fused`): the eager
pass's images bit for bit, in a few fused kernels that write a bounded number of bytes per image.

On the CPU the stages compile to C++; on CUDA to Triton (the gpu test in this file). The bounds are
what CI can guard of the GPU's numbers, counted from the allocator's records. Eager, the pass runs
some hundred kernels and allocates some thousand times its output's bytes (measured here: 963x,
its peak 124x). Compiled, 5 kernels allocate 14.8x and peak at 6.4x. Of those, 4.2x are the decoded
sources and their one copy into the batch's atlas (four 128-px files for each 96-px Mosaic image),
1.2x the resized sources, and 3.1x the CPU's bucketize (its int32 positions and results), which Triton fuses. The warp
and MixUp write only their outputs. Nothing compiles again for other batch sizes, shapes, one view or
two, or cached pixels (the kernel count stays that of the first pass).

The inductor cases build C++ for a minute on 2 cores: they run with ``pytest -m extended``. The default
run compiles the same stages with ``aot_eager`` (dynamo's and AOTAutograd's graphs of each stage, run by
eager kernels; seconds, no C++): every case's images bit for bit, every stage one graph, nothing
compiled again (test_the_stages_compile_to_one_graph_each_and_make_the_eager_images).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from harness.timing import allocations
from torch._inductor import metrics

from yolokit.data import AugmentConfig, DetectionDataset, build_dataloader, to_device
from yolokit.data.augment import fused
from yolokit.data.augment.color import apply_hsv_lut_batch
from yolokit.data.augment.device_augment import augment_batch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="torch.compile on the CPU needs a C++ compiler")

CASES = {                                   # (hyp, loader keywords, batch size)
    "mosaic-mixup": (dict(mixup=0.5), {}, 8),
    "warps-flips-uneven": (dict(mosaic=0.0, degrees=10.0, shear=2.0, perspective=0.001, flipud=0.5), {}, 5),
    "rect-no-mosaic": (dict(mosaic=0.0, hsv_h=0.02), dict(rect=True), 4),
    "ram-cache": (dict(mixup=0.5), dict(cache_images="ram"), 6),
}


def _batch(yaml, case: str, imgsz: int = 96) -> dict:
    hyp, kw, n = CASES[case]
    loader_kw = {k: kw.pop(k) for k in ("rect",) if k in kw}
    ds = DetectionDataset(yaml, "train", imgsz=imgsz, augment=True, hyp=AugmentConfig(**hyp), **kw)
    return next(iter(build_dataloader(ds, n, workers=0, seed=1, uint8_images=True, augment_on="device",
                                      **loader_kw)))


def _memory(batch: dict, compiled: bool) -> tuple[float, float, torch.Tensor]:
    """Bytes the pass allocates and its peak over what it held before, each over the output's bytes, from
    the allocator's own records (`harness.timing.allocations` says why not the ops' memory columns)."""
    out, allocated, peak = allocations(lambda: augment_batch(batch, "cpu", compiled=compiled))
    return allocated / out.numel(), peak / out.numel(), out


@pytest.fixture(scope="module")
def fresh(shapes_yaml):
    """The stages compiled afresh in this process: the kernels inductor generated for one pass with
    every stage (resize, two views' warps, MixUp, HSV)."""
    torch._dynamo.reset()
    fused._compiled.clear()
    metrics.reset()
    batch = _batch(shapes_yaml, "mosaic-mixup")
    with torch._inductor.config.patch({"cpp.simdlen": 1}):   # scalar C++: 60 s to compile here instead of 100
        augment_batch(batch, "cpu", compiled=True)
    yield {"kernels": metrics.generated_kernel_count, "stages": sorted(f.__name__ for f in fused._compiled),
           "batch": batch}


@pytest.fixture
def aot_stages(monkeypatch):
    """``fused.stage`` compiles with ``aot_eager`` in this test (its options are inductor's); the graphs
    each compile makes are counted."""
    graphs, aot, real = [], torch._dynamo.lookup_backend("aot_eager"), torch.compile

    def counted(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    def compile_(fn, *, dynamic, fullgraph, options):
        assert options == fused.options()
        return real(fn, backend=counted, dynamic=dynamic, fullgraph=fullgraph)

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(fused, "_compiled", {})
    yield graphs
    torch._dynamo.reset()


def test_the_stages_compile_to_one_graph_each_and_make_the_eager_images(shapes_yaml, aot_stages):
    """Each stage traces whole (fullgraph) into one graph, with sizes as symbols: other batch sizes, one
    view or two, cached pixels and rect shapes compile nothing again; the images are eager's bit for bit."""
    for case in CASES:
        batch = _batch(shapes_yaml, case)
        compiled = augment_batch(batch, "cpu", compiled=True)
        assert torch.equal(compiled, augment_batch(batch, "cpu")), case
        if case == "mosaic-mixup":
            assert sorted(f.__name__ for f in fused._compiled) == ["_hsv_pixels", "_mix", "_resize_pixels",
                                                                   "_warp_view"]
            first = len(aot_stages)
            assert first == 4, [g.graph for g in aot_stages]
    out = to_device(batch, "cpu", compiled=True)                       # what the trainer calls
    assert torch.equal(out["images"], augment_batch(batch, "cpu").float().mul_(1 / 255))
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 3, 40, 56), dtype=torch.uint8, generator=g)
    luts = torch.randint(0, 256, (3, 3, 256), dtype=torch.uint8, generator=g)
    assert torch.equal(apply_hsv_lut_batch(images, luts, compiled=True), apply_hsv_lut_batch(images, luts))
    assert len(aot_stages) == first


@pytest.mark.extended   # a C++ build of a minute; the default run: the aot_eager test above
def test_a_few_fused_kernels_and_bounded_bytes_per_image(fresh):
    assert fresh["stages"] == ["_hsv_pixels", "_mix", "_resize_pixels", "_warp_view"]
    assert 4 <= fresh["kernels"] <= 8, fresh["kernels"]             # eager: 380 aten kernels (256 px, 8 images)
    batch = fresh["batch"]
    eager_alloc, eager_peak, eager = _memory(batch, compiled=False)
    alloc, peak, out = _memory(batch, compiled=True)
    assert torch.equal(out, eager)
    assert alloc <= 20 and peak <= 10, (alloc, peak)          # 14.8x, 6.4x here; the stacked warp: 172x, 70x
    assert eager_alloc >= 50 * alloc and eager_peak >= 8 * peak, (eager_alloc, eager_peak, alloc, peak)


@pytest.mark.extended   # with the C++ build above; the default run: the aot_eager test, same cases
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_pass_makes_the_eager_images_bit_for_bit(fresh, shapes_yaml, case):
    batch = _batch(shapes_yaml, case)
    compiled = augment_batch(batch, "cpu", compiled=True)
    assert torch.equal(compiled, augment_batch(batch, "cpu"))
    out = to_device(batch, "cpu", compiled=True)                       # what the trainer calls
    assert torch.equal(out["images"], compiled.float().mul_(1 / 255))
    # nothing compiled again: other sizes, one view or two, pixels or JPEGs, rect shapes reuse the kernels
    assert metrics.generated_kernel_count == fresh["kernels"]


@pytest.mark.extended   # with the C++ build above; the default run: the aot_eager test, same images
def test_the_compiled_hsv_step_is_opencvs_on_a_whole_batch(fresh):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 3, 40, 56), dtype=torch.uint8, generator=g)   # not square, 3 images
    luts = torch.randint(0, 256, (3, 3, 256), dtype=torch.uint8, generator=g)
    assert torch.equal(apply_hsv_lut_batch(images, luts, compiled=True), apply_hsv_lut_batch(images, luts))
    assert metrics.generated_kernel_count == fresh["kernels"]           # the pass's HSV kernel, reused


@pytest.mark.gpu
def test_on_cuda_the_compiled_pass_makes_the_eager_images_and_never_syncs(shapes_yaml):
    """Triton's kernels against the eager CUDA pass, bit for bit (no FMA contraction, every cast kept);
    once compiled, a pass of JPEGs waits for nothing (``set_sync_debug_mode("error")``), as the eager one."""
    for case in CASES:
        batch = _batch(shapes_yaml, case, imgsz=160)
        compiled = augment_batch(batch, "cuda", compiled=True)
        assert torch.equal(compiled.cpu(), augment_batch(batch, "cuda").cpu()), case
    jpegs = _batch(shapes_yaml, "mosaic-mixup", imgsz=160)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        augment_batch(jpegs, "cuda", compiled=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_options_this_torch_does_not_know_are_left_out(monkeypatch):
    """torch.compile refuses an option name it does not know: torch 2.11's inductor lacks some that
    later releases have (the CPU twins of the realize thresholds)."""
    monkeypatch.setitem(fused.OPTIONS, "an_option_of_a_later_torch", 1)
    known = fused.options()
    assert "an_option_of_a_later_torch" not in known and known["emulate_precision_casts"] is True
    assert known["realize_opcount_threshold"] == 1000                  # in every supported release
