"""An exported file, run again: ONNX (onnxruntime), OpenVINO IR (openvino) or an AOTInductor ``.pt2``.

``load_exported(path)`` returns an :class:`ExportedModel`: the same ``predict`` call as a
``Detector`` (``models.detector.input_batch`` pads the input, the file gives the decoded
predictions, ``models.detector.detections_of`` applies the same NMS or top-k and maps the boxes
back), and the attributes ``yolokit.predict`` and ``yolokit.val`` read (``names``, ``strides``,
``num_classes``, ``end_to_end``, ``device``). A file with NMS in its graph gives its own detections,
with the thresholds it was exported with. A segmentation model's file also gives each prediction's mask
coefficients and the prototypes, and ``predict`` gives each detection its mask as ``Detector.predict`` does.

Every format stores what ``interop.onnx.file_info`` says about the file: the ONNX metadata key
``yolokit``, ``yolokit.json`` beside an OpenVINO model, the ``.pt2`` package's AOTInductor metadata.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from yolokit.models.detector import detections_of, input_batch, mapped_back, with_masks
from yolokit.ops.nms import Detections

EXTRAS = {"onnx": ("onnxruntime", "export"), "openvino": ("openvino", "openvino"), "pt2": ("torch", "")}


class ExportError(ValueError):
    """An exported file that cannot be read, run or trusted; the message names the file and what to do."""


def format_of(path: str | Path) -> str | None:
    """"onnx", "openvino" or "pt2" for an exported file or folder, None for anything else."""
    path = Path(path)
    if path.suffix == ".onnx":
        return "onnx"
    if path.suffix == ".pt2":
        return "pt2"
    if path.suffix == ".xml" or (path.is_dir() and any(path.glob("*.xml"))):
        return "openvino"
    return None


def require(fmt: str, path: str | Path | None = None) -> None:
    """Raises an ImportError naming the extra to install when ``fmt``'s runtime is missing."""
    module, extra = EXTRAS[fmt]
    if importlib.util.find_spec(module) is None:
        where = f"{path}: " if path is not None else ""
        raise ImportError(f"{where}{fmt} needs the {module} package: pip install 'yolokit[{extra}]'")


class ExportedModel:
    """An exported detector, run by its runtime, with ``Detector``'s inference interface.

    Args:
        path: an ``.onnx`` file, an OpenVINO folder (or its ``.xml``), or a ``.pt2`` package.
        device: "cpu", or "cuda" for a ``.pt2`` compiled for CUDA and for ONNX (CUDA provider).

    Attributes:
        format: "onnx", "openvino" or "pt2".
        info: what the file says about itself (``interop.onnx.file_info``).
        names, strides, num_classes, end_to_end, name: as a Detector's.
        masks: a segmentation model's extra outputs (``["coefficients", "protos"]``); empty for a detection
            model's file.

    Raises:
        ExportError: not a yolokit export, truncated or from another program (the message names the
            file); ImportError: the runtime's extra is not installed.

    Examples:
        >>> model = load_exported("yolov8n.onnx")
        >>> model.predict(torch.zeros(1, 3, 640, 640), conf=0.5)[0].boxes.shape
        torch.Size([0, 4])
    """

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu"):
        self.path, self.device = Path(path), torch.device(device)
        fmt = format_of(self.path)
        if fmt is None:
            raise ExportError(f"{self.path}: not an exported model (.onnx, an OpenVINO folder or .pt2)")
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such file or folder")
        require(fmt, self.path)
        self.format = fmt
        try:
            self.info, self._run = _OPENERS[fmt](self.path, self.device)
        except (ExportError, ImportError):
            raise
        except Exception as exc:   # the runtimes' own errors: a truncated or foreign file
            raise ExportError(f"{self.path}: {fmt} cannot read it ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else 'no message'}); "
                              "export it again with yolokit export") from exc
        self.names: list[str] = list(self.info["names"])
        self.strides = [int(s) for s in self.info["strides"]]
        self.num_classes = len(self.names)
        self.name = self.info.get("name", self.path.stem)
        self.end_to_end = self.info["output"] == "end_to_end"
        self.masks = list(self.info.get("masks", []))   # a segmentation model's outputs: coefficients, protos
        self.has_names = True

    def __repr__(self) -> str:
        return (f"ExportedModel({str(self.path)!r}, format={self.format!r}, output={self.info['output']!r}, "
                f"half={self.info['half']}, dynamic={self.info['dynamic']})")

    @property
    def imgsz(self) -> tuple[int, int]:
        """The (height, width) the file was exported at."""
        return tuple(self.info["imgsz"])

    @property
    def fixed_imgsz(self) -> tuple[int, int] | None:
        """The only input size the file takes, or None when it takes any multiple of the stride."""
        return None if self.info["dynamic"] else self.imgsz

    def eval(self) -> ExportedModel:
        return self

    def check_nms(self, nms: bool) -> None:
        """Raises a ValueError when the file cannot give what ``nms`` asks for."""
        output = self.info["output"]
        if nms and output == "end_to_end":
            raise ValueError(f"{self.path} holds the one-to-one branch without NMS: use --no-nms (nms=False), or "
                             "export with --nms or --no-end-to-end for the branch NMS selects from")
        if not nms and output != "end_to_end":
            raise ValueError(f"{self.path} has no one-to-one (end-to-end) output: its detections need NMS "
                             "(nms=False needs a yolo26 model exported end to end)")

    def __call__(self, batch: Tensor) -> Tensor | tuple[Tensor, ...]:
        """The file's output for a float32 batch in [0, 1] (Tensor[B, 3, H, W]); a segmentation model's file
        gives a tuple: that output, the mask coefficients and the prototypes."""
        fixed = self.fixed_imgsz
        if fixed is not None and tuple(batch.shape[-2:]) != fixed:
            raise ExportError(f"{self.path} was exported for {fixed[1]}x{fixed[0]} input, got "
                              f"{batch.shape[-1]}x{batch.shape[-2]}: use --imgsz {max(fixed)} (square letterbox), "
                              "or export again without --static")
        outputs = self._run(batch)
        return tuple(outputs) if self.masks else outputs[0]

    @torch.inference_mode()
    def predict(self, images: Tensor, *, conf: float = 0.25, iou: float = 0.7, max_det: int = 300,
                classes: Sequence[int] | None = None, agnostic: bool = False, multi_label: bool = False,
                orig_shapes: Sequence[tuple[int, int]] | None = None, ratio_pad: Sequence[Any] | None = None,
                nms: bool = True, mask_form: str = "whole") -> list[Detections]:
        """``Detector.predict`` on the exported file: the same padding, NMS (or top-k), boxes mapped
        back, and a segmentation file's masks in the same ``mask_form``. A file with NMS in its graph gives
        its own detections (its ``conf``, ``iou`` and ``max_det`` from the export; ``conf``, ``classes`` and
        ``max_det`` here filter them further)."""
        if mask_form not in ("whole", "crops"):
            raise ValueError(f"mask_form must be 'whole' or 'crops', got {mask_form!r}")
        if self.info["output"] != "detections":
            self.check_nms(nms)
        batch, orig_shapes, ratio_pad = input_batch(images, int(max(self.strides)), "cpu", torch.float32,
                                                    orig_shapes, ratio_pad)
        out = self(batch)
        out, coefficients, protos = (t.float().cpu() for t in out) if self.masks else (out.float().cpu(), None, None)
        size = tuple(batch.shape[-2:])
        if self.info["output"] == "predictions":
            return detections_of(out, orig_shapes, ratio_pad, nms=True, conf=conf, iou=iou, max_det=max_det,
                                 classes=classes, agnostic=agnostic, multi_label=multi_label,
                                 seg=None if coefficients is None else (coefficients, protos, size),
                                 mask_form=mask_form)
        if self.info["output"] == "end_to_end":
            rows = list(out)
        else:   # detections [K, 7]: image, box, score, label
            rows = [out[out[:, 0] == i][:, 1:] for i in range(len(batch))]
            rows = [r[r[:, 4].argsort(descending=True)] for r in rows]
        dets, kept = [], []
        for r in rows:
            keep = r[:, 4] > conf
            if classes is not None:
                keep &= torch.isin(r[:, 5].long(), torch.as_tensor(list(classes)))
            index = keep.nonzero().flatten()[:max_det]
            dets.append(Detections(r[index, :4], r[index, 4], r[index, 5].long()))
            kept.append(index)
        dets = mapped_back(dets, orig_shapes, ratio_pad)
        if coefficients is None:
            return dets
        return with_masks(dets, kept, (coefficients, protos, size), orig_shapes, ratio_pad,   # a row's: its point's
                          mask_form=mask_form)


def load_exported(path: str | Path, *, device: str | torch.device = "cpu") -> ExportedModel:
    """An :class:`ExportedModel` for ``path`` (see there)."""
    return ExportedModel(path, device=device)


def _info_from_onnx(meta: dict[str, str], path: Path) -> dict[str, Any]:
    if "yolokit" in meta:
        return json.loads(meta["yolokit"])
    if "strides" not in meta or "names" not in meta:
        raise ExportError(f"{path}: an ONNX file without yolokit's metadata (strides, names); "
                          "export it with yolokit export")
    output = meta.get("output", "predictions").split()[0]   # files written before the json key
    h, w = json.loads(meta.get("imgsz", "[640, 640]"))
    return {"name": path.stem, "config": meta.get("yolokit_config", ""), "strides": json.loads(meta["strides"]),
            "names": json.loads(meta["names"]), "imgsz": [h, w], "dynamic": False, "half": False,
            "output": "end_to_end" if "one-to-one" in meta.get("output", "") else output,
            "conf": 0.25, "iou": 0.7, "max_det": 300}


def _open_onnx(path: Path, device: torch.device) -> tuple[dict[str, Any], Callable[[Tensor], Tensor]]:
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ImportError(f"{path}: onnxruntime here has no CUDA provider: pip install onnxruntime-gpu")
        providers.insert(0, "CUDAExecutionProvider")
    session = ort.InferenceSession(str(path), providers=providers)
    info = _info_from_onnx(session.get_modelmeta().custom_metadata_map, path)
    name = session.get_inputs()[0].name

    def run(batch: Tensor) -> list[Tensor]:
        return [torch.from_numpy(o) for o in session.run(None, {name: np.ascontiguousarray(batch.cpu().numpy())})]

    return info, run


def _open_openvino(path: Path, device: torch.device) -> tuple[dict[str, Any], Callable[[Tensor], Tensor]]:
    import openvino as ov

    if device.type != "cpu":
        raise ValueError(f"{path}: OpenVINO runs here on the CPU; use --device cpu")
    folder = path if path.is_dir() else path.parent
    xml = path if path.suffix == ".xml" else next(iter(sorted(folder.glob("*.xml"))))
    sidecar = folder / "yolokit.json"
    if not sidecar.is_file():
        raise ExportError(f"{folder}: an OpenVINO model without yolokit.json; export it with yolokit export")
    info = json.loads(sidecar.read_text())
    # float32 files run in float32: OpenVINO would otherwise pick bf16 on CPUs that have it
    hint = {} if info.get("half") or info.get("int8") else {"INFERENCE_PRECISION_HINT": "f32"}
    compiled = ov.Core().compile_model(str(xml), "CPU", hint)

    def run(batch: Tensor) -> list[Tensor]:
        result = compiled(np.ascontiguousarray(batch.cpu().numpy()))
        return [torch.from_numpy(np.asarray(result[output])) for output in compiled.outputs]

    return info, run


def _open_pt2(path: Path, device: torch.device) -> tuple[dict[str, Any], Callable[[Tensor], Tensor]]:
    import zipfile

    if not zipfile.is_zipfile(path):
        raise ExportError(f"{path}: not a .pt2 package (truncated, or another kind of file); "
                          "export it again with yolokit export --format pt2")
    import torchvision  # noqa: F401  (registers torchvision::nms, which a package with NMS in its graph calls)

    package = torch._inductor.aoti_load_package(str(path))
    meta = package.get_metadata()
    if "yolokit" not in meta:
        raise ExportError(f"{path}: a .pt2 package without yolokit's metadata; export it with yolokit export")
    info = json.loads(meta["yolokit"])
    if info.get("device", "cpu") != device.type:
        raise ValueError(f"{path} was compiled for {info.get('device', 'cpu')}: use --device "
                         f"{info.get('device', 'cpu')}, or export again with --device {device.type}")

    def run(batch: Tensor) -> list[Tensor]:
        out = package(batch.to(device))
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return info, run


_OPENERS = {"onnx": _open_onnx, "openvino": _open_openvino, "pt2": _open_pt2}
