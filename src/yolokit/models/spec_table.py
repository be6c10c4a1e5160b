"""The module table of model YAMLs: a row's module name -> our block, and how the row's ``args`` become
the block's constructor arguments.

Every row is ``[from, repeats, module, args]``. How ``args`` reach the constructor is one of three forms
(``ModuleRule.args``):

- ``"channels"`` (Conv, C2f, C3k2, SPPF, ...): ``args = [c_out, *rest]``. ``c_out`` is scaled by the
  model's width as Conv's is (``ceil(min(c_out, max_channels) * width / 8) * 8``) and the block is
  called as ``block(c_in, c_out, *rest)``, ``c_in`` being the channels of the map the row reads.
- ``"input"``: ``block(c_in, *args)`` (blocks that keep their channels, such as ``DarknetResidual``).
- ``"plain"``: ``block(*args)`` as written (``nn.Upsample``, ``Concat``, ``Index``).

``repeats`` (scaled by the model's depth when above 1) either stacks that many copies in an
``nn.Sequential`` (``"stack"``) or goes to the block as its repeat count right after the channel
arguments (``"inside"``: ``block(c_in, c_out, n, *rest)``). A row that reads several maps gets
``c_in`` as a list. Output channels are never declared: the builder runs each new layer on an empty
batch and reads them off its output.

Users add their own blocks with ``register_module`` (an explicit call) or pass them to one build as
``create_model(..., modules={"MyBlock": MyBlock})``. Nothing in a YAML is evaluated: a module name is
looked up here (or among the user's), and arguments are literal values; the names ``nc`` (the class
count), ``anchors`` (the file's anchors) and ``None`` are the only words resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from yolokit.models.attention import C2PSA
from yolokit.models.csp import C2, C3, C3k2
from yolokit.models.layers import (
    DARKNET_STYLE,
    SPP,
    SPPF,
    Bottleneck,
    C2f,
    Concat,
    Conv,
    DarknetResidual,
    DarknetSPP,
    DWConv,
    Index,
    MaxPoolSame,
)

ARG_FORMS = ("channels", "input", "plain")
REPEAT_FORMS = ("stack", "inside")


@dataclass(frozen=True)
class ModuleRule:
    """How one module name of a YAML row becomes a layer.

    Attributes:
        make: the constructor (a class or a function), called with positional arguments.
        args: "channels", "input" or "plain" (see the module docstring).
        repeats: "stack" or "inside".
        adjust: ``adjust(constructor args, scale)`` -> the args to use (YOLO11's C3k2 switches its
            ``c3k`` on at scales m, l and x).
        light_head: a model that uses this block gets YOLO11's lighter class branch in its Detect head.
        weights_at: position in the row's args of a weights file (a timm backbone's): read when a model
            is created, left out when ``build_model`` rebuilds one from a stored config (whose
            checkpoint holds the weights).
    """

    make: Callable[..., nn.Module]
    args: str = "channels"
    repeats: str = "stack"
    adjust: Callable[[list[Any], str | None], list[Any]] | None = None
    light_head: bool = False
    weights_at: int | None = None

    def __post_init__(self) -> None:
        if self.args not in ARG_FORMS:
            raise ValueError(f"args must be one of {ARG_FORMS}, got {self.args!r}")
        if self.repeats not in REPEAT_FORMS:
            raise ValueError(f"repeats must be one of {REPEAT_FORMS}, got {self.repeats!r}")


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


def _conv(c1, c2, k=1, s=1, p=None, g=1, d=1, act=True) -> Conv:
    return Conv(c1, c2, k, s, p, g=g, d=d, act=_flag(act, "act"))


def _darknet_conv(c1, c2, k=1, s=1, p=None, g=1, d=1) -> Conv:
    return Conv(c1, c2, k, s, p, style=DARKNET_STYLE, g=g, d=d)


def _dwconv(c1, c2, k=1, s=1, d=1, act=True) -> DWConv:
    return DWConv(c1, c2, k, s, d=d, act=_flag(act, "act"))


def _bottleneck(c1, c2, shortcut=True, g=1, k=(3, 3), e=0.5) -> Bottleneck:
    return Bottleneck(c1, c2, shortcut=_flag(shortcut, "shortcut"), kernels=tuple(k), expansion=e, groups=g)


def _c2(c1, c2, n=1, shortcut=True, g=1, e=0.5) -> C2:
    return C2(c1, c2, n, shortcut=_flag(shortcut, "shortcut"), groups=g, expansion=e)


def _c2f(c1, c2, n=1, shortcut=False, g=1, e=0.5) -> C2f:
    return C2f(c1, c2, n, shortcut=_flag(shortcut, "shortcut"), groups=g, expansion=e)


def _c3(c1, c2, n=1, shortcut=True, g=1, e=0.5) -> C3:
    return C3(c1, c2, n, shortcut=_flag(shortcut, "shortcut"), groups=g, expansion=e)


def _c3k2(c1, c2, n=1, c3k=False, e=0.5, attn=False, g=1, shortcut=True) -> C3k2:
    return C3k2(c1, c2, n, c3k=_flag(c3k, "c3k"), expansion=e, attn=_flag(attn, "attn"), groups=g,
                shortcut=_flag(shortcut, "shortcut"))


def _c3k2_scale(args: list[Any], scale: str | None) -> list[Any]:
    """YOLO11 at scales m, l and x uses C3k inner blocks in every C3k2 (args: c1, c2, n, c3k, ...)."""
    return [*args[:3], True, *args[4:]] if scale in ("m", "l", "x") else args


def _c2psa(c1, c2, n=1, e=0.5) -> C2PSA:
    return C2PSA(c1, c2, n, expansion=e)


def _sppf(c1, c2, k=5, n=None, shortcut=False) -> SPPF:
    """SPPF(c1, c2, k, n=3, shortcut=False). Rows that give only ``k`` are the YOLOv8 form (cv1 activated);
    rows that give ``n`` are the newer form, whose cv1 has no activation."""
    return SPPF(c1, c2, k, n=3 if n is None else n, shortcut=_flag(shortcut, "shortcut"), cv1_act=n is None)


def _spp(c1, c2, k=(5, 9, 13)) -> SPP:
    return SPP(c1, c2, tuple(k))


def _upsample(size=None, scale_factor=None, mode="nearest") -> nn.Upsample:
    return nn.Upsample(size, scale_factor, mode)


def _index(*args) -> Index:
    """``[index]``, or the community ``[channels, index]`` (the channels are read off the map instead)."""
    if len(args) not in (1, 2) or not isinstance(args[-1], int):
        raise TypeError(f"Index takes [index] or [channels, index], got {list(args)}")
    return Index(args[-1])


def _timm(model_name, out_indices=None, weights=None) -> nn.Module:
    from yolokit.models.timm_backbone import TimmBackbone  # timm is optional: imported when a row names it

    kwargs = {} if out_indices is None else {"out_indices": tuple(out_indices)}
    return TimmBackbone(model_name, weights=weights, **kwargs)


BUILTIN: dict[str, ModuleRule] = {
    "Conv": ModuleRule(_conv),
    "DWConv": ModuleRule(_dwconv),
    "Bottleneck": ModuleRule(_bottleneck),
    "C2": ModuleRule(_c2, repeats="inside"),
    "C2f": ModuleRule(_c2f, repeats="inside"),
    "C3": ModuleRule(_c3, repeats="inside"),
    "C3k2": ModuleRule(_c3k2, repeats="inside", adjust=_c3k2_scale, light_head=True),
    "C2PSA": ModuleRule(_c2psa, repeats="inside"),
    "SPPF": ModuleRule(_sppf),
    "SPP": ModuleRule(_spp),
    "Concat": ModuleRule(Concat, args="plain"),
    "Index": ModuleRule(_index, args="plain"),
    "nn.Upsample": ModuleRule(_upsample, args="plain"),
    "nn.MaxPool2d": ModuleRule(nn.MaxPool2d, args="plain"),
    "nn.ZeroPad2d": ModuleRule(lambda padding: nn.ZeroPad2d(tuple(padding) if isinstance(padding, list) else padding),
                               args="plain"),
    # Darknet's blocks (yolokit's own YOLOv3 files): leaky ReLU 0.1, batch-norm eps 1e-5
    "DarknetConv": ModuleRule(_darknet_conv),
    "DarknetResidual": ModuleRule(DarknetResidual, args="input"),
    "DarknetSPP": ModuleRule(lambda kernels=(5, 9, 13): DarknetSPP(tuple(kernels)), args="plain"),
    "MaxPoolSame": ModuleRule(MaxPoolSame, args="plain"),
    "TimmBackbone": ModuleRule(_timm, args="plain", weights_at=2),
}
# The last row's module: the head (built by models.spec from the maps it reads).
HEADS = ("Detect", "AnchorDetect", "Segment", "Segment26")

_USER: dict[str, ModuleRule] = {}


def register_module(name: str, cls: Callable[..., nn.Module], *, args: str = "channels",
                    repeats: str = "stack") -> None:
    """Makes ``name`` usable as a row's module in every model YAML of this process.

    Args:
        name: the name rows use (a built-in name cannot be taken).
        cls: the block's class (or any callable returning an ``nn.Module``).
        args: how the row's ``args`` become constructor arguments: "channels" (``[c_out, *rest]`` ->
            ``cls(c_in, c_out * width, *rest)``, as Conv), "input" (``cls(c_in, *args)``) or "plain"
            (``cls(*args)``).
        repeats: "stack" (``repeats`` copies in an ``nn.Sequential``) or "inside" (passed as the
            argument right after the channels: ``cls(c_in, c_out, n, *rest)``).

    The block's output channels are read off its output (the builder runs it on an empty batch).
    Registering the same class again is a no-op; another class under a taken name is an error
    (``unregister_module`` first).

    Examples:
        >>> register_module("SE", SqueezeExcite)            # rows: [-1, 1, SE, [256]] -> SE(c_in, 256 * width)
        >>> create_model("my-net.yaml", scale="s").name
        'my-net-s'
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"module name must be a non-empty string, got {name!r}")
    if name in BUILTIN or name in HEADS:
        raise ValueError(f"{name!r} is a built-in module of model YAMLs; register your block under another name")
    if not callable(cls):
        raise TypeError(f"register_module({name!r}, ...): {cls!r} is not a class or callable")
    rule = ModuleRule(cls, args=args, repeats=repeats)
    if name in _USER and _USER[name] != rule:
        raise ValueError(f"module {name!r} is already registered as {_USER[name].make!r}; "
                         "call unregister_module first to replace it")
    _USER[name] = rule


def unregister_module(name: str) -> None:
    """Removes a block ``register_module`` added (a name never registered is an error)."""
    if name not in _USER:
        raise KeyError(f"module {name!r} is not registered")
    del _USER[name]


def registered_modules() -> list[str]:
    """Names of the blocks ``register_module`` added, in registration order."""
    return list(_USER)


def module_rule(name: str, extra: Mapping[str, Callable[..., nn.Module] | ModuleRule] | None = None) -> ModuleRule:
    """The rule of a row's module name: built-in, passed for this build (``extra``), or registered.

    Raises:
        KeyError: unknown name (the message says how to add a block).
    """
    if name in BUILTIN:
        return BUILTIN[name]
    if extra and name in extra:
        value = extra[name]
        return value if isinstance(value, ModuleRule) else ModuleRule(value)
    if name in _USER:
        return _USER[name]
    raise KeyError(f"unknown module {name!r}: not a built-in block ({', '.join(BUILTIN)}, {', '.join(HEADS)}); "
                   f"register yours with yolokit.models.register_module({name!r}, YourClass) or pass "
                   f"modules={{{name!r}: YourClass}}")
