"""What the pages' code blocks run against: a folder holding every file their placeholder paths name.

``stage(root)`` writes it once per session (the ``pages_staged`` fixture of conftest.py); each test
copies it, so a block finds what the page tells the reader to have:

- ``path/to/data.yaml``, ``data.yaml``, ``shared/data.yaml``: a small shapes set (16 + 8 images of 64 px);
- ``path/to/images``, ``images/``, ``image.jpg``, ``data/**/*.jpg``, ``list.txt`` (a list of image
  files): a few images; ``clip.mp4``: a 6-frame video;
- ``annotations/instances_{train,val}2017.json`` with ``train2017/`` and ``val2017/``: the small set as
  COCO json, with COCO's 80 categories (the shapes are the first four), as the pages' COCO models take;
- ``runs/train``: a small trained run (1 epoch of that set), its ``weights/model.pt`` also as
  ``model.pt``; ``runs/v8n``, ``runs/v8n-p2``, ``runs/mine``, ``runs/full``: copies of it to compare;
- ``my-seg-set``: a small segmentation set (32 + 8 images of 64 px, polygons), and ``runs/seg``: a
  yolov8n-seg trained on it for 1 epoch;
- ``my.yaml``: a TrainConfig YAML;
- ``best.pt``: a 2-class yolov8s; ``yolov8n.pt`` and ``yolo11n.pt``: Ultralytics checkpoints
  (written by the stand-ins of tests/interop); ``yolo26n.pt``: a (narrow) YOLO26 checkpoint
  the reference's own trainer saved (tests/interop/fixtures); ``yolov3-tiny.weights``: a Darknet file;
- ``"shapes"``: the built-in set, generated once into the session's ``YOLOKIT_CACHE``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from unittest import mock

import cv2
import numpy as np
import torch
from _torchrun_env import subprocess_env

import yolokit
from yolokit.data import make_shapes

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")   # the line before a block that deliberately does not run


def _coco(small: Path, files: Path) -> None:
    """The small set's two splits as COCO instances json, images in ``train2017/`` and ``val2017/``."""
    (files / "annotations").mkdir()
    names = ["circle", "rectangle", "triangle", "star"]
    for split in ("train", "val"):
        folder = files / f"{split}2017"
        folder.mkdir()
        images, annotations = [], []
        for i, image in enumerate(sorted((small.parent / "images" / split).glob("*.jpg"))):
            shutil.copy(image, folder / image.name)
            h, w = cv2.imread(str(image)).shape[:2]
            images.append({"id": i + 1, "file_name": image.name, "height": h, "width": w})
            label = small.parent / "labels" / split / f"{image.stem}.txt"
            for row in label.read_text().split("\n") if label.exists() else []:
                if row.strip():
                    c, x, y, bw, bh = map(float, row.split())
                    box = [(x - bw / 2) * w, (y - bh / 2) * h, bw * w, bh * h]
                    annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "category_id": int(c) + 1,
                                        "bbox": box, "area": box[2] * box[3], "iscrowd": 0})
        categories = [{"id": k + 1, "name": names[k] if k < len(names) else f"class{k}"} for k in range(80)]
        (files / "annotations" / f"instances_{split}2017.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": categories}))


def _train(*args: str, env: dict[str, str]) -> None:
    """``yolokit train ARGS`` (one epoch at 64 px, no plots) in this process, with the blocks' cache."""
    from yolokit.cli import main

    with mock.patch.dict(os.environ, YOLOKIT_CACHE=env["YOLOKIT_CACHE"], MPLBACKEND="Agg"):
        code = main(["train", *args, "--epochs", "1", "--imgsz", "64", "--batch", "8", "--workers", "0",
                     "--no-plots", "--quiet"])
    assert code == 0, f"yolokit train {' '.join(args)}: exit {code}"


def stage(root: Path) -> tuple[Path, dict[str, str]]:
    """``root/files`` holding every placeholder file, and the environment the blocks run with."""
    env = {**subprocess_env(), "YOLOKIT_CACHE": str(root / "cache"), "MPLBACKEND": "Agg",
           "WANDB_MODE": "offline"}                   # no network here: W&B logs to the run folder
    with mock.patch.dict(os.environ, YOLOKIT_CACHE=env["YOLOKIT_CACHE"]):   # here: no interpreter to start
        make_shapes()                                        # the built-in set, once
    small = make_shapes(root / "small", n_train=16, n_val=8, imgsz=64)
    files = root / "files"
    for name in ("path/to/data.yaml", "data.yaml", "shared/data.yaml"):
        (files / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(small, files / name)                # data.yaml names its folder absolutely
    rng = np.random.default_rng(0)
    for folder in ("path/to/images", "images", "data/a", "data/b/c"):
        (files / folder).mkdir(parents=True)
        for i in range(3 if folder.startswith(("path", "images")) else 1):
            cv2.imwrite(str(files / folder / f"{i}.jpg"), rng.integers(0, 255, (48, 64, 3), np.uint8))
    shutil.copy(files / "images" / "0.jpg", files / "image.jpg")
    (files / "list.txt").write_text("images/1.jpg\nimages/2.jpg\n")
    video = cv2.VideoWriter(str(files / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 10, (64, 48))
    for _ in range(6):
        video.write(rng.integers(0, 255, (48, 64, 3), np.uint8))
    video.release()
    _coco(small, files)
    (files / "my.yaml").write_text("model: yolov8n\ndata: path/to/data.yaml\nepochs: 1\nimgsz: 64\nbatch: 8\n")
    torch.manual_seed(0)
    yolokit.save(yolokit.create_model("yolov8s", num_classes=2), files / "best.pt")
    yolokit.save(yolokit.create_model("yolov3-tiny", num_classes=80), files / "yolov3-tiny.weights")
    sys.path.insert(0, str(ROOT / "tests"))
    from interop.conftest import write_their_checkpoint, write_their_spec_checkpoint
    write_their_checkpoint(files / "yolov8n.pt", "yolov8n", nc=80)
    shutil.copy(ROOT / "tests" / "interop" / "fixtures" / "yolo26-tiny-last.pt", files / "yolo26n.pt")
    yolo11 = yolokit.create_model("yolo11n.yaml", num_classes=80)
    write_their_spec_checkpoint(files / "yolo11n.pt", yolo11, {**yolo11.config.spec, "scale": "n", "channels": 3,
                                                                "yaml_file": "yolo11n.yaml"})
    _train("--data", str(small), "--out", str(files / "runs" / "train"), env=env)
    shutil.copy(files / "runs" / "train" / "weights" / "model.pt", files / "model.pt")
    for name in ("v8n", "v8n-p2", "mine", "full"):
        shutil.copytree(files / "runs" / "train", files / "runs" / name)
    seg = make_shapes(files / "my-seg-set", n_train=32, n_val=8, imgsz=64, segments=True)   # as the guide's block
    _train("--model", "yolov8n-seg", "--data", str(seg), "--out", str(files / "runs" / "seg"), env=env)
    return files, env
