"""timm backbones: feature maps and strides, local weights only, under a YOLOv8 neck and head, in a YAML."""

import os
import socket
from dataclasses import asdict

import pytest
import torch

timm = pytest.importorskip("timm")

import yolokit  # noqa: E402
from yolokit.models import Detector, build_model, config_from_dict  # noqa: E402
from yolokit.models.heads import DFLHead  # noqa: E402
from yolokit.models.necks import YOLOv8PAN  # noqa: E402
from yolokit.models.timm_backbone import TimmBackbone  # noqa: E402


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails the test: nothing may be downloaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def resnet_file(tmp_path_factory):
    """A resnet18 classifier's weights in both file kinds, and the model that wrote them."""
    torch.manual_seed(1)
    full = timm.create_model("resnet18", pretrained=False).eval()
    folder = tmp_path_factory.mktemp("timm")
    from safetensors.torch import save_file

    save_file(full.state_dict(), str(folder / "resnet18.safetensors"))
    torch.save({"epoch": 3, "state_dict": full.state_dict()}, folder / "resnet18.pth")
    return folder, full


def test_feature_maps_and_strides():
    backbone = TimmBackbone("resnet18", out_indices=(1, 2, 3, 4)).eval()
    assert backbone.out_channels == (64, 128, 256, 512) and backbone.strides == (4, 8, 16, 32)
    with torch.no_grad():
        maps = backbone(torch.rand(2, 3, 64, 96))
    assert [tuple(m.shape) for m in maps] == [(2, c, 64 // s, 96 // s)
                                              for c, s in zip(backbone.out_channels, backbone.strides, strict=True)]


def test_under_a_v8_pan_and_dfl_head():
    backbone = TimmBackbone("resnet18", out_indices=(2, 3, 4))
    neck = YOLOv8PAN(backbone.out_channels, depth=1)
    model = Detector(backbone, neck, DFLHead(neck.out_channels, backbone.strides, num_classes=3), name="r18-v8")
    assert neck.out_channels == (128, 256, 512)
    maps = model(torch.rand(1, 3, 64, 64))
    assert [tuple(m.shape) for m in maps] == [(1, 67, 8, 8), (1, 67, 4, 4), (1, 67, 2, 2)]
    units = [n for n, _ in model.checkpoint_units()]
    assert units[:3] == ["backbone.model.conv1", "backbone.model.bn1", "backbone.model.layer1"]
    assert units[-1] == "neck.bottom_up5"


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_local_weights_load_and_equal_the_file(resnet_file, suffix):
    folder, full = resnet_file
    backbone = TimmBackbone("resnet18", out_indices=(2, 3, 4), weights=folder / f"resnet18{suffix}").eval()
    state = full.state_dict()
    mine = backbone.model.state_dict()
    assert mine and all(torch.equal(v, state[k]) for k, v in mine.items())   # resnet keeps timm's names
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        expected = full.forward_intermediates(x, indices=(2, 3, 4), intermediates_only=True)
        for a, b in zip(backbone(x), expected, strict=True):
            assert torch.equal(a, b)


def test_pretrained_needs_a_local_file_and_bad_files_are_errors(resnet_file, tmp_path):
    folder, _ = resnet_file
    with pytest.raises(ValueError, match="local file only"):
        TimmBackbone("resnet18", pretrained=True)
    with pytest.raises(ValueError, match="not a timm model name"):
        TimmBackbone("resnet_eighteen")
    with pytest.raises(FileNotFoundError, match="missing.safetensors: no such weights file"):
        TimmBackbone("resnet18", weights=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"resnet18.safetensors: not the weights of timm's resnet34 \(missing: "
                                         r"layer1.2.conv1.weight"):
        TimmBackbone("resnet34", weights=folder / "resnet18.safetensors")
    with pytest.raises(ValueError, match=r"resnet18.safetensors: not the weights of timm's resnet26 .*other shape"):
        TimmBackbone("resnet26", weights=folder / "resnet18.safetensors")
    evil = tmp_path / "evil.pth"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"state_dict": Payload()}, evil)
    with pytest.raises(ValueError, match="evil.pth: not a weights file torch reads with weights_only=True"):
        TimmBackbone("resnet18", weights=evil)
    assert not (tmp_path / "pwned").exists()


def test_a_yaml_row_names_a_timm_model(resnet_file, tmp_path):
    folder, full = resnet_file
    weights = tmp_path / "r18.safetensors"
    weights.write_bytes((folder / "resnet18.safetensors").read_bytes())
    spec = {"nc": 4,
            "backbone": [[-1, 1, "TimmBackbone", ["resnet18", [2, 3, 4], str(weights)]],
                         [0, 1, "Index", [0]], [0, 1, "Index", [1]], [0, 1, "Index", [2]]],
            "head": [[-1, 1, "SPPF", [512, 5]], [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
                     [[-1, 2], 1, "Concat", [1]], [-1, 1, "C2f", [256]], [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
                     [[-1, 1], 1, "Concat", [1]], [-1, 1, "C2f", [128]], [[10, 7, 4], 1, "Detect", ["nc"]]]}
    model = yolokit.create_model(spec)
    assert model.strides == (8, 16, 32) and model.backbone.out_channels == (128, 256, 512)
    assert torch.equal(model.backbone.get_submodule("0").model.conv1.weight, full.state_dict()["conv1.weight"])
    assert [m.shape[1] for m in model(torch.rand(1, 3, 64, 64))] == [64 + 4] * 3
    config = config_from_dict(asdict(model.config))
    weights.unlink()   # a stored config rebuilds without the weights file: its checkpoint holds the weights
    rebuilt = build_model(config)
    rebuilt.load_state_dict(model.state_dict())
    assert [k for k in rebuilt.state_dict()] == [k for k in model.state_dict()]
