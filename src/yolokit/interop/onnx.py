"""ONNX export: the network plus decode, and optionally NMS, as one graph.

The graph takes ``images`` float32 [B, 3, H, W] in [0, 1] (B dynamic; H and W any multiples of the
largest stride, or with ``dynamic=False`` the export size) and returns either

- ``predictions`` [B, P, 4 + C]: ``Detector.decode`` output, xyxy boxes in input pixels
  and class scores in [0, 1]; or, with ``nms=True``,
- ``detections`` [K, 7]: rows ``(image_index, x1, y1, x2, y2, score, label)``, from the
  standard ONNX ``NonMaxSuppression`` op (no torchvision, no custom ops).

With ``nms=True`` each point keeps only its best class (as ``Detector.predict`` does) and
NMS runs per class; ONNX's op caps ``max_det`` per class and image, not per image.

An end-to-end model (YOLO26) is exported by default with its one-to-one branch and the top-k that
replaces NMS inside the graph (no NMS op):

- ``detections`` [B, k, 6]: rows ``(x1, y1, x2, y2, score, class)``, best first, k =
  min(max_det, points) (``ops.nms.top_k_predictions``); the caller keeps the rows above its
  threshold. ``end_to_end=False`` exports its one-to-many branch as any other model.
A segmentation model's file has two more outputs: ``coefficients`` [B, P, M] (each prediction's mask
coefficients; end to end, each row's [B, k, M]) and ``protos`` [B, M, H/4, W/4] (``mask_outputs``); NMS in
its graph is not built.
Batch norms are folded into the convolutions by the exporter (eval mode); a model in
another dtype or on another device is exported from a float32 CPU copy. With ``half=True`` the
weights and the arithmetic are float16; the input and the output stay float32 (casts at both ends). The export uses
``torch.onnx.export(dynamo=True)``; it needs ``onnx`` and ``onnxscript``
(``pip install 'yolokit[export]'``, which adds ``onnxruntime`` to run the result).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from yolokit.models import Detector
from yolokit.ops.masks import point_coefficients
from yolokit.ops.nms import top_k_points

_PROTOBUF_LIMIT = 2**31 - 2**26  # leave room below protobuf's 2 GiB for the graph itself


class DecodedDetector(nn.Module):
    """``images -> Detector.decode(Detector(images))``: the graph that gets exported.

    Args:
        model: the detector (used as is: pass a fused copy for deployment).
        best_class_only: zero every score but each point's highest, so that per-class
            NMS gives ``Detector.predict``'s single-label result.
        top_k: an end-to-end model's one-to-one branch and its ``top_k`` best (point, class)
            pairs instead: Tensor[B, min(top_k, P), 6].
    """

    def __init__(self, model: Detector, *, best_class_only: bool = False, top_k: int | None = None):
        super().__init__()
        self.model, self.best_class_only, self.top_k = model, best_class_only, top_k

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Tensor[B, 3, H, W] -> Tensor[B, P, 4 + C] (or [B, k, 6] with ``top_k``); a segmentation model's
        also each point's (row's) mask coefficients Tensor[B, P, M] (or [B, k, M]) and the prototypes
        Tensor[B, M, H/4, W/4]."""
        out = self.model(images)
        seg = getattr(self.model.head, "segments", False)
        if self.top_k is not None:
            rows, point = top_k_points(self.model.decode(out, nms=False), max_det=self.top_k)
            if not seg:
                return rows
            coefficients = point_coefficients(out["one2one_coefficients"])
            return rows, coefficients.gather(1, point[..., None].expand(-1, -1, coefficients.shape[-1])), \
                out["protos"]
        preds = self.model.decode(out)
        if self.best_class_only:
            boxes, scores = preds[..., :4], preds[..., 4:]
            scores = scores * (scores == scores.amax(dim=-1, keepdim=True)).to(scores.dtype)
            preds = torch.cat((boxes, scores), dim=-1)
        return (preds, point_coefficients(out["coefficients"]), out["protos"]) if seg else preds


class HalfGraph(nn.Module):
    """``module`` in float16 between a float32 input and a float32 output (the file's interface does not
    change with its precision)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module.half()

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, ...]:
        out = self.module(images.half())
        return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()


def export_graph(model: Detector, *, nms: bool = False, end_to_end: bool = False, max_det: int = 300,
                 half: bool = False) -> nn.Module:
    """The module every export traces: ``DecodedDetector`` of a float32 CPU copy of ``model`` in eval mode
    (float16 in a ``HalfGraph`` with ``half``); ``model`` itself is left as it was. NMS in the graph of a
    segmentation model is refused (a ValueError): every format's export starts here."""
    if nms and mask_outputs(model):
        raise ValueError(f"NMS in the graph is not built for a segmentation model ({model.name}): export it without "
                         "--nms (its masks then come with the predictions; yolokit predict runs NMS)")
    net = copy.deepcopy(model).to("cpu", torch.float32).eval()
    graph = DecodedDetector(net, best_class_only=nms, top_k=max_det if end_to_end else None).eval()
    return HalfGraph(graph).eval() if half else graph


def export_shapes(model: Detector, h: int, w: int, *, dynamic: bool = True) -> tuple[Tensor, dict]:
    """An example input and ``torch.export``'s dynamic shapes: the batch always; with ``dynamic``, H and W
    as any multiples of the largest stride (up to 8192 pixels)."""
    stride = int(max(model.strides))
    dims = {0: torch.export.Dim("batch", min=1, max=4096)}
    if dynamic:
        dims[2] = stride * torch.export.Dim("rows", min=1, max=8192 // stride)
        dims[3] = stride * torch.export.Dim("columns", min=1, max=8192 // stride)
    return torch.zeros(2, 3, h, w), {"images": dims}   # batch 2: a batch of 1 would be baked in as a constant


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"ONNX export needs {', '.join(missing)}: pip install 'yolokit[export]'")


def export_onnx(
    model: Detector,
    path: str | Path,
    *,
    imgsz: int | tuple[int, int] = 640,
    nms: bool = False,
    conf: float = 0.25,
    iou: float = 0.7,
    max_det: int = 300,
    opset: int | None = None,
    end_to_end: bool | None = None,
    dynamic: bool = True,
    half: bool = False,
) -> Path:
    """Exports ``model`` (network + decode, optionally NMS) to an ONNX file.

    Args:
        model: any yolokit Detector; left as it is (the export traces a float32 CPU copy in eval mode).
        path: destination ``.onnx`` file.
        imgsz: input size, one int or (height, width); multiples of the largest stride.
        nms: append ONNX NonMaxSuppression; the output becomes ``detections`` [K, 7].
        conf: NMS score threshold (scores strictly above it are kept).
        iou: NMS IoU threshold.
        max_det: most boxes per class and image (end-to-end: the k of the top-k).
        opset: ONNX opset (default: the exporter's).
        end_to_end: an end-to-end model's (YOLO26's) one-to-one branch and top-k in the graph, the
            output ``detections`` [B, k, 6]. None: for such a model unless ``nms`` is asked for.
        dynamic: the file takes any H and W that are multiples of the largest stride; False: only
            ``imgsz`` (the batch is dynamic either way).
        half: float16 weights and arithmetic (float32 input and output).

    Returns:
        ``path``. The model config, strides, input size, class names and output layout are
        stored in the file's metadata (``yolokit_config``, ``strides``, ``imgsz``,
        ``names``, ``output``; ``yolokit`` holds them all as one json, see ``file_info``).

    Examples:
        >>> export_onnx(create_model("yolov8n"), "yolov8n.onnx", imgsz=320)
        PosixPath('yolov8n.onnx')
        >>> onnxruntime.InferenceSession("yolov8n.onnx").run(None, {"images": x})[0].shape
        (1, 2100, 84)
    """
    _require("onnx", "onnxscript")
    import onnx

    if end_to_end is None:
        end_to_end = model.end_to_end and not nms
    if end_to_end and (nms or not model.end_to_end):
        raise ValueError(f"end_to_end export needs a model with a one-to-one branch (such as yolo26) and no NMS; "
                         f"{model.name}: end-to-end {model.end_to_end}, nms {nms}")
    path = Path(path)
    h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
    stride = max(model.strides)
    if h % stride or w % stride:
        raise ValueError(f"imgsz {h}x{w} must be a multiple of {model.name}'s largest stride {stride}")
    wrapper = export_graph(model, nms=nms, end_to_end=end_to_end, max_det=max_det, half=half)
    example, dynamic_shapes = export_shapes(model, h, w, dynamic=dynamic)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        program = torch.onnx.export(wrapper, (example,), dynamo=True, input_names=["images"],
                                    output_names=["detections" if end_to_end else "predictions", *mask_outputs(model)],
                                    dynamic_shapes=dynamic_shapes, opset_version=opset, verbose=False)
    proto = program.model_proto
    if nms:
        add_nms(proto, conf=conf, iou=iou, max_det=max_det)
    meta = file_info(model, h, w, nms=nms, end_to_end=end_to_end, dynamic=dynamic, half=half, conf=conf, iou=iou,
                     max_det=max_det)
    info: dict[str, Any] = {
        "yolokit": json.dumps(meta),
        "yolokit_config": meta["config"],
        "strides": json.dumps(meta["strides"]),
        "imgsz": json.dumps([h, w]),
        "names": json.dumps(model.names),
        "output": OUTPUTS[meta["output"]],
    }
    onnx.helper.set_model_props(proto, info)
    large = proto.ByteSize() > _PROTOBUF_LIMIT
    if not large:
        onnx.checker.check_model(proto)
    onnx.save_model(proto, str(path), save_as_external_data=large, location=f"{path.name}.data")
    return path


def mask_outputs(model: Any) -> list[str]:
    """The outputs a segmentation model's file adds after its first: ``coefficients`` (each prediction's, or
    with ``end_to_end`` each row's: [B, P or k, M]) and ``protos`` ([B, M, H/4, W/4]); none for a detection model."""
    return ["coefficients", "protos"] if getattr(getattr(model, "head", None), "segments", False) else []


OUTPUTS = {
    "detections": "detections [K, 7]: image_index, x1, y1, x2, y2, score, label",
    "end_to_end": "detections [B, k, 6]: x1, y1, x2, y2, score, label (one-to-one, no NMS)",
    "predictions": "predictions [B, P, 4 + C]: x1, y1, x2, y2, class scores",
}


def file_info(model: Detector, h: int, w: int, *, nms: bool, end_to_end: bool, dynamic: bool, half: bool,
              conf: float, iou: float, max_det: int) -> dict[str, Any]:
    """What an exported file says about itself (every format stores this dict as json): the model's
    name, config, strides and class names, the export size, whether other sizes run, the precision, the
    output (a key of ``OUTPUTS``), the thresholds baked into the graph, and ``masks``: the outputs a
    segmentation model adds (``mask_outputs``; empty for a detection model)."""
    return {"name": model.name, "config": json.dumps(asdict(model.config)) if model.config is not None else "",
            "strides": [int(s) for s in model.strides], "names": list(model.names), "imgsz": [h, w],
            "dynamic": bool(dynamic), "half": bool(half),
            "output": "detections" if nms else "end_to_end" if end_to_end else "predictions",
            "conf": float(conf), "iou": float(iou), "max_det": int(max_det), "masks": mask_outputs(model)}


def add_nms(proto: Any, *, conf: float = 0.25, iou: float = 0.7, max_det: int = 300) -> None:
    """Replaces a graph's ``predictions`` output [B, P, 4 + C] by ``detections`` [K, 7], in place.

    Uses the standard ONNX ops (NonMaxSuppression, GatherND, ...): per image and class,
    boxes scoring above ``conf`` are kept greedily unless they overlap a kept one by more
    than ``iou``; at most ``max_det`` per class and image. Rows are ``(image_index, x1,
    y1, x2, y2, score, label)``.

    Args:
        proto: an ``onnx.ModelProto`` with an output named ``predictions``.
    """
    from onnx import TensorProto, helper

    graph = proto.graph
    (pred_output,) = [o for o in graph.output if o.name == "predictions"]
    graph.output.remove(pred_output)

    def const(name: str, values: list, dtype: int) -> str:
        graph.initializer.append(helper.make_tensor(name, dtype, [len(values)], values))
        return name

    i64 = TensorProto.INT64
    zero, one, two, three, four = (const(f"nms_c{v}", [v], i64) for v in (0, 1, 2, 3, 4))
    end, axis1, axis2 = const("nms_end", [2**62], i64), const("nms_axis1", [1], i64), const("nms_axis2", [2], i64)
    max_out = const("nms_max_det", [int(max_det)], i64)
    iou_thr = const("nms_iou", [float(iou)], TensorProto.FLOAT)
    score_thr = const("nms_conf", [float(conf)], TensorProto.FLOAT)
    graph.node.extend([
        helper.make_node("Slice", ["predictions", zero, four, axis2], ["nms_boxes"]),  # [B, P, 4]
        helper.make_node("Slice", ["predictions", four, end, axis2], ["nms_scores"]),  # [B, P, C]
        helper.make_node("Transpose", ["nms_scores"], ["nms_scores_t"], perm=[0, 2, 1]),  # [B, C, P]
        helper.make_node("NonMaxSuppression", ["nms_boxes", "nms_scores_t", max_out, iou_thr, score_thr],
                         ["nms_selected"]),  # [K, 3]: image, class, point
        helper.make_node("Slice", ["nms_selected", zero, one, axis1], ["nms_image"]),
        helper.make_node("Slice", ["nms_selected", one, two, axis1], ["nms_class"]),
        helper.make_node("Slice", ["nms_selected", two, three, axis1], ["nms_point"]),
        helper.make_node("Concat", ["nms_image", "nms_point"], ["nms_image_point"], axis=1),
        helper.make_node("GatherND", ["nms_boxes", "nms_image_point"], ["nms_sel_boxes"]),  # [K, 4]
        helper.make_node("GatherND", ["nms_scores_t", "nms_selected"], ["nms_sel_scores"]),  # [K]
        helper.make_node("Unsqueeze", ["nms_sel_scores", axis1], ["nms_sel_scores_1"]),
        helper.make_node("Cast", ["nms_image"], ["nms_image_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["nms_class"], ["nms_class_f"], to=TensorProto.FLOAT),
        helper.make_node("Concat", ["nms_image_f", "nms_sel_boxes", "nms_sel_scores_1", "nms_class_f"],
                         ["detections"], axis=1),
    ])
    graph.output.append(helper.make_tensor_value_info("detections", TensorProto.FLOAT, ["num_detections", 7]))
