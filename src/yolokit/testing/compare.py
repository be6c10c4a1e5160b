"""Assertions that compare: two models' weights bit for bit, two sets of detections up to tolerances."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from yolokit.ops import Detections


def _state(x: Any) -> dict[str, Any]:
    """The state dict of a module (DDP and ``torch.compile`` wrappers unwrapped), of an EMA (its
    ``module``), or the mapping itself."""
    from torch import nn

    if isinstance(x, Mapping):
        return dict(x)
    if not isinstance(x, nn.Module) and isinstance(getattr(x, "module", None), nn.Module):
        x = x.module                                           # yolokit.train.ema.ModelEMA
    while True:
        compiled = getattr(x, "_orig_mod", None)                # torch.compile's wrapper
        if isinstance(x, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            x = x.module
        elif isinstance(compiled, nn.Module):
            x = compiled
        else:
            break
    if not isinstance(x, nn.Module):
        raise TypeError(f"compare modules, EMAs or state dicts, got {type(x).__name__}")
    return x.state_dict()


def _tensor_difference(key: str, x: Tensor, y: Tensor) -> str | None:
    """What differs between two tensors, bit for bit; None when nothing does."""
    import torch

    if x.shape != y.shape or x.dtype != y.dtype:
        return f"{key}: {x.dtype} {tuple(x.shape)} in a, {y.dtype} {tuple(y.shape)} in b"
    shape = tuple(x.shape)
    x, y = x.detach().cpu().contiguous().reshape(-1), y.detach().cpu().contiguous().reshape(-1)
    x_bytes, y_bytes = x.view(torch.uint8), y.view(torch.uint8)
    if torch.equal(x_bytes, y_bytes):
        return None
    size = max(x.element_size(), 1)
    differs = (x_bytes.reshape(-1, size) != y_bytes.reshape(-1, size)).any(dim=1)
    count = int(differs.sum())
    wide = torch.complex128 if x.is_complex() else torch.float64
    gap = (x[differs].to(wide) - y[differs].to(wide)).abs().max().item()
    first = int(differs.nonzero()[0])
    where = [int(i) for i in torch.unravel_index(torch.tensor(first), shape)]
    return (f"{key}: {count} of {x.numel()} elements differ, max abs difference {gap:.6g}, the first at {where}: "
            f"{x[first].item()!r} in a, {y[first].item()!r} in b")


def assert_weights_equal(a: Any, b: Any) -> None:
    """Assert two models' weights and buffers are equal bit for bit.

    ``a`` and ``b``: modules (DDP and ``torch.compile`` wrappers looked through), EMAs (``ModelEMA``: its
    ``module``) or state dicts, in any combination. Tensors compare by their bytes (``-0.0`` differs from
    ``0.0``, a NaN equals the same NaN); the keys' order does not matter.

    Raises:
        AssertionError: naming the first differing tensor (in ``a``'s order), how many of its elements
            differ and by at most how much, then the next eight differing tensors (shape or dtype
            mismatches among them) and how many more, and the keys found on one side only.

    Examples:
        >>> model = torch.nn.Linear(2, 2)
        >>> assert_weights_equal(model, copy.deepcopy(model).state_dict())
    """
    import torch

    sa, sb = _state(a), _state(b)
    problems = []
    for key, x in sa.items():
        if key not in sb:
            continue
        y = sb[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            problem = _tensor_difference(key, x, y)
        else:
            problem = None if type(x) is type(y) and x == y else f"{key}: {x!r} in a, {y!r} in b"
        if problem:
            problems.append(problem)
    only_a, only_b = [k for k in sa if k not in sb], [k for k in sb if k not in sa]
    if not (problems or only_a or only_b):
        return
    lines = [f"weights differ: first differing tensor {problems[0]}" if problems else "weights differ"]
    lines += [f"  also {p}" for p in problems[1:9]]
    lines += [f"  and {len(problems) - 9} more differing tensors"] if len(problems) > 9 else []
    lines += [f"  only in {side} ({len(keys)}): {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}"
              for side, keys in (("a", only_a), ("b", only_b)) if keys]
    raise AssertionError("\n".join(lines))


def _as_images(x: Any, side: str) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(boxes float64 [K, 4], scores float64 [K], labels int64 [K]) per image, on the CPU."""
    import torch

    images = [x] if hasattr(x, "boxes") and hasattr(x, "scores") else x
    if not isinstance(images, Sequence) or not all(hasattr(d, "boxes") for d in images):
        raise TypeError(f"{side}: compare Detections or lists of them, got {type(x).__name__}")
    return [(torch.as_tensor(d.boxes).detach().cpu().double().reshape(-1, 4),
             torch.as_tensor(d.scores).detach().cpu().double().reshape(-1),
             torch.as_tensor(d.labels).detach().cpu().long().reshape(-1)) for d in images]


def _matching(close: list[list[int]], n_b: int) -> list[int | None]:
    """For each b, the a it is matched to: a maximum one-to-one matching over ``close[a] = [b, ...]``."""
    owner: list[int | None] = [None] * n_b

    def take(i: int, seen: set[int]) -> bool:   # an augmenting path from a's i (Kuhn's algorithm)
        for j in close[i]:
            if j not in seen:
                seen.add(j)
                if owner[j] is None or take(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(close)):
        take(i, set())
    return owner


def _describe(boxes: Tensor, scores: Tensor, labels: Tensor, k: int) -> str:
    box = ", ".join(f"{v:.7g}" for v in boxes[k].tolist())
    return f"box [{box}], score {scores[k].item():.7g}, label {labels[k].item()}"


def _image_difference(image: int, a: tuple, b: tuple, atol: float, rtol: float) -> str | None:
    import torch

    (box_a, score_a, label_a), (box_b, score_b, label_b) = a, b
    near = ((box_a[:, None] - box_b[None]).abs() <= atol + rtol * box_b.abs()[None]).all(dim=2)
    near &= (score_a[:, None] - score_b[None]).abs() <= atol + rtol * score_b.abs()[None]
    near &= label_a[:, None] == label_b[None]
    order_a, order_b = torch.argsort(-score_a, stable=True).tolist(), torch.argsort(-score_b, stable=True).tolist()
    owner = _matching([[j for j in order_b if near[i, j]] for i in range(len(score_a))], len(score_b))
    matched = {i for i in owner if i is not None}
    lonely_a = [i for i in order_a if i not in matched]
    lonely_b = [j for j in order_b if owner[j] is None]
    if not lonely_a and not lonely_b:
        return None
    head = f"detections differ in image {image} ({len(score_a)} in a, {len(score_b)} in b; atol={atol}, rtol={rtol})"
    mine, other, side, other_side = ((a, b, "a", "b") if lonely_a else (b, a, "b", "a"))
    k = (lonely_a or lonely_b)[0]
    line = f"first differing detection: {side}'s {_describe(*mine, k)} has no match in {other_side}"
    same = (other[2] == mine[2][k]).nonzero().flatten()
    if len(same):   # the nearest of its class on the other side
        gaps = (other[0][same] - mine[0][k]).abs().amax(dim=1)
        j = int(same[gaps.argmin()])
        line += (f"; the nearest of its label there: {_describe(*other, j)} (box off by {gaps.min().item():.3g}, "
                 f"score by {abs(other[1][j] - mine[1][k]).item():.3g})")
    return f"{head}\n  {line}\n  unmatched: {len(lonely_a)} in a, {len(lonely_b)} in b"


def assert_detections_close(a: Detections | Sequence[Detections], b: Detections | Sequence[Detections], *,
                            atol: float = 1e-4, rtol: float = 1e-5) -> None:
    """Assert two sets of detections are the same up to tolerances, in any order.

    Per image, the detections of ``a`` and ``b`` are paired one to one (a maximum matching), each pair of the
    same label with box coordinates and score within ``atol + rtol * |b's value|`` (``torch.isclose``'s
    rule); every detection must find its pair, in whatever order either side lists them (runtimes order
    equal scores differently).

    Args:
        a: ``Detections`` (boxes Tensor[K, 4] xyxy, scores Tensor[K], labels Tensor[K]; numpy arrays too)
            of one image, or a list of them, one per image.
        b: the same kind as ``a``.
        atol: absolute tolerance, in pixels for boxes, for scores as they are.
        rtol: relative tolerance.

    Raises:
        AssertionError: naming the image, the counts, and the first detection without a pair (the highest
            scored of ``a``'s, else of ``b``'s) with the nearest of its label on the other side.

    Examples:
        >>> from yolokit import Detections
        >>> one = Detections(torch.tensor([[0.0, 0, 10, 10], [5, 5, 20, 20]]), torch.tensor([0.9, 0.8]),
        ...                  torch.tensor([1, 2]))
        >>> other = Detections(one.boxes.flip(0) + 1e-5, one.scores.flip(0), one.labels.flip(0))
        >>> assert_detections_close(one, other)
    """
    single_a, single_b = hasattr(a, "boxes"), hasattr(b, "boxes")
    if single_a != single_b:
        raise AssertionError(f"a is {'one image' if single_a else 'a list'}, b {'one image' if single_b else 'a list'}")
    images_a, images_b = _as_images(a, "a"), _as_images(b, "b")
    if len(images_a) != len(images_b):
        raise AssertionError(f"detections of {len(images_a)} images in a, of {len(images_b)} in b")
    for image, (da, db) in enumerate(zip(images_a, images_b, strict=True)):
        problem = _image_difference(image, da, db, atol, rtol)
        if problem:
            raise AssertionError(problem)
