"""accel.graphs: a step recorded once per key and replayed, checked on the CPU through the make_fx stand-in
(tests/_graph_tape.py), whose replays freeze Python numbers and tensors as a CUDA graph's do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._graph_tape import TapeBackend
from yolokit.accel import MuSGD, Precision, musgd_param_groups
from yolokit.accel.graphs import GraphCaptureError, StepGraphs, bucket


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


class Run:
    """A model, its optimizer and precision, stepped the way the trainer's graph step does."""

    def __init__(self, optimizer: str = "sgd", precision: str = "fp32", replace_state: bool = False,
                 device: str = "cpu"):
        self.model = _net().to(device)
        if optimizer == "musgd":
            self.opt = MuSGD(musgd_param_groups(self.model, 0.01, 0.9, 5e-4), lr=0.01, momentum=0.9,
                             ns_precision="float32")
        elif optimizer == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01, fused=True)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                                       weight_decay=5e-4, fused=True)
        self.precision = Precision(precision, device)
        self.replace_state = replace_state
        self.lr = 0.01          # a Python number the step reads (the wrong way to pass a changing one)
        self.calls = torch.zeros((), dtype=torch.long, device=device)

    def step(self, variant, images, target):
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        with self.precision.autocast():
            loss = (self.model(images).float() - target).square().mean()
        self.precision.backward(loss * images.shape[0])
        self.precision.unscale_(self.opt)
        norm = self.precision.clip_grad_norm_(self.opt, 10.0)
        self.precision.step(self.opt, norm, blocking=False)
        with torch.no_grad():
            if self.replace_state:
                self.calls = self.calls + 1      # replaced, not updated: a replay starts from the old tensor
            else:
                self.calls += 1
        return {"loss": loss.detach()}

    def state(self) -> list[torch.Tensor]:
        return [*self.model.state_dict().values(), *(t for s in self.opt.state.values() for t in s.values()
                                                     if isinstance(t, torch.Tensor)), self.calls]


def _batches(n: int, size: int = 4, px: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, px, px, generator=g), torch.randn(size, 2, generator=g)) for _ in range(n)]


def _set_lr(run: Run, lr: float) -> None:
    run.lr = lr
    for group in run.opt.param_groups:
        group["lr"] = lr


def _both(make, batches, lrs, *, key_lr: bool = True, warmup: int = 2):
    """The same steps eagerly and through StepGraphs on the tape; returns both runs and the graphs."""
    eager, graphed = make(), make()
    tape = TapeBackend(watch=[graphed.model, graphed.opt, graphed.precision, graphed])
    graphs = StepGraphs(graphed.step, "cpu", backend=tape, warmup=warmup)
    eager_out, graph_out = [], []
    for (x, y), lr in zip(batches, lrs, strict=True):
        _set_lr(eager, lr)
        _set_lr(graphed, lr)
        eager_out.append(eager.step((), x, y)["loss"])
        graph_out.append(graphs({"images": x, "target": y}, variant=(lr,) if key_lr else ())["loss"])
    return eager, graphed, graphs, tape, eager_out, graph_out


def _equal(a: Run, b: Run) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))


def test_bucket_is_the_next_power_of_two_from_eight():
    assert [bucket(n) for n in (0, 1, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]
    assert bucket(3, smallest=1) == 4


@pytest.mark.parametrize(("optimizer", "precision"), [("sgd", "fp32"), ("adamw", "fp32"), ("sgd", "fp16"),
                                                       ("adamw", "bf16"), ("musgd", "fp32"), ("musgd", "bf16")])
def test_replays_equal_eager_steps_bit_for_bit_and_a_new_learning_rate_is_a_new_graph(optimizer, precision):
    batches = _batches(9)
    lrs = [0.01] * 5 + [0.005] * 4           # a new epoch's rate after step 5
    eager, graphed, graphs, tape, eo, go = _both(lambda: Run(optimizer, precision), batches, lrs)
    assert _equal(eager, graphed)
    assert all(torch.equal(a, b) for a, b in zip(eo, go, strict=True))
    # per rate: 2 eager steps, a recording (which runs the step on the tape), then replays
    assert (graphs.stats.eager, graphs.stats.recorded, graphs.stats.replays) == (4, 2, 3)
    assert tape.kept == []                      # nothing the step keeps was made while recording
    assert int(graphed.calls) == 9
    if precision == "fp16":                     # the loss scale and its growth tracker followed the replays
        assert torch.equal(eager.precision.scaler._scale, graphed.precision.scaler._scale)
        assert torch.equal(eager.precision.scaler._growth_tracker, graphed.precision.scaler._growth_tracker)
        assert int(graphed.precision.scaler._growth_tracker) >= 3   # the replays stepped and counted


def test_the_stand_in_catches_a_python_number_left_out_of_the_key():
    batches = _batches(7)
    lrs = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07]   # changes every step, as in the warmup
    eager, graphed, graphs, *_ = _both(Run, batches, lrs, key_lr=False)
    assert graphs.stats.replays == 4
    assert not _equal(eager, graphed)           # the replays kept the rate recorded at step 3
    eager, graphed, graphs, *_ = _both(Run, batches, lrs, key_lr=True)
    assert graphs.stats.recorded == 0 and _equal(eager, graphed)   # in the key: never repeats, runs eagerly


def test_the_stand_in_catches_state_replaced_instead_of_updated():
    batches = _batches(6)
    eager, graphed, graphs, tape, *_ = _both(lambda: Run(replace_state=True), batches, [0.01] * 6)
    assert graphs.stats.replays == 3
    assert tape.kept == ["Run.calls[0]"]
    assert int(graphed.calls) != int(eager.calls) == 6


def test_shapes_are_part_of_the_key_and_the_oldest_graphs_are_dropped():
    run = Run()
    graphs = StepGraphs(run.step, "cpu", backend=TapeBackend(), warmup=1, max_graphs=2)
    for px in (8, 8, 12, 12, 16, 16, 8, 8):
        x, y = _batches(1, px=px)[0]
        graphs({"images": x, "target": y})
    # 8, 12, 16: one eager run and a recording each; 8 again after being dropped: recorded again
    assert (graphs.stats.recorded, graphs.stats.dropped, graphs.graphs) == (4, 2, 2)
    # one input buffer per name and shape, shared by the graphs that take it, dropped with the last of them:
    # the images at 16 and 8 px, and the targets (one shape for all)
    assert sorted(k[1] for k in graphs._buffers) == [(4, 2), (4, 3, 8, 8), (4, 3, 16, 16)]


def test_graphs_of_the_same_input_shape_share_its_buffer():
    """Two variants (two learning rates) at one shape: two graphs reading one images buffer, each replay
    copying its own batch in first, each equal to the eager steps."""
    batches = _batches(10)
    lrs = [0.01, 0.02] * 5                       # alternate: both graphs replayed in turns
    eager, graphed, graphs, *_ = _both(Run, batches, lrs, warmup=1)
    assert graphs.graphs == 2 and len(graphs._buffers) == 2 and graphs.stats.replays == 6
    assert _equal(eager, graphed)


def test_no_backend_on_the_cpu_and_a_failed_recording_says_so():
    with pytest.raises(ValueError, match="need a CUDA device"):
        StepGraphs(Run().step, "cpu")

    class Refuses(TapeBackend):
        def record(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    run = Run()
    graphs = StepGraphs(run.step, "cpu", backend=Refuses(), warmup=1)
    x, y = _batches(1)[0]
    graphs({"images": x, "target": y})
    with pytest.raises(GraphCaptureError, match="not permitted when stream is capturing"):
        graphs({"images": x, "target": y})


def test_replayed_outputs_are_the_callers_own():
    run = Run()
    graphs = StepGraphs(run.step, "cpu", backend=TapeBackend(), warmup=1)
    batches = _batches(4)
    outs = [graphs({"images": x, "target": y})["loss"] for x, y in batches]
    kept = [o.clone() for o in outs]
    x, y = batches[0]
    graphs({"images": x, "target": y})
    assert all(torch.equal(a, b) for a, b in zip(outs, kept, strict=True))
    assert len({float(o) for o in outs}) == 4



@pytest.mark.gpu
@pytest.mark.parametrize(("optimizer", "precision"), [("sgd", "fp16"), ("adamw", "bf16"), ("sgd", "fp32"),
                                                       ("musgd", "bf16")])
def test_on_cuda_recorded_steps_train_as_the_eager_ones(optimizer, precision):
    """torch.cuda.CUDAGraph through StepGraphs: fused SGD with the fp16 scaler, fused AdamW (made
    capturable while recorded by Precision.step), MuSGD, a new learning rate recorded anew; the replays' weights
    follow the eager run's (cuDNN's backward need not be deterministic: within 1e-5 of each tensor's norm)."""
    batches = [(x.cuda(), y.cuda()) for x, y in _batches(9)]
    lrs = [0.01] * 5 + [0.005] * 4
    eager, graphed = Run(optimizer, precision, device="cuda"), Run(optimizer, precision, device="cuda")
    graphs = StepGraphs(graphed.step, "cuda")
    for (x, y), lr in zip(batches, lrs, strict=True):
        _set_lr(eager, lr)
        _set_lr(graphed, lr)
        eager.step((), x, y)
        graphs({"images": x, "target": y}, variant=(lr,))
    torch.cuda.synchronize()
    assert (graphs.stats.recorded, graphs.stats.replays) == (2, 2 + 3)   # on CUDA a recording does not run the step
    for a, b in zip(eager.state(), graphed.state(), strict=True):
        if a.dtype.is_floating_point:
            assert torch.isfinite(b).all() and (a - b).float().norm() <= 1e-5 * a.float().norm() + 1e-6
        else:
            assert torch.equal(a, b)
