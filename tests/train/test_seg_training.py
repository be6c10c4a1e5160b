"""A segmentation model trains as a detection model does: the trainer reads masks for it, its loss has the
mask term, validation scores its masks, and a resumed run ends with the uninterrupted run's bits.

13 images of the generated segmentation set (``shapes-seg``: polygons) in micro-batches of 2, ``nbs`` 6: steps
of 3, 3 and 1 micro-batches, two epochs with multi-scale (the masks keep their size while the images change
theirs). The network is tests/fixtures/tiny-seg.yaml: tiny.yaml with YOLOv8's Segment head.
"""

from __future__ import annotations

import csv
import math

import _train_workers as workers
import pytest
import torch
from _models import TINY, TINY_SEG

from yolokit.accel.launcher import launch
from yolokit.data import DatasetError, make_shapes
from yolokit.testing import assert_weights_equal
from yolokit.train import TrainConfig, Trainer, train
from yolokit.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env", "forked_ranks")]


@pytest.fixture(scope="module")
def seg_shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("seg") / "set", n_train=13, n_val=5, imgsz=96, segments=True))


def config(data, out, **kw) -> TrainConfig:
    base = dict(model=TINY_SEG, data=data, imgsz=96, batch=2, nbs=6, epochs=2, workers=0, out=str(out), plots=False,
                warmup_epochs=1.0, close_mosaic=1, mosaic_buffer=0, seed=3, optimizer="SGD", lr0=0.01,
                save_period_iters=2, multi_scale=True, verbose=False)
    return TrainConfig(**{**base, **kw})


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "data%")}
            for r in csv.DictReader((run_dir / "results.csv").open())]


def test_a_segmentation_model_trains_scores_its_masks_and_resumes_bit_for_bit(seg_shapes, tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "run"
    result = train(config(seg_shapes, whole))
    rows = _rows(whole)
    assert [r["epoch"] for r in rows] == ["1", "2"]
    for row in rows:
        assert {"train/box", "train/seg", "train/cls", "train/dfl", "mask_mAP50", "mask_mAP50-95"} <= row.keys()
        assert float(row["train/seg"]) > 0 and all(math.isfinite(float(v)) for k, v in row.items() if k != "epoch")
        box, masks = (0.1 * float(row[f"{p}mAP50"]) + 0.9 * float(row[f"{p}mAP50-95"]) for p in ("", "mask_"))
        assert float(row["fitness"]) == pytest.approx(box + masks, rel=1e-5, abs=1e-9)   # the reference's sum
    assert {"mask_mAP50", "mask_mAP50-95"} <= result.keys()

    with pytest.raises(RuntimeError, match="simulated crash"):
        workers.fit_until(config(seg_shapes, out), at=10)          # in epoch 2's step 2: last.pt is step 4's
    state = load_checkpoint(out / "weights" / "last.pt")
    assert (state["epoch"], state["step_in_epoch"], state["steps"]) == (1, 1, 4)
    assert state["ranks"][0]["meter"]["keys"] == ["box", "seg", "cls", "dfl"]
    Trainer(TrainConfig(resume=str(out))).fit()
    a, b = load_checkpoint(whole / "weights" / "last.pt"), load_checkpoint(out / "weights" / "last.pt")
    assert a["steps"] == b["steps"] == 6
    assert_weights_equal(a["model"], b["model"])
    assert_weights_equal(a["ema"]["module"], b["ema"]["module"])
    assert any("proto" in k for k in a["model"]) and a["best_fitness"] == b["best_fitness"]
    assert _rows(out) == rows


def test_a_segmentation_model_on_a_set_without_polygons_stops_at_setup_in_one_line(tmp_path):
    data = make_shapes(tmp_path / "boxes", n_train=4, n_val=2, imgsz=96)
    with pytest.raises(DatasetError, match=r"\(train\): no label row has a polygon"):
        train(config(str(data), tmp_path / "run", epochs=1))
    assert not list((tmp_path / "run").glob("weights/*.pt"))


def test_a_detection_model_trains_on_a_segmentation_set_from_its_boxes(seg_shapes, tmp_path):
    train(config(seg_shapes, tmp_path / "run", model=TINY, epochs=1, multi_scale=False))
    (row,) = _rows(tmp_path / "run")
    assert "train/seg" not in row and "mask_mAP50" not in row and float(row["train/box"]) > 0
    assert torch.isfinite(torch.tensor(float(row["fitness"])))


def test_the_device_augmentation_trains_the_segmentation_model_as_the_workers_do(seg_shapes, tmp_path):
    """The trainer on augment_on="device" with a seg model: it trains, its batches carry the masks to the loss,
    and an epoch's losses agree closely with the workers path's (the labels and masks are equal bit for bit:
    tests/data/test_segment_items.py; the images within a grey level)."""
    rows = []
    for on in ("workers", "device"):
        train(config(seg_shapes, tmp_path / on, epochs=1, multi_scale=False, augment_on=on, save_period_iters=0))
        (row,) = _rows(tmp_path / on)
        rows.append({k: float(row[f"train/{k}"]) for k in ("box", "seg", "cls", "dfl")})
    for key, value in rows[0].items():
        assert value > 0 and rows[1][key] == pytest.approx(value, rel=0.02), (key, rows)


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-12)) if y.norm() > 0 else float(x.norm())


def test_two_processes_train_the_segmentation_model_one_process_trains(seg_shapes, tmp_path):
    """13 images, micro-batches of 2, steps of 4 images (``nbs`` 4): one process accumulates 2 micro-batches,
    two processes (batch 4) take one each; 7 micro-batches an epoch make steps of 2, 2, 2 and 1, the last one
    on rank 0 only (uneven shards). Masks travel with their micro-batches; every rank holds the same weights
    after every step, and they equal one process's to float rounding (sums over ranks round differently from
    sums over micro-batches)."""
    single = tmp_path / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the kernels of the ranks (one thread each)
    try:
        one = workers.fit_recording(config(seg_shapes, single, nbs=4, multi_scale=False, save_period_iters=0))
    finally:
        torch.set_num_threads(threads)
    many = launch(workers.fit_recording, 2, config(seg_shapes, tmp_path / "two", batch=4, nbs=4, multi_scale=False,
                                                   save_period_iters=0), timeout=600)
    assert len(one["digests"]) == 8 and all(r["digests"] == many[0]["digests"] for r in many)
    a, b = (load_checkpoint(p / "weights" / "last.pt") for p in (single, tmp_path / "two"))
    worst = max(_relative(b["model"][k], v) for k, v in a["model"].items() if v.is_floating_point())
    assert 0 < worst < 1e-3, worst
    assert many[0]["result"]["mask_mAP50-95"] == pytest.approx(one["result"]["mask_mAP50-95"], abs=1e-6)


def test_fine_tuning_from_the_reference_seg_checkpoint_keeps_all_but_the_class_scores(seg_shapes, tmp_path):
    """The reference's yolov8-seg checkpoint (tests/interop/fixtures: narrowed, 3 classes) fine-tuned with
    ``weights`` on the 4-class set, the backbone, the prototype network and the coefficient branches held
    frozen: they keep the checkpoint's tensors (so they came from it), the rest of the head trains on from
    the checkpoint, and the class scores are resized to 4 classes."""
    from pathlib import Path

    import yolokit

    weights = Path(__file__).resolve().parents[1] / "interop" / "fixtures" / "yolov8-seg-tiny.pt"
    source = yolokit.load(weights).float().state_dict()
    out = tmp_path / "tuned"
    result = train(config(seg_shapes, out, model=None, weights=str(weights), epochs=1, multi_scale=False,
                          save_period_iters=0, freeze="backbone,head.proto,head.coef"))
    tuned = load_checkpoint(out / "weights" / "last.pt")["model"]
    held = [k for k in source if k.startswith(("backbone.", "head.proto.", "head.coef.")) and "weight" in k]
    assert any(k.startswith("head.proto.") for k in held) and any(k.startswith("head.coef.") for k in held)
    assert all(torch.equal(tuned[k].float(), source[k]) for k in held)       # a fresh head would differ
    box = [k for k in source if k.startswith("head.box.") and k.endswith("weight")]
    assert box and not all(torch.equal(tuned[k].float(), source[k]) for k in box)   # trained on from there
    assert tuned["head.cls.0.2.weight"].shape[0] == 4 != source["head.cls.0.2.weight"].shape[0]
    assert "mask_mAP50-95" in result


def test_checkpointing_recomputes_the_seg_model_exactly_and_bf16_trains_it(seg_shapes, tmp_path):
    """Activation checkpointing of every unit gives the plain run's numbers (one epoch, CPU kernels are
    deterministic); bf16 autocast trains the seg head too (its mask term in float32)."""
    plain, checkpointed, bf16 = tmp_path / "plain", tmp_path / "ckpt", tmp_path / "bf16"
    common = dict(epochs=1, multi_scale=False, save_period_iters=0)
    train(config(seg_shapes, plain, **common))
    train(config(seg_shapes, checkpointed, checkpointing="all", **common))
    assert _rows(checkpointed) == _rows(plain)
    assert_weights_equal(load_checkpoint(plain / "weights" / "last.pt")["model"],
                         load_checkpoint(checkpointed / "weights" / "last.pt")["model"])
    train(config(seg_shapes, bf16, precision="bf16", **common))
    (row,) = _rows(bf16)
    assert math.isfinite(float(row["train/seg"])) and float(row["train/seg"]) > 0
    assert float(row["train/seg"]) != float(_rows(plain)[0]["train/seg"])   # another precision, other numbers


def test_the_batch_finder_probes_a_segmentation_step(seg_shapes, tmp_path, monkeypatch):
    """``batch="auto"``: the probe runs the seg model's step with worst-case boxes and masks of the loss's
    size (a wrong mask shape would raise in the loss), then the run trains at the batch it found."""
    from yolokit.train import autobatch

    probed = []

    def measure(probe, device, **kw):
        probe(3)
        probed.append(device.type)
        return 3

    monkeypatch.setattr(autobatch, "measure_batch", measure)
    train(config(seg_shapes, tmp_path / "run", batch="auto", nbs=4, epochs=1, multi_scale=False,
                 save_period_iters=0))
    assert probed == ["cpu"]
    (row,) = _rows(tmp_path / "run")
    assert int(row["steps"]) == 5 and float(row["train/seg"]) > 0      # 13 images in batches of 3, a step each


@pytest.mark.extended   # ~2 minutes of tracing (the loss breaks at each image's positives); the default run: the
# seg steps above, and test_step_syncs.py's compile test (what the trainer hands torch.compile)
def test_a_compiled_segmentation_run_trains_what_the_eager_run_trains(seg_shapes, tmp_path, monkeypatch):
    """``compile=True`` (aot_eager: the graphs inductor would get, no C++ build) on the seg model and its loss,
    with checkpointing and an uneven accumulation: the losses and learning rates of the eager run."""
    from yolokit.accel import perf

    original, compiled = perf.prepare_model, []

    def prepare(model, **kw):
        net = original(model, **kw, **({"compile_backend": "aot_eager"} if kw.get("compile") else {}))
        if isinstance(net, torch._dynamo.eval_frame.OptimizedModule):
            compiled.append(type(model).__name__)
        return net

    monkeypatch.setattr(perf, "prepare_model", prepare)
    rows = {}
    for on in (False, True):
        train(config(seg_shapes, tmp_path / f"run{int(on)}", epochs=1, multi_scale=False, save_period_iters=0,
                     checkpointing="all", compile=on))
        rows[on] = _rows(tmp_path / f"run{int(on)}")
    assert compiled == ["Detector", "YOLOv8SegLoss"]
    for eager, comp in zip(rows[False], rows[True], strict=True):
        for k in ("train/box", "train/seg", "train/cls", "train/dfl", "lr", "steps"):
            assert float(comp[k]) == pytest.approx(float(eager[k]), rel=1e-4), k
