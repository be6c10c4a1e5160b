"""Tests of losses/yolo26.py against Ultralytics' own numbers (fixtures/yolo26-loss.pt).

The fixture holds Ultralytics 8.4's ``E2ELoss`` (the criterion of ``yolo26n.yaml``) on seeded
maps of both branches: each branch's loss vector and assignment, the trainer's loss and its
gradients, a batch without boxes, a DFL head, the weight schedule and a few CIoU values;
``fixtures/make_yolo26_loss.py`` writes it (run by hand where ultralytics is installed). Nothing
here imports ultralytics.

Scale: Ultralytics' loss (the trainer's ``loss.sum()``) is the batch size times ours; the tests
compare ``total * B`` with it. Tolerances are relative (1e-5): for a gradient map, to its
largest entry (its small entries are differences of nearly equal float32 terms).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from yolokit.losses import TaskAlignedAssigner, YOLO26Loss
from yolokit.losses.yolo26 import YOLO26BranchLoss, branch_weights, ciou_unclamped

FIXTURE = Path(__file__).with_name("fixtures") / "yolo26-loss.pt"
BRANCHES = ("one2many", "one2one")
RTOL = 1e-5
THEIR_ITEMS = {"box_loss": "box", "cls_loss": "cls", "l1_loss": "l1", "dfl_loss": "dfl"}


@pytest.fixture(scope="module")
def ref() -> dict:
    return torch.load(FIXTURE, weights_only=True)


def _loss(ref: dict, reg_max: int = 1, **kwargs) -> YOLO26Loss:
    loss = YOLO26Loss(ref["num_classes"], ref["strides"], reg_max=reg_max, **ref["gains"], **kwargs)
    loss.set_epoch(ref["epoch"], ref["epochs"])
    return loss


def _maps(case: dict, requires_grad: bool = False) -> dict[str, list[torch.Tensor]]:
    return {k: [m.clone().requires_grad_(requires_grad) for m in case["maps"][k]] for k in BRANCHES}


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max().clamp(min=1e-30)).item()


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=RTOL, atol=0.0, msg=lambda m: f"{what}: {m}")


def _per_point(assigned, batch: int, per_image: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(foreground, GT index within the image, weight), each Tensor[B, P], from padded rows."""
    foreground = assigned.point_row < batch * per_image
    gt_index = torch.where(foreground, assigned.point_row - torch.arange(batch)[:, None] * per_image, 0)
    return foreground, gt_index, assigned.point_weights


def _gt_per_image(targets: torch.Tensor, batch: int) -> int:
    return int(torch.bincount(targets[:, 0].long(), minlength=batch).max()) if len(targets) else 0


# ----------------------------------------------------------------------------- the fixture


def test_the_fixture_is_ultralytics_yolo26(ref):
    assert ref["ultralytics"].startswith("8.4")
    assert ref["strides"] == (8, 16, 32) and ref["image_size"] == 64
    loss = YOLO26Loss(3, (8, 16, 32))
    assert ref["gains"] == {"box": 7.5, "cls": 0.5, "dfl": 1.5}            # their default.yaml
    assert loss.gains == {"box": 7.5, "cls": 0.5, "l1": 1.5}   # our defaults are theirs (the L1 term: the dfl gain)
    assert (loss.one2many.assigner.topk, loss.one2many.assigner.topk2) == (10, None)
    assert (loss.one2one.assigner.topk, loss.one2one.assigner.topk2) == (7, 1)
    assert loss.one2many.assigner.min_gt_side == loss.one2one.assigner.min_gt_side == 16.0
    assert ref["main"]["item_names"] == ["box_loss", "cls_loss", "l1_loss"]


# ----------------------------------------------------------------------------- the loss's numbers


def test_each_branch_equals_the_reference(ref):
    """Box (CIoU), cls (BCE) and L1 of each branch, gains applied, per batch."""
    case, loss = ref["main"], _loss(ref)
    losses = loss.branch_losses(_maps(case), ref["targets"])
    for branch in BRANCHES:
        total, parts = losses[branch]
        assert list(parts) == ["box", "cls", "l1"]
        theirs = case["branches"][branch]["loss"]
        assert (theirs > 0).all()
        for name, value in zip(parts, theirs, strict=True):
            _close(parts[name], value, f"{branch} {name}")
        _close(total, theirs.sum(), f"{branch} total")


def test_total_and_parts_equal_the_reference(ref):
    """total * B is the trainer's loss; the parts are what Ultralytics reports (the one-to-one branch's)."""
    case, loss = ref["main"], _loss(ref)
    assert loss.epoch_weights == case["weights"]
    total, parts = loss(_maps(case), ref["targets"])
    assert total.dtype == torch.float32 and total.ndim == 0
    _close(total * 3, case["total"], "total")
    assert list(parts) == [THEIR_ITEMS[k] for k in case["item_names"]]
    for name, value in zip(parts, case["items"], strict=True):
        _close(parts[name], value, name)
        assert parts[name].dtype == torch.float32 and not parts[name].requires_grad
    losses = loss.branch_losses(_maps(case), ref["targets"])
    o2m, o2o = case["weights"]
    _close(total, losses["one2many"][0] * o2m + losses["one2one"][0] * o2o, "weighted sum")


def test_their_total_is_the_batch_size_times_ours(ref):
    """Ours is normalized per batch; theirs is multiplied by the batch size (3 and 2 images here)."""
    for case, targets in ((ref["main"], ref["targets"]), (ref["empty"], torch.zeros(0, 6))):
        total, _ = _loss(ref)(_maps(case), targets)
        batch = case["maps"]["one2many"][0].shape[0]
        assert (case["total"] / total).item() == pytest.approx(batch, rel=1e-6)


def test_gradients_equal_the_reference(ref):
    case, loss = ref["main"], _loss(ref)
    maps = _maps(case, requires_grad=True)
    total, _ = loss(maps, ref["targets"])
    flat = [m for k in BRANCHES for m in maps[k]]
    grads = torch.autograd.grad(total * 3, flat)
    theirs = [g for k in BRANCHES for g in case["grads"][k]]
    for level, (ours, want) in enumerate(zip(grads, theirs, strict=True)):
        assert torch.equal(ours == 0, want == 0), level       # the same points train the box channels
        assert _rel(ours, want) < RTOL, (level, _rel(ours, want))


def test_no_box_in_the_batch(ref):
    case, loss = ref["empty"], _loss(ref)
    for max_boxes in (None, 0):
        maps = _maps(case, requires_grad=True)
        total, parts = loss(maps, torch.zeros(0, 6), max_boxes=max_boxes)
        assert parts["box"] == 0 and parts["l1"] == 0 and parts["cls"] > 0
        _close(total * 2, case["total"], "total")
        _close(torch.stack(list(parts.values())), case["items"], "parts")
        grads = torch.autograd.grad(total * 2, [m for k in BRANCHES for m in maps[k]])
        theirs = [g for k in BRANCHES for g in case["grads"][k]]
        for ours, want in zip(grads, theirs, strict=True):
            assert ours[:, :4].abs().sum() == 0 and _rel(ours, want) < RTOL


def test_a_dfl_head_equals_the_reference(ref):
    """reg_max 16: the DFL term in place of L1 (same assigner, same weights)."""
    case, loss = ref["dfl"], _loss(ref, reg_max=16)
    assert case["item_names"] == ["box_loss", "cls_loss", "dfl_loss"]
    losses = loss.branch_losses(_maps(case), case["targets"])
    for branch in BRANCHES:
        total, parts = losses[branch]
        assert list(parts) == ["box", "cls", "dfl"]
        _close(torch.stack(list(parts.values())), case["branches"][branch]["loss"], branch)
    total, parts = loss(_maps(case), case["targets"])
    _close(total * 2, case["total"], "total")
    _close(torch.stack(list(parts.values())), case["items"], "parts")


def test_padded_targets_give_the_same_loss_and_gradients(ref):
    case, loss = ref["main"], _loss(ref)
    maps = _maps(case, requires_grad=True)
    flat = [m for k in BRANCHES for m in maps[k]]
    want_total, want_parts = loss(maps, ref["targets"])
    want_grads = torch.autograd.grad(want_total, flat)
    g = _gt_per_image(ref["targets"], 3)
    for max_boxes in (g, g + 3):
        total, parts = loss(maps, ref["targets"], max_boxes=max_boxes)
        torch.testing.assert_close(total, want_total, rtol=1e-6, atol=0)
        for k in parts:
            torch.testing.assert_close(parts[k], want_parts[k], rtol=1e-6, atol=0)
        for ours, want in zip(torch.autograd.grad(total, flat), want_grads, strict=True):
            assert _rel(ours, want) < 1e-6


def test_the_loss_does_not_depend_on_the_order_of_the_images_rows(ref):
    """Rows as they come (any order across images, the order within each image kept) or sorted."""
    case, loss = ref["main"], _loss(ref)
    targets = ref["targets"]
    order = torch.sort(-targets[:, 0], stable=True).indices     # image 2's rows first
    total, parts = loss(_maps(case), targets)
    shuffled, shuffled_parts = loss(_maps(case), targets[order])
    torch.testing.assert_close(shuffled, total, rtol=1e-6, atol=0)
    for k in parts:
        torch.testing.assert_close(shuffled_parts[k], parts[k], rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- the assignment


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("case_name", ["main", "dfl"])
def test_the_assignment_equals_the_reference(ref, branch, case_name):
    """Foreground, GT index and target score per point. Ultralytics may also mark points of weight 0
    foreground (its top-k's tie among t = 0, see TaskAlignedAssigner): only those may differ."""
    case = ref[case_name]
    targets = case.get("targets", ref["targets"])
    loss = _loss(ref, reg_max=16 if case_name == "dfl" else 1)
    batch = case["maps"][branch][0].shape[0]
    g = _gt_per_image(targets, batch)
    fg, gt_index, weight = _per_point(getattr(loss, branch).assignment(case["maps"][branch], targets, max_boxes=g),
                                      batch, g)
    theirs = case["branches"][branch]
    assert (weight[fg] > 0).all()
    assert torch.equal(fg, theirs["foreground"] & (theirs["weight"] > 0))
    assert (theirs["weight"][theirs["foreground"] & ~fg] == 0).all()
    assert (theirs["foreground"] & ~fg).sum() <= 1                  # this fixture: one such point at most
    assert torch.equal(gt_index[fg], theirs["gt_index"][fg])
    assert _rel(weight, theirs["weight"]) < RTOL
    if branch == "one2one":                                          # one point per GT at most
        rows = gt_index[fg] + torch.arange(batch)[:, None].expand_as(fg)[fg] * 100
        assert len(rows.unique()) == len(rows)
    assert fg.sum() >= (20 if branch == "one2many" else 4)


def test_small_boxes_are_widened_as_the_reference_widens_them(ref):
    """Without the widening the assignment is not Ultralytics': the tiny GTs of the fixture matter."""
    case = ref["main"]
    targets = ref["targets"]
    g = _gt_per_image(targets, 3)
    plain = YOLO26BranchLoss(3, (8, 16, 32), topk=10, min_gt_side=0.0)
    fg, gt_index, _ = _per_point(plain.assignment(case["maps"]["one2many"], targets, max_boxes=g), 3, g)
    theirs = case["branches"]["one2many"]
    assert not torch.equal(fg, theirs["foreground"] & (theirs["weight"] > 0))
    tiny = 1   # image 0's second box, 4.75 x 5.5 px: no point of the grid inside it, 4 inside its 16 px square
    fg_widened, index_widened, _ = _per_point(
        _loss(ref).one2many.assignment(case["maps"]["one2many"], targets, max_boxes=g), 3, g)
    assert not (fg[0] & (gt_index[0] == tiny)).any()
    assert (fg_widened[0] & (index_widened[0] == tiny)).any()
    assert (theirs["foreground"][0] & (theirs["gt_index"][0] == tiny)).any()


def test_a_contested_point_goes_to_the_best_gt_holding_it(ref):
    """Ultralytics gives a point two GTs kept to the GT of highest CIoU among all that hold it, even one
    that did not keep it (contested="any"); among the keepers only ("kept", YOLOv8Loss's rule) the
    fixture's image 0 differs at a point of its large overlapping boxes."""
    case, targets = ref["main"], ref["targets"]
    g = _gt_per_image(targets, 3)
    branch = _loss(ref).one2many
    branch.assigner.contested = "kept"
    fg, gt_index, weight = _per_point(branch.assignment(case["maps"]["one2many"], targets, max_boxes=g), 3, g)
    theirs = case["branches"]["one2many"]
    differs = fg & theirs["foreground"] & (gt_index != theirs["gt_index"])
    assert differs.sum() >= 1 and not differs[1:].any()
    assert (weight[differs] > 0).all() and (theirs["weight"][differs] > 0).all()


@pytest.mark.parametrize("chunk_pairs", [84, 200, 10**9])
@pytest.mark.parametrize("padded", [False, True])
def test_the_assignment_does_not_depend_on_chunks(ref, chunk_pairs, padded):
    """Each point's best GT over all GTs is folded chunk by chunk (one row, a few rows, all). The
    decisions are equal; the weights to rounding (CPU kernels may round a chunk's last lanes apart)."""
    case, targets = ref["main"], ref["targets"]
    g = _gt_per_image(targets, 3) if padded else None
    whole = _loss(ref).one2many
    whole.assigner.chunk_pairs = 10**9
    want = whole.assignment(case["maps"]["one2many"], targets, max_boxes=g)
    part = _loss(ref).one2many
    part.assigner.chunk_pairs = chunk_pairs
    got = part.assignment(case["maps"]["one2many"], targets, max_boxes=g)
    for name in want._fields:
        if getattr(want, name).is_floating_point():
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=0)
        else:
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_topk2_and_widening_keep_the_default_assigner_as_it_was():
    """The new options are off by default; topk2 with contested="kept" keeps each GT's best positive."""
    from _dense_assignment import point_targets  # tests/ is on sys.path (tests/conftest.py)

    tal = TaskAlignedAssigner()
    assert (tal.topk2, tal.min_gt_side, tal.contested) == (None, 0.0, "kept")
    gen = torch.Generator().manual_seed(3)
    points = torch.cartesian_prod(torch.arange(8) * 8 + 4.0, torch.arange(8) * 8 + 4.0).flip(-1)
    pred = torch.cat([points - 10, points + 10], 1)[None].repeat(2, 1, 1) + torch.rand(2, 64, 4, generator=gen) * 6
    logits = torch.randn(2, 64, 3, generator=gen)
    gts = torch.tensor([[[2.0, 3.0, 40.0, 30.0], [20.0, 20.0, 60.0, 50.0]], [[5.0, 5.0, 50.0, 60.0], [0.0] * 4]])
    labels, mask = torch.tensor([[0, 2], [1, 0]]), torch.tensor([[True, True], [True, False]])
    many = point_targets(TaskAlignedAssigner(topk=7), logits, pred, points, labels, gts, mask, logits=True)
    one = point_targets(TaskAlignedAssigner(topk=7, topk2=1), logits, pred, points, labels, gts, mask, logits=True)
    assert one.foreground.sum() == 3 and many.foreground.sum() > 3
    for b, g in ((0, 0), (0, 1), (1, 0)):
        theirs = many.foreground[b] & (many.gt_index[b] == g)
        mine = one.foreground[b] & (one.gt_index[b] == g)
        best = torch.where(theirs, many.weights[b], -1.0).argmax()
        assert mine.nonzero().flatten().tolist() == [best.item()]


# ----------------------------------------------------------------------------- the weights per epoch


@pytest.mark.parametrize("epochs", [1, 2, 10])
def test_the_weights_per_epoch_are_the_references(ref, epochs):
    """A fresh run's update() after each epoch, and a resume at each epoch (updates = start - 1, then
    update()): both give each epoch's steps branch_weights(epoch, epochs), to the last bit."""
    table = ref["schedule"][epochs]
    fresh = torch.tensor([branch_weights(e, epochs) for e in range(epochs)], dtype=torch.float64)
    assert torch.equal(fresh, table["fresh"])
    assert torch.equal(fresh[1:], table["resumed"][1:])   # a resume starts at epoch 1 or later
    assert fresh[0].tolist() == [0.8, 1 - 0.8]
    if epochs > 1:
        assert fresh[-1, 0].item() == pytest.approx(0.1) and fresh[-1, 1].item() == pytest.approx(0.9)
        assert (fresh[1:, 0] < fresh[:-1, 0]).all()
    loss = YOLO26Loss(3, (8, 16, 32))
    for e in range(epochs):
        assert loss.set_epoch(e, epochs) == tuple(table["fresh"][e].tolist()) == loss.epoch_weights


def test_the_weights_at_known_epochs():
    assert branch_weights(0, 10) == (0.8, 1 - 0.8)
    assert branch_weights(9, 10)[0] == pytest.approx(0.1) and branch_weights(30, 10)[0] == pytest.approx(0.1)
    assert branch_weights(3, 10)[0] == pytest.approx(0.8 - 3 / 9 * 0.7)
    assert YOLO26Loss(3, (8, 16, 32)).epoch_weights == (0.8, 1 - 0.8)   # before any set_epoch: epoch 0's


def test_set_epoch_reweights_the_branches(ref):
    case, loss = ref["main"], _loss(ref)
    losses = loss.branch_losses(_maps(case), ref["targets"])
    for epoch in (0, 5, 9):
        o2m, o2o = loss.set_epoch(epoch, 10)
        total, _ = loss(_maps(case), ref["targets"])
        torch.testing.assert_close(total, losses["one2many"][0] * o2m + losses["one2one"][0] * o2o, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- pieces, inputs, reads


@pytest.mark.parametrize("reg_max", [1, 16])
@pytest.mark.parametrize("boxes", ["inverted", "zero", "huge"])
def test_degenerate_predictions_give_finite_losses_and_gradients(ref, reg_max, boxes):
    """Raw distances may be anything: inverted boxes, points, boxes far larger than the image."""
    gen = torch.Generator().manual_seed(5)
    maps = {}
    for branch in BRANCHES:
        maps[branch] = []
        for s in (8, 16, 32):
            m = torch.randn(3, 4 * reg_max + 3, 64 // s, 64 // s, generator=gen)
            if reg_max == 1:
                m[:, :4] = {"inverted": -1.5 - m[:, :4].abs(), "zero": 0.0, "huge": 1e4}[boxes]
            else:
                m[:, :4 * reg_max] *= {"inverted": 1.0, "zero": 0.0, "huge": 30.0}[boxes]
            maps[branch].append(m.requires_grad_())
    total, parts = _loss(ref, reg_max=reg_max)(maps, ref["targets"])
    assert torch.isfinite(total) and all(torch.isfinite(p) for p in parts.values())
    grads = torch.autograd.grad(total, [m for k in BRANCHES for m in maps[k]])
    assert all(torch.isfinite(g).all() for g in grads)


def test_ciou_takes_inverted_boxes_as_the_reference_does(ref):
    """A head of raw distances can predict x2 < x1: the box term keeps the negative side (their bbox_iou)."""
    pairs = ref["ciou"]
    _close(ciou_unclamped(pairs["pred"], pairs["gt"]), pairs["ciou"], "ciou")


def test_maps_must_come_as_the_heads_dict(ref):
    loss = _loss(ref)
    maps = _maps(ref["main"])
    with pytest.raises(ValueError, match="one2many"):
        loss(maps["one2many"], ref["targets"])
    with pytest.raises(ValueError, match="one2many"):
        loss({"one2one": maps["one2one"]}, ref["targets"])
    with pytest.raises(ValueError, match="4 \\* reg_max"):
        loss({k: [m[:, 1:] for m in v] for k, v in maps.items()}, ref["targets"])


def test_half_precision_maps_give_a_float32_loss(ref):
    case, loss = ref["main"], _loss(ref)
    want, _ = loss(_maps(case), ref["targets"])
    maps = {k: [m.bfloat16() for m in v] for k, v in _maps(case).items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, parts = loss(maps, ref["targets"])
    assert total.dtype == torch.float32 and all(p.dtype == torch.float32 for p in parts.values())
    assert total.item() == pytest.approx(want.item(), rel=0.05)


@pytest.mark.parametrize("max_boxes", [None, 6])
def test_a_step_reads_nothing_back(ref, max_boxes):
    from _host_sync import count_host_syncs  # tests/ is put on sys.path by tests/conftest.py

    case, loss = ref["main"], _loss(ref)
    maps = _maps(case, requires_grad=True)
    with count_host_syncs() as syncs:
        total, parts = loss(maps, ref["targets"], max_boxes=max_boxes)
        total.backward()
    assert not syncs, syncs.details
    assert parts["box"] > 0
