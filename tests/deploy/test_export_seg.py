"""A segmentation model's export: the file carries each prediction's mask coefficients and the prototypes, checks
its masks against the model's (IoU), and ``predict`` on it gives the model's masks.

The networks are tests/fixtures/tiny-seg.yaml with Kaiming-scale weights (``lively``: scores and masks vary
from point to point) and the reference's narrow YOLO26-seg checkpoint (tests/interop/fixtures), exported at
96 px with dynamic H and W and run on images of two sizes.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from _models import TINY_SEG, lively

import yolokit
from yolokit.data import DetectionDataset, build_dataloader, make_shapes
from yolokit.deploy import ExportedModel, export
from yolokit.deploy.exporter import mask_iou
from yolokit.interop.onnx import export_graph
from yolokit.val import validate

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow
YOLO26_SEG = Path(__file__).parents[1] / "interop" / "fixtures" / "yolo26-seg-tiny.pt"


def tiny_seg():
    torch.manual_seed(0)
    return lively(yolokit.create_model(TINY_SEG, num_classes=3)).eval()


def images():
    rng = np.random.default_rng(0)
    out = []
    for n, h, w in ((2, 96, 128), (1, 64, 160)):
        coarse = torch.from_numpy(rng.integers(0, 255, (n, 3, h // 16, w // 16), dtype=np.uint8)).float()
        out.append(torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear").to(torch.uint8))
    return out


def assert_same_masks(model, exported, *, nms):
    """The file's detections are the model's (10 best per image, no threshold), with masks of the same shape
    that agree where they have pixels (an untrained model's boxes hold few); and the masks of the 20 best
    points over the whole input (the check's ``mask_iou``) agree to IoU 0.99 (float rounding may flip a pixel
    whose logit is 0), with enough pixels to mean something."""
    graph = export_graph(model, end_to_end=exported.end_to_end, max_det=exported.info["max_det"])
    for batch in images():
        want = model.predict(batch, conf=0.0, max_det=10, nms=nms)
        got = exported.predict(batch, conf=0.0, max_det=10, nms=nms)
        cropped = exported.predict(batch, conf=0.0, max_det=10, nms=nms, mask_form="crops")    # predict()'s form
        for c, g in zip(cropped, got, strict=True):
            assert torch.equal(c.masks.dense(batch.shape[-2:]), g.masks)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w.labels, g.labels) and torch.allclose(w.boxes, g.boxes, atol=1e-3)
            assert g.masks.shape == w.masks.shape == (10, *batch.shape[-2:])
            assert (w.masks ^ g.masks).sum() <= 0.01 * (w.masks | g.masks).sum()
        x = batch.float() / 255
        with torch.no_grad():
            eager = graph(x)
        iou = mask_iou(eager, exported(x), tuple(x.shape[-2:]), rows=exported.end_to_end)
        assert iou is not None and iou >= 0.99, iou


def test_a_seg_model_exports_its_masks_checks_them_and_predicts_them(tmp_path, capsys):
    model = tiny_seg()
    path = export(model, "onnx", tmp_path / "new" / "folder" / "seg.onnx", imgsz=96)   # the folders are made
    said = capsys.readouterr().out
    assert "checked: boxes within" in said and "masks IoU 1.0000 at least (tolerance 0.99)" in said, said
    exported = yolokit.load(path)
    assert isinstance(exported, ExportedModel) and exported.masks == ["coefficients", "protos"]
    predictions, coefficients, protos = exported(torch.rand(2, 3, 96, 128))
    assert predictions.shape[:2] == coefficients.shape[:2] and coefficients.shape[-1] == 8
    assert protos.shape == (2, 8, 24, 32)
    assert_same_masks(model, exported, nms=True)
    # validation on the file scores its masks as on the model (yolokit val --weights seg.onnx)
    data = make_shapes(tmp_path / "set", n_train=1, n_val=4, imgsz=96, segments=True)
    val_set = DetectionDataset(str(data), "val", imgsz=96, rect=True, stride=32, classes=[0, 1, 2])   # 3, as the model
    loader = build_dataloader(val_set, 2, workers=0, shuffle=False, uint8_images=True, stride=32)
    on_model, _ = validate(model, loader, num_classes=3)
    on_file, _ = validate(exported, loader, num_classes=3)
    assert on_file.mask_map50_95 is not None
    assert on_file.mask_map50_95 == pytest.approx(on_model.mask_map50_95, abs=1e-4)
    assert on_file.map50_95 == pytest.approx(on_model.map50_95, abs=1e-4)


def test_nms_in_the_graph_of_a_seg_model_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="NMS in the graph is not built for a segmentation model"):
        export(tiny_seg(), "onnx", tmp_path / "seg.onnx", imgsz=96, nms=True)
    assert not (tmp_path / "seg.onnx").exists()


@pytest.mark.extended   # 25-90 s: YOLO26-seg end to end (ONNX), OpenVINO and an AOTInductor package
@pytest.mark.parametrize("fmt", ["onnx-end-to-end", "openvino", "pt2"])
def test_every_format_carries_the_masks(tmp_path, fmt):
    if fmt == "openvino":
        pytest.importorskip("openvino")
    model = yolokit.load(YOLO26_SEG).float().eval() if fmt == "onnx-end-to-end" else tiny_seg()
    fmt = fmt.split("-")[0]
    path = export(model, fmt, tmp_path / ("seg_openvino" if fmt == "openvino" else f"seg.{fmt}"), imgsz=96,
                  report=None)
    exported = yolokit.load(path)
    assert exported.masks and exported.end_to_end == model.end_to_end
    assert_same_masks(model, exported, nms=not model.end_to_end)
