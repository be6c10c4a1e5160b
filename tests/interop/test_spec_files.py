"""Models built from model YAMLs in files: yolokit's own format, training checkpoints, users' blocks, ONNX."""

import json
from dataclasses import asdict

import pytest
import torch
from torch import nn

import yolokit
from yolokit.interop.native import load_native
from yolokit.models import SpecConfig, SpecError, register_module, unregister_module
from yolokit.testing import assert_weights_equal


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_model_yaml_model_round_trips_through_yolokit_files(tmp_path, suffix):
    model = yolokit.create_model("yolov8n-p2.yaml", num_classes=3)
    model.names = ["a", "b", "c"]
    path = yolokit.save(model, tmp_path / f"p2{suffix}")
    if suffix == ".pt":
        assert torch.load(path, weights_only=True)["config"] == asdict(model.config)   # plain data only
    for loaded in (yolokit.load(path), load_native(path)):
        assert isinstance(loaded.config, SpecConfig) and loaded.config == model.config
        assert loaded.name == "yolov8n-p2" and loaded.strides == (4, 8, 16, 32) and loaded.names == ["a", "b", "c"]
        assert_weights_equal(model, loaded)
    with pytest.raises(ValueError, match="holds a yolov8n-p2 but model='yolov8n'"):
        yolokit.load(path, model="yolov8n")


def test_a_training_checkpoint_rebuilds_from_its_model_config(tmp_path):
    torch.manual_seed(0)
    model = yolokit.create_model("yolo11n.yaml", num_classes=2)
    torch.save({"epoch": 3, "model": model.state_dict(), "model_config": asdict(model.config),
                "ema": None, "optimizer": {}}, tmp_path / "last.pt")
    loaded = yolokit.load(tmp_path / "last.pt")
    assert loaded.config == model.config
    assert_weights_equal(model, loaded)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model.eval()(x), loaded(x), strict=True))
    ema = yolokit.create_model("yolo11n.yaml", num_classes=2)          # other weights: the EMA's are read
    torch.save({"epoch": 3, "model": model.state_dict(), "model_config": asdict(model.config), "names": ["x", "y"],
                "ema": {"module": ema.state_dict(), "updates": 9}, "optimizer": {}}, tmp_path / "last.pt")
    loaded = yolokit.load(tmp_path / "last.pt")
    assert_weights_equal(ema, loaded)
    assert loaded.names == ["x", "y"]
    fused = yolokit.create_model("yolo11n.yaml", num_classes=2).eval().fuse(channels_last=False)
    yolokit.save(fused, tmp_path / "fused.safetensors")
    assert_weights_equal(fused, yolokit.load(tmp_path / "fused.safetensors"))   # fused files rebuild fused


class Gate(nn.Module):
    def __init__(self, c1, c2):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, 1)

    def forward(self, x):
        return self.conv(x) * torch.sigmoid(x.mean(1, keepdim=True))


def test_a_file_naming_a_users_block_loads_once_it_is_registered(tmp_path):
    spec = {"nc": 2, "backbone": [[-1, 1, "Conv", [16, 3, 2]], [-1, 1, "Conv", [32, 3, 2]], [-1, 1, "Gate", [32]],
                                  [-1, 1, "Conv", [64, 3, 2]]],
            "head": [[[2, 3], 1, "Detect", ["nc"]]]}
    model = yolokit.create_model(spec, modules={"Gate": Gate})
    path = yolokit.save(model, tmp_path / "gate.safetensors")
    with pytest.raises(SpecError, match=r"gate.safetensors: .*layer 2 \(Gate\): unknown module 'Gate'.*"
                                        r"register_module\('Gate'"):
        yolokit.load(path)
    register_module("Gate", Gate)
    try:
        assert_weights_equal(model, yolokit.load(path))
    finally:
        unregister_module("Gate")


def test_predict_on_a_model_yaml_model():
    model = yolokit.create_model("yolo11n.yaml", num_classes=3)
    (det,) = model.predict(torch.rand(3, 70, 90), conf=0.0, max_det=7)   # padded to stride multiples
    assert det.boxes.shape == (7, 4) and det.labels.max() < 3


@pytest.mark.extended   # ~50 s of torch.export on 2 cores; export_onnx is model-agnostic (test_onnx.py covers it)
@pytest.mark.parametrize("name,strides", [("yolov8n-p2.yaml", (4, 8, 16, 32)), ("yolo11n.yaml", (8, 16, 32))])
def test_onnx_export_of_model_yaml_models(tmp_path, name, strides):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from yolokit.interop import export_onnx

    model = yolokit.create_model(name, num_classes=3)
    path = export_onnx(model, tmp_path / "m.onnx", imgsz=(64, 96))
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    x = torch.rand(2, 3, 64, 96)
    (got,) = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(
        None, {"images": x.numpy()})
    with torch.no_grad():
        expected = model.eval().decode(model(x))
    assert got.shape == (2, sum(64 * 96 // s**2 for s in strides), 4 + 3)
    assert (torch.from_numpy(got) - expected).abs().max().item() < 1e-3
    import onnx

    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    assert json.loads(props["yolokit_config"])["spec"]["head"][-1][2] == "Detect"
