"""The HSV augmentation on a batch of tensors, on the training device, equal to OpenCV's.

The loader's workers spend about a third of a cached Mosaic sample's time on the HSV step
(two colour conversions and a lookup table over 640x640 pixels). With
``build_dataloader(..., hsv_on_device=True)`` the workers only draw each image's gains
(`transforms.hsv_lut`, from the item's own generator, as before) and the batch carries the
tables; `to_device` then applies them to the uint8 batch on the device with
`apply_hsv_lut_batch`.

`apply_hsv_lut_batch` follows OpenCV's uint8 conversions step by step, so the batch is the
one the workers would have made:
- BGR to HSV is OpenCV's integer arithmetic (its division tables, 12-bit fixed point):
  exact on every one of the 16.7M colours;
- HSV to BGR is OpenCV's vectorised float32 path (hue sector by truncation, values times
  255 truncated). Where OpenCV's build fuses ``1 - s * h`` into one FMA (x86 with AVX2, as
  the PyPI wheels dispatch), the product here is formed in float64 and rounded once, which
  is what an FMA gives: equal on all 11.8M HSV triples on such a machine. A build without
  FMA rounds twice and differs by 1 level on about 0.015% of them.
OpenCV converts the last few pixels of a row (fewer than its vector block, 32 with AVX2) with
scalar code that rounds where the vector code truncates; `transforms.apply_hsv_lut` hands it the
image as one row, so only the last ``H * W % 32`` pixels could differ, none at training sizes
(multiples of 32 on both sides).
The order of the steps is unchanged: HSV acts on the image after Mosaic, the affine step,
MixUp and albumentations; the flips after it commute with a per-pixel map; the multi-scale
resize comes after `to_device`.
"""

from __future__ import annotations

import torch

from yolokit.data.augment.fused import stage

_SHIFT = 12                     # OpenCV's fixed point for hue and saturation (hsv_shift)
_HALF = 1 << (_SHIFT - 1)
_CHUNK = 1 << 23                # pixels converted at once (bounds the int and float temporaries)
_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _division_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCV's saturation and hue (range 180) division tables, int32 [256], on `device`."""
    if device not in _tables:
        i = torch.arange(1, 256, dtype=torch.float64)
        sdiv = torch.zeros(256, dtype=torch.float64)
        hdiv = torch.zeros(256, dtype=torch.float64)
        sdiv[1:] = torch.round((255 << _SHIFT) / i)          # round half to even, as saturate_cast
        hdiv[1:] = torch.round((180 << _SHIFT) / (6 * i))
        _tables[device] = sdiv.to(device, torch.int32), hdiv.to(device, torch.int32)
    return _tables[device]


def _to_hsv(r: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
            tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """OpenCV's COLOR_BGR2HSV of uint8 planes (int32 in, int32 out: h 0..179, s, v 0..255); ``tables``:
    `_division_tables` of their device (looked up when not given)."""
    sdiv, hdiv = tables if tables is not None else _division_tables(r.device)
    v = torch.maximum(torch.maximum(r, g), b)
    diff = v - torch.minimum(torch.minimum(r, g), b)
    s = (diff * sdiv[v] + _HALF) >> _SHIFT
    h = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * hdiv[diff] + _HALF) >> _SHIFT                  # arithmetic shift: floor, as in C
    h = torch.where(h < 0, h + 180, h)
    return h, s, v


def _to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """OpenCV's vectorised COLOR_HSV2BGR of uint8 values (int in; uint8 r, g, b out)."""
    f32 = torch.float32
    h = h.to(f32) * torch.tensor(6 / 180, dtype=f32)
    s = s.to(f32) * torch.tensor(1 / 255, dtype=f32)
    v = v.to(f32) * torch.tensor(1 / 255, dtype=f32)
    sector = torch.trunc(h)
    h = h - sector
    s64 = s.double()
    t0 = v
    t1 = v * (1 - s)
    t2 = v * (1 - s64 * h.double()).to(f32)                 # 1 - s*h in one rounding (an FMA)
    t3 = v * (1 - s64 * (1 - h).double()).to(f32)
    sector = sector - torch.trunc(sector * torch.tensor(1 / 6, dtype=f32)) * 6
    sector = sector.to(torch.uint8)
    # sectors 0..5 -> (b, g, r): (t1,t3,t0) (t1,t0,t2) (t3,t0,t1) (t0,t2,t1) (t0,t1,t3) (t2,t1,t0)
    b = torch.where(sector < 2, t1, torch.where(sector == 2, t3, torch.where(sector > 4, t2, t0)))
    g = torch.where(sector < 1, t3, torch.where(sector < 3, t0, torch.where(sector == 3, t2, t1)))
    r = torch.where(sector < 1, t0, torch.where(sector == 1, t2, torch.where(sector < 4, t1,
                                                                             torch.where(sector == 4, t3, t0))))
    return tuple(torch.trunc(x * 255).clamp_(0, 255).to(torch.uint8) for x in (r, g, b))


def apply_hsv_lut_batch(images: torch.Tensor, luts: torch.Tensor, *, compiled: bool = False) -> torch.Tensor:
    """Each image's OpenCV HSV values mapped through its tables: `transforms.apply_hsv_lut` on a batch.

    Args:
        images: uint8 Tensor[B, 3, H, W], RGB (the loader's `images_uint8`), on any device.
        luts: uint8 Tensor[B, 3, 256], each image's hue, saturation and value tables
            (`transforms.hsv_lut`), on the same device.
        compiled: through ``torch.compile`` (`yolokit.data.augment.fused`): one fused kernel over the whole
            batch instead of some forty over chunks, the same values; compiles once per process.

    Returns:
        a new uint8 Tensor[B, 3, H, W], RGB.

    Examples:
        >>> import numpy as np, torch
        >>> from yolokit.data.augment.transforms import hsv_lut
        >>> lut = torch.from_numpy(hsv_lut(np.random.default_rng(0)))[None]
        >>> apply_hsv_lut_batch(torch.full((1, 3, 2, 2), 114, dtype=torch.uint8), lut).shape
        torch.Size([1, 3, 2, 2])
    """
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be uint8 [B, 3, H, W], got {images.dtype} {list(images.shape)}")
    if luts.shape != (images.shape[0], 3, 256) or luts.dtype != torch.uint8:
        raise ValueError(f"luts must be uint8 [{images.shape[0]}, 3, 256], got {luts.dtype} {list(luts.shape)}")
    b, _, height, width = images.shape
    tables = _division_tables(images.device)
    flat = images.reshape(b, 3, height * width)
    if compiled:                                                        # one kernel for the whole batch
        return stage(_hsv_pixels, True)(flat, luts, *tables).view(images.shape)
    out = torch.empty_like(flat)
    step = max(1, _CHUNK // max(1, height * width))
    for lo in range(0, b, step):                                        # chunks bound the int and float temporaries
        out[lo:lo + step] = _hsv_pixels(flat[lo:lo + step], luts[lo:lo + step], *tables)
    return out.view(images.shape)


def _hsv_pixels(pixels: torch.Tensor, luts: torch.Tensor, sdiv: torch.Tensor, hdiv: torch.Tensor) -> torch.Tensor:
    """`apply_hsv_lut_batch` of uint8 [n, 3, P] pixels and their [n, 3, 256] tables, in one piece
    (``sdiv``, ``hdiv``: `_division_tables`)."""
    x = pixels.to(torch.int32)
    hsv = _to_hsv(x[:, 0], x[:, 1], x[:, 2], (sdiv, hdiv))              # [n, P] each, nothing stacked
    hsv = [torch.gather(luts[:, c].to(torch.int64), 1, v.to(torch.int64)) for c, v in enumerate(hsv)]
    return torch.stack(_to_rgb(*hsv), 1)                                # each image through its tables
