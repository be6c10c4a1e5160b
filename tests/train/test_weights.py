"""Pretrained weights bring their variant: yolokit files, Ultralytics checkpoints, Darknet files.

With another class count only the class-score outputs stay as initialised, and the report
line counts parameters, not tensors.
"""

import subprocess
import sys

import pytest
import torch

import yolokit
from yolokit.data import make_shapes
from yolokit.train import TrainConfig, Trainer
from yolokit.train.weights import read_pretrained, transfer_weights


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=8, n_val=4, imgsz=64))


def setup_run(shapes, out, notes=None, **kw):
    """``Trainer.setup()`` of a 4-class run: everything built, nothing trained."""
    from yolokit.train.callbacks import Callback

    class Notes(Callback):
        def on_setup_end(self, summary):
            notes.extend(summary["notes"])

    config = TrainConfig(data=shapes, imgsz=64, batch=4, epochs=1, workers=0, out=str(out), plots=False, **kw)
    run = Trainer(config, callbacks=[Notes()] if notes is not None else []).setup()
    run.loader.close()
    return run


def test_a_yolov8s_file_trains_a_yolov8s_and_only_the_class_scores_start_fresh(shapes, tmp_path):
    torch.manual_seed(1)
    source = yolokit.create_model("yolov8s", num_classes=2)
    path = tmp_path / "best.pt"
    yolokit.save(source, path)
    notes = []
    run = setup_run(shapes, tmp_path / "run", notes, weights=str(path))
    assert run.model.name == "yolov8s" and run.config.model == "yolov8s" and run.model.num_classes == 4
    assert TrainConfig.from_yaml(tmp_path / "run" / "config.yaml").model == "yolov8s"   # the resolved variant
    theirs, ours = source.state_dict(), run.model.state_dict()
    fresh = sorted(k for k in ours if not torch.equal(ours[k].cpu(), theirs[k]) if ours[k].shape == theirs[k].shape)
    differs = sorted(k for k in ours if ours[k].shape != theirs[k].shape)
    assert fresh == [] and differs == [f"head.cls.{i}.2.{w}" for i in range(3) for w in ("bias", "weight")]
    total = sum(p.numel() for p in run.model.parameters())
    cls_out = sum(p.numel() for n, p in run.model.named_parameters() if n in differs)
    (note,) = notes
    assert f"{total - cls_out:,}/{total:,} parameters transferred" in note
    assert "head.cls.*.2 (class scores: the weights have 2 classes, the data 4)" in note and "tensors" not in note


def test_a_model_that_contradicts_the_file_is_an_error_naming_both(shapes, tmp_path):
    path = tmp_path / "s.safetensors"
    yolokit.save(yolokit.create_model("yolov8s", num_classes=4), path)
    with pytest.raises(ValueError, match=r"'yolov8n' contradicts the weights .*s\.safetensors, which hold a yolov8s"):
        setup_run(shapes, tmp_path / "run", weights=str(path), model="yolov8n")
    run = setup_run(shapes, tmp_path / "run2", weights=str(path), model="yolov8s")   # agreeing is fine
    assert run.model.name == "yolov8s"
    assert TrainConfig().model is None and setup_run(shapes, tmp_path / "run3").model.name == "yolov8n"


def test_an_ultralytics_checkpoint_brings_its_variant(tmp_path):
    from interop.conftest import write_their_checkpoint

    path = tmp_path / "best.pt"
    theirs = write_their_checkpoint(path, "yolov8s", nc=2)
    source = read_pretrained(path)
    assert source.name == "yolov8s" and source.num_classes == 2
    model = yolokit.create_model("yolov8s", num_classes=3)
    left = transfer_weights(model, source, path=path, report=lambda line: None)
    assert sorted(left) == sorted(f"head.cls.{i}.2.{w}" for i in range(3) for w in ("weight", "bias"))
    first = next(p for n, p in theirs.named_parameters() if n.endswith("conv.weight"))
    assert torch.equal(model.state_dict()[next(iter(model.state_dict()))], first.detach())
    with pytest.raises(ValueError, match="contradicts .* which hold a yolov8s"):
        read_pretrained(path, "yolov8m")


def test_an_ultralytics_yolo11_checkpoint_fine_tunes_from_its_own_architecture(shapes, tmp_path):
    """--weights yolo11n.pt: the run trains the architecture the file carries (no --model), or the
    packaged YAML it names (--model yolo11n.yaml); only the class-score outputs start fresh."""
    from interop.conftest import write_their_spec_checkpoint

    torch.manual_seed(3)
    theirs = yolokit.create_model("yolo11n.yaml", num_classes=2)
    path = tmp_path / "yolo11n.pt"
    write_their_spec_checkpoint(path, theirs, {**theirs.config.spec, "scale": "n", "channels": 3,
                                               "yaml_file": "yolo11n.yaml"})
    for model in (None, "yolo11n.yaml"):
        notes = []
        run = setup_run(shapes, tmp_path / f"run-{model}", notes, weights=str(path), model=model)
        assert run.model.name == "yolo11n" and run.model.num_classes == 4 and run.model.config.family == "spec"
        ours, source = run.model.state_dict(), theirs.state_dict()
        differs = sorted(k for k in ours if ours[k].shape != source[k].shape)
        assert differs and all(".cls." in k for k in differs)       # the class scores, 2 classes there, 4 here
        same = [k for k in ours if k not in differs and source[k].is_floating_point()]
        assert all(torch.allclose(ours[k].float(), source[k].float(), rtol=1e-3, atol=1e-3) for k in same)
        assert "parameters transferred" in notes[0]
    with pytest.raises(ValueError, match=r"'yolov8n.yaml' contradicts the weights .* which hold a yolo11n"):
        setup_run(shapes, tmp_path / "bad", weights=str(path), model="yolov8n.yaml")


def test_a_darknet_file_keeps_box_and_objectness_rows(tmp_path):
    torch.manual_seed(2)
    source = yolokit.create_model("yolov3-tiny", num_classes=2)
    path = tmp_path / "tiny.weights"
    yolokit.save(source, path)
    loaded = read_pretrained(path)
    assert loaded.name == "yolov3-tiny" and loaded.num_classes == 2
    model = yolokit.create_model("yolov3-tiny", num_classes=5)
    lines = []
    left = transfer_weights(model, loaded, path=path, report=lines.append)
    assert left == ["head.preds.0.weight", "head.preds.0.bias", "head.preds.1.weight", "head.preds.1.bias"]
    anchors = len(model.head.anchors[0])
    for level in range(2):
        ours, theirs = model.head.preds[level].weight, loaded.head.preds[level].weight
        for a in range(anchors):   # per anchor (tx, ty, tw, th, obj, classes...): 7 rows there, 10 here
            assert torch.equal(ours[a * 10:a * 10 + 5], theirs[a * 7:a * 7 + 5])
    class_params = sum(anchors * 5 * p.numel() // p.shape[0] for n, p in model.named_parameters() if n in left)
    total = sum(p.numel() for p in model.parameters())
    assert f"{total - class_params:,}/{total:,} parameters transferred" in lines[0]


def test_the_command_line_names_both_and_exits_2(shapes, tmp_path):
    path = tmp_path / "s.pt"
    yolokit.save(yolokit.create_model("yolov8s", num_classes=4), path)
    done = subprocess.run([sys.executable, "-m", "yolokit", "train", "--data", shapes, "--weights", str(path),
                           "--model", "yolov8m", "--out", str(tmp_path / "run"), "--workers", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "'yolov8m' contradicts the weights" in done.stderr and "which hold a yolov8s" in done.stderr
    assert "Traceback" not in done.stderr
