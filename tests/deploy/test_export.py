"""``yolokit.export`` to every format, its check, and the exported file run again with ``Detector``'s
``predict``: the same detections as the eager model, on images of two sizes (dynamic H and W).

The networks are the tiny YAML detector (tests/fixtures/tiny.yaml) with seeded weights and YOLO26's
narrow checkpoint (tests/interop/fixtures), so that each export takes seconds. The tiny detector's
convolutions are drawn with Kaiming's scale, so that scores and boxes vary from point to point as a
trained model's do (with its initial weights the activations vanish, every point scores about the
same, and float rounding alone reorders NMS).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from _models import TINY, lively

import yolokit
from yolokit.deploy import ExportedModel, ExportError, check_export, export
from yolokit.deploy.exporter import row_difference

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow
YOLO26 = Path(__file__).parents[1] / "interop" / "fixtures" / "yolo26-tiny-last.pt"


def tiny(num_classes=3):
    torch.manual_seed(0)
    return lively(yolokit.create_model(TINY, num_classes=num_classes))


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    """The tiny detector's float32 ONNX export at 96 px (dynamic H and W), made once."""
    return export(tiny(), "onnx", tmp_path_factory.mktemp("onnx") / "tiny.onnx", imgsz=96, report=None)


def images(seed=0):
    """Two batches of real-looking uint8 images (smooth blobs), at two sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for n, h, w in ((2, 96, 128), (1, 64, 160)):
        coarse = torch.from_numpy(rng.integers(0, 255, (n, 3, h // 16, w // 16), dtype=np.uint8)).float()
        out.append(torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear").to(torch.uint8))
    return out


def as_rows(d):
    return torch.cat((d.boxes, d.scores[:, None], d.labels[:, None].float()), 1)


def clear_threshold(model, nms):
    """A score threshold that about 3% of the (point, class) scores of ``images()`` pass, with no score
    within 1e-5 of it: float rounding (1e-6 here) then moves no detection across it."""
    with torch.no_grad():
        scores = torch.cat([model.decode(model(b.float() / 255), nms=nms)[..., 4:].flatten() for b in images()])
    target = float(scores.quantile(0.97))
    scores = scores.unique().sort().values
    gaps = (scores[1:] - scores[:-1]) > 2e-5
    middles = ((scores[1:] + scores[:-1]) / 2)[gaps]
    return float(middles[(middles - target).abs().argmin()])


def same_detections(model, exported, *, nms=True, box_tol=1e-3, score_tol=1e-4):
    """Per image, the same number of detections, boxes and scores within the tolerances."""
    total, conf = 0, clear_threshold(model, nms)
    for batch in images():
        want = model.predict(batch, conf=conf, nms=nms, max_det=100)
        got = exported.predict(batch, conf=conf, nms=nms, max_det=100)
        box, score, count = row_difference([as_rows(d) for d in want], [as_rows(d) for d in got], score_tol)
        assert count == 0 and box <= box_tol and score <= score_tol, (box, score, count)
        total += sum(len(d.boxes) for d in want)
    assert total >= 10                                   # the comparison compared something
    return total


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_an_fp32_export_checks_itself_and_runs_as_the_model_does(tmp_path, fmt, capsys):
    if fmt == "openvino":
        pytest.importorskip("openvino")
    model = tiny()
    path = yolokit.export(model, fmt, tmp_path / f"tiny{'.onnx' if fmt == 'onnx' else '_openvino'}", imgsz=96)
    said = capsys.readouterr().out
    assert f"exported {model.name} to {path} ({fmt}, fp32" in said and "checked: boxes within" in said
    exported = yolokit.load(path)
    assert isinstance(exported, ExportedModel) and exported.format == fmt and exported.info["dynamic"]
    assert exported.names == model.names and exported.strides == list(model.strides)
    same_detections(model, exported)
    assert not model.training and next(model.parameters()).dtype == torch.float32   # left as it was


@pytest.mark.extended   # AOTInductor compiles C++ for 40 s; the GPU command compiles for CUDA too
def test_a_pt2_package_runs_as_the_model_does(tmp_path):
    model = tiny()
    path = export(model, "pt2", tmp_path / "tiny.pt2", imgsz=96, report=None)
    exported = yolokit.load(path)
    assert exported.format == "pt2" and exported.info["device"] == "cpu"
    same_detections(model, exported)


@pytest.mark.parametrize("fmt", ["onnx", pytest.param("pt2", marks=pytest.mark.extended)])   # pt2: a compile
def test_nms_in_the_graph_gives_the_models_detections_for_any_batch(tmp_path, fmt):
    model = tiny()
    path = export(model, fmt, tmp_path / f"nms.{fmt}", imgsz=96, nms=True, conf=0.25, iou=0.7, max_det=100,
                  report=None)
    exported = yolokit.load(path)
    assert exported.info["output"] == "detections"
    # the graph keeps each point's best class (single label) and caps max_det per class
    for batch in [*images(), torch.cat([images()[0]] * 2)]:             # batches of 2, 1 and 4: still dynamic
        want = model.predict(batch, conf=0.25, iou=0.7, max_det=100)
        got = exported.predict(batch, conf=0.25, max_det=100)
        for w, g in zip(want, got, strict=True):
            assert len(w.boxes) == len(g.boxes) > 0
            order = w.scores.argsort(descending=True), g.scores.argsort(descending=True)
            assert torch.allclose(w.scores[order[0]], g.scores[order[1]], atol=1e-5)
            assert torch.allclose(w.boxes[order[0]], g.boxes[order[1]], atol=1e-3)


@pytest.mark.extended   # two exports of YOLO26; its ONNX graph: tests/interop/test_onnx.py
def test_yolo26_keeps_its_end_to_end_output_and_its_nms_branch(tmp_path):
    model = lively(yolokit.load(YOLO26))
    e2e = yolokit.load(export(model, "onnx", tmp_path / "e2e.onnx", imgsz=96, max_det=100, report=None))
    assert e2e.info["output"] == "end_to_end" and e2e.end_to_end
    same_detections(model, e2e, nms=False)
    with pytest.raises(ValueError, match="use --no-nms"):
        e2e.predict(images()[0])
    o2m = yolokit.load(export(model, "onnx", tmp_path / "o2m.onnx", imgsz=96, end_to_end=False, report=None))
    assert o2m.info["output"] == "predictions"
    same_detections(model, o2m, nms=True)


@pytest.mark.extended
@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_fp16_is_within_its_tolerance(tmp_path, fmt):
    if fmt == "openvino":
        pytest.importorskip("openvino")
    model = tiny()
    path = export(model, fmt, tmp_path / f"half{'.onnx' if fmt == 'onnx' else '_openvino'}", imgsz=96, half=True,
                  report=None)
    exported = yolokit.load(path)
    assert exported.info["half"]
    batch = images()[0].float() / 255
    with torch.no_grad():
        want = model.decode(model(batch))
    got = exported(batch)
    assert 1e-6 < (got - want).abs().max() < 0.05 * 96       # float16: not equal, but close


def test_int8_is_calibrated_on_the_data_and_within_its_tolerance(tmp_path, capsys):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from yolokit.data import make_shapes

    data = make_shapes(tmp_path / "shapes", n_train=12, n_val=4, imgsz=64)
    model = tiny(num_classes=4)
    path = export(model, "openvino", tmp_path / "int8_openvino", imgsz=64, int8=True, data=str(data))
    said = capsys.readouterr().out
    assert "(openvino, int8," in said and "checked: boxes within" in said and "INFO" not in said
    exported = yolokit.load(path)
    assert exported.info["int8"] and not exported.info["half"]
    batch = images()[0][..., :64, :64].float() / 255
    with torch.no_grad():
        want = model.decode(model(batch))
    diff = (exported(batch) - want).abs()
    assert diff[..., 4:].max() > 1e-4                    # quantized: not the float32 scores
    assert diff[..., 4:].max() < 0.1 and diff[..., :4].max() < 0.05 * 64
    # what is rounded to 256 levels: the backbone's convolutions; not the DFL's expectation (a MatMul: box
    # sides of 16 bins rounded cost the demo's yolov8n 0.015 mAP50-95), nor the head's convolutions
    import openvino as ov

    fed = {}
    for op in ov.Core().read_model(next(path.glob("*.xml"))).get_ordered_ops():
        quantized = any(i.get_source_output().get_node().get_type_name() == "FakeQuantize" for i in op.inputs())
        fed.setdefault(op.get_type_name(), []).append((op.get_friendly_name(), quantized))
    assert fed["MatMul"] and not any(q for _, q in fed["MatMul"])
    head = sum(isinstance(m, torch.nn.Conv2d) and m.weight.requires_grad for m in model.head.modules())
    quantized = [q for _, q in fed["Convolution"]]
    assert head >= 6 and sum(quantized) >= 5 and len(quantized) - sum(quantized) == head


def test_the_check_fails_on_a_file_that_differs(tmp_path, onnx_file):
    import onnx
    from onnx import numpy_helper

    model = tiny()
    assert check_export(model, onnx_file).startswith("boxes within")
    path = tmp_path / "tiny.onnx"
    proto = onnx.load(str(onnx_file))
    weights = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))
    weights.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weights) * 1.05, weights.name))
    onnx.save(proto, str(path))
    with pytest.raises(ExportError, match=r"^onnx export of .*tiny.onnx differs from the model: boxes within"):
        check_export(model, path)


def test_an_onnx_file_written_before_the_json_metadata_still_loads(tmp_path, onnx_file):
    """Files exported before ``file_info`` existed carry only the separate keys (strides, names, imgsz,
    output): they load as fixed-size files with the same detections."""
    import onnx

    proto = onnx.load(str(onnx_file))
    kept = [p for p in proto.metadata_props if p.key != "yolokit"]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    old = tmp_path / "old.onnx"
    onnx.save(proto, str(old))
    exported = yolokit.load(old)
    assert exported.info["output"] == "predictions" and exported.fixed_imgsz == (96, 96)
    model = tiny()
    batch = images()[0][..., :96, :96]
    want, got = model.predict(batch, conf=0.3), exported.predict(batch, conf=0.3)
    assert [len(d.boxes) for d in got] == [len(d.boxes) for d in want]


def _written(model, out, **kwargs):
    """A stand-in for the ONNX export (5-10 s) where only what follows it is tested: a file is there."""
    Path(out).write_bytes(b"onnx")
    return Path(out)


def test_an_export_that_fails_its_check_leaves_no_file(tmp_path, monkeypatch):
    import yolokit.deploy.exporter as exporter

    def differs(model, path, **kwargs):
        raise ExportError(f"onnx export of {path} differs from the model: boxes within 3 px")

    monkeypatch.setattr(exporter, "check_export", differs)
    monkeypatch.setattr(exporter, "export_onnx", _written)   # the file's making is not what is tested here
    with pytest.raises(ExportError, match=r"differs from the model: boxes within 3 px \(the file is removed\)$"):
        export(tiny(), "onnx", tmp_path / "bad.onnx", imgsz=96, report=None)
    assert not (tmp_path / "bad.onnx").exists()


def test_a_fixed_size_file_says_which_size_it_takes(tmp_path):
    model = tiny()
    exported = yolokit.load(export(model, "onnx", tmp_path / "fixed.onnx", imgsz=96, dynamic=False, report=None))
    assert exported.fixed_imgsz == (96, 96)
    with pytest.raises(ExportError, match=r"fixed.onnx was exported for 96x96 input, got 128x96: use --imgsz 96"):
        exported.predict(images()[0])
    from yolokit.predict import predict_iter

    frames = [f.permute(1, 2, 0).numpy()[..., ::-1].copy() for f in images()[0]]
    results = list(predict_iter(exported, frames, imgsz=96))   # predict letterboxes to the square it takes
    assert len(results) == 2 and results[0].orig_shape == (96, 128)


def test_bad_files_are_named_in_one_line(tmp_path, monkeypatch, onnx_file):
    model = tiny()
    good = onnx_file
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.pt2"
    foreign.write_text("not a package")
    cases = {cut: r"cut.onnx: onnx cannot read it .*export it again", foreign: r"foreign.pt2: not a .pt2 package",
             tmp_path / "nothing.onnx": "no such file"}
    for path, message in cases.items():
        with pytest.raises((ExportError, FileNotFoundError), match=message) as info:
            yolokit.load(path)
        assert "\n" not in str(info.value)
    folder = tmp_path / "ov_openvino"
    folder.mkdir()
    (folder / "m.xml").write_text("<net/>")
    pytest.importorskip("openvino")
    with pytest.raises(ExportError, match="without yolokit.json"):
        yolokit.load(folder)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'yolokit\[openvino\]'"):
        export(model, "openvino", tmp_path / "x_openvino", imgsz=96)


def test_the_arguments_are_checked_before_any_work(tmp_path):
    model = tiny()
    for kwargs, message in [({"format": "tflite"}, "format must be one of onnx, openvino, pt2"),
                            ({"format": "onnx", "int8": True}, "int8 is the OpenVINO format's"),
                            ({"format": "openvino", "int8": True}, "int8 needs calibration images"),
                            ({"format": "onnx", "imgsz": 100}, "must be a multiple of"),
                            ({"format": "onnx", "device": "cuda"}, "made on the cpu")]:
        with pytest.raises(ValueError, match=message):
            export(model, out=tmp_path / "x", **kwargs)
    assert not list(tmp_path.iterdir())


@pytest.mark.extended   # an export each; the tiny YOLOv8-style network runs by default (above)
@pytest.mark.parametrize("name", ["yolov3-tiny", "yolo11n.yaml"])
def test_other_families_export_with_the_same_detections(tmp_path, name):
    torch.manual_seed(0)
    model = lively(yolokit.create_model(name, num_classes=3))
    exported = yolokit.load(export(model, "onnx", tmp_path / "m.onnx", imgsz=64, report=None))
    same_detections(model, exported)


def test_a_file_that_does_not_run_in_its_check_is_removed_with_one_line(tmp_path, monkeypatch):
    from yolokit.deploy import exporter

    def fails(*args, **kwargs):
        raise RuntimeError("Expected u1 >= 2 but received 0\nException raised from run_single_threaded")

    monkeypatch.setattr(exporter, "check_export", fails)
    monkeypatch.setattr(exporter, "export_onnx", _written)
    out = tmp_path / "tiny.onnx"
    with pytest.raises(ExportError) as info:
        export(tiny(), "onnx", out, imgsz=64, report=None)
    assert str(info.value) == (f"the onnx file {out} did not run: RuntimeError: Expected u1 >= 2 but received 0 "
                               "(the file is removed)")
    assert not out.exists()


@pytest.mark.parametrize("fmt, out, written", [("pt2", "model_pt2", "model_pt2.pt2"), ("onnx", "m", "m.onnx"),
                                               ("onnx", "m.v2", "m.v2.onnx"), ("pt2", "ready.pt2", "ready.pt2"),
                                               ("openvino", "ov_folder", "ov_folder")])
def test_a_file_without_its_formats_suffix_gets_it(tmp_path, monkeypatch, capsys, fmt, out, written):
    """A runtime knows a file's format by its suffix: `--out model_pt2` writes model_pt2.pt2 and says so."""
    import yolokit.deploy.exporter as exporter
    import yolokit.deploy.openvino as openvino

    made = []
    for module, name in ((exporter, "export_onnx"), (exporter, "export_pt2"), (openvino, "export_openvino")):
        monkeypatch.setattr(module, name, lambda model, path, **kwargs: made.append(Path(path)))
    monkeypatch.setattr(exporter, "require", lambda fmt: None)
    path = export(tiny(), fmt, tmp_path / out, imgsz=96, check=False, report=print)
    assert made == [path] == [tmp_path / written]
    assert capsys.readouterr().out.startswith(f"exported {tiny().name} to {tmp_path / written} ({fmt}, fp32")
