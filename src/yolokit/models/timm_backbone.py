"""A timm model as a YOLO backbone: ``TimmBackbone("resnet18", out_indices=(2, 3, 4))``.

timm is an optional dependency (``pip install yolokit[timm]``), imported when a ``TimmBackbone`` is
built. The feature extractor is ``timm.create_model(name, features_only=True, out_indices=...)``;
its ``feature_info`` gives the channels and strides the neck reads. Pretrained weights come from a
local file only (safetensors, or a torch file read with ``weights_only=True``): nothing is ever
downloaded, and asking for pretrained weights without a file is an error.

In a model YAML the row ``[-1, 1, TimmBackbone, [resnet18, [2, 3, 4], weights.safetensors]]``
(model name, out_indices, optional weights file) outputs the list of maps; ``Index`` rows pick them:
``[0, 1, Index, [0]]`` is its first map.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


class TimmBackbone(nn.Module):
    """A timm feature extractor: maps at ``out_indices``, in increasing stride.

    Args:
        model_name: a timm model name ("resnet18", "convnext_atto", "efficientnet_b0", ...).
        out_indices: timm's feature levels to return (resnet18: 0 to 4 at strides 2 to 32).
        weights: a local file of the timm model's weights (its ``state_dict()``, or a checkpoint dict
            holding it under "state_dict" or "model"): ``.safetensors`` or a torch file. None: random
            initialisation.
        pretrained: True asks for pretrained weights, which then must come from ``weights``.

    Attributes:
        out_channels: channels of each output map.
        strides: stride of each output map in input pixels.

    Raises:
        ImportError: timm is not installed.
        ValueError: ``pretrained`` without ``weights``, or a weights file that does not fit.

    Examples:
        >>> backbone = TimmBackbone("resnet18", out_indices=(2, 3, 4))
        >>> backbone.out_channels, backbone.strides
        ((128, 256, 512), (8, 16, 32))
    """

    def __init__(self, model_name: str, out_indices: Sequence[int] = (2, 3, 4), *,
                 weights: str | os.PathLike | None = None, pretrained: bool = False):
        super().__init__()
        try:
            import timm
        except ImportError as exc:
            raise ImportError(f"TimmBackbone({model_name!r}) needs timm: pip install 'yolokit[timm]'") from exc
        if pretrained and weights is None:
            raise ValueError(f"TimmBackbone({model_name!r}): pretrained weights come from a local file only "
                             "(yolokit never downloads); pass weights='path/to/model.safetensors'")
        if not isinstance(model_name, str) or not timm.is_model(model_name):
            raise ValueError(f"TimmBackbone: {model_name!r} is not a timm model name (timm.list_models() lists them)")
        options: dict[str, Any] = {"features_only": True, "out_indices": tuple(int(i) for i in out_indices)}
        if weights is not None:
            # timm loads a given state dict before it wraps the model as a feature extractor (it knows
            # the renames); "source" cleared so that no hub lookup can take precedence. It loads a
            # feature extractor's weights non-strictly, so the names and shapes are checked first.
            state = read_weights(weights)
            check_weights(model_name, state, source=str(weights))
            options.update(pretrained=True, pretrained_cfg_overlay={"state_dict": state, "source": "", "file": None,
                                                                    "url": "", "hf_hub_id": None})
        else:
            options["pretrained"] = False
        try:
            self.model = timm.create_model(model_name, **options)
        except (RuntimeError, KeyError) as exc:
            where = f" with weights {weights}" if weights is not None else ""
            raise ValueError(f"TimmBackbone({model_name!r}){where}: {exc}") from exc
        self.model_name, self.weights = model_name, None if weights is None else str(weights)
        info = self.model.feature_info
        self.out_channels = tuple(int(c) for c in info.channels())
        self.strides = tuple(int(r) for r in info.reduction())

    def forward(self, x: Tensor) -> list[Tensor]:
        """Tensor[B, 3, H, W] -> one map per out index, Tensor[B, out_channels[i], H / strides[i], W / strides[i]]."""
        return list(self.model(x))

    def checkpoint_units(self) -> list[tuple[str, nn.Module]]:
        """The extractor's top-level blocks that hold parameters (stem parts and stages)."""
        return [(f"model.{name}", m) for name, m in self.model.named_children()
                if any(True for _ in m.parameters())]


def check_weights(model_name: str, state: Mapping[str, Tensor], *, source: str) -> None:
    """Raises ValueError naming ``source`` unless ``state`` holds every tensor of the timm model (its
    classifier aside) with the model's shapes, and nothing else. Checked on the meta device."""
    import timm

    with torch.device("meta"):
        model = timm.create_model(model_name, pretrained=False)
    classifier = model.pretrained_cfg.get("classifier") or ()
    classifier = (classifier,) if isinstance(classifier, str) else tuple(classifier)

    def head(key: str) -> bool:
        return any(key.startswith(c + ".") for c in classifier)

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in state and not head(k)]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} vs {expected[k]}" for k in expected
             if k in state and not head(k) and tuple(state[k].shape) != expected[k]]
    problems = [f"{label}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("other shape", wrong)) if items]
    if problems:
        raise ValueError(f"{source}: not the weights of timm's {model_name} ({'; '.join(problems)})")


def read_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """A timm model's state dict from a local file, without running code from it.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no state dict of tensors (the message names it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such weights file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a pickle the safe unpickler refuses, a damaged file
        raise ValueError(f"{path}: not a weights file torch reads with weights_only=True ({exc})") from exc
    for candidate in (obj, *(obj.get(k) for k in ("state_dict", "model") if isinstance(obj, Mapping))):
        if isinstance(candidate, Mapping) and candidate and all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in candidate.items()):
            return dict(candidate)
    raise ValueError(f"{path}: holds no state dict of tensors (nor one under 'state_dict' or 'model')")
