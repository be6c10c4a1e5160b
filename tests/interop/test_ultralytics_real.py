"""Against the real ultralytics package: runs only where it is importable (never a yolokit dependency).

Their own code builds the model and writes both checkpoint kinds (a training checkpoint
with the model under "ema", and the finished one from their ``strip_optimizer``);
yolokit must read both without ultralytics' help and give the same raw maps.
"""

import copy

import pytest
import torch

ultralytics = pytest.importorskip("ultralytics")

import yolokit  # noqa: E402
from yolokit.ops.boxes import box_convert  # noqa: E402


def _their_model(variant: str, num_classes: int, randomize):
    from ultralytics.nn.tasks import DetectionModel

    return randomize(DetectionModel(f"{variant}.yaml", nc=num_classes, verbose=False), 0)


def _save_like_their_trainer(model, path):
    from ultralytics.cfg import DEFAULT_CFG_DICT
    from ultralytics.utils import IterableSimpleNamespace

    ema = copy.deepcopy(model).half()
    ema.args = IterableSimpleNamespace(**DEFAULT_CFG_DICT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.save({"epoch": 0, "best_fitness": 0.0, "stopper": {"best_fitness": 0.0, "best_epoch": 0}, "model": None,
                "ema": ema, "updates": 1, "modelopt": None, "optimizer": optimizer.state_dict(), "scaler": {},
                "train_args": dict(DEFAULT_CFG_DICT), "train_metrics": {}, "train_results": {}}, path)


@pytest.mark.parametrize("variant,num_classes", [("yolov8n", 80), ("yolov8s", 3)])
def test_raw_maps_equal_theirs_for_both_checkpoint_kinds(tmp_path, variant, num_classes, their):
    from ultralytics.nn.tasks import load_checkpoint
    from ultralytics.utils.torch_utils import strip_optimizer

    model = _their_model(variant, num_classes, their.randomize)
    training, finished = tmp_path / "last.pt", tmp_path / "best.pt"
    _save_like_their_trainer(model, training)
    strip_optimizer(training, finished)
    x = torch.rand(2, 3, 128, 160)
    for path in (training, finished):
        theirs = load_checkpoint(str(path))[0].float().eval()
        with torch.no_grad():
            decoded, raw = theirs(x)  # ultralytics 8.4: raw = {"boxes": [B, 4R, P], "scores": [B, C, P], ...}
            ours = yolokit.load(path)
            maps = ours(x)
            flat = torch.cat([m.flatten(2) for m in maps], dim=2)
            boxes = box_convert(ours.decode(maps)[..., :4], "xyxy", "cxcywh")
        assert ours.name == variant and ours.num_classes == num_classes
        diff = max((flat[:, :64] - raw["boxes"]).abs().max().item(), (flat[:, 64:] - raw["scores"]).abs().max().item())
        box_diff = (boxes - decoded[:, :4].transpose(1, 2)).abs().max().item()
        print(f"{variant} {path.name}: max abs diff of raw maps {diff:.3g}, of decoded boxes {box_diff:.3g} px")
        assert diff < 1e-4
        assert box_diff < 1e-3


@pytest.mark.parametrize("name,num_classes", [("yolo11n", 80), ("yolo11s", 3), ("yolov8n-p2", 3), ("yolov8n-p6", 3),
                                              ("yolov5nu", 3), ("yolov3-tinyu", 3)])
def test_other_architectures_equal_theirs_for_both_checkpoint_kinds(tmp_path, name, num_classes, their):
    """Every architecture besides YOLOv8 is rebuilt from the model file their checkpoint carries."""
    from ultralytics.nn.tasks import load_checkpoint
    from ultralytics.utils.torch_utils import strip_optimizer

    model = _their_model(name, num_classes, their.randomize)
    training, finished = tmp_path / "last.pt", tmp_path / "best.pt"
    _save_like_their_trainer(model, training)
    strip_optimizer(training, finished)
    x = torch.rand(2, 3, 128, 192)   # multiples of 64 (P6)
    for path in (training, finished):
        theirs = load_checkpoint(str(path))[0].float().eval()
        ours = yolokit.load(path)
        with torch.no_grad():
            _, raw = theirs(x)
            maps = ours(x)
        flat = torch.cat([m.flatten(2) for m in maps], dim=2)
        diff = max((flat[:, :64] - raw["boxes"]).abs().max().item(), (flat[:, 64:] - raw["scores"]).abs().max().item())
        print(f"{name} {path.name}: max abs diff of raw maps {diff:.3g}")
        assert ours.name == name and ours.num_classes == num_classes and ours.config.family == "spec"
        assert diff < 1e-4
