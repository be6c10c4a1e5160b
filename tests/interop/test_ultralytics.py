"""Ultralytics YOLOv8 checkpoints: stand-in files written here, read without ultralytics."""

import sys
from pathlib import Path

import pytest
import torch

import yolokit
from yolokit.interop.state import config_from_state_dict
from yolokit.interop.ultralytics import (
    LAYER_NAMES,
    load_ultralytics,
    read_ultralytics,
    ultralytics_to_yolokit,
    yolokit_name,
)

KEYS = Path(__file__).parent / "fixtures" / "ultralytics-yolov8n-keys.tsv"


def reference_keys():
    rows = [line.split("\t") for line in KEYS.read_text().splitlines() if line and not line.startswith("#")]
    return [(key, tuple(int(v) for v in shape.strip("()").split(",") if v.strip())) for key, _, shape in rows]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_stand_in_has_the_reference_keys_and_shapes(their):
    model = their.model("yolov8n", 80)
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == reference_keys()


def test_name_mapping_covers_every_reference_key_once_with_equal_shapes():
    ours = {k: tuple(v.shape) for k, v in yolokit.create_model("yolov8n").state_dict().items()}
    mapped = [(yolokit_name(key), shape) for key, shape in reference_keys()]
    assert len({k for k, _ in mapped}) == len(mapped) == len(ours) == 355
    assert all(ours[k] == shape for k, shape in mapped)
    assert yolokit_name("model.9.cv2.conv.weight") == "backbone.stages.3.2.cv2.conv.weight"
    assert yolokit_name("model.22.cv2.0.2.bias") == "head.box.0.2.bias"
    assert yolokit_name("model.22.dfl.conv.weight") == "head.dfl.conv.weight"
    assert set(LAYER_NAMES) == set(range(22)) - {10, 11, 13, 14, 17, 20}  # upsample / concat hold nothing


@pytest.mark.parametrize("variant,nc,training", [("yolov8n", 80, False), ("yolov8n", 3, True)])
def test_checkpoint_loads_and_raw_maps_equal_theirs(tmp_path, their, variant, nc, training):
    path = tmp_path / "best.pt"
    theirs = their.write(path, variant, nc, training=training)
    assert not any(name.startswith("ultralytics") for name in sys.modules)
    ckpt = read_ultralytics(path)
    assert ckpt.entry == ("ema" if training else "model") and ckpt.version == "8.4.190"
    assert ckpt.class_names[nc - 1] == f"class{nc - 1}"
    assert ckpt.state_dict["model.0.conv.weight"].dtype == torch.float16
    x = torch.rand(2, 3, 64, 96)
    with torch.no_grad():
        expected = theirs(x)
        for model in (yolokit.load(path), load_ultralytics(path)):
            assert (model.name, model.num_classes, model.training) == (variant, nc, False)
            assert model.has_names and model.names == [f"class{i}" for i in range(nc)]  # the checkpoint's names
            assert next(model.parameters()).dtype == torch.float32
            assert max_diff(model(x), expected) < 1e-4
    assert not any(name.startswith("ultralytics") for name in sys.modules)


def test_plain_state_dict_in_their_naming_torch_and_safetensors(tmp_path, their):
    from safetensors.torch import save_file

    theirs = their.model("yolov8n", 5)
    torch.save(theirs.state_dict(), tmp_path / "sd.pt")
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(tmp_path / "sd.safetensors"))
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        for name in ("sd.pt", "sd.safetensors"):
            assert read_ultralytics(tmp_path / name).entry == "state_dict"
            for model in (yolokit.load(tmp_path / name), load_ultralytics(tmp_path / name)):
                assert (model.name, model.num_classes) == ("yolov8n", 5)
                assert max_diff(model(x), theirs(x)) == 0


@pytest.mark.parametrize("variant", ["yolov8n", "yolov8s", "yolov8m", "yolov8l", "yolov8x"])
def test_variant_and_class_count_inferred_from_shapes(their, variant):
    with their.fake() as classes, torch.device("meta"):
        state = classes["DetectionModel"](variant, 7).state_dict()
    config = config_from_state_dict(ultralytics_to_yolokit(state))
    assert (config.name, config.num_classes, config.reg_max) == (variant, 7, 16)


def test_model_argument_loads_into_a_given_detector_or_insists_on_a_variant(tmp_path, their):
    path = tmp_path / "best.pt"
    their.write(path, "yolov8n", 4)
    target = yolokit.create_model("yolov8n", num_classes=4)
    assert yolokit.load(path, model=target) is target and not target.training
    assert yolokit.load(path, model="yolov8n").num_classes == 4
    with pytest.raises(ValueError, match=r"best\.pt: tensors do not fit yolov8s"):
        yolokit.load(path, model="yolov8s")
    with pytest.raises(ValueError, match=r"best\.pt: holds a 4-class head but yolov8n was built with 80"):
        yolokit.load(path, model=yolokit.create_model("yolov8n"))


def test_other_tasks_or_architectures_are_refused_by_name(tmp_path, their):
    state = dict(their.model("yolov8n", 2).state_dict())
    state["model.22.proto.cv1.conv.weight"] = torch.zeros(1)  # a segmentation head
    torch.save(state, tmp_path / "seg.pt")
    with pytest.raises(ValueError, match=r"seg\.pt: not a YOLOv8 detection model: .*model\.22\.proto"):
        yolokit.load(tmp_path / "seg.pt")
    state = {k: v for k, v in their.model("yolov8n", 2).state_dict().items() if not k.startswith("model.21.")}
    torch.save(state, tmp_path / "cut.pt")
    with pytest.raises(ValueError, match=r"cut\.pt: tensors do not fit any yolokit variant; closest is yolov8n"):
        load_ultralytics(tmp_path / "cut.pt")


def test_not_an_ultralytics_checkpoint(tmp_path):
    torch.save({"model": None, "ema": None, "epoch": 3}, tmp_path / "empty.pt")
    with pytest.raises(ValueError, match=r"empty\.pt: not an Ultralytics checkpoint"):
        read_ultralytics(tmp_path / "empty.pt")
