"""Ultralytics' own model files, read as they are by yolokit's builder, against their DetectionModel.

Runs only where ultralytics is importable (the bench extra; never a yolokit dependency): the same
parameter count, the same tensor shapes in the same order, the same output maps' shapes, and, with
their weights renamed onto ours, the same raw maps.
"""

from pathlib import Path

import pytest
import torch

ultralytics = pytest.importorskip("ultralytics")

import yolokit  # noqa: E402
from yolokit.interop.ultralytics import to_spec_names  # noqa: E402

MODELS = Path(ultralytics.__file__).parent / "cfg" / "models"
FILES = {"yolov8": "v8/yolov8.yaml", "yolov8-p2": "v8/yolov8-p2.yaml", "yolov8-p6": "v8/yolov8-p6.yaml",
         "yolo11": "11/yolo11.yaml", "yolov5": "v5/yolov5.yaml"}
UNSCALED = {"yolov3u": "v3/yolov3.yaml", "yolov3-sppu": "v3/yolov3-spp.yaml", "yolov3-tinyu": "v3/yolov3-tiny.yaml"}
CASES = [(arch, s) for arch in FILES for s in "nsmlx"] + [(arch, None) for arch in UNSCALED]


def their_model(arch, scale, nc):
    from ultralytics.nn.tasks import DetectionModel

    cfg = str(MODELS / (FILES[arch] if scale else UNSCALED[arch]))
    if scale:   # their name convention: the letter after the version picks the scale
        cfg = cfg.replace(f"{arch}.yaml", f"{arch[:6]}{scale}{arch[6:]}.yaml" if arch.startswith("yolov")
                          else f"{arch}{scale}.yaml")
    return DetectionModel(cfg, nc=nc, verbose=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch,scale", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_their_files_build_the_same_tensors_and_maps(arch, scale):
    theirs = their_model(arch, scale, 80).eval()
    path = MODELS / (FILES[arch] if scale else UNSCALED[arch])
    with torch.device("meta"):
        ours = yolokit.create_model(path, scale=scale)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    shapes = [tuple(v.shape) for v in ours.state_dict().values()]
    assert shapes == [tuple(v.shape) for v in theirs.state_dict().values()]
    assert list(to_spec_names(theirs.state_dict(), model=ours)) == list(ours.state_dict())
    assert ours.strides == tuple(int(s) for s in theirs.stride)


@pytest.mark.parametrize("arch", ["yolov8", "yolov8-p2", "yolov8-p6", "yolo11", "yolov5"])
def test_their_files_compute_their_maps(arch):
    theirs = their_model(arch, "n", 3).eval()
    ours = yolokit.create_model(MODELS / FILES[arch], scale="n", num_classes=3).eval()
    ours.load_state_dict(to_spec_names(theirs.state_dict(), model=ours))
    x = torch.rand(2, 3, 128, 192)
    with torch.no_grad():
        _, raw = theirs(x)
        maps = ours(x)
    assert [tuple(m.shape[-2:]) for m in maps] == [tuple(f.shape[-2:]) for f in raw["feats"]]
    flat = torch.cat([m.flatten(2) for m in maps], dim=2)
    assert (flat - torch.cat((raw["boxes"], raw["scores"]), dim=1)).abs().max().item() < 1e-4
