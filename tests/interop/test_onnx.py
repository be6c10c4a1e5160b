"""ONNX export (network + decode, optional NMS) checked against onnxruntime.

Exporting runs torch.export and its decompositions, several seconds per model on two CPU
cores; the default run exports yolov3-tiny here (anchor head, tiny FPN), and YOLOv8's DFL head
and PAN through the tiny YAML network (tests/fixtures/tiny.yaml) in tests/deploy/test_export.py
(dynamic batch and sizes, metadata, NMS) and below with YOLO26's two branches.
YOLOKIT_TEST_ALL_EXPORTS=1 exports every variant (about two minutes more).
"""

import json
import os

import pytest
import torch

import yolokit
from yolokit.interop import export_onnx
from yolokit.interop.onnx import add_nms
from yolokit.ops.boxes import box_iou
from yolokit.ops.nms import non_max_suppression

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

DEFAULT = ("yolov3-tiny",)
ALL = os.environ.get("YOLOKIT_TEST_ALL_EXPORTS") == "1"


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.slow
@pytest.mark.parametrize("name", yolokit.list_models())
def test_export_matches_decode_with_dynamic_batch(tmp_path, name):
    if name not in DEFAULT and not ALL:
        pytest.skip("set YOLOKIT_TEST_ALL_EXPORTS=1 to export every variant")
    model = yolokit.create_model(name, num_classes=3).train()
    imgsz = (64, 96)
    path = export_onnx(model, tmp_path / f"{name}.onnx", imgsz=imgsz)
    x = torch.rand(3, 3, *imgsz)  # exported with batch 2: batch 3 shows the batch axis is dynamic
    (got,) = session(path).run(None, {"images": x.numpy()})
    assert model.training  # mode restored
    with torch.no_grad():
        expected = model.eval().decode(model(x))
    diff = (torch.from_numpy(got) - expected).abs().max().item()
    print(f"{name}: onnxruntime vs torch, max abs diff {diff:.3g} (boxes in pixels, scores in [0, 1])")
    assert got.shape == tuple(expected.shape) and diff < 1e-3
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    assert json.loads(props["yolokit_config"])["name"] == name
    assert json.loads(props["imgsz"]) == list(imgsz) and json.loads(props["strides"]) == list(model.strides)
    assert json.loads(props["names"]) == model.names


def nms_graph(num_classes):
    """An ONNX graph predictions -> detections made of an Identity and ``add_nms``."""
    from onnx import TensorProto, helper

    shape = ["batch", "points", 4 + num_classes]
    graph = helper.make_graph([helper.make_node("Identity", ["raw"], ["predictions"])], "nms",
                              [helper.make_tensor_value_info("raw", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("predictions", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("conf,iou", [(0.25, 0.45), (0.5, 0.7)])
def test_onnx_nms_equals_non_max_suppression(tmp_path, conf, iou):
    proto = nms_graph(3)
    add_nms(proto, conf=conf, iou=iou, max_det=300)
    onnx.checker.check_model(proto)
    onnx.save_model(proto, str(tmp_path / "nms.onnx"))
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(2, 400, 2, generator=g) * 100
    boxes = torch.cat((xy, xy + 5 + torch.rand(2, 400, 2, generator=g) * 30), -1)
    scores = torch.zeros(2, 400, 3)  # one class per point with distinct scores: no ties to break
    scores.scatter_(2, torch.randint(0, 3, (2, 400, 1), generator=g), torch.rand(2, 400, 1, generator=g))
    preds = torch.cat((boxes, scores), -1)
    (got,) = session(tmp_path / "nms.onnx").run(None, {"raw": preds.numpy()})
    expected = non_max_suppression(preds, conf=conf, iou=iou, max_det=300)
    rows = torch.cat([torch.cat((torch.full((len(d), 1), float(i)), d.boxes, d.scores[:, None],
                                 d.labels[:, None].float()), 1) for i, d in enumerate(expected)])
    key = lambda t: t[torch.argsort(t[:, 0].double() * 1e4 + t[:, 6].double() * 10 + t[:, 5].double())]  # noqa: E731
    assert got.shape == rows.shape and len(rows) > 20
    diff = (key(torch.from_numpy(got)) - key(rows)).abs().max().item()
    assert diff == 0, diff


@pytest.mark.extended   # export_onnx(nms=True) of a model, run for any batch and compared detection for detection:
# tests/deploy/test_export.py::test_nms_in_the_graph_gives_the_models_detections_for_any_batch; the NMS graph
# itself: test_onnx_nms_equals_non_max_suppression above
def test_export_with_nms_gives_valid_nms_output(tmp_path):
    """Tie-agnostic checks: a random network scores many points exactly alike, and which of two
    tied boxes survives is up to each NMS implementation (the exact comparison is above)."""
    model = yolokit.create_model("yolov3-tiny", num_classes=4).eval()
    conf, iou = 0.25, 0.45
    with torch.no_grad():
        for conv in model.head.preds:
            conv.weight.normal_(0, 0.05)
            conv.bias.normal_(0.0, 1.0)
    path = export_onnx(model, tmp_path / "nms.onnx", imgsz=64, nms=True, conf=conf, iou=iou)
    x = torch.rand(2, 3, 64, 64)
    (got,) = session(path).run(None, {"images": x.numpy()})
    got = torch.from_numpy(got)
    with torch.no_grad():
        preds = model.decode(model(x))
    assert got.shape[1] == 7 and len(got) > 0 and set(got[:, 0].tolist()) <= {0.0, 1.0}
    for image, label in {(int(r[0]), int(r[6])) for r in got}:
        kept = got[(got[:, 0] == image) & (got[:, 6] == label)]
        # each row is one of the model's own predictions, with its best class
        p = preds[image]
        match = torch.cdist(kept[:, 1:5], p[:, :4]).argmin(1)
        assert torch.allclose(kept[:, 1:5], p[match, :4], atol=1e-3)
        assert torch.allclose(kept[:, 5], p[match, 4 + label], atol=1e-4)
        assert (p[match, 4:].argmax(1) == label).all()
        # no two kept boxes of one class overlap by more than iou
        overlap = box_iou(kept[:, 1:5], kept[:, 1:5]) - torch.eye(len(kept))
        assert (overlap <= iou + 1e-4).all()


def test_export_checks_the_input_size(tmp_path):
    with pytest.raises(ValueError, match="multiple of yolov8n's largest stride 32"):
        export_onnx(yolokit.create_model("yolov8n"), tmp_path / "m.onnx", imgsz=100)


@pytest.mark.slow
def test_an_end_to_end_model_exports_its_one_to_one_top_k_without_nms(tmp_path):
    """The one-to-one branch's top-k in the graph, on tests/fixtures/tiny.yaml with YOLO26's head (two
    branches, reg_max 1): the head and the top-k are yolo26n's, the export takes a third of its time.
    A trained YOLO26 (the reference's) through the same export: tests/deploy/test_export.py (extended)."""
    import yaml
    from _models import TINY, lively

    from yolokit.ops.nms import top_k_predictions

    with open(TINY) as f:
        spec = {**yaml.safe_load(f), "end2end": True, "reg_max": 1}
    torch.manual_seed(0)
    model = lively(yolokit.create_model(spec, num_classes=3))
    assert model.end_to_end
    path = export_onnx(model, tmp_path / "yolo26.onnx", imgsz=96, max_det=100)
    graph = onnx.load(str(path), load_external_data=False)
    assert "NonMaxSuppression" not in {node.op_type for node in graph.graph.node}
    assert [o.name for o in graph.graph.output] == ["detections"]
    torch.manual_seed(0)
    x = torch.rand(3, 3, 96, 96)
    (got,) = session(path).run(None, {"images": x.numpy()})
    with torch.no_grad():
        expected = top_k_predictions(model.eval().decode(model(x), nms=False), max_det=100)
    got = torch.from_numpy(got)
    assert got.shape == expected.shape == (3, 100, 6)
    assert ((got[..., 4] - expected[..., 4]).abs() < 1e-5).all()            # the same scores, best first
    assert expected[..., 4].unique().numel() > 250                         # scores that differ: an order to keep
    for ours, theirs in zip(got, expected, strict=True):                    # the same rows (ties in either order)
        gap = (ours[:, None, :4] - theirs[None, :, :4]).abs().amax(-1) < 1e-3
        gap &= ours[:, None, 5] == theirs[None, :, 5]
        assert gap.any(1).all() and gap.any(0).all()
    with pytest.raises(ValueError, match="end_to_end export needs a model with a one-to-one branch"):
        export_onnx(yolokit.create_model("yolov8n", num_classes=3), tmp_path / "v8.onnx", end_to_end=True)
