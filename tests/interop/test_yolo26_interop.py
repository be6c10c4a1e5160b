"""YOLO26 against the reference, without the reference installed.

``fixtures/yolo26-reference.pt`` (written by ``fixtures/make_yolo26.py`` with the reference) holds, per
scale, the reference's parameter count and state-dict layout; the raw maps of both branches, the
decoded one-to-many predictions and the end-to-end top-300 rows of its yolo26n under seeded weights;
and the same outputs of ``fixtures/yolo26-tiny-last.pt``, a checkpoint its trainer saved.
"""

from pathlib import Path

import pytest
import torch
from _seeded_weights import seeded_input, seeded_state

import yolokit
from yolokit.interop.safe_load import pickle_globals
from yolokit.interop.ultralytics import read_ultralytics, to_spec_names
from yolokit.models.heads import EndToEndHead
from yolokit.ops.boxes import box_convert
from yolokit.ops.nms import top_k_predictions

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = torch.load(FIXTURES / "yolo26-reference.pt", weights_only=True)
PARAMETERS = {"n": 2_572_280, "s": 10_009_784, "m": 21_896_248, "l": 26_299_704, "x": 58_993_368}   # the table


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the larger magnitude of the two (at least 1)."""
    return ((a.double() - b.double()).abs().max() / max(b.abs().max().item(), 1.0)).item()


@pytest.mark.parametrize("scale", list(PARAMETERS))
def test_each_scale_has_the_reference_parameters_and_state_dict_layout(scale):
    theirs = REFERENCE["scales"][scale]
    with torch.device("meta"):
        model = yolokit.create_model(f"yolo26{scale}.yaml")
    assert isinstance(model.head, EndToEndHead) and model.end_to_end and model.head.reg_max == 1
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[scale] == theirs["parameters"]
    state = model.state_dict()
    renamed = to_spec_names(dict.fromkeys(theirs["keys"], torch.empty(0)), model=model)
    assert list(renamed) == list(state)                                  # one to one, in order
    assert [list(t.shape) for t in state.values()] == theirs["shapes"]


def test_summary_reports_the_reference_gflops():
    summary = yolokit.create_model("yolo26n.yaml").summary(640)
    assert summary.parameters == PARAMETERS["n"] and round(summary.gflops, 1) == 6.1   # their file's comment


def our_outputs(model, x):
    with torch.no_grad():
        raw = model.eval()(x)
        return raw, model.decode(raw), model.decode(raw, nms=False)


def check_outputs(model, theirs):
    x = seeded_input(tuple(REFERENCE["input_shape"]), REFERENCE["input_seed"])
    raw, decoded, one2one = our_outputs(model, x)
    for branch in ("one2many", "one2one"):
        assert [m.shape for m in raw[branch]] == [m.shape for m in theirs[branch]]
        for a, b in zip(raw[branch], theirs[branch], strict=True):
            assert relative(a, b) < 1e-4, branch
    their_decoded = theirs["decoded"].transpose(1, 2)                    # [B, P, 4 + C], boxes xywh
    their_decoded = torch.cat((box_convert(their_decoded[..., :4], "cxcywh", "xyxy"), their_decoded[..., 4:]), dim=-1)
    assert relative(decoded, their_decoded) < 1e-4
    for agnostic, key in ((False, "end2end"), (True, "end2end_agnostic")):
        rows = top_k_predictions(one2one, max_det=300, agnostic=agnostic)
        assert rows.shape == theirs[key].shape == (1, 300, 6)
        assert same_rows(rows[0], theirs[key][0])
    return x


def same_rows(ours: torch.Tensor, theirs: torch.Tensor, tol: float = 1e-4) -> bool:
    """The same [k, 6] rows, scores in the same descending order; rows whose scores tie within rounding
    may come in either order (topk's order among equal values is the kernel's)."""
    if not (ours[1:, 4] <= ours[:-1, 4]).all() or relative(ours[:, 4], theirs[:, 4]) > tol:
        return False
    scale = max(theirs[:, :4].abs().max().item(), 1.0)
    gap = (ours[:, None, :4] - theirs[None, :, :4]).abs().amax(-1) / scale            # [k, k]
    close = (ours[:, None, 4] - theirs[None, :, 4]).abs() < tol
    match = (gap < tol) & (ours[:, None, 5] == theirs[None, :, 5]) & close
    return bool(match.any(1).all() and match.any(0).all())


def test_seeded_weights_give_the_reference_outputs_of_both_branches():
    theirs = REFERENCE["seeded"]
    model = yolokit.create_model("yolo26n.yaml", num_classes=REFERENCE["num_classes"])
    model.load_state_dict(seeded_state(model.state_dict(), theirs["weights_seed"]))
    check_outputs(model, theirs)


def test_a_checkpoint_their_trainer_saved_loads_and_gives_their_outputs():
    path = FIXTURES / "yolo26-tiny-last.pt"
    assert "ultralytics.nn.modules.head.Detect" in pickle_globals(path)
    contents = read_ultralytics(path)
    assert contents.architecture["end2end"] is True and contents.architecture["reg_max"] == 1
    model = yolokit.load(path)
    assert model.end_to_end and model.num_classes == 3 and model.names == ["square", "bar", "block"]
    x = check_outputs(model.float(), REFERENCE["trained"])
    (dets,) = model.predict(x, conf=0.001, nms=False)                    # end-to-end: the rows above conf
    rows = REFERENCE["trained"]["end2end"][0].clone()
    rows[:, :4] = rows[:, :4].clamp(0, x.shape[-1])                      # predict clips boxes to the image
    kept = rows[rows[:, 4] > 0.001]
    assert len(dets) == len(kept) > 0
    assert same_rows(torch.cat((dets.boxes, dets.scores[:, None], dets.labels[:, None].float()), dim=1), kept)


def test_nms_false_needs_a_one_to_one_branch_and_validate_routes_through_it(tmp_path, monkeypatch):
    import yolokit.models.detector as detector
    from yolokit.data import DetectionDataset, build_dataloader, make_shapes
    from yolokit.val import validate

    with pytest.raises(ValueError, match="yolov8n has no one-to-one"):
        yolokit.create_model("yolov8n", num_classes=3).predict(torch.rand(3, 64, 64), nms=False)
    data = make_shapes(tmp_path / "set", n_train=2, n_val=3, imgsz=64)
    loader = build_dataloader(DetectionDataset(str(data), "val", imgsz=64, rect=True), 2, workers=0, shuffle=False)
    model = yolokit.create_model("yolo26n.yaml", num_classes=4)
    calls, seen = [], []
    original = detector.end_to_end_detections
    monkeypatch.setattr(detector, "end_to_end_detections", lambda *a, **k: calls.append(k) or original(*a, **k))
    validate(model, loader, num_classes=4, conf=0.0, max_det=5, nms=False, on_image=lambda *a: seen.append(a[-1]))
    assert [c["max_det"] for c in calls] == [5, 5] and len(seen) == 3 and all(len(d) == 5 for d in seen)


def test_the_commands_say_in_one_line_when_nms_cannot_be_left_out(tmp_path):
    import subprocess
    import sys

    import cv2
    import numpy as np

    image = tmp_path / "a.jpg"
    cv2.imwrite(str(image), np.random.default_rng(0).integers(0, 255, (64, 80, 3), np.uint8))
    run = [sys.executable, "-m", "yolokit", "predict", str(image), "--device", "cpu", "--imgsz", "64", "--no-nms",
           "--out", str(tmp_path / "out")]
    refused = subprocess.run([*run, "--model", "yolov8n"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "yolov8n has no one-to-one (end-to-end) branch" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
    done = subprocess.run([*run, "--weights", str(FIXTURES / "yolo26-tiny-last.pt"), "--conf", "0.003"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a.jpg: 80x64" in done.stdout and "results written to" in done.stdout
