"""Loss parts summed on the device during an epoch, read only every few batches."""

from __future__ import annotations

import torch

from yolokit.accel import distributed


class LossMeter:
    """Sums each loader batch's loss parts on the device; the host reads them rarely.

    A batch's parts are the image-weighted mean of its micro-batches' parts. Batches with
    a non-finite part are left out of the sums and counted as a run of bad batches; the
    longest such run is kept on the device too.

    :meth:`mark` (after each optimizer step) keeps a device copy of the sums;
    :meth:`state_dict` returns that copy, so a checkpoint written at a step boundary, or
    after an interrupted step was dropped, holds exactly the batches of the completed
    steps, and a resumed epoch's means equal the uninterrupted epoch's.

    Args:
        device: Where the sums live.
        every: :meth:`due` is true every ``every`` batches (when the trainer reads). Default: 16 on
            an accelerator (a read waits for the device), every batch on the CPU (a read is free).
        world_size: Processes whose sums :meth:`epoch_means` combines; default: the process group's.
    """

    def __init__(self, device: torch.device, every: int | None = None, *, world_size: int | None = None) -> None:
        self.device = torch.device(device)
        self.world_size = world_size if world_size is not None else distributed.world_size()
        self.every = every if every is not None else (1 if self.device.type == "cpu" else 16)
        self.keys: list[str] = []
        self._sums: torch.Tensor | None = None       # [P] sums of finite batches' parts
        self._counts = torch.zeros(3, device=device)  # finite batches, current bad run, longest bad run
        self._read: list[float] = []
        self._marked: tuple[torch.Tensor, torch.Tensor] | None = None   # (sums, counts) at the last mark
        self._taken: list[float] | None = None        # sums and finite count at the last take_recent()

    def mark(self) -> None:
        """Remember the sums as they are now (device copies, nothing read)."""
        if self._sums is not None:
            self._marked = (self._sums.clone(), self._counts.clone())

    def state_dict(self) -> dict:
        """The sums at the last :meth:`mark`, on the CPU (reads the device)."""
        if self._marked is None:
            return {"keys": [], "sums": torch.zeros(0), "counts": torch.zeros(3)}
        return {"keys": list(self.keys), "sums": self._marked[0].cpu(), "counts": self._marked[1].cpu()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from the sums of :meth:`state_dict`."""
        self.keys = list(state["keys"])
        if self.keys:
            self._sums = state["sums"].to(self.device, copy=True)
            self._counts = state["counts"].to(self.device, copy=True)
            self._taken = torch.cat([state["sums"], state["counts"][:1]]).tolist()
            self.mark()

    def add(self, outputs: list[tuple[dict[str, torch.Tensor], int]]) -> None:
        """One loader batch: ``(parts, images)`` per micro-batch, as the trainer's function returns them."""
        if not self.keys:
            self.keys = list(outputs[0][0])
            self._sums = torch.zeros(len(self.keys), device=self.device)
        images = sum(n for _, n in outputs)
        parts = sum(torch.stack([p[k].float() for k in self.keys]) * (n / images) for p, n in outputs)
        finite = torch.isfinite(parts).all()
        self._sums += torch.where(finite, parts, 0.0)
        bad_run = (self._counts[1] + 1) * (~finite)
        self._counts = torch.stack([self._counts[0] + finite, bad_run, torch.maximum(self._counts[2], bad_run)])

    def due(self, index: int) -> bool:
        """Whether batch ``index`` (0-based) is one after which the trainer reads the meter."""
        return (index + 1) % self.every == 0

    def _refresh(self) -> None:
        if self._sums is not None:
            self._read = torch.cat([self._sums, self._counts]).tolist()   # one read of the device

    def running(self) -> dict[str, float]:
        """Mean parts over the finite batches so far, as of the last read (no device read here)."""
        if not self._read:
            return {}
        n = max(self._read[len(self.keys)], 1.0)
        return {k: v / n for k, v in zip(self.keys, self._read, strict=False)}

    def take_recent(self) -> dict[str, float]:
        """Mean parts over the finite batches since the previous call (or the epoch's start, or the
        resumed position), as of the last read; no device read here. Empty when there were none."""
        if not self._read:
            return {}
        now = self._read[:len(self.keys) + 1]
        before, self._taken = self._taken or [0.0] * len(now), now
        n = now[-1] - before[-1]
        return {k: (a - b) / n for k, a, b in zip(self.keys, now, before, strict=False)} if n > 0 else {}

    def longest_nonfinite_run(self) -> int:
        """Longest run of consecutive batches with a non-finite loss this epoch (reads the device)."""
        self._refresh()
        return int(self._read[-1]) if self._read else 0

    def epoch_means(self) -> dict[str, float]:
        """Mean parts over the finite batches of every process (a collective: call it on every rank,
        also on one that had no batch this epoch)."""
        keys = self.keys
        if self.world_size > 1:
            keys = next((k for k in distributed.all_gather_object(self.keys) if k), [])
        if not keys:
            return {}
        sums = self._sums if self._sums is not None else torch.zeros(len(keys), device=self.device)
        totals = distributed.all_reduce_mean(torch.cat([sums, self._counts[:1]]))
        n = max(float(totals[-1]), 1e-12)
        return {k: float(v) / n for k, v in zip(keys, totals[:-1], strict=True)}
