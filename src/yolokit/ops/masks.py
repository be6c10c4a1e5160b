"""Instance masks from a segmentation head's output: each detection's mask logits (its coefficients times its
image's prototypes), at the network's input or straight in the original image, cropped to its box.

A mask pixel ``(i, j)`` is inside a box ``(x1, y1, x2, y2)`` (in that mask's pixels) when ``x1 <= j < x2`` and
``y1 <= i < y2``, as the segmentation loss crops its targets; a detection's mask is where its logit is above 0
(its sigmoid above 0.5) inside its box.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from yolokit.ops.geometry import RatioPad


def box_window(boxes: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
    """Which columns and rows of an h x w mask each box covers (pixel index i inside when
    ``x1 <= i < x2``): Tensor[M, 1, w] and Tensor[M, h, 1], float 0/1, separable."""
    x1, y1, x2, y2 = boxes[:, :, None].unbind(1)
    cols = torch.arange(w, device=boxes.device, dtype=boxes.dtype)[None, None, :]
    rows = torch.arange(h, device=boxes.device, dtype=boxes.dtype)[None, :, None]
    return ((cols >= x1[..., None]) & (cols < x2[..., None])).to(boxes.dtype), \
        ((rows >= y1[..., None]) & (rows < y2[..., None])).to(boxes.dtype)


def point_coefficients(levels: Sequence[Tensor]) -> Tensor:
    """A segmentation head's per-level coefficients Tensor[B, M, H_l, W_l] as Tensor[B, P, M]: each point's, in
    ``Detector.decode``'s point order (the levels in order, each row-major)."""
    return torch.cat([c.flatten(2) for c in levels], 2).transpose(1, 2)


def mask_logits(coefficients: Tensor, protos: Tensor) -> Tensor:
    """Tensor[K, h, w] float32: each detection's coefficients (Tensor[K, M]) times the prototypes (Tensor[M, h, w])."""
    m, h, w = protos.shape
    return (coefficients.float() @ protos.float().reshape(m, h * w)).view(-1, h, w)


def decode_masks(coefficients: Tensor, protos: Tensor, boxes: Tensor, size: Sequence[int]) -> Tensor:
    """Masks at the network's input: logits upsampled (bilinear) to ``size``, above 0, inside the boxes.

    Args:
        coefficients: Tensor[K, M] of the K detections.
        protos: Tensor[M, h, w] their image's prototypes.
        boxes: Tensor[K, 4] xyxy in input pixels.
        size: (height, width) of the input.

    Returns:
        Tensor[K, height, width] bool.
    """
    height, width = int(size[0]), int(size[1])
    if not len(coefficients):
        return torch.zeros(0, height, width, dtype=torch.bool, device=protos.device)
    logits = F.interpolate(mask_logits(coefficients, protos)[None], (height, width), mode="bilinear",
                           align_corners=False)[0]
    cols, rows = box_window(boxes.float(), height, width)
    return (logits > 0) & cols.bool() & rows.bool()


def masks_in_original(coefficients: Tensor, protos: Tensor, boxes: Tensor, ratio_pad: RatioPad,
                      input_size: Sequence[int], orig_shape: Sequence[int], *, chunk_pixels: int = 2**22) -> Tensor:
    """Masks in the original image, sampled once from the prototypes (no letterboxed mask in between).

    Each original pixel's centre maps to the input (``original * ratio + pad``) and from there to the
    prototypes, which span the whole input; its logit is read there by bilinear interpolation (the same
    as upsampling the prototype logits to the input, for a pixel on the input's grid), then kept where
    above 0 and inside the detection's box in original pixels. Only the pixels inside each box are sampled:
    the work is the boxes' areas, not the detections times the image (:func:`mask_crops_in_original`, whose
    crops this pastes into whole images). The logits are read separably, along x then y, each axis's two
    neighbours and weights found once per image.

    Args:
        coefficients: Tensor[K, M]; protos: Tensor[M, h, w].
        boxes: Tensor[K, 4] xyxy in original pixels.
        ratio_pad: the image's ``((ratio_w, ratio_h), (pad_w, pad_h))`` into the input.
        input_size: (height, width) of the network's input.
        orig_shape: (height, width) of the original image.
        chunk_pixels: most pixels of one box sampled at once (a large box is sampled in bands of rows).

    Returns:
        Tensor[K, height, width] bool.
    """
    crops = mask_crops_in_original(coefficients, protos, boxes, ratio_pad, input_size, orig_shape,
                                   chunk_pixels=chunk_pixels)
    return crops.dense(orig_shape).to(protos.device)


def mask_crops_in_original(coefficients: Tensor, protos: Tensor, boxes: Tensor, ratio_pad: RatioPad,
                           input_size: Sequence[int], orig_shape: Sequence[int], *, chunk_pixels: int = 2**22
                           ) -> MaskCrops:
    """:func:`masks_in_original`'s masks as the crops of their boxes: memory the boxes' areas, not K whole images.

    Returns:
        :class:`MaskCrops`: each box's pixels ``(x1, y1, x2, y2)`` (x2 and y2 exclusive, clipped to the image)
        and the mask there, on the prototypes' device.
    """
    height, width = int(orig_shape[0]), int(orig_shape[1])
    device = protos.device
    # pixel i is inside [a, b) when a <= i < b: columns ceil(x1) ... ceil(x2) - 1, clipped to the image
    window = boxes.detach().double().ceil().clamp_min(0).cpu().reshape(-1, 4)
    window = torch.minimum(window, torch.tensor([width, height, width, height], dtype=torch.float64)).long()
    window[:, 2:] = torch.maximum(window[:, 2:], window[:, :2])                # an empty box: an empty window
    crops: list[Tensor] = []
    if len(coefficients):
        (rw, rh), (pw, ph) = ratio_pad
        logits = mask_logits(coefficients, protos)                           # [K, h, w]
        h, w = logits.shape[-2:]
        cols = _taps(width, rw, pw, float(input_size[1]), w, device)
        rows = _taps(height, rh, ph, float(input_size[0]), h, device)
    for j, (x1, y1, x2, y2) in enumerate(window.tolist()):
        if x2 <= x1 or y2 <= y1:
            crops.append(torch.zeros(y2 - y1, x2 - x1, dtype=torch.bool, device=device))
            continue
        lo, hi, weight = (t[x1:x2] for t in cols)
        across = torch.lerp(logits[j].index_select(1, lo), logits[j].index_select(1, hi), weight)   # along x first
        step = max(1, chunk_pixels // (x2 - x1))
        bands = []                                                           # a large box: bands of rows
        for r0 in range(y1, y2, step):
            r1 = min(r0 + step, y2)
            lo, hi, weight = rows[0][r0:r1], rows[1][r0:r1], rows[2][r0:r1, None]
            bands.append(torch.lerp(across.index_select(0, lo), across.index_select(0, hi), weight) > 0)
        crops.append(bands[0] if len(bands) == 1 else torch.cat(bands))
    return MaskCrops(window, crops)


@dataclass
class MaskCrops:
    """Detections' masks as the crops of their boxes (``Detector.predict(..., mask_form="crops")``): what
    validation keeps, in memory the boxes' areas where whole masks take K x H x W.

    Attributes:
        windows: int64 [K, 4] (CPU) each crop's place ``(x1, y1, x2, y2)`` in the image, x2 and y2 exclusive.
        crops: K bool tensors, [y2 - y1, x2 - x1] each; a mask has no pixel outside its window.
    """

    windows: Tensor
    crops: list[Tensor]

    def __len__(self) -> int:
        return len(self.crops)

    def __getitem__(self, which: Tensor) -> MaskCrops:
        """The masks ``which`` picks (a bool mask or indices over the K)."""
        rows = torch.as_tensor(which).cpu().reshape(-1)
        rows = rows.nonzero().reshape(-1) if rows.dtype == torch.bool else rows.long()
        return MaskCrops(self.windows[rows], [self.crops[i] for i in rows.tolist()])

    def to(self, device: torch.device | str) -> MaskCrops:
        """On ``device``, all crops moved in one copy."""
        target = torch.device(device)
        if not self.crops or all(c.device.type == target.type and target.index in (None, c.device.index)
                                 for c in self.crops):
            return self
        sizes = [c.numel() for c in self.crops]
        flat = torch.cat([c.reshape(-1) for c in self.crops]).to(device)
        return MaskCrops(self.windows, [f.view(c.shape) for f, c in zip(flat.split(sizes), self.crops, strict=True)])

    def dense(self, shape: Sequence[int]) -> Tensor:
        """Whole-image masks: bool Tensor[K, H, W] of ``shape``, on the crops' device."""
        device = self.crops[0].device if self.crops else "cpu"
        out = torch.zeros(len(self), int(shape[0]), int(shape[1]), dtype=torch.bool, device=device)
        for whole, (x1, y1, x2, y2), crop in zip(out, self.windows.tolist(), self.crops, strict=True):
            whole[y1:y2, x1:x2] = crop
        return out


def _taps(n: int, ratio: float, pad: float, size_in: float, size: int, device: torch.device
          ) -> tuple[Tensor, Tensor, Tensor]:
    """Where each of ``n`` original pixels (along one axis) reads the prototypes: the two neighbouring prototype
    pixels (int64 [n]) and the second one's weight (float32 [n], a ``torch.lerp`` weight), as bilinear upsampling
    reads them (the centre's place ``(i + 0.5) * ratio + pad`` in the input, scaled to the prototypes; clamped at
    the borders)."""
    place = ((torch.arange(n, device=device, dtype=torch.float64) + 0.5) * ratio + pad) / size_in * size - 0.5
    place = place.clamp(0, size - 1)
    lo = place.floor().long().clamp_max(size - 1)
    hi = (lo + 1).clamp_max(size - 1)
    return lo, hi, (place - lo).float()
