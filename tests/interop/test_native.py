"""yolokit's own format (safetensors + config JSON, or torch.save read with weights_only) and load/save."""

import json
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open

import yolokit
from yolokit.interop.formats import file_format
from yolokit.interop.native import load_native, save_native
from yolokit.interop.state import config_from_state_dict
from yolokit.testing import assert_weights_equal


@pytest.mark.parametrize("name", yolokit.list_models())
def test_safetensors_round_trip_of_every_variant(tmp_path, name):
    model = yolokit.create_model(name, num_classes=3)
    path = yolokit.save(model, tmp_path / "m.safetensors")
    assert file_format(path) == "safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "yolokit"
    assert json.loads(metadata["config"]) == json.loads(json.dumps(asdict(model.config)))
    loaded = yolokit.load(path)
    assert loaded.config == model.config and loaded.name == name and not loaded.training
    assert_weights_equal(model, loaded)


@pytest.mark.parametrize("name", ["yolov8n", "yolov3-tiny"])
def test_torch_round_trip_reads_with_plain_weights_only(tmp_path, name):
    model = yolokit.create_model(name, num_classes=2)
    path = yolokit.save(model, tmp_path / "m.pt")
    raw = torch.load(path, weights_only=True)  # no allowlist needed: plain containers and tensors
    assert raw["format"] == "yolokit" and raw["config"] == asdict(model.config)
    for loaded in (yolokit.load(path), load_native(path)):
        assert loaded.config == model.config
        assert_weights_equal(model, loaded)


@pytest.mark.parametrize("name,classes", [("yolov8m", 1), ("yolov3", 4), ("yolov3-spp", 4), ("yolov3-tiny", 20)])
def test_plain_state_dict_gives_variant_and_class_count_from_shapes(tmp_path, name, classes):
    with torch.device("meta"):
        state = yolokit.create_model(name, num_classes=classes).state_dict()
    config = config_from_state_dict(state)
    assert (config.name, config.num_classes) == (name, classes)


def test_plain_state_dict_file_loads_with_or_without_a_name(tmp_path):
    model = yolokit.create_model("yolov8n", num_classes=6)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    for path, name in ((tmp_path / "sd.pt", None), (tmp_path / "wrapped.pt", "yolov8n")):
        loaded = yolokit.load(path, model=name)
        assert (loaded.name, loaded.num_classes) == ("yolov8n", 6)
        assert_weights_equal(model, loaded)


def test_fused_model_round_trip_keeps_outputs(tmp_path):
    model = yolokit.create_model("yolov8n", num_classes=2).eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        yolokit.save(model.fuse(), tmp_path / "fused.safetensors")
        loaded = yolokit.load(tmp_path / "fused.safetensors")
        assert all((a - b).abs().max() < 1e-4 for a, b in zip(loaded(x), expected, strict=True))
    assert_weights_equal(model, loaded)


def test_save_writes_in_place_atomically(tmp_path):
    path = yolokit.save(yolokit.create_model("yolov3-tiny", num_classes=1), tmp_path / "m.pth")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]
    assert file_format(path) == "torch"


def test_errors_name_the_file(tmp_path):
    model = yolokit.create_model("yolov8n", num_classes=3)
    yolokit.save(model, tmp_path / "n3.safetensors")
    with pytest.raises(ValueError, match=r"n3\.safetensors: holds a yolov8n but model='yolov8s' was asked for"):
        yolokit.load(tmp_path / "n3.safetensors", model="yolov8s")
    with pytest.raises(ValueError, match=r"n3\.safetensors: holds a 3-class head but yolov8n was built with 80"):
        yolokit.load(tmp_path / "n3.safetensors", model=yolokit.create_model("yolov8n"))
    holds = r"n3\.safetensors: tensors do not fit yolov8s \(the file holds a yolov8n with 3 classes\): shape mismatch"
    with pytest.raises(ValueError, match=holds):
        yolokit.load(tmp_path / "n3.safetensors", model=yolokit.create_model("yolov8s", num_classes=3))
    (tmp_path / "junk.bin").write_bytes(b"hello, not weights")
    with pytest.raises(ValueError, match=r"junk\.bin: unknown weights format"):
        yolokit.load(tmp_path / "junk.bin")
    with pytest.raises(FileNotFoundError, match=r"missing\.pt"):
        yolokit.load(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"m\.onnx: unknown suffix"):
        yolokit.save(model, tmp_path / "m.onnx")
    torch.save({"format": "yolokit", "format_version": 99, "config": {}, "state_dict": {}}, tmp_path / "new.pt")
    with pytest.raises(ValueError, match=r"new\.pt: yolokit format version 99 is newer"):
        yolokit.load(tmp_path / "new.pt")
    torch.save({"weights": [1, 2, 3]}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other\.pt: a torch file, but neither"):
        yolokit.load(tmp_path / "other.pt")
    torch.save({"head.cls.0.2.weight": torch.zeros(3, 8, 1, 1)}, tmp_path / "bits.pt")
    with pytest.raises(ValueError, match=r"bits\.pt: does not look like any yolokit variant: no detection head"):
        yolokit.load(tmp_path / "bits.pt")


def test_save_native_needs_a_config(tmp_path):
    model = yolokit.create_model("yolov8n")
    model.config = None
    with pytest.raises(ValueError, match="no config"):
        save_native(model, tmp_path / "m.safetensors")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_class_names_travel_with_the_file(tmp_path, suffix):
    model = yolokit.create_model("yolov8n", num_classes=3)
    assert not model.has_names and model.names == ["0", "1", "2"]
    plain = yolokit.load(yolokit.save(model, tmp_path / f"plain{suffix}"))
    assert not plain.has_names
    model.names = ["cat", "dog", "emu"]
    loaded = yolokit.load(yolokit.save(model, tmp_path / f"named{suffix}"))
    assert loaded.has_names and loaded.names == ["cat", "dog", "emu"]
    with pytest.raises(ValueError, match="3 classes but 2 names"):
        model.names = ["cat", "dog"]


def test_a_runs_inference_file_gives_its_names(tmp_path):
    from yolokit.train import TrainConfig
    from yolokit.train.weights import export_final

    model = yolokit.create_model("yolov8n", num_classes=2)
    path = export_final(model, tmp_path / "model.pt", ["circle", "star"], TrainConfig())
    assert yolokit.load(path).names == ["circle", "star"]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_inference_files_store_half_weights_names_and_extras(tmp_path, suffix):
    model = yolokit.create_model("yolov8n", num_classes=2)
    path = yolokit.save(model, tmp_path / f"m{suffix}", names=["a", "b"], half=True,
                        extra={"train_config": {"epochs": 7}})
    if suffix == ".pt":
        raw = torch.load(path, weights_only=True)
        assert raw["train_config"] == {"epochs": 7} and raw["state_dict"]["head.cls.0.2.weight"].dtype == torch.float16
    else:
        with safe_open(str(path), "pt") as f:
            assert json.loads(f.metadata()["train_config"]) == {"epochs": 7}
            assert f.get_tensor("head.cls.0.2.weight").dtype == torch.float16
    loaded = yolokit.load(path)
    assert loaded.names == ["a", "b"]
    expected = model.state_dict()
    for k, v in loaded.state_dict().items():  # float16 on disk, loaded back into the float32 model
        assert torch.equal(v, expected[k].half().to(v.dtype) if v.is_floating_point() else expected[k]), k


def test_every_format_in_the_table_reads_what_it_writes(tmp_path):
    from yolokit.interop.formats import FORMATS

    models = {"darknet": yolokit.create_model("yolov3-tiny", num_classes=2)}
    for fmt in FORMATS:
        model = models.get(fmt.name, yolokit.create_model("yolov8n", num_classes=2))
        for suffix in fmt.suffixes:
            path = yolokit.save(model, tmp_path / f"m{suffix}")
            assert file_format(path) == fmt.name
            loaded = yolokit.load(path, model=model.name)
            pairs = zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
