"""MuSGD: Muon's orthogonalized momentum plus SGD on matrix and conv weights, SGD on the rest.

YOLO26's default optimizer, taking the same steps as Ultralytics 8.4's ``MuSGD`` as its
trainer builds it (``tests/accel/test_musgd.py``: bit for bit on the CPU that wrote the
reference, within 1e-6 relative allowed). Each parameter group says which update it gets:

- ``use_muon=True`` (conv and linear weights): a Muon step and an SGD step, one after the other.
  Muon: ``m = beta * m + (1 - beta) * g``; the direction ``u = beta * m + (1 - beta) * g``
  (Nesterov) or ``m``; ``p -= lr * muon_scale * sqrt(max(1, rows / cols)) * orthogonalize(u)``.
  Then SGD at ``lr * sgd_scale`` with the group's weight decay, momentum and Nesterov flag.
- ``use_muon=False`` (norm weights, biases): SGD alone at ``lr``.

``beta`` is the group's ``momentum``: both parts use it, so a warmup that moves the momentum
moves Muon's too. Weight decay is SGD's L2 term ``g + weight_decay * p``; Muon ignores it.

The loop, with the groups YOLO26's trainer uses::

    optimizer = MuSGD(musgd_param_groups(model, lr=0.01, momentum=0.9, weight_decay=5e-4))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

Rounding, kept as theirs so that the steps agree (each measured in the tests):

- Newton-Schulz runs in bfloat16 (five quintic steps, coefficients 3.4445, -4.7750, 2.0315,
  after dividing by the Frobenius norm + 1e-7), so the orthogonalized direction carries
  bfloat16's ~3 significant digits before it is cast back to the parameter's dtype.
- The Muon directions of one group are orthogonalized in batches: matrices with the same
  column count (and the same ``rows / cols`` factor) are stacked, their rows zero-padded to
  the tallest one (a batch never spans more than 16x in rows), and the batch is transposed
  when its padded row count exceeds its columns. The zero rows do not change the result
  mathematically, but whether a matrix runs transposed depends on its batch-mates, and the
  bfloat16 iteration amplifies the difference: a [4, 9] conv weight orthogonalized beside a
  [32, 9] one differs from the same weight alone by up to 6% of its largest element.
  Orthogonalizing each matrix alone would move the test's parameters by up to 3e-5 after two
  steps at lr 0.01 (float32 Newton-Schulz: 1.2e-4), far outside the 1e-6 it meets this way.
- A conv weight [O, I, kh, kw] is flattened to [O, I*kh*kw] in its memory order: a
  channels_last weight becomes [O, kh*kw*I] (columns permuted, so the same result up to
  rounding) and its direction is written back channels_last.
- The shape factor ``sqrt(max(1, rows / cols))`` reads the tensor's last two dimensions, so
  for a conv weight it is ``sqrt(max(1, kh / kw))`` (1 for square kernels), not
  ``sqrt(max(1, O / (I*kh*kw)))``.
- In a Muon group the SGD part's weight decay reads the parameter after the Muon step.

State per parameter: ``momentum_buffer`` (SGD) and, in Muon groups, ``muon_momentum_buffer``;
``state_dict`` / ``load_state_dict`` resume exactly (the buffers keep the parameter's memory
layout, which decides the flattening above). A step allocates everything the Muon part needs
before it changes a tensor, so out of memory in the Newton-Schulz iteration leaves the
optimizer and the parameters as they were (:func:`~yolokit.accel.oom.retry_step` can repeat
it); the SGD part allocates as torch's foreach SGD does.

Speed, and the one deliberate deviation: the bfloat16 matrix products are fast on GPUs, but a
CPU without native bfloat16 (AVX2) multiplies them about 8x slower than float32: a yolo26n
step took 8.7 s on this project's 2-core CPU (Ultralytics' own as long). So ``ns_precision``
defaults to "auto": bfloat16 on CUDA (the reference's steps), float32 elsewhere (1.2 s a step;
two steps at lr 0.01 move the test's parameters up to 1.2e-4 away from the reference's).
``ns_precision="bfloat16"`` gives the reference's steps on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's a, b, c: X <- a X + (b A + c A^2) X, A = X X^T
NS_STEPS = 5
NS_EPS = 1e-7
MAX_ROW_SPREAD = 16  # tallest / shortest matrix in one padded batch
CLASS_BRANCHES = ("head.cls", "head.one2one_cls")  # yolokit's names of the class branches (theirs: cv3)
_NORMS = tuple(c for c in vars(nn).values() if isinstance(c, type) and "Norm" in c.__name__)


NS_PRECISIONS = ("auto", "bfloat16", "float32")


def ns_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in: "bfloat16" (the reference's), "float32", or "auto": bfloat16 on
    CUDA, float32 elsewhere (a CPU without native bfloat16 multiplies it 8x slower than float32)."""
    if precision not in NS_PRECISIONS:
        raise ValueError(f"ns_precision must be one of {NS_PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if precision == "bfloat16" else torch.float32


def orthogonalize(matrices: Tensor, steps: int = NS_STEPS, eps: float = NS_EPS,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately ``U V^T`` of each matrix ``U S V^T`` by Newton-Schulz, in ``dtype`` (bfloat16: the reference's).

    Args:
        matrices: Tensor[..., R, C] (any float dtype); each is scaled to unit Frobenius norm first.
        steps: quintic iterations.
        eps: added to the norm (an all-zero matrix stays zero).
        dtype: the iteration's dtype.

    Returns:
        ``dtype`` Tensor[..., R, C] with the input's singular vectors; its singular values are
        pushed towards 1 (about 0.7 to 1.2 unless the input's were far below its largest,
        which five steps leave small). The work is done on the wide side: transposed when R > C.
    """
    a, b, c = NS_COEFFICIENTS
    shape = matrices.shape
    x = matrices.reshape(-1, shape[-2], shape[-1]).to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    tall = shape[-2] > shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)   # b A + c A A
        x = torch.baddbmm(x, poly, x, beta=a)                      # a X + poly X
    if tall:
        x = x.mT
    return x.reshape(shape)


def _as_matrix(u: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``u`` as [rows, cols] in its own memory order (a view where it can be), and the way back."""
    shape = u.shape
    if u.is_contiguous():
        return (u.flatten(1) if u.ndim > 2 else u), lambda x: x.view(shape)
    if u.ndim == 4 and u.is_contiguous(memory_format=torch.channels_last):
        o, i, h, w = shape
        return u.permute(0, 2, 3, 1).flatten(1), lambda x: x.view(o, h, w, i).permute(0, 3, 1, 2)
    return (u.reshape(shape[0], -1) if u.ndim > 2 else u.contiguous()), lambda x: x.reshape(shape)


def muon_directions(updates: Sequence[Tensor], precision: str = "bfloat16") -> list[Tensor]:
    """Each update orthogonalized and scaled by ``sqrt(max(1, shape[-2] / shape[-1]))``, in its dtype and layout.

    ``precision``: the Newton-Schulz dtype (``ns_dtype``).

    Updates with equal column counts (after flattening) and factors run as one padded batch
    (see the module's notes on rounding); the results are new tensors.
    """
    matrices, restores, buckets = [], [], {}
    for i, u in enumerate(updates):
        if u.ndim < 2:
            raise ValueError(f"Muon needs a matrix or conv weight, got a tensor of shape {tuple(u.shape)}")
        matrix, restore = _as_matrix(u)
        matrices.append(matrix)
        restores.append(restore)
        factor = max(1.0, u.shape[-2] / u.shape[-1]) ** 0.5
        buckets.setdefault((matrix.shape[1], factor, matrix.device, matrix.dtype), []).append(i)
    out = list(updates)
    for (cols, factor, device, dtype), members in buckets.items():
        members.sort(key=lambda i: -matrices[i].shape[0])   # tallest first; stable
        for batch in _row_spread_runs(members, [m.shape[0] for m in matrices]):
            stack = torch.zeros(len(batch), matrices[batch[0]].shape[0], cols, device=device, dtype=dtype)
            for j, i in enumerate(batch):
                stack[j, : matrices[i].shape[0]].copy_(matrices[i])
            done = orthogonalize(stack, dtype=ns_dtype(precision, device)).contiguous().to(dtype).mul_(factor)
            for j, i in enumerate(batch):
                out[i] = restores[i](done[j, : matrices[i].shape[0]])
    return out


def _row_spread_runs(members: list[int], rows: list[int]) -> list[list[int]]:
    """``members`` (sorted tallest first) cut wherever the run's first is over 16x taller than the next."""
    runs, start = [], 0
    for j in range(1, len(members) + 1):
        if j == len(members) or rows[members[start]] > MAX_ROW_SPREAD * rows[members[j]]:
            runs.append(members[start:j])
            start = j
    return runs


class MuSGD(torch.optim.Optimizer):
    """Muon + SGD on groups with ``use_muon``, SGD on the others (see the module's docstring).

    Args:
        params: parameters or groups; a group's keys override the defaults below.
        lr: learning rate (Muon's step is ``lr * muon_scale``, the SGD part's ``lr * sgd_scale``).
        momentum: SGD momentum, also Muon's beta.
        weight_decay: L2 term of the SGD part.
        nesterov: Nesterov momentum in both parts.
        use_muon: whether a group gets the Muon step (its tensors need two or more dimensions).
        muon_scale: Muon's share of ``lr`` (YOLO26's trainer: 0.2).
        sgd_scale: the SGD part's share of ``lr`` in Muon groups (YOLO26's trainer: 1.0); groups
            without Muon take SGD at ``lr``.
        ns_precision: the Newton-Schulz iteration's dtype: "bfloat16" (the reference's, on every
            device), "float32", or "auto" (default): bfloat16 on CUDA, float32 elsewhere. On this
            project's 2-core AVX2 CPU a yolo26n step takes 8.7 s in bfloat16 and 1.2 s in float32;
            two steps at lr 0.01 differ from the reference's by up to 1.2e-4 in float32.

    Ultralytics' class itself defaults to ``muon=0.5, sgd=0.5`` and no Nesterov; the defaults
    here are those their trainer passes. The two scales are group keys, so they are saved
    with ``state_dict``.

    As torch's fused optimizers, it takes ``found_inf`` and ``grad_scale`` from its caller
    (:meth:`yolokit.accel.Precision.step`, ``torch.amp.GradScaler``): a step with inf/NaN gradients
    is skipped on the device, nothing read back, and its buffers are updated in place, so its step
    can be recorded as a CUDA graph.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.01,
                 momentum: float = 0.9, weight_decay: float = 0.0, *, nesterov: bool = True,
                 use_muon: bool = False, muon_scale: float = 0.2, sgd_scale: float = 1.0,
                 ns_precision: str = "auto"):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"need lr >= 0, 0 <= momentum < 1, weight_decay >= 0; got {lr}, {momentum}, "
                             f"{weight_decay}")
        ns_dtype(ns_precision, torch.device("cpu"))   # checks the name
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        use_muon=use_muon, muon_scale=muon_scale, sgd_scale=sgd_scale, ns_precision=ns_precision)
        super().__init__(params, defaults)
        self.register_load_state_dict_post_hook(_buffers_like_params)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            flat = [tuple(p.shape) for p in group["params"] if p.ndim < 2]
            if flat:
                raise ValueError(f"a use_muon group holds tensors of fewer than 2 dimensions {flat}; "
                                 "put them in an SGD group (musgd_param_groups does)")

    _step_supports_amp_scaling = True   # ``grad_scale`` (still scaled) and ``found_inf`` (0-dim, nonzero: skip)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every group; parameters without a gradient are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if grad_scale is not None:
            torch._foreach_div_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None],
                                grad_scale)
        kept = None if found_inf is None else self._snapshot()
        work = []   # first everything Muon allocates, nothing changed yet
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                work.append((group, params, self._muon_part(group, params) if group["use_muon"] else None))
        for group, params, muon in work:
            lr = group["lr"]
            if muon is not None:
                momentum, directions = muon
                for p, m in zip(params, momentum, strict=True):   # in place once there: a CUDA graph replays it
                    state = self.state[p]
                    if "muon_momentum_buffer" in state:
                        state["muon_momentum_buffer"].copy_(m)
                    else:
                        state["muon_momentum_buffer"] = m
                torch._foreach_add_(params, directions, alpha=-(lr * group["muon_scale"]))
                lr *= group["sgd_scale"]
            self._sgd_part(group, params, lr)
        if kept is not None:
            self._keep_where(found_inf.bool(), kept)
        return loss

    def _snapshot(self) -> list[tuple[Tensor, str | None, Tensor | None]]:
        """Copies of what a step changes (parameters with a gradient, their buffers; None: none yet)."""
        kept = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                kept.append((p, None, p.clone()))
                for key in ("momentum_buffer", "muon_momentum_buffer") if group["use_muon"] else ("momentum_buffer",):
                    old = self.state[p].get(key) if p in self.state else None
                    kept.append((p, key, None if old is None else old.clone()))
        return kept

    def _keep_where(self, skip: Tensor, kept: list[tuple[Tensor, str | None, Tensor | None]]) -> None:
        """Where ``skip`` (0-dim, on the device): the step's changes undone; a buffer the skipped step
        created is zeros, which the next step treats as no buffer."""
        for p, key, old in kept:
            now = p if key is None else self.state[p][key]
            now.copy_(torch.where(skip, torch.zeros_like(now) if old is None else old, now))

    def _muon_part(self, group: dict[str, Any], params: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """(new Muon momentum, scaled directions) of a group, computed out of place."""
        beta = group["momentum"]
        grads = [p.grad for p in params]
        old = [self.state[p].get("muon_momentum_buffer") if p in self.state else None for p in params]
        old = [torch.zeros_like(p) if m is None else m for p, m in zip(params, old, strict=True)]
        momentum = torch._foreach_mul(old, beta)
        torch._foreach_add_(momentum, grads, alpha=1 - beta)
        if group["nesterov"]:
            ahead = torch._foreach_mul(momentum, beta)
            torch._foreach_add_(ahead, grads, alpha=1 - beta)
        else:
            ahead = momentum
        return momentum, muon_directions(ahead, group["ns_precision"])

    def _sgd_part(self, group: dict[str, Any], params: list[Tensor], lr: float) -> None:
        momentum, decay = group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        if decay != 0:
            grads = torch._foreach_add(grads, params, alpha=decay)
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buffers.append(state["momentum_buffer"])
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        steps = torch._foreach_add(grads, buffers, alpha=momentum) if group["nesterov"] else buffers
        torch._foreach_add_(params, steps, alpha=-lr)


def _buffers_like_params(optimizer: torch.optim.Optimizer) -> None:
    """After a load: each buffer in its parameter's memory layout, as a fresh run creates it."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == p.shape and value.stride() != p.stride():
                state[key] = torch.empty_like(p).copy_(value)


def musgd_param_groups(model: nn.Module, lr: float, momentum: float, weight_decay: float, *,
                       boosted: Sequence[str] = CLASS_BRANCHES, boost: float = 3.0,
                       nesterov: bool = True) -> list[dict[str, Any]]:
    """``model``'s trainable parameters in MuSGD groups, as YOLO26's trainer groups them.

    - "muon": every 2-d or 4-d tensor (linear and conv weights): Muon + SGD, decayed.
    - "weights": other weights outside normalization layers: SGD, decayed.
    - "norm": weights of normalization layers (``torch.nn`` classes named ``*Norm*``): SGD, no decay.
    - "bias": biases: SGD, no decay.

    Each group is split in two: the parameters under a ``boosted`` name prefix (by default
    the head's class branches, ``head.cls`` and YOLO26's ``head.one2one_cls``) at
    ``lr * boost``, the rest at ``lr``. Groups come in the order muon, weights, norm, bias,
    then the boosted ones; empty groups are left out. Each has ``name`` and ``lr_scale`` (1 or
    ``boost``) for a schedule that sets learning rates (``train.optim.LRSchedule``).
    Parameters with ``requires_grad=False`` are left out (Ultralytics' trainer lists them
    but never steps them: they get no gradient). A model wrapped by DDP, DataParallel or
    ``torch.compile`` is unwrapped first, so that the names are the model's own.
    """
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    sets: dict[tuple[str, bool], list[Tensor]] = {(k, up): [] for up in (False, True)
                                                  for k in ("muon", "weights", "norm", "bias")}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{module_name}.{name}" if module_name else name
            kind = ("muon" if p.ndim in (2, 4) else "bias" if name == "bias"
                    else "norm" if isinstance(module, _NORMS) else "weights")
            up = any(full.startswith(prefix + ".") for prefix in boosted)
            sets[kind, up].append(p)
    groups = []
    for (kind, up), params in sets.items():
        if params:
            groups.append({"params": params, "name": kind, "lr": lr * boost if up else lr,
                           "lr_scale": boost if up else 1.0, "momentum": momentum, "nesterov": nesterov,
                           "weight_decay": 0.0 if kind in ("norm", "bias") else weight_decay,
                           "use_muon": kind == "muon"})
    return groups
