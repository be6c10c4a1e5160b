"""Darknet .weights: header, per-layer layout, byte-identical round trips, class count from size."""

import filecmp
import struct

import numpy as np
import pytest
import torch
from torch import nn

import yolokit
from yolokit.interop.darknet import (
    DarknetHeader,
    darknet_count,
    darknet_fits,
    darknet_num_classes,
    darknet_order,
    load_darknet,
    load_darknet_model,
    looks_like_darknet,
    read_darknet,
    read_darknet_header,
    save_darknet,
)
from yolokit.interop.formats import file_format
from yolokit.models.layers import Conv


def write_weights(path, header, count, seed=0):
    """A .weights file of ``count`` random float32 values in [0, 1)."""
    values = np.random.default_rng(seed).random(count, dtype=np.float32)
    with open(path, "wb") as f:
        f.write(header.to_bytes())
        values.tofile(f)
    return values


@pytest.mark.parametrize("header,size", [
    (DarknetHeader(0, 2, 0, 2**40 + 7), 20),  # 0.2: seen is int64
    (DarknetHeader(0, 1, 0, 12345), 16),  # 0.1: int32
    (DarknetHeader(1, 0, 3, 99), 20),  # 1.0: int64
    (DarknetHeader(1000, 0, 0, 5), 16),  # major >= 1000: int32
])
def test_header_bytes_round_trip(header, size):
    data = header.to_bytes()
    assert len(data) == size == header.nbytes
    assert struct.unpack("<3i", data[:12]) == (header.major, header.minor, header.revision)
    assert DarknetHeader.from_bytes(data + b"\0" * 8) == header


def test_values_land_in_darknet_layer_order(tmp_path):
    model = yolokit.create_model("yolov3-tiny", num_classes=1)
    count = darknet_count(model)
    (tmp_path / "t.weights").write_bytes(DarknetHeader().to_bytes() + np.arange(count, dtype="<f4").tobytes())
    load_darknet(model, tmp_path / "t.weights")
    stem = model.backbone.stages[0][0]
    assert stem.bn.bias.tolist() == list(range(0, 16))  # beta first
    assert stem.bn.weight.tolist() == list(range(16, 32))  # then gamma
    assert stem.bn.running_mean.tolist() == list(range(32, 48))
    assert stem.bn.running_var.tolist() == list(range(48, 64))
    assert torch.equal(stem.conv.weight, torch.arange(64, 64 + 16 * 27, dtype=torch.float32).view(16, 3, 3, 3))
    pos = sum(t.numel() for layer in darknet_order(model)[:9] for t in (
        [layer.bn.bias, layer.bn.weight, layer.bn.running_mean, layer.bn.running_var, layer.conv.weight]))
    first_head = model.head.preds[1]  # stride-32 detection conv: bias first, no batch norm
    assert darknet_order(model)[9] is first_head
    assert first_head.bias.tolist() == list(range(pos, pos + 18))
    assert first_head.weight.flatten()[0].item() == pos + 18
    assert model.head.preds[0].weight.flatten()[-1].item() == count - 1  # the last value of the file


def test_tiny_round_trip_is_byte_identical(tmp_path):
    header = DarknetHeader(0, 2, 5, 32013312)
    write_weights(tmp_path / "a.weights", header, 8_858_734)  # yolov3-tiny, 80 classes
    model = yolokit.load(tmp_path / "a.weights", model="yolov3-tiny")
    assert (model.name, model.num_classes, model.training) == ("yolov3-tiny", 80, False)
    assert not hasattr(model, "darknet_header")  # nothing of the file's hangs on the model
    assert read_darknet_header(tmp_path / "a.weights") == header
    yolokit.save(model, tmp_path / "b.weights", header=header)
    assert (tmp_path / "b.weights").read_bytes() == (tmp_path / "a.weights").read_bytes()
    fresh = yolokit.create_model("yolov3-tiny")
    assert load_darknet(fresh, tmp_path / "a.weights") == header
    save_darknet(fresh, tmp_path / "c.weights", header=header)
    assert (tmp_path / "c.weights").read_bytes() == (tmp_path / "a.weights").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["yolov3", "yolov3-spp"])
def test_full_round_trip_is_byte_identical(tmp_path, name):
    """One class keeps the head small; the backbone and neck (99.9% of the values) are the full ones."""
    header = DarknetHeader(0, 1, 0, 7)  # 32-bit seen
    with torch.device("meta"):
        count = darknet_count(yolokit.create_model(name, num_classes=1))
    write_weights(tmp_path / "a.weights", header, count)
    model = load_darknet_model(tmp_path / "a.weights", name)
    assert model.num_classes == 1 and read_darknet_header(tmp_path / "a.weights") == header
    save_darknet(model, tmp_path / "b.weights", header=header)
    assert filecmp.cmp(tmp_path / "a.weights", tmp_path / "b.weights", shallow=False)


def test_counts_match_the_published_files():
    """pjreddie's yolov3.weights (248,007,048 bytes) and yolov3-tiny.weights (35,434,956 bytes)."""
    with torch.device("meta"):
        full, tiny = yolokit.create_model("yolov3"), yolokit.create_model("yolov3-tiny")
    assert 20 + 4 * darknet_count(full) == 248_007_048
    assert 20 + 4 * darknet_count(tiny) == 35_434_956


@pytest.mark.parametrize("name", ["yolov3", "yolov3-spp", "yolov3-tiny"])
def test_class_count_follows_from_the_file_size(name):
    with torch.device("meta"):
        for classes in (1, 3, 80):
            assert darknet_num_classes(name, darknet_count(yolokit.create_model(name, num_classes=classes))) == classes


def test_loaded_model_runs_and_matches_a_model_filled_by_load_darknet(tmp_path):
    count = darknet_count(yolokit.create_model("yolov3-tiny", num_classes=5))
    write_weights(tmp_path / "a.weights", DarknetHeader(), count, seed=1)
    model = yolokit.load(tmp_path / "a.weights", model="yolov3-tiny")
    assert model.num_classes == 5
    other = yolokit.create_model("yolov3-tiny", num_classes=5)
    assert yolokit.load(tmp_path / "a.weights", model=other) is other and not other.training
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), other(x), strict=True))
    assert all(b.item() == 0 for n, b in model.named_buffers() if n.endswith("num_batches_tracked"))


def test_errors_name_the_file(tmp_path):
    write_weights(tmp_path / "odd.weights", DarknetHeader(), 1000)
    with pytest.raises(ValueError, match=r"odd\.weights: 1,000 values after the header fit no class count of yolov3-t"):
        yolokit.load(tmp_path / "odd.weights", model="yolov3-tiny")
    with pytest.raises(ValueError, match=r"odd\.weights: a Darknet \.weights header, but its 1,000 values fit no "
                                         r"YOLOv3-family variant \(yolov3: 61,576,342 \+ 5,385 per class"):
        yolokit.load(tmp_path / "odd.weights")
    with pytest.raises(ValueError, match=r"odd\.weights: Darknet weights need a YOLOv3-family variant"):
        yolokit.load(tmp_path / "odd.weights", model="yolov8n")
    with pytest.raises(ValueError, match=r"odd\.weights: holds 1,000 values after its header but yolov3-tiny with 80"):
        load_darknet(yolokit.create_model("yolov3-tiny"), tmp_path / "odd.weights")
    (tmp_path / "short.weights").write_bytes(b"\0" * 6)
    with pytest.raises(ValueError, match=r"short\.weights: too short for a Darknet header"):
        read_darknet(tmp_path / "short.weights")
    with pytest.raises(ValueError, match="YOLOv3 family only"):
        save_darknet(yolokit.create_model("yolov8n"), tmp_path / "v8.weights")
    with pytest.raises(ValueError, match="fused model"):
        save_darknet(yolokit.create_model("yolov3-tiny").fuse(), tmp_path / "f.weights")


def test_partial_file_fills_leading_layers_only(tmp_path):
    """Like darknet53.conv.74: a pretrained backbone, loaded with strict=False."""
    model = yolokit.create_model("yolov3-tiny", num_classes=2)
    backbone = [m for m in darknet_order(model) if isinstance(m, Conv)][:7]
    count = sum(t.numel() for m in backbone for t in (m.bn.bias, m.bn.weight, m.bn.running_mean,
                                                      m.bn.running_var, m.conv.weight))
    write_weights(tmp_path / "backbone.weights", DarknetHeader(), count)
    head_before = model.head.preds[0].weight.clone()
    with pytest.raises(ValueError, match="needs"):
        load_darknet(model, tmp_path / "backbone.weights")
    load_darknet(model, tmp_path / "backbone.weights", strict=False)
    last = model.backbone.stages[1][3]
    assert (last.conv.weight >= 0).all() and torch.equal(model.head.preds[0].weight, head_before)
    write_weights(tmp_path / "cut.weights", DarknetHeader(), count - 3)
    with pytest.raises(ValueError, match=r"cut\.weights: ends inside a layer"):
        load_darknet(model, tmp_path / "cut.weights", strict=False)


def test_darknet_order_lists_every_convolution_once():
    for name in ("yolov3", "yolov3-spp", "yolov3-tiny"):
        with torch.device("meta"):
            model = yolokit.create_model(name)
        order = darknet_order(model)
        convs = [m for m in model.modules() if isinstance(m, (Conv, nn.Conv2d)) and not any(
            m is c.conv for c in model.modules() if isinstance(c, Conv))]
        assert len(order) == len({id(m) for m in order}) == len(convs)


def test_variant_and_class_count_come_from_the_size_and_a_wrong_variant_is_named(tmp_path):
    write_weights(tmp_path / "tiny80.weights", DarknetHeader(0, 2, 5, 1), 8_858_734)
    model = yolokit.load(tmp_path / "tiny80.weights")  # no variant named: only yolov3-tiny fits
    assert (model.name, model.num_classes) == ("yolov3-tiny", 80)
    assert darknet_fits(8_858_734) == [("yolov3-tiny", 80)]
    with pytest.raises(ValueError, match=r"fit no class count of yolov3 .*; it fits yolov3-tiny with 80 classes"):
        yolokit.load(tmp_path / "tiny80.weights", model="yolov3")
    with pytest.raises(ValueError, match=r"needs 8,678,554; it fits yolov3-tiny with 80 classes"):
        load_darknet(yolokit.create_model("yolov3-tiny", num_classes=2), tmp_path / "tiny80.weights")
    with torch.device("meta"):  # yolov3 and yolov3-spp are told apart by size too
        count = darknet_count(yolokit.create_model("yolov3-spp", num_classes=3))
    assert darknet_fits(count) == [("yolov3-spp", 3)]


def test_recognised_by_header_and_size_not_by_suffix(tmp_path):
    count = darknet_count(yolokit.create_model("yolov3-tiny", num_classes=2))
    write_weights(tmp_path / "model.bin", DarknetHeader(0, 1, 0, 5), count)
    assert file_format(tmp_path / "model.bin") == "darknet" and looks_like_darknet(tmp_path / "model.bin")
    assert yolokit.load(tmp_path / "model.bin").num_classes == 2
    (tmp_path / "notes.weights").write_text("these are not weights, just a text file of some length\n" * 3)
    assert not looks_like_darknet(tmp_path / "notes.weights")
    with pytest.raises(ValueError, match=r"notes\.weights: named \.weights but not a Darknet weights file"):
        yolokit.load(tmp_path / "notes.weights")
    (tmp_path / "odd.bin").write_bytes(DarknetHeader().to_bytes() + b"\0" * 10)  # not whole float32 values
    assert not looks_like_darknet(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match="unknown weights format"):
        file_format(tmp_path / "odd.bin")
    (tmp_path / "big.bin").write_bytes(struct.pack("<3iq", 5000, 2, 0, 0) + b"\0" * 40)  # version far too large
    assert not looks_like_darknet(tmp_path / "big.bin")
