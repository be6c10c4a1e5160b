"""The device's half of the device augmentation: a batch of recipes (`yolokit.data.augment.recipes`) to images.

``build_dataloader(..., augment_on="device")`` leaves the pixels of an augmenting dataset's
batches to `to_device`, which calls `augment_batch` on the training device. One batched pass:

1. decode: the batch's JPEG files with one `torchvision.io.decode_jpeg` call on a list (nvJPEG on
   CUDA); the sources the workers decoded (caches, other formats, JPEGs without their end marker)
   come as one uint8 tensor; a file the decoder still rejects is decoded by OpenCV on the host
   (grey if OpenCV cannot either), named once in the log;
2. resize: every source to its loaded size (long side imgsz), as `cv2.resize(INTER_LINEAR)` does,
   one bilinear gather over all of them;
3. warp: every output pixel's input point through its view's inverse matrix (the Mosaic canvas or
   the letterbox, then the affine step; the flips folded into the output coordinates), its four
   neighbours looked up in the frame's tiles (or the grey outside them), bilinear, rounded to uint8;
4. MixUp (`cv2.addWeighted`'s float weights, rounded), the HSV tables (`color.apply_hsv_lut_batch`,
   OpenCV's conversions exactly).

No step loops over the images in Python (the JPEG list goes to one decode call), and no step reads
the device: every size comes from the recipes on the host.

On CUDA the pass runs on a stream of its own, the caller's stream waiting for it with an event
(`yolokit.data.augment.pass_stream` says why: nvJPEG's decoder is not ordered after queued work).

Every gather index is inside its source by construction: a tile's pixels are read only where the
output point falls inside the tile, each tile is checked on the host against its source's size
(a recipe outside raises, naming the files), and the indices are clamped to the source before the
gather, so a gather can never trip a device-side assert. ``YOLOKIT_CHECK_INDICES=1`` in the
environment (or ``CHECK_INDICES = True``) checks every gather index against its source instead,
reading each back (slow: for debugging), and names the tensor and the batch's files.

Eager, the work is cut into chunks of about `CHUNK` output pixels to bound the temporaries, so the
number of kernels grows with the batch's pixels over `CHUNK` only. Compiled, a stage keeps no
temporaries (the four neighbours and the channels are broadcast dimensions, never stacked, and
`yolokit.data.augment.fused` has inductor recompute rather than store), so it runs on the whole batch at
once and writes only its output.

Against the workers' OpenCV images (the same recipes, so the same parameters and labels) a sample
differs by 0.1-0.4 grey levels on average (tests/data/test_device_augment.py bounds it at 1). The
frame is looked up as OpenCV sees it (a neighbour across a tile's or the canvas's edge is the grey
or the other tile there, the paste replicates its window's border, warps snap to OpenCV's 1/32
pixel grid), so edges add nothing; what is left: float weights here against OpenCV's fixed-point
ones (15-bit in the warp, 11-bit in the resize) move single pixels by one level; torchvision's
JPEG decoder against OpenCV's, by up to two; and the HSV step, exact itself, turns a one-level
change of a saturated colour into a hue step now and then (single pixels, up to ~20 levels, under
4% of the pixels by more than two). A letterbox that resizes (a rect batch shape smaller than an
image's own, which the batch shapes avoid) resizes once from the file here, twice in the workers.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from functools import partial

import cv2
import numpy as np
import torch

from yolokit.data.augment.color import apply_hsv_lut_batch
from yolokit.data.augment.fused import stage
from yolokit.data.augment.pass_stream import on_pass_stream, raise_if_the_device_failed, settle
from yolokit.data.sources.images import PAD_VALUE, batch_files

CHUNK = 1 << 22          # pixels per warp or resize step: bounds the temporaries (~2 GB at the peak)
CHECK_INDICES = os.environ.get("YOLOKIT_CHECK_INDICES", "0") not in ("", "0")   # the debug switch (docstring)
logger = logging.getLogger("yolokit.data")
_UNDECODABLE: set[str] = set()   # files reported once per process


def _files(batch: dict) -> str:
    return ", ".join(batch_files(batch.get("paths", []), batch.get("aug_files"), most=12))


def _gather(source: torch.Tensor, index: torch.Tensor, what: str, batch: dict) -> torch.Tensor:
    """``source[:, index]`` of a uint8 [3, N] atlas, flat: float [3, index.numel()] (``index_select``, which
    takes int32 indices as they are; compiled, a gather that fuses with its index and its use). The indices
    are clamped into the source (they are inside it by construction: a clamp makes a device-side assert
    impossible even so); with ``CHECK_INDICES`` they are checked instead, and one outside raises, naming
    the tensor and the batch's files."""
    n, flat = source.shape[1], index.reshape(-1)
    if CHECK_INDICES:
        if flat.numel():
            low, high = (int(v) for v in torch.stack((flat.min(), flat.max())).tolist())
            if low < 0 or high >= n:
                raise IndexError(f"device augmentation: {what} index {low if low < 0 else high} outside its "
                                 f"source of {n:,} pixels; the batch's files: {_files(batch)}")
    else:
        flat = flat.clamp(0, max(n - 1, 0))
    return source.index_select(1, flat).float()


def _host_tensors(batch: dict) -> dict:
    """The batch with its recipe arrays (numpy, as the loader hands them over) as CPU tensors."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def decode_sources(batch: dict, device: torch.device | str) -> tuple[torch.Tensor, list[int], list[tuple[int, int]]]:
    """Every source of the batch decoded on ``device``: uint8 [3, P] (RGB planes, one after the
    other), each source's offset in it and its decoded (h, w) (host numbers: nothing is read back).
    On CUDA on the pass's own stream, as `augment_batch` (the module's docstring says why)."""
    return on_pass_stream(_decode_sources, batch, torch.device(device))


def _decode_sources(batch: dict, device: torch.device) -> tuple[torch.Tensor, list[int], list[tuple[int, int]]]:
    batch = _host_tensors(batch)
    rows = batch["aug_sources"].tolist()
    jpeg_rows = [r for r in rows if r[0] == 0]
    parts, sizes = [], {}
    if jpeg_rows:
        data = batch["aug_jpeg"]
        ends = [r[1] for r in jpeg_rows[1:]] + [data.numel()]
        files = list(torch.split(data, [e - r[1] for r, e in zip(jpeg_rows, ends, strict=True)]))
        images = _decode(files, jpeg_rows, batch.get("aug_files") or [], device)
        for r, im in zip(jpeg_rows, images, strict=True):
            sizes[(0, r[1])] = (int(im.shape[1]), int(im.shape[2]))
        parts = [im.reshape(3, -1) for im in images]
    at, jpeg_at = 0, {}
    for r in jpeg_rows:
        jpeg_at[r[1]] = at
        h, w = sizes[(0, r[1])]
        at += h * w
    if batch["aug_pixels"].shape[1]:
        parts.append(batch["aug_pixels"].to(device, non_blocking=True))
    atlas = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    offsets = [jpeg_at[r[1]] if r[0] == 0 else at + r[1] for r in rows]
    shapes = [sizes[(0, r[1])] if r[0] == 0 else (r[2], r[3]) for r in rows]
    return atlas, offsets, shapes


def _decode(files: list[torch.Tensor], rows: list[list[int]], names: list[str],
            device: torch.device) -> list[torch.Tensor]:
    """The JPEG files decoded on ``device`` in one call: uint8 [3, h, w] each. When the call fails
    (a file damaged since the workers checked its end), the files are decoded one by one and each
    that still fails is decoded by OpenCV on the host, as the workers would, or is grey
    (``PAD_VALUE``, its boxes kept) when OpenCV cannot either; each such file is named once in the
    log. The run goes on, as the workers path goes on."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def one_call(data):
        with warnings.catch_warnings():      # torchvision 0.29 points to torchcodec; the call itself stays
            warnings.simplefilter("ignore", DeprecationWarning)
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    try:
        return one_call(files)
    except RuntimeError as err:
        raise_if_the_device_failed(err, device, names)
    images = []
    for k, (data, row) in enumerate(zip(files, rows, strict=True)):
        settle(device)                  # the retries allocate on this stream too: nothing queued reads a block
        try:
            images.append(one_call(data))
            continue
        except RuntimeError as err:
            raise_if_the_device_failed(err, device, names)
            reason = re.sub(r"^.*\.(?:cpp|cu):\d+, ", "", str(err).strip().splitlines()[-1])   # no source line
        bgr = cv2.imdecode(data.numpy(), cv2.IMREAD_COLOR)
        if bgr is not None and bgr.shape[:2] == (row[2], row[3]):
            images.append(torch.from_numpy(np.ascontiguousarray(bgr[..., ::-1].transpose(2, 0, 1))).to(device))
            done = "decoded by OpenCV on the host instead"
        else:
            images.append(torch.full((3, row[2], row[3]), PAD_VALUE, dtype=torch.uint8, device=device))
            done = "OpenCV cannot decode it either: grey in this batch, its boxes kept"
        name = names[k] if k < len(names) else f"JPEG source {k} of the batch"
        if name not in _UNDECODABLE:
            _UNDECODABLE.add(name)
            logger.warning("%s: the JPEG decoder on %s rejects it (%s); %s. Check or replace the file",
                           name, device, reason, done)
    return images


def _bilinear(atlas: torch.Tensor, base: torch.Tensor, width: torch.Tensor, height: torch.Tensor,
              x: torch.Tensor, y: torch.Tensor, batch: dict) -> torch.Tensor:
    """Each point's bilinear value in its image (border pixels repeated, as `cv2.resize`): float [3, ...].
    The four neighbours are a broadcast dimension, not a stack: compiled, values the kernel recomputes,
    no buffer."""
    x, y = x.clamp(min=0), y.clamp(min=0)
    x0, y0 = torch.minimum(x.floor(), width - 1), torch.minimum(y.floor(), height - 1)
    fx, fy = (x - x0).clamp(max=1), (y - y0).clamp(max=1)
    x0, y0 = x0.long(), y0.long()
    x1, y1 = torch.minimum(x0 + 1, width.long() - 1), torch.minimum(y0 + 1, height.long() - 1)
    w = width.long()
    k = torch.arange(4, device=atlas.device).view(4, *[1] * x.dim())   # the four neighbours, broadcast
    kx, ky = (k % 2).bool(), (k >= 2)
    idx = base + torch.where(ky, y1, y0) * w + torch.where(kx, x1, x0)       # [4, ...]
    v = _gather(atlas, idx, "resize", batch).view(3, *idx.shape)             # [3, 4, ...]
    weights = torch.where(kx, fx, 1 - fx) * torch.where(ky, fy, 1 - fy)
    t = v * weights                                       # summed in order, not by a reduction: eager and
    return t[:, 0] + t[:, 1] + t[:, 2] + t[:, 3]          # compiled add the same way on every device


def resize_sources(atlas: torch.Tensor, offsets: list[int], shapes: list[tuple[int, int]],
                   targets: list[tuple[int, int]], batch: dict | None = None,
                   compiled: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Every source resized to its target (h, w) like `cv2.resize(INTER_LINEAR)`: the new atlas and offsets.
    ``batch``: its files are named if a gather index is found outside its source (``CHECK_INDICES``).
    ``compiled``: through the fused stage (`yolokit.data.augment.fused`), all pixels at once."""
    if any(o < 0 or o + h * w > atlas.shape[1] for o, (h, w) in zip(offsets, shapes, strict=True)):
        raise ValueError(f"device augmentation: a source lies outside the batch's {atlas.shape[1]:,} decoded "
                         f"pixels; the batch's files: {_files(batch or {})}")
    new_offsets, at = [], 0
    for th, tw in targets:
        new_offsets.append(at)
        at += th * tw
    if list(shapes) == list(targets) and offsets == new_offsets:
        return atlas, offsets
    dev = atlas.device
    ints = torch.tensor([[o, w, tw, n] for o, (_, w), (_, tw), n in zip(offsets, shapes, targets, new_offsets,
                                                                         strict=True)], dtype=torch.int64)
    floats = torch.tensor([[h, w, h / th, w / tw] for (h, w), (th, tw) in zip(shapes, targets, strict=True)],
                          dtype=torch.float32)
    starts = torch.tensor(new_offsets, dtype=torch.int32 if at < 2**31 else torch.int64)   # int32: half the bytes
    ints, floats, starts = (t.to(dev, non_blocking=True) for t in (ints, floats, starts))
    out = torch.empty((3, at), dtype=torch.uint8, device=dev)
    compiled = compiled and not CHECK_INDICES                          # the check reads indices back: eager
    run, chunk = stage(_resize_pixels, compiled), at if compiled else CHUNK
    for lo in range(0, at, chunk):                                     # chunks bound the eager temporaries
        n = min(chunk, at - lo)
        out[:, lo:lo + n] = run(atlas, ints, floats, starts, lo, n, None if compiled else batch)   # no dict guards
    return out, new_offsets


def _resize_pixels(atlas: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, starts: torch.Tensor,
                   lo: int, n: int, batch: dict | None = None) -> torch.Tensor:
    """Output pixels ``lo .. lo + n`` of the resized atlas: uint8 [3, n]. ``ints`` [S, 4] each source's
    (offset, width, target width, new offset), ``floats`` [S, 4] (h, w, h / th, w / tw), ``starts`` [S]
    the new offsets (each pixel's source is the last start at or before it)."""
    pos = torch.arange(lo, lo + n, device=atlas.device, dtype=starts.dtype)
    s = torch.bucketize(pos, starts, right=True, out_int32=starts.dtype == torch.int32) - 1   # Triton fuses it
    i, f = ints[s], floats[s]                                          # [n, 4] each (compiled: lookups)
    local = pos - i[:, 3]
    oy = torch.div(local, i[:, 2], rounding_mode="floor")
    ox = local - oy * i[:, 2]
    x = (ox.float() + 0.5) * f[:, 3] - 0.5                             # cv2.resize's source point
    y = (oy.float() + 0.5) * f[:, 2] - 0.5
    return _bilinear(atlas, i[:, 0], f[:, 1], f[:, 0], x, y, batch or {}).round_().clamp_(0, 255).to(torch.uint8)


def _warp_view(atlas: torch.Tensor, tiles: torch.Tensor, frame: torch.Tensor, inverse: torch.Tensor,
               windows: torch.Tensor, warp: torch.Tensor, flips: torch.Tensor, shape: torch.Tensor,
               size: tuple[int, int], batch: dict | None = None) -> torch.Tensor:
    """One view of n samples: uint8 [n, 3, H, W]. ``tiles`` int32 [n, 4, 8]: each quadrant's tile as (atlas
    offset or -1, width, x1, y1, x2, y2, sx - x1, sy - y1); ``frame`` int32 [n, 4]: (h, w, centre x, y)."""
    n, dev = tiles.shape[0], atlas.device
    height, width = size
    ys = torch.arange(height, device=dev, dtype=torch.float32).view(1, -1, 1)
    xs = torch.arange(width, device=dev, dtype=torch.float32).view(1, 1, -1)
    h_b, w_b = shape[:, 0].view(-1, 1, 1).float(), shape[:, 1].view(-1, 1, 1).float()
    xf = torch.where(flips[:, 0].view(-1, 1, 1), w_b - 1 - xs, xs)          # the flips: where each pixel reads
    yf = torch.where(flips[:, 1].view(-1, 1, 1), h_b - 1 - ys, ys)
    m = inverse.view(n, 9, 1, 1)
    q = m[:, 6] * xf + m[:, 7] * yf + m[:, 8]
    u = (m[:, 0] * xf + m[:, 1] * yf + m[:, 2]) / q
    v = (m[:, 3] * xf + m[:, 4] * yf + m[:, 5]) / q
    wd = windows.view(n, 8, 1, 1)
    grid = warp.view(-1, 1, 1)
    u = torch.where(grid, (u * 32).round() / 32, u).clamp(wd[:, 0], wd[:, 1])   # OpenCV's 1/32 pixel warp grid
    v = torch.where(grid, (v * 32).round() / 32, v).clamp(wd[:, 2], wd[:, 3])
    x0, y0 = u.floor(), v.floor()
    fx, fy = u - x0, v - y0
    i32 = torch.int32                                                     # int32 index arithmetic: half the bytes
    k = torch.arange(4, device=dev).view(4, 1, 1, 1)                      # the four neighbours, broadcast (no
    kx, ky = (k % 2).bool(), (k >= 2)                                     # stack: compiled, nothing stored)
    cx, cy = (x0 + kx.float()).to(i32), (y0 + ky.float()).to(i32)         # [4, n, H, W] frame pixels
    fr = frame.view(1, n, 4, 1, 1)
    quadrant = (cx >= fr[:, :, 2]).to(i32) + 2 * (cy >= fr[:, :, 3]).to(i32)
    row = torch.arange(n, device=dev, dtype=i32).view(1, n, 1, 1) * 4 + quadrant
    t = tiles.reshape(n * 4, -1).t()[:, row]                              # [8, 4, n, H, W]
    inside = ((t[0] >= 0) & (cx >= t[2]) & (cx < t[4]) & (cy >= t[3]) & (cy < t[5])
              & (cx >= 0) & (cy >= 0) & (cx < fr[:, :, 1]) & (cy < fr[:, :, 0]))
    flat = torch.where(inside, t[0] + (cy + t[7]) * t[1] + cx + t[6], 0)      # int32
    vals = _gather(atlas, flat, "warp", batch or {}).view(3, *flat.shape).movedim(0, 2)   # [4, n, 3, H, W]
    vals = torch.where(inside.unsqueeze(2), vals, float(PAD_VALUE))
    weights = torch.where(kx, fx, 1 - fx) * torch.where(ky, fy, 1 - fy)     # [4, n, H, W]
    t = vals * weights.unsqueeze(2)                       # summed in order, not by a reduction (whose order
    out = (t[0] + t[1] + t[2] + t[3]).round_().clamp_(0, 255)   # is the device's): [n, 3, H, W]
    shown = ((xf >= wd[:, 4]) & (xf < wd[:, 5]) & (yf >= wd[:, 6]) & (yf < wd[:, 7])
             & (xs < w_b) & (ys < h_b)).unsqueeze(1)
    return torch.where(shown, out, float(PAD_VALUE)).to(torch.uint8).contiguous()


def _mix(a: torch.Tensor, b: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """cv2.addWeighted on uint8 [n, 3, H, W] views: float weights ``ratio`` [n] and 1 - ratio, rounded to nearest."""
    r = ratio.float().view(-1, 1, 1, 1)
    return (a.float() * r + b.float() * (1 - ratio).float().view(-1, 1, 1, 1)).round_().clamp_(0, 255).to(torch.uint8)


def augment_batch(batch: dict, device: torch.device | str, compiled: bool = False) -> torch.Tensor:
    """A recipe batch's images on ``device``: uint8 Tensor[B, 3, H, W], RGB, as the workers make them.

    On CUDA the pass runs on its own stream and the current stream waits for it (the module's
    docstring says why); the images may be used on the current stream at once.

    Args:
        batch: from `recipes.collate_recipes` (its tensors on the CPU, as the loader yields them).
        device: the training device.
        compiled: the per-pixel stages through ``torch.compile`` (`yolokit.data.augment.fused`): a few fused
            kernels instead of some hundred, the same images; compiles once per process.

    Raises:
        ValueError: a recipe whose tile lies outside its source (names the batch's files).
        IndexError: with ``CHECK_INDICES``, a gather index outside its source (names them too).
    """
    return on_pass_stream(partial(_augment, compiled=compiled and not CHECK_INDICES), batch, torch.device(device))


def _view_args(on: dict, s: slice, k: int, compiled: bool) -> list[torch.Tensor]:
    """View ``k``'s recipe tensors of images ``s`` for `_warp_view`. Compiled: contiguous (one or two views
    give other strides) with their image dimension marked dynamic (the last batch of an epoch is smaller),
    so a batch of another shape reuses the compiled kernels instead of compiling again."""
    args = [on["table"][s, k], on["frame"][s, k], on["inverse"][s, k], on["windows"][s, k], on["warp"][s, k],
            on["flips"][s], on["shape"][s]]
    if compiled:
        args = [a.contiguous() for a in args]
        for a in args:
            torch._dynamo.maybe_mark_dynamic(a, 0)
    return args


def _check_tiles(targets: list[tuple[int, int]], batch: dict) -> None:
    """Every tile of the batch's recipes reads inside its source (host numbers; ``targets``: each source's
    resized (h, w)): raises naming the files if not."""
    src = batch["aug_tiles"][..., 0]
    used = src >= 0
    if not bool(used.any()):
        return
    hw = torch.tensor(targets + [(0, 0)], dtype=torch.int64)[torch.where(used, src, len(targets))]
    x1, y1, x2, y2, sx, sy = (batch["aug_tiles"][..., k] for k in range(1, 7))
    bad = used & ((x2 > x1) & (y2 > y1)) & ((sx < 0) | (sy < 0) | (sx + x2 - x1 > hw[..., 1])
                                            | (sy + y2 - y1 > hw[..., 0]))
    if bool(bad.any()):
        image = int(bad.nonzero()[0, 0])
        raise ValueError(f"device augmentation: a recipe of image {image} of the batch reads outside its source "
                         f"(tile {batch['aug_tiles'][bad][0].tolist()}); the batch's files: {_files(batch)}")


def _augment(batch: dict, device: torch.device, compiled: bool = False) -> torch.Tensor:
    batch = _host_tensors(batch)
    atlas, offsets, shapes = _decode_sources(batch, device)
    rows = batch["aug_sources"].tolist()
    targets = [(r[4], r[5]) for r in rows]
    atlas, offsets = resize_sources(atlas, offsets, shapes, targets, batch, compiled)
    b = batch["aug_tiles"].shape[0]
    shape = batch["aug_shape"]
    height, width = (int(v) for v in shape.max(0).values.tolist())
    tiles = batch["aug_tiles"]                                            # [B, 2, 4, 7] (src, x1, y1, x2, y2, sx, sy)
    src = tiles[..., 0]
    offs = torch.tensor(offsets + [0], dtype=torch.int64)
    widths = torch.tensor([w for _, w in targets] + [1], dtype=torch.int64)
    table = torch.stack([torch.where(src >= 0, offs[src], -1), widths[src], tiles[..., 1], tiles[..., 2],
                         tiles[..., 3], tiles[..., 4], tiles[..., 5] - tiles[..., 1],
                         tiles[..., 6] - tiles[..., 2]], -1)              # [B, 2, 4, 8] on the host
    frame = batch["aug_frame"].clamp(max=2**31 - 1).to(torch.int32)
    if atlas.shape[1] >= 2**31:
        raise ValueError(f"a batch of {atlas.shape[1]:,} source pixels: int32 indices hold 2**31; use a smaller batch")
    _check_tiles(targets, batch)
    table = table.to(torch.int32)
    mixed = bool((batch["aug_mix"] < 1).any())
    views = 2 if mixed else 1
    warp = (batch["aug_windows"][..., 0] == -1e9)                         # the full warps (not pastes)
    host = dict(table=table[:, :views], frame=frame[:, :views], inverse=batch["aug_inverse"][:, :views].float(),
                windows=batch["aug_windows"][:, :views].float(), warp=warp[:, :views], flips=batch["aug_flip"],
                shape=shape)
    on = {k: v.to(device, non_blocking=True) for k, v in host.items()}
    step = b if compiled else max(1, CHUNK // max(1, height * width))   # chunks bound the eager temporaries
    mix = batch["aug_mix"].to(device, non_blocking=True)
    warp_view, mix_views = stage(_warp_view, compiled), stage(_mix, compiled)

    def chunk(s: slice) -> torch.Tensor:
        out = [warp_view(atlas, *_view_args(on, s, k, compiled), (height, width), None if compiled else batch)
               for k in range(views)]                          # compiled: no guards on the batch's dict
        return mix_views(out[0], out[1], mix[s]) if mixed else out[0]

    if step >= b:
        images = chunk(slice(0, b))                                     # compiled: the stage's output, no copy
    else:
        images = torch.empty((b, 3, height, width), dtype=torch.uint8, device=device)
        for lo in range(0, b, step):
            images[lo:lo + step] = chunk(slice(lo, lo + step))
    if "hsv_lut" in batch:
        images = apply_hsv_lut_batch(images, batch["hsv_lut"].to(device, non_blocking=True), compiled=compiled)
        if bool((shape != torch.tensor([height, width])).any()):         # the collate's grey around smaller images
            ys = torch.arange(height, device=device).view(1, 1, -1, 1)
            xs = torch.arange(width, device=device).view(1, 1, 1, -1)
            sh = on["shape"].view(b, 2, 1, 1)
            images = torch.where((ys < sh[:, 0:1]) & (xs < sh[:, 1:2]), images, PAD_VALUE).to(torch.uint8)
    return images
