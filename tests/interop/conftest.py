"""A small stand-in of Ultralytics' module and class names, for writing their checkpoint format.

``fake_ultralytics()`` registers modules named ``ultralytics.nn.tasks``,
``ultralytics.nn.modules.{conv,block,head}`` and ``ultralytics.utils`` in ``sys.modules``
only while a test writes a file (pickle records a class by its module and name) and
removes them before anything is loaded. The classes mirror the attribute names of
Ultralytics' YOLOv8 layers (so their state-dict keys come out the same, checked against
the reference key list) and route a forward pass through the yolov8.yaml layer graph
(facts: layer order, ``from`` indices, channel formulas), written here independently of
yolokit's own model code.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types

import pytest
import torch
from torch import nn

# yolov8.yaml scales: depth, width, max channels
SCALES = {"yolov8n": (0.33, 0.25, 1024), "yolov8s": (0.33, 0.50, 1024), "yolov8m": (0.67, 0.75, 768),
          "yolov8l": (1.00, 1.00, 512), "yolov8x": (1.00, 1.25, 512)}
MODULES = ("ultralytics", "ultralytics.nn", "ultralytics.nn.tasks", "ultralytics.nn.modules",
           "ultralytics.nn.modules.conv", "ultralytics.nn.modules.block", "ultralytics.nn.modules.head",
           "ultralytics.utils")


def _classes() -> dict[str, type]:
    class Conv(nn.Module):
        default_act = nn.SiLU()  # one activation object shared by every Conv, as theirs is

        def __init__(self, c1, c2, k=1, s=1):
            super().__init__()
            self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
            self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
            self.act = self.default_act

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))

    class Bottleneck(nn.Module):
        def __init__(self, c1, c2, shortcut=True):
            super().__init__()
            self.cv1, self.cv2, self.add = Conv(c1, c2, 3), Conv(c2, c2, 3), shortcut and c1 == c2

        def forward(self, x):
            return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))

    class C2f(nn.Module):
        def __init__(self, c1, c2, n=1, shortcut=False):
            super().__init__()
            self.c = c2 // 2
            self.cv1, self.cv2 = Conv(c1, 2 * self.c, 1), Conv((2 + n) * self.c, c2, 1)
            self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut) for _ in range(n))

        def forward(self, x):
            y = list(self.cv1(x).split((self.c, self.c), 1))
            for m in self.m:
                y.append(m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, c1, c2, k=5):
            super().__init__()
            self.cv1, self.cv2, self.m = Conv(c1, c1 // 2, 1), Conv(c1 // 2 * 4, c2, 1), nn.MaxPool2d(k, 1, k // 2)

        def forward(self, x):
            y = [self.cv1(x)]
            for _ in range(3):
                y.append(self.m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class Concat(nn.Module):
        def forward(self, xs):
            return torch.cat(xs, 1)

    class DFL(nn.Module):
        def __init__(self, c1=16):
            super().__init__()
            self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
            self.conv.weight.data[:] = torch.arange(c1, dtype=torch.float).view(1, c1, 1, 1)

    class Detect(nn.Module):
        def __init__(self, nc, ch):
            super().__init__()
            self.nc, self.nl, self.reg_max = nc, len(ch), 16
            c2, c3 = max(16, ch[0] // 4, 64), max(ch[0], min(nc, 100))
            self.cv2 = nn.ModuleList(nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 64, 1)) for x in ch)
            self.cv3 = nn.ModuleList(nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in ch)
            self.dfl = DFL(16)

        def forward(self, xs):
            return [torch.cat((b(x), c(x)), 1) for x, b, c in zip(xs, self.cv2, self.cv3, strict=True)]

    class DetectionModel(nn.Module):
        def __init__(self, variant, nc=80):
            super().__init__()
            depth, width, max_c = SCALES[variant]
            w = [math.ceil(min(c, max_c) * width / 8) * 8 for c in (64, 128, 256, 512, 1024)]
            d = [max(round(n * depth), 1) for n in (3, 6, 6, 3, 3)]
            up = nn.Upsample(None, 2, "nearest")
            layers = [  # (from, module) as yolov8.yaml lists them
                (-1, Conv(3, w[0], 3, 2)), (-1, Conv(w[0], w[1], 3, 2)), (-1, C2f(w[1], w[1], d[0], True)),
                (-1, Conv(w[1], w[2], 3, 2)), (-1, C2f(w[2], w[2], d[1], True)),
                (-1, Conv(w[2], w[3], 3, 2)), (-1, C2f(w[3], w[3], d[2], True)),
                (-1, Conv(w[3], w[4], 3, 2)), (-1, C2f(w[4], w[4], d[3], True)), (-1, SPPF(w[4], w[4], 5)),
                (-1, up), ([-1, 6], Concat()), (-1, C2f(w[4] + w[3], w[3], d[4])),
                (-1, nn.Upsample(None, 2, "nearest")), ([-1, 4], Concat()), (-1, C2f(w[3] + w[2], w[2], d[4])),
                (-1, Conv(w[2], w[2], 3, 2)), ([-1, 12], Concat()), (-1, C2f(w[2] + w[3], w[3], d[4])),
                (-1, Conv(w[3], w[3], 3, 2)), ([-1, 9], Concat()), (-1, C2f(w[3] + w[4], w[4], d[4])),
                ([15, 18, 21], Detect(nc, (w[2], w[3], w[4]))),
            ]
            for i, (f, m) in enumerate(layers):
                m.f, m.i = f, i
            self.model = nn.Sequential(*(m for _, m in layers))
            self.names = {i: f"class{i}" for i in range(nc)}
            self.yaml = {"nc": nc, "scale": variant[-1]}
            self.stride = torch.tensor([8.0, 16.0, 32.0])
            self.args = {"imgsz": 640}

        def forward(self, x):
            outputs = []
            for m in self.model:
                if m.f != -1:
                    x = outputs[m.f] if isinstance(m.f, int) else [x if j == -1 else outputs[j] for j in m.f]
                x = m(x)
                outputs.append(x)
            return x

    class IterableSimpleNamespace(types.SimpleNamespace):
        pass

    homes = {"Conv": "conv", "Concat": "conv", "Bottleneck": "block", "C2f": "block", "SPPF": "block",
             "DFL": "block", "Detect": "head"}
    classes = {}
    for cls in (Conv, Bottleneck, C2f, SPPF, Concat, DFL, Detect, DetectionModel, IterableSimpleNamespace):
        name = cls.__name__
        cls.__qualname__ = name
        if name in homes:
            cls.__module__ = f"ultralytics.nn.modules.{homes[name]}"
        elif name == "DetectionModel":
            cls.__module__ = "ultralytics.nn.tasks"
        else:
            cls.__module__ = "ultralytics.utils"
        classes[name] = cls
    return classes


@contextlib.contextmanager
def fake_ultralytics():
    """Registers the stand-in modules while the block runs; yields ``{class name: class}``."""
    if any(name in sys.modules for name in MODULES):
        pytest.skip("a real ultralytics is imported in this process")
    classes = _classes()
    try:
        for name in MODULES:
            sys.modules[name] = types.ModuleType(name)
        for cls in classes.values():
            setattr(sys.modules[cls.__module__], cls.__name__, cls)
        yield classes
    finally:
        for name in MODULES:
            sys.modules.pop(name, None)


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Random weights and batch-norm statistics (DFL projection kept), eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point() or name.endswith("dfl.conv.weight"):
                continue
            noise = torch.randn(t.shape, generator=generator)
            if name.endswith("running_var"):
                t.copy_(0.5 + noise.abs() * 0.5)
            elif t.ndim == 4:  # conv weights: keep their scale, so activations stay moderate
                t.mul_(1 + 0.2 * noise)
            else:
                t.add_(0.1 * noise)
    return model.eval()


def their_model(variant: str = "yolov8n", nc: int = 80, *, seed: int = 0) -> nn.Module:
    """A stand-in DetectionModel with random weights; usable after the modules are unregistered."""
    with fake_ultralytics() as classes:
        return _randomize(classes["DetectionModel"](variant, nc), seed)


def write_their_checkpoint(path, variant: str = "yolov8n", nc: int = 80, *, training: bool = False,
                           extra: dict | None = None, seed: int = 0) -> nn.Module:
    """Writes a checkpoint the way their trainer does and returns the float32 model it holds.

    Finished run: the float16 model object under "model", "ema" None. Training: "model"
    None, the float16 model under "ema" with an IterableSimpleNamespace as its ``args``,
    plus optimizer and scaler state.
    """
    import copy

    with fake_ultralytics() as classes:
        model = _randomize(classes["DetectionModel"](variant, nc), seed)
        half = copy.deepcopy(model).half()
        model = copy.deepcopy(half).float().eval()  # the values the file holds, in float32
        common = {"date": "2025-01-01T00:00:00", "version": "8.4.190", "license": "AGPL-3.0", "docs": "",
                  "train_args": {"imgsz": 640, "epochs": 1}, "train_metrics": {}, "train_results": {}, "git": {}}
        if training:
            half.args = classes["IterableSimpleNamespace"](imgsz=640, epochs=1)
            ckpt = {"epoch": 0, "best_fitness": 0.5, "stopper": {"best_fitness": 0.5, "best_epoch": 0},
                    "model": None, "ema": half, "updates": 3, "modelopt": None,
                    "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2)}}, "param_groups": [{"lr": 0.01}]},
                    "scaler": {}, **common}
        else:
            ckpt = {**common, "epoch": -1, "best_fitness": None, "stopper": None, "model": half, "ema": None,
                    "updates": None, "modelopt": None, "optimizer": None, "scaler": None}
        ckpt.update(extra or {})
        torch.save(ckpt, path)
    return model


# yolokit block -> the module of Ultralytics' class of that name (their layers of YOLO11, P2/P6, YOLOv5u)
THEIR_HOMES = {"Conv": "conv", "DWConv": "conv", "Concat": "conv", "Bottleneck": "block", "C2f": "block",
               "C2": "block", "C3": "block", "C3k": "block", "C3k2": "block", "C2PSA": "block", "PSABlock": "block",
               "Attention": "block", "SPPF": "block", "SPP": "block", "DFL": "block"}


def write_their_spec_checkpoint(path, model, architecture, *, training=False, names=None):
    """Pickles a yolokit model built from a model YAML as their trainer pickles a DetectionModel.

    Each layer becomes an instance of a class named as theirs (in stand-in modules registered only
    while the file is written), the rows a ``Sequential`` under ``model``, the head a ``Detect``
    whose branches are ``cv2`` / ``cv3`` / ``dfl``, and ``architecture`` (plain data) its ``yaml``
    attribute. Stored float16 under "model" (finished run) or "ema" (training). Returns the float32
    values the file holds, by yolokit name.
    """
    import copy

    if any(name in sys.modules for name in MODULES):
        pytest.skip("a real ultralytics is imported in this process")
    fakes = {}

    def fake(name, module):
        if name not in fakes:
            fakes[name] = type(name, (nn.Module,), {"__module__": module, "__qualname__": name})
        return fakes[name]

    def convert(module):
        kind = type(module).__name__
        if kind in THEIR_HOMES:
            cls = fake(kind, f"ultralytics.nn.modules.{THEIR_HOMES[kind]}")
        elif type(module).__module__.startswith("torch.nn"):
            cls = type(module)
        else:
            raise TypeError(f"no Ultralytics class for {kind}")
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)
        new.__dict__["_modules"] = {k: convert(v) for k, v in module._modules.items()}
        return new

    source = copy.deepcopy(model).half().float().eval()   # the values a float16 file holds
    detect = fake("Detect", "ultralytics.nn.modules.head")()
    detect.cv2, detect.cv3, detect.dfl = convert(source.head.box), convert(source.head.cls), convert(source.head.dfl)
    detect.nc, detect.reg_max, detect.stride = source.num_classes, source.head.reg_max, torch.tensor(
        [float(s) for s in source.strides])
    rows = [source.backbone.get_submodule(str(i)) for i in source.backbone.rows]
    rows += [source.neck.get_submodule(str(i)) for i in source.neck.rows]
    theirs = fake("DetectionModel", "ultralytics.nn.tasks")()
    theirs.model = nn.Sequential(*(convert(m) for m in rows), detect)
    theirs.yaml, theirs.stride = dict(architecture), detect.stride
    theirs.names = names or {i: f"class{i}" for i in range(source.num_classes)}
    half = theirs.half()
    ckpt = {"date": "2025-01-01T00:00:00", "version": "8.4.190", "train_args": {}, "epoch": -1,
            "model": None if training else half, "ema": half if training else None, "optimizer": None}
    with fake_ultralytics():
        for cls in fakes.values():
            setattr(sys.modules[cls.__module__], cls.__name__, cls)
        torch.save(ckpt, path)
    return source.state_dict()


@pytest.fixture(scope="session")
def their():
    """The stand-in toolkit: ``their.model(...)``, ``their.write(path, ...)``, ``their.fake()``,
    ``their.write_spec(path, model, architecture)``."""
    return types.SimpleNamespace(model=their_model, write=write_their_checkpoint, fake=fake_ultralytics,
                                 randomize=_randomize, write_spec=write_their_spec_checkpoint)


@pytest.fixture
def marker(tmp_path):
    """A path that a malicious pickle would create; tests assert it never appears."""
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a payload ran while loading"


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine, two spinning threads can be 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
