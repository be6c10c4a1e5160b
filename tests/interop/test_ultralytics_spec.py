"""Ultralytics checkpoints of architectures other than YOLOv8 (YOLO11, P2, P6, YOLOv5u), without ultralytics.

Two checks that need no ultralytics: (1) yolokit's models built from our model files, given
deterministic weights, reproduce the raw maps Ultralytics' own models computed for the same
weights and input (``fixtures/ultralytics-spec-maps.pt``, written by ``fixtures/make_spec_maps.py``);
(2) checkpoints pickled as their trainer pickles (stand-in classes named as theirs) load through
the safe reader, rebuilt from the model file they carry. test_ultralytics_real.py repeats both
against the real package where it is installed.
"""

import re
from pathlib import Path

import pytest
import torch
import yaml
from _seeded_weights import seeded_input, seeded_state

import yolokit
from yolokit.interop import UnsafeFileError
from yolokit.interop.safe_load import pickle_globals
from yolokit.interop.ultralytics import load_ultralytics, read_ultralytics, to_spec_names
from yolokit.models import SpecConfig
from yolokit.models.spec_config import CFG

REFERENCE = torch.load(Path(__file__).parent / "fixtures" / "ultralytics-spec-maps.pt", weights_only=True)


def architecture(name, scale):
    """Their DetectionModel's ``yaml``: the model file's content plus the scale and file name."""
    spec = yaml.safe_load((CFG / f"{name}.yaml").read_text())
    file_name = re.sub(r"^(yolo\D*?\d+)", rf"\g<1>{scale}", name)   # yolo11 -> yolo11n, yolov8-p2 -> yolov8n-p2
    return {**spec, "scale": scale, "yaml_file": f"{file_name}.yaml", "channels": 3}


@pytest.mark.parametrize("name", list(REFERENCE["models"]))
def test_raw_maps_equal_ultralytics_reference(name):
    entry = REFERENCE["models"][name]
    model = yolokit.create_model(f"{name}.yaml", num_classes=REFERENCE["num_classes"])
    model.load_state_dict(seeded_state(model.state_dict(), entry["weights_seed"]))
    with torch.no_grad():
        maps = model.eval()(seeded_input(tuple(REFERENCE["input_shape"]), REFERENCE["input_seed"]))
    assert [m.shape for m in maps] == [m.shape for m in entry["maps"]]
    diff = max((a - b).abs().max().item() for a, b in zip(maps, entry["maps"], strict=True))
    scale = max(m.abs().max().item() for m in entry["maps"])
    print(f"{name}: max abs diff {diff:.3g} (maps up to {scale:.3g}; ultralytics {REFERENCE['ultralytics']})")
    assert diff < 1e-4 and scale > 0.1


@pytest.mark.parametrize("name,scale,training", [("yolo11", "n", False), ("yolo11", "n", True),
                                                 ("yolov8-p2", "n", False)])
def test_their_checkpoint_loads_from_the_architecture_it_carries(tmp_path, their, name, scale, training):
    torch.manual_seed(0)
    model = yolokit.create_model(f"{name}.yaml", scale=scale, num_classes=3).eval()
    arch = architecture(name, scale)
    path = tmp_path / "best.pt"
    values = their.write_spec(path, model, arch, training=training, names={0: "cat", 1: "dog", 2: "fox"})
    assert {"ultralytics.nn.modules.block.C3k2", "ultralytics.nn.modules.block.C2PSA"} <= set(pickle_globals(path)) \
        or name != "yolo11"
    contents = read_ultralytics(path)
    assert contents.architecture == arch and contents.entry == ("ema" if training else "model")
    loaded = yolokit.load(path)
    assert isinstance(loaded.config, SpecConfig) and loaded.config.scale == scale and loaded.num_classes == 3
    assert loaded.name == ("yolo11n" if name == "yolo11" else "yolov8n-p2") and not loaded.training
    assert loaded.names == ["cat", "dog", "fox"]
    state = loaded.state_dict()
    assert list(state) == list(values) and all(torch.equal(state[k], v) for k, v in values.items())
    x = torch.rand(1, 3, 64, 64)
    model.load_state_dict(values)   # the float16-rounded values the file holds
    with torch.no_grad():
        for a, b in zip(loaded(x), model(x), strict=True):
            assert torch.equal(a, b)


def test_a_state_dict_in_their_naming_loads_into_a_model_yaml_model(tmp_path):
    torch.manual_seed(0)
    source = yolokit.create_model("yolo11n.yaml", num_classes=3)
    theirs = {}
    for key, value in source.state_dict().items():   # yolokit's names back to theirs
        part, _, rest = key.partition(".")
        if part == "head":
            branch, _, tail = rest.partition(".")
            key = f"model.23.{ {'box': 'cv2', 'cls': 'cv3', 'dfl': 'dfl'}[branch]}.{tail}"
        else:
            key = f"model.{rest}"
        theirs[key] = value
    assert to_spec_names(theirs, model=source).keys() == source.state_dict().keys()
    torch.save(theirs, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a YOLOv8 detection model"):   # no architecture in a plain state dict
        yolokit.load(tmp_path / "plain.pt")
    target = yolokit.create_model("yolo11n.yaml", num_classes=3)
    loaded = yolokit.load(tmp_path / "plain.pt", model=target)
    assert loaded is target and all(torch.equal(a, b) for a, b in zip(
        loaded.state_dict().values(), source.state_dict().values(), strict=True))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in theirs.items()}, str(tmp_path / "plain.safetensors"))
    again = yolokit.load(tmp_path / "plain.safetensors", model=yolokit.create_model("yolo11n.yaml", num_classes=3))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), source.state_dict().values(),
                                                 strict=True))


def test_an_architecture_we_cannot_build_is_an_error_naming_the_file_and_layer(tmp_path, their):
    model = yolokit.create_model("yolov8-p2.yaml", scale="n", num_classes=3)
    arch = architecture("yolov8-p2", "n")
    arch["head"][2] = [-1, 3, "C2fCIB", [512]]   # a block yolokit does not have
    path = tmp_path / "v10.pt"
    their.write_spec(path, model, arch)
    with pytest.raises(ValueError, match=r"v10.pt: .*layer 12 \(C2fCIB\): unknown module 'C2fCIB'"):
        load_ultralytics(path)


def test_a_class_outside_the_allowlist_is_refused(tmp_path, their):
    import yolokit.interop.safe_load as safe_load

    path = tmp_path / "y.pt"
    their.write_spec(path, yolokit.create_model("yolo11n.yaml", num_classes=3), architecture("yolo11", "n"))
    allowed = tuple(g for g in safe_load.ULTRALYTICS_GLOBALS if not g.endswith(".C2PSA"))
    with pytest.raises(UnsafeFileError, match="ultralytics.nn.modules.block.C2PSA"):
        safe_load.load_pickled(path, allow=allowed)
