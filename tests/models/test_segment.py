"""Instance segmentation heads: the published -seg architectures from their YAMLs, at every scale, with the
reference's sizes; what the heads return in training and inference; a user's YAML with a Segment head."""

import pytest
import torch
import yaml

import yolokit
from yolokit.models import SpecError, packaged_yamls
from yolokit.models.segment import EndToEndSegmentHead, FusedProto, SegmentHead
from yolokit.train import TrainConfig
from yolokit.train.build import build_loss

# Parameter counts (80 classes, unfused) of the reference's -seg models built from its model files
# (Ultralytics 8.4.190, ``sum(p.numel() for p in model.parameters())``; the same as its files' comments).
REFERENCE_PARAMETERS = {
    "yolov8-seg": {"n": 3_409_968, "s": 11_821_056, "m": 27_285_968, "l": 45_997_728, "x": 71_827_888},
    "yolo11-seg": {"n": 2_876_848, "s": 10_113_248, "m": 22_420_896, "l": 27_678_368, "x": 62_142_656},
    "yolo26-seg": {"n": 3_126_280, "s": 11_505_800, "m": 27_112_072, "l": 31_515_528, "x": 70_693_800},
}
# GFLOPs at 640 of the n scale: the reference's fused model summary (thop on the fused model: batch norms
# folded, as torch's flop counter counts none). YOLO26-seg: the reference's fuse also drops the one-to-many
# branch, which ours still runs (as the detection YOLO26's count does), so its file's figure (10.5, thop
# on the unfused model) is the comparison, within the counters' 1% (docs/models.md).
REFERENCE_GFLOPS_N = {"yolov8-seg": 12.0, "yolo11-seg": 9.8, "yolo26-seg": 10.5}
CASES = [(arch, scale) for arch, scales in REFERENCE_PARAMETERS.items() for scale in scales]


def meta_model(name, **kwargs):
    with torch.device("meta"):
        return yolokit.create_model(name, **kwargs)


def test_the_seg_yamls_are_packaged():
    assert {"yolov8-seg.yaml", "yolo11-seg.yaml", "yolo26-seg.yaml"} <= set(packaged_yamls())


@pytest.mark.parametrize("arch,scale", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_every_seg_architecture_has_the_reference_size(arch, scale):
    model = meta_model(f"{arch}.yaml", scale=scale)
    assert sum(p.numel() for p in model.parameters()) == REFERENCE_PARAMETERS[arch][scale]
    head = model.head
    assert type(head) is (EndToEndSegmentHead if arch == "yolo26-seg" else SegmentHead)
    _, width, max_channels = model.config.spec["scales"][scale]
    assert head.num_masks == 32 and head.proto_channels == round(min(256, max_channels) * width / 8) * 8
    assert model.strides == (8, 16, 32) and model.num_classes == 80


@pytest.mark.parametrize("arch", list(REFERENCE_PARAMETERS))
def test_the_n_scale_costs_the_reference_gflops(arch):
    summary = yolokit.create_model(f"{arch}.yaml", scale="n").summary(640)
    if arch == "yolo26-seg":
        assert summary.gflops == pytest.approx(REFERENCE_GFLOPS_N[arch], rel=0.01)
    else:
        assert round(summary.gflops, 1) == REFERENCE_GFLOPS_N[arch]


@pytest.mark.parametrize("arch", list(REFERENCE_PARAMETERS))
def test_the_head_returns_boxes_coefficients_and_prototypes(arch):
    torch.manual_seed(0)
    model = yolokit.create_model(f"{arch}.yaml", scale="n", num_classes=3)
    x = torch.rand(2, 3, 64, 96)
    model.eval()
    with torch.no_grad():
        out = model(x)
    levels = [(64 // s, 96 // s) for s in (8, 16, 32)]
    assert out["protos"].shape == (2, 32, 16, 24)                       # stride 4
    assert [tuple(c.shape) for c in out["coefficients"]] == [(2, 32, h, w) for h, w in levels]
    assert "semantic" not in out
    decoded = model.decode(out)
    assert decoded.shape == (2, sum(h * w for h, w in levels), 4 + 3)
    if arch == "yolo26-seg":
        assert [tuple(c.shape) for c in out["one2one_coefficients"]] == [(2, 32, h, w) for h, w in levels]
        assert model.decode(out, nms=False).shape == decoded.shape
        model.train()
        out = model(x)
        assert out["semantic"].shape == (2, 3, 8, 12)                   # one map per class at stride 8
        out["one2one_coefficients"][0].sum().backward()                 # the one-to-one branch reads detached maps
        assert all(p.grad is None for p in model.backbone.parameters())
        assert model.head.one2one_coef[0][0].conv.weight.grad is not None


def test_the_prototypes_of_yolo26_add_every_level_into_the_finest():
    torch.manual_seed(0)
    proto = FusedProto([8, 16, 32], [8, 16, 32], 16, 4, num_classes=2).eval()
    features = [torch.rand(1, 8, 8, 8), torch.rand(1, 16, 4, 4), torch.rand(1, 32, 2, 2)]
    by_hand = features[0] + proto.refine[0](features[1]).repeat_interleave(2, 2).repeat_interleave(2, 3) \
        + proto.refine[1](features[2]).repeat_interleave(4, 2).repeat_interleave(4, 3)
    torch.testing.assert_close(proto.fused(features), by_hand, rtol=0, atol=0)
    protos, semantic = proto(features)
    assert protos.shape == (1, 4, 16, 16) and semantic is None


def _spec(head):
    return {"nc": 3, "scales": {"n": [0.5, 0.25, 1024]},
            "backbone": [[-1, 1, "Conv", [32, 3, 2]], [-1, 1, "Conv", [64, 3, 2]], [-1, 1, "C2f", [64, True]],
                         [-1, 1, "Conv", [128, 3, 2]], [-1, 2, "C2f", [128, True]]],
            "head": [[-1, 1, "nn.Upsample", [None, 2, "nearest"]], [[-1, 2], 1, "Concat", [1]],
                     [-1, 1, "C2f", [64]], [[7, 4], 1, *head]]}


def test_a_users_yaml_with_a_segment_head_builds_and_runs(tmp_path):
    path = tmp_path / "my-seg.yaml"
    path.write_text(yaml.safe_dump(_spec(["Segment", ["nc", 8, 64]]), sort_keys=False))
    model = yolokit.create_model(path, scale="n").eval()
    assert isinstance(model.head, SegmentHead) and model.head.num_masks == 8
    assert model.head.proto_channels == 16                               # 64 x width 0.25
    with torch.no_grad():
        out = model(torch.rand(1, 3, 64, 64))
    assert out["protos"].shape == (1, 8, 32, 32)                          # twice the stride-4 level's size
    default = yolokit.create_model(_spec(["Segment", ["nc"]]), scale="n").head      # 32 masks, 256 wide
    assert (default.num_masks, default.proto_channels) == (32, 64)


@pytest.mark.parametrize("head, end2end, message", [
    (["Segment", ["nc", 0]], False, "masks must be an integer >= 1, got 0"),
    (["Segment", ["nc", 32, 256, 1]], False, r"args are \[nc, masks, prototype channels\]"),
    (["Segment", ["nc"]], True, "Segment needs end2end: false"),
    (["Segment26", ["nc"]], False, "Segment26 needs end2end: true"),
])
def test_bad_segment_rows_name_the_row(head, end2end, message):
    spec = _spec(head) | ({"end2end": True} if end2end else {})
    with pytest.raises(SpecError, match=message) as info:
        yolokit.create_model(spec, scale="n")
    assert head[0] in str(info.value)


def test_the_trainer_builds_the_seg_losses_and_refuses_a_box_only_set_in_one_line(tmp_path, capsys):
    from yolokit.cli import main
    from yolokit.losses import YOLO26SegLoss, YOLOv8SegLoss

    loss = build_loss(yolokit.create_model("yolov8n-seg", num_classes=3), TrainConfig(overlap_mask=False))
    assert type(loss) is YOLOv8SegLoss and loss.num_masks == 32 and not loss.overlap
    assert type(build_loss(yolokit.create_model("yolo26n-seg", num_classes=3), TrainConfig())) is YOLO26SegLoss
    data = yolokit.data.make_shapes(tmp_path / "set", n_train=2, n_val=1, imgsz=64)
    assert main(["train", "--model", "yolo11n-seg", "--data", str(data), "--imgsz", "64",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no label row has a polygon" in err[0] and "(train)" in err[0], err
    assert not list((tmp_path / "run").glob("weights/*.pt"))


@pytest.mark.parametrize("nms", [True, False])
def test_predict_gives_each_detection_the_mask_of_the_point_it_came_from(nms):
    """An image letterboxed at ratio 1 into the input (only padded below): each detection's mask in the
    original is the input mask (``decode_masks``) of its own point's coefficients, cut out of the padding."""
    from yolokit.models.detector import input_batch
    from yolokit.ops.masks import decode_masks
    from yolokit.ops.nms import end_to_end_points, nms_points

    torch.manual_seed(0)
    model = yolokit.create_model("yolo26n-seg" if not nms else "yolov8n-seg", num_classes=3).eval()
    image = torch.rand(3, 64, 64)
    (det,) = model.predict(image, conf=0.0, max_det=6, nms=nms, orig_shapes=[(50, 64)],
                           ratio_pad=[((1.0, 1.0), (0.0, 7.0))])
    batch, _, _ = input_batch(image, 32, "cpu", torch.float32)
    with torch.no_grad():
        out = model(batch)
    preds = model.decode(out) if nms else model.decode(out, nms=False)
    levels = out["coefficients" if nms else "one2one_coefficients"]
    coefficients = torch.cat([c.flatten(2) for c in levels], 2)[0].T
    ((kept, point),) = (nms_points(preds, conf=0.0, max_det=6) if nms else
                        end_to_end_points(preds, conf=0.0, max_det=6))
    assert len(det) == len(point) == 6 and torch.equal(det.scores, kept.scores)
    at_input = decode_masks(coefficients[point], out["protos"][0], kept.boxes, (64, 64))[:, 7:57]
    assert det.masks.shape == (6, 50, 64) and torch.equal(det.masks, at_input)
    assert yolokit.create_model("yolov8n", num_classes=3).predict(image)[0].masks is None   # a detection model


def test_the_seg_models_have_built_in_names_at_every_scale():
    """``create_model("yolov8n-seg")`` is the packaged YAML at scale n, for the three families and five scales;
    ``list_models()`` stays the detection variants (what the export and interop suites run)."""
    names = yolokit.list_models("segment")
    assert names == [f"{f}{s}-seg" for f in ("yolov8", "yolo11", "yolo26") for s in "nsmlx"]
    assert not set(names) & set(yolokit.list_models())
    for name in ("yolov8n-seg", "yolo26s-seg"):
        a, b = yolokit.create_model(name, num_classes=3), yolokit.create_model(f"{name}.yaml", num_classes=3)
        assert a.name == name and type(a.head) is type(b.head)
        assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in b.parameters())
    with pytest.raises(ValueError, match="task must be 'detect' or 'segment'"):
        yolokit.list_models("pose")

