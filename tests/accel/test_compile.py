"""torch.compile with activation checkpointing, channels_last and autocast: same training as eager.

Compiling is slow on 2 cores, so these use yolov8n at 64 px, batch 2, and the
``aot_eager`` backend (dynamo + AOTAutograd, eager kernels); one test runs inductor on a
small stack of the same blocks where a C++ compiler is present.
"""

import copy
import shutil

import pytest
import torch
import torch._dynamo as dynamo
from _models import TINY
from torch import nn
from torch._dynamo.testing import CompileCounter

import yolokit
from yolokit.accel.checkpointing import checkpointed_modules, enable_activation_checkpointing
from yolokit.accel.perf import prepare_model
from yolokit.losses.yolov8 import YOLOv8Loss
from yolokit.models.layers import SPPF, C2f, Conv

pytestmark = pytest.mark.slow

TARGETS = torch.tensor([[0, 0, 4, 4, 30, 40], [1, 1, 10, 10, 60, 50], [1, 0, 20, 5, 40, 25]], dtype=torch.float32)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _images(batch: int = 2, h: int = 64, w: int = 64) -> torch.Tensor:
    return torch.rand(batch, 3, h, w, generator=torch.Generator().manual_seed(batch * h + w))


def _yolov8n() -> nn.Module:
    torch.manual_seed(0)
    return yolokit.create_model("yolov8n", num_classes=2).train()


def _train(net: nn.Module, model: nn.Module, *, steps: int, dtype: torch.dtype | None,
           channels_last: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``steps`` SGD steps of ``net`` (model or its compiled wrapper) on one fixed batch.

    Returns:
        Losses per step, gradients of the first step by name, the final state dict.
    """
    criterion = YOLOv8Loss(model.head.num_classes, model.head.strides, reg_max=model.head.reg_max)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = _images()
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    losses, grads = [], {}
    for step in range(steps):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss, _ = criterion(net(images), TARGETS)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_near(actual: dict, expected: dict, rel: float) -> None:
    """Every tensor within ``rel`` of the largest magnitude of its expected value; integers equal."""
    assert actual.keys() == expected.keys()
    for k, b in expected.items():
        a = actual[k]
        if not b.dtype.is_floating_point:
            assert torch.equal(a, b), k
            continue
        scale = b.abs().max().item()
        err = (a.float() - b.float()).abs().max().item()
        assert err <= rel * scale + 1e-7, (k, err, scale)


def _count_graph_breaks(fn, *args) -> tuple[int, int]:
    dynamo.reset()
    explained = dynamo.explain(fn)(*args)
    return explained.graph_count, explained.graph_break_count


@pytest.mark.parametrize("name", ["yolov8n", pytest.param("yolov3-tiny", marks=pytest.mark.extended)])
def test_forward_is_one_graph_with_checkpointing_and_channels_last(name):
    torch.manual_seed(0)
    model = yolokit.create_model(name).train()
    enable_activation_checkpointing(model.checkpoint_units("all"))
    assert len(checkpointed_modules(model)) >= 2
    prepare_model(model, channels_last=True)
    x = _images().contiguous(memory_format=torch.channels_last)
    assert _count_graph_breaks(model, x) == (1, 0)
    model.eval()
    with torch.no_grad():  # inference: decode too (its grid cache is bypassed while compiling)
        assert _count_graph_breaks(lambda images: model.decode(model(images)), x) == (1, 0)


@pytest.mark.parametrize("dtype", [pytest.param(None, marks=pytest.mark.extended),   # 16 s; compiled training
                                   pytest.param(torch.bfloat16, marks=pytest.mark.extended),   # equals eager:
                                   pytest.param(torch.float16, marks=pytest.mark.extended)],   # test_step_syncs.py
                         ids=["fp32", "bf16", "fp16"])
def test_compiled_checkpointed_training_matches_eager(dtype):
    """Three SGD steps: losses, first gradients, BN running stats and weights as in eager.

    The reference is eager and not checkpointed, in the same layout (channels_last alone
    changes the third step's loss by 0.2% here: the loss of this tiny batch is chaotic).
    """
    model = _yolov8n()
    eager = prepare_model(copy.deepcopy(model), channels_last=True)
    enable_activation_checkpointing(model.checkpoint_units("all"))
    net = prepare_model(model, channels_last=True, compile=True, compile_backend="aot_eager")
    losses, grads, state = _train(net, model, steps=3, dtype=dtype, channels_last=True)
    ref_losses, ref_grads, ref_state = _train(eager, eager, steps=3, dtype=dtype, channels_last=True)
    # aot_eager runs eager's kernels on the traced graph: equal here bit for bit; the margin
    # is for reordering only (BN stats counted twice would be ~3% off, a lost gradient 100%)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    _assert_near(grads, ref_grads, 1e-5)
    _assert_near(state, ref_state, 1e-5)  # running stats updated once per step (not twice) in both
    assert int(model.backbone.stages[0][0].bn.num_batches_tracked) == 3
    assert len(ref_grads) == sum(p.requires_grad for p in model.parameters())  # every weight trained


def _saved_by_compiled_forward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the compiled forward graph hands to backward (outputs other than its inputs), as aot_eager partitions."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    seen = {}

    def forward_compiler(gm: torch.fx.GraphModule, _inputs):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        seen["bytes"] = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in outputs
                            if isinstance(n, torch.fx.Node) and n.op != "placeholder"
                            and isinstance(n.meta.get("val"), torch.Tensor))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)
    dynamo.reset()
    sum(o.sum() for o in torch.compile(model, backend=backend)(x)).backward()
    return seen["bytes"]


@pytest.mark.extended   # 25-50 s (two traces of yolov8n); compiled checkpointing runs by default in
# test_forward_is_one_graph_with_checkpointing_and_channels_last and test_checkpointing.py's compiled BN test
def test_compiled_checkpointing_still_saves_activation_memory():
    """Compiling keeps the recompute: the forward graph saves a fraction of what it saves without checkpointing."""
    x = _images(2, 128, 128)
    plain = _saved_by_compiled_forward(_yolov8n(), x)
    model = _yolov8n()
    enable_activation_checkpointing(model.checkpoint_units("all"))
    checkpointed = _saved_by_compiled_forward(model, x)
    assert checkpointed < 0.5 * plain, (checkpointed, plain)  # 0.36 here (eager at 256 px: 0.38)


@pytest.mark.extended   # a C++ build (35 s); the default run compiles the same checkpointed training with aot_eager
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_checkpointed_blocks_match_eager():
    """Inductor's generated kernels, with checkpointed C2f/SPPF blocks, train like eager."""
    torch.manual_seed(0)
    model = nn.Sequential(Conv(3, 16, 3, 2), C2f(16, 16, 1, shortcut=True), Conv(16, 32, 3, 2), SPPF(32, 32)).train()
    eager = copy.deepcopy(model)
    enable_activation_checkpointing(list(model)[1:], every=1)
    net = prepare_model(model, channels_last=True, compile=True)  # inductor
    x = _images(2, 32, 32).contiguous(memory_format=torch.channels_last)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, eager)]
    for step in range(2):
        outs = [net(x), eager(x)]
        for out in outs:
            (out.square().mean() + out.mean()).backward()
        if step == 0:
            _assert_near({n: p.grad for n, p in model.named_parameters()},
                         {n: p.grad for n, p in eager.named_parameters()}, 1e-3)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    _assert_near(model.state_dict(), eager.state_dict(), 1e-3)
    assert int(model[1].cv1.bn.num_batches_tracked) == 2  # checkpointed, compiled: counted once a step


def test_last_smaller_batch_compiles_once_more():
    """An epoch's last, smaller batch adds one graph (batch dim dynamic, or B=1 specialised); no more.
    (A property of the batch dimension, shown on the tiny network of tests/fixtures: yolov8n's forward is
    one graph above.)"""
    torch.manual_seed(0)
    model = yolokit.create_model(TINY, num_classes=2).train()
    counter = CompileCounter()
    net = torch.compile(model, backend=counter)
    for batch in (2, 2, 3, 2, 3, 2):  # two epochs of [2, 2, 3]-sized batches
        sum(o.sum() for o in net(_images(batch))).backward()
    assert counter.frame_count == 2
    for batch in (4, 5):  # the second graph has a dynamic batch dim: other sizes reuse it
        sum(o.sum() for o in net(_images(batch))).backward()
    assert counter.frame_count == 2


@pytest.mark.extended   # the trainer validates uncompiled; this bounds a user's compiled eval model
def test_rectangular_eval_batches_do_not_recompile_every_batch():
    """Compiled eval over rectangular shapes: H and W become dynamic after the first changes.

    The trainer validates with the plain (EMA) module anyway; this bounds the cost for
    anyone who compiles an eval model.
    """
    model = _yolov8n().eval()
    counter = CompileCounter()
    net = torch.compile(model, backend=counter)
    shapes = [(64, 64), (64, 96), (96, 64), (128, 96), (96, 128), (160, 64), (64, 192), (128, 128)]
    with torch.no_grad():
        for h, w in shapes:
            net(_images(2, h, w))
    assert counter.frame_count <= 3


def test_the_compiled_loss_traces_again_only_when_its_work_changes_shape():
    """Batches whose busiest image holds 2, 5, 3 and 4 boxes: the YOLOv8 loss is traced for the first batch,
    then once with the box count as a symbol, and reused. (Its chunk loop steps over whole images, at most
    the batch: a step that followed the box count made a graph per count, and past dynamo's recompile
    limit the loss ran eagerly.) The device's chunk size is a constant of the trace, read once."""
    criterion, counter = YOLOv8Loss(2, (8, 16, 32)), CompileCounter()
    compiled = torch.compile(criterion, backend=counter, dynamic=None)
    maps = [torch.randn(2, 64 + 2, s, s) for s in (8, 4, 2)]
    g = torch.Generator().manual_seed(0)
    for boxes in (2, 5, 3, 4):
        xy = torch.rand(boxes + 1, 2, generator=g) * 40
        targets = torch.cat([torch.tensor([0.0] * boxes + [1.0])[:, None], torch.zeros(boxes + 1, 1),
                             xy, xy + 8 + torch.rand(boxes + 1, 2, generator=g) * 16], 1)
        total, _ = compiled(maps, targets, max_boxes=boxes)
        eager, _ = criterion(maps, targets, max_boxes=boxes)
        assert torch.allclose(total, eager, rtol=1e-5)
    assert counter.frame_count == 2, counter.frame_count


def test_the_loss_marks_its_constant_as_torch_compiler_would():
    """The assigner marks ``pairs_per_chunk`` constant without importing dynamo at import time: the same
    mark as ``torch.compiler.assume_constant_result`` (a torch release that marks otherwise fails here)."""
    from yolokit.losses.assigners import TaskAlignedAssigner, _constant_to_compile

    def ours():
        return 1

    def theirs():
        return 1

    assert vars(_constant_to_compile(ours)) == vars(torch.compiler.assume_constant_result(theirs)) != {}
    assert TaskAlignedAssigner.pairs_per_chunk._dynamo_marked_constant is True
