"""A researcher's own blocks in model YAMLs: how args reach them, how their channels are found, rebuilding."""

from dataclasses import asdict

import pytest
import torch
import yaml
from torch import nn

import yolokit
from yolokit.models import (
    ModuleRule,
    SpecError,
    build_model,
    config_from_dict,
    register_module,
    registered_modules,
    unregister_module,
)
from yolokit.models.layers import Conv


class SqueezeExcite(nn.Module):
    """Channel attention that also changes the channel count ("channels" form: c_in, c_out, reduction)."""

    def __init__(self, c1, c2, reduction=4):
        super().__init__()
        self.args = (c1, c2, reduction)
        self.fc = nn.Sequential(nn.Conv2d(c1, max(c1 // reduction, 1), 1), nn.SiLU(),
                                nn.Conv2d(max(c1 // reduction, 1), c1, 1), nn.Sigmoid())
        self.out = Conv(c1, c2, 1)

    def forward(self, x):
        return self.out(x * self.fc(x.mean((2, 3), keepdim=True)))


class Doubler(nn.Module):
    """Keeps the spatial size and doubles the channels, whatever its arguments say ("input" form)."""

    def __init__(self, c1, gain=1.0):
        super().__init__()
        self.args, self.conv = (c1, gain), nn.Conv2d(c1, 2 * c1, 1)

    def forward(self, x):
        return self.conv(x)


class Stack(nn.Module):
    """Repeats its inner convolution ``n`` times itself ("inside" repeats)."""

    def __init__(self, c1, c2, n=1):
        super().__init__()
        self.args = (c1, c2, n)
        self.m = nn.Sequential(Conv(c1, c2, 3), *(Conv(c2, c2, 3) for _ in range(n - 1)))

    def forward(self, x):
        return self.m(x)


class Mixer(nn.Module):
    """Reads two maps ("channels" form with a list input: c_in is a list)."""

    def __init__(self, c1, c2):
        super().__init__()
        self.args = (c1, c2)
        self.conv = Conv(sum(c1), c2, 1)

    def forward(self, xs):
        return self.conv(torch.cat(xs, 1))


SPEC = {
    "nc": 2, "scales": {"s": [0.5, 0.5, 512]}, "scale": "s",
    "backbone": [[-1, 1, "Conv", [64, 3, 2]], [-1, 1, "Conv", [128, 3, 2]], [-1, 1, "SE", [256, 8]],
                 [-1, 1, "Conv", [256, 3, 2]], [-1, 1, "Doubler", [0.5]], [-1, 6, "Stack", [512]]],
    "head": [[-1, 1, "nn.Upsample", [None, 2, "nearest"]], [[-1, 2], 1, "Mixer", [256]],
             [[7, 5], 1, "Detect", ["nc"]]],
}
MODULES = {"SE": SqueezeExcite, "Doubler": ModuleRule(Doubler, args="input"),
           "Stack": ModuleRule(Stack, repeats="inside"), "Mixer": Mixer}


@pytest.fixture
def registered():
    """Registers the test blocks for one test and removes them after it."""
    for name, value in MODULES.items():
        rule = value if isinstance(value, ModuleRule) else ModuleRule(value)
        register_module(name, rule.make, args=rule.args, repeats=rule.repeats)
    yield
    for name in MODULES:
        unregister_module(name)
    assert not set(MODULES) & set(registered_modules())


def test_args_become_constructor_arguments_by_form(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    model = yolokit.create_model(path, modules=MODULES)
    layer = model.backbone.get_submodule
    # "channels": [c_out, *rest] -> cls(c_in, c_out * width (multiple of 8), *rest)
    assert layer("2").args == (64, 128, 8)
    # "input": cls(c_in, *args); its output channels (2 * c_in) are read off its output
    assert layer("4").args == (128, 0.5) and model.backbone.get_submodule("5").args[0] == 256
    # "inside": the depth-scaled repeats (6 * 0.5) go in after the channels
    assert layer("5").args == (256, 256, 3) and len(layer("5").m) == 3
    # a row reading two maps gets their channels as a list
    assert model.neck.get_submodule("7").args == ([256, 128], 128)
    assert model.strides == (4, 8) and model.neck.out_channels == (128, 256)
    maps = model(torch.rand(1, 3, 64, 64))
    assert [tuple(m.shape) for m in maps] == [(1, 66, 16, 16), (1, 66, 8, 8)]


def test_registered_blocks_rebuild_from_a_stored_config(registered, tmp_path):
    torch.manual_seed(0)
    model = yolokit.create_model(SPEC)
    config = config_from_dict(asdict(model.config))
    rebuilt = build_model(config)
    rebuilt.load_state_dict(model.state_dict())
    x = torch.rand(1, 3, 64, 64)
    model.eval(), rebuilt.eval()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), rebuilt(x), strict=True))
    unregister_module("Mixer")
    with pytest.raises(SpecError, match=r"layer 7 \(Mixer\): unknown module 'Mixer'.*register_module\('Mixer'"):
        build_model(config)
    register_module("Mixer", Mixer)


def test_register_module_rules(registered):
    register_module("SE", SqueezeExcite)   # the same again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_module("SE", Doubler)
    with pytest.raises(ValueError, match="'Conv' is a built-in module"):
        register_module("Conv", Doubler)
    with pytest.raises(ValueError, match="args must be one of"):
        register_module("X", Doubler, args="both")
    with pytest.raises(ValueError, match="repeats must be one of"):
        register_module("X", Doubler, repeats="many")
    with pytest.raises(KeyError, match="not registered"):
        unregister_module("X")


def test_blocks_that_fail_name_the_row(tmp_path):
    class Broken(nn.Module):
        def __init__(self, c1, c2):
            super().__init__()
            raise RuntimeError("no good")

    class WrongOutput(nn.Module):
        def __init__(self, c1, c2):
            super().__init__()

        def forward(self, x):
            return {"x": x}

    for block, why in ((Broken, r"cannot be built .*RuntimeError: no good"),
                       (WrongOutput, "returned dict, not a tensor")):
        spec = {**SPEC, "backbone": [[-1, 1, "Conv", [64, 3, 2]], [-1, 1, "Bad", [64]]],
                "head": [[[1], 1, "Detect", ["nc"]]]}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(spec))
        with pytest.raises(SpecError, match=rf"bad.yaml: layer 1 \(Bad\): {why}"):
            yolokit.create_model(path, modules={"Bad": block})
