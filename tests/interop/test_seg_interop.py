"""The reference's instance segmentation checkpoints load into yolokit and give its raw outputs.

``fixtures/yolov8-seg-tiny.pt`` and ``fixtures/yolo26-seg-tiny.pt`` are SegmentationModel objects saved as
the reference's trainer saves them (float16, class names), narrowed copies of its yolov8-seg and
yolo26-seg model files with seeded weights; ``fixtures/seg-reference.pt`` holds their outputs on a seeded
input (written by ``fixtures/make_seg.py`` with the reference).
"""

from pathlib import Path

import pytest
import torch

import yolokit
from yolokit.interop.safe_load import pickle_globals
from yolokit.models.segment import EndToEndSegmentHead, SegmentHead

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = torch.load(FIXTURES / "seg-reference.pt", weights_only=True)


def seeded_input():
    shape = REFERENCE["input_shape"]
    return torch.rand(shape, generator=torch.Generator().manual_seed(REFERENCE["input_seed"]))


def assert_near(ours, theirs, what):
    """Within 1e-4 of the reference's largest magnitude in that tensor."""
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    tol = 1e-4 * max(float(theirs.abs().max()), 1.0)
    gap = float((ours - theirs).abs().max())
    assert gap <= tol, f"{what}: differs by {gap:.3g} (tolerance {tol:.3g})"


def flat(maps):
    """Per-level Tensor[B, K, H, W] -> Tensor[B, K, P] in the reference's point order."""
    return torch.cat([m.flatten(2) for m in maps], dim=2)


@pytest.mark.parametrize("arch, head", [("yolov8-seg", SegmentHead), ("yolo26-seg", EndToEndSegmentHead)])
def test_a_seg_checkpoint_loads_and_gives_the_reference_outputs(arch, head):
    path = FIXTURES / f"{arch}-tiny.pt"
    assert "ultralytics.nn.tasks.SegmentationModel" in pickle_globals(path)
    model = yolokit.load(path).float().eval()
    assert type(model.head) is head and model.name == arch.replace("-seg", "n-seg")
    assert model.num_classes == 3 and model.names == ["square", "bar", "block"]
    theirs = REFERENCE[arch]
    assert sum(p.numel() for p in model.parameters()) == theirs["parameters"]
    x = seeded_input()
    with torch.no_grad():
        out = model(x)
    assert_near(out["protos"], theirs["protos"], "prototypes")
    branches = {"one2many": ("maps", "coefficients")} if head is SegmentHead else {
        "one2many": ("one2many", "coefficients"), "one2one": ("one2one", "one2one_coefficients")}
    reg = 4 * model.head.reg_max
    for branch, (maps, coefficients) in branches.items():
        rows = flat(out[maps])
        assert_near(rows[:, :reg], theirs[branch]["boxes"], f"{branch} box rows")
        assert_near(rows[:, reg:], theirs[branch]["scores"], f"{branch} class logits")
        assert_near(flat(out[coefficients]), theirs[branch]["coefficients"], f"{branch} mask coefficients")
    decoded = theirs["decoded"]                               # [B, 4 + C + masks, P]: xywh, scores, coefficients
    xy, wh = decoded[:, :2], decoded[:, 2:4]
    boxes = torch.cat((xy - wh / 2, xy + wh / 2), dim=1).transpose(1, 2)
    ours = model.decode(out)                                  # [B, P, 4 + C]: xyxy, scores
    assert_near(ours[..., :4], boxes, "decoded boxes")
    assert_near(ours[..., 4:], decoded[:, 4:7].transpose(1, 2), "decoded scores")
    assert_near(flat(out["coefficients"]), decoded[:, 7:], "decoded coefficients")


def test_the_seg_checkpoints_name_the_reference_layers_they_map():
    """Every tensor of the reference's checkpoint has a place in yolokit's model and none is left unset."""
    from yolokit.interop.ultralytics import read_ultralytics, to_spec_names

    for arch in ("yolov8-seg", "yolo26-seg"):
        contents = read_ultralytics(FIXTURES / f"{arch}-tiny.pt")
        model = yolokit.load(FIXTURES / f"{arch}-tiny.pt")
        renamed = to_spec_names(contents.state_dict, model=model)
        assert set(renamed) == set(model.state_dict())
        assert any(k.startswith("head.proto.") for k in renamed) and any(k.startswith("head.coef.") for k in renamed)
