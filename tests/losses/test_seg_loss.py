"""YOLOv8-seg's whole loss (box, mask, class, DFL and semantic terms) against the reference's, each part
and the gradients with respect to every input, with index maps and per-object masks
(fixtures/seg-full-loss.pt, written by fixtures/make_seg_full_loss.py with the reference)."""

from pathlib import Path

import pytest
import torch

from yolokit.losses import YOLOv8SegLoss, pad_targets
from yolokit.losses.masks import semantic_targets

REFERENCE = torch.load(Path(__file__).parent / "fixtures" / "seg-full-loss.pt", weights_only=True)
CASES = ["overlap", "per_instance", "overlap_semantic", "per_instance_semantic", "empty"]


def assert_relative(ours, theirs, what, rel=1e-4):
    ours, theirs = ours.detach(), theirs.detach()
    scale = float(theirs.abs().max())
    gap = float((ours - theirs).abs().max())
    assert gap <= rel * max(scale, 1e-12), f"{what}: differs by {gap:.3g}, {gap / max(scale, 1e-30):.2g} of its largest"


def loss_fn(overlap: bool) -> YOLOv8SegLoss:
    return YOLOv8SegLoss(REFERENCE["num_classes"], REFERENCE["strides"], reg_max=REFERENCE["reg_max"],
                         num_masks=REFERENCE["num_masks"], overlap=overlap, **REFERENCE["gains"])


def inputs(case: str) -> dict:
    x = REFERENCE["empty_inputs" if case == "empty" else "inputs"]
    out = {k: [t.clone().requires_grad_() for t in x[k]] for k in ("maps", "coefficients")}
    out["protos"] = x["protos"].clone().requires_grad_()
    if "semantic" in case or case == "empty":
        out["semantic"] = x["semantic"].clone().requires_grad_()
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded"])
@pytest.mark.parametrize("case", CASES)
def test_each_part_and_every_gradient_is_the_references(case, padded):
    ref = REFERENCE["cases"][case]
    objects = torch.zeros(0, 6) if case == "empty" else REFERENCE["objects"]
    out = inputs(case)
    max_boxes = 3 if padded else None                                  # 3: the busiest image's count
    total, parts = loss_fn(ref["overlap"])(out, objects, masks=ref["masks"], max_boxes=max_boxes)
    want = {k: v for k, v in ref["items"].items() if k != "sem" or "semantic" in out}
    assert list(parts) == [k for k in ("box", "seg", "cls", "dfl", "sem") if k in want]
    for k, v in want.items():
        assert_relative(parts[k], v, k)
    (total * ref["batch_size"]).backward()                             # the reference's loss is * batch size
    for name in ("maps", "coefficients"):
        for level, (ours, theirs) in enumerate(zip(out[name], ref["grads"][name], strict=True)):
            assert_relative(ours.grad, theirs, f"gradient of the {name} at level {level}")
    assert_relative(out["protos"].grad, ref["grads"]["protos"], "gradient of the prototypes")
    if "semantic" in out:
        assert_relative(out["semantic"].grad, ref["grads"]["semantic"], "gradient of the semantic maps")
    if case == "empty":
        assert float(parts["seg"]) == float(parts["sem"]) == 0.0 and float(out["protos"].grad.abs().max()) == 0.0


def test_the_references_widening_of_tiny_objects_is_min_gt_side_16_with_contested_any():
    """The fixture's reference (8.4) widens the 2 x 3 px object and the 40 x 2 px line to 16 px for its inside
    test, and still gives them no positive: their widened boxes' points align 0 with them. yolokit's assigner
    with the widening and ``contested="any"`` gives the reference's loss; with the widening alone it keeps those
    points as positives of weight 0, and the mask term trains them."""
    ref = REFERENCE["cases"]["overlap"]
    parts = {}
    for contested in ("any", "kept"):
        loss = YOLOv8SegLoss(REFERENCE["num_classes"], REFERENCE["strides"], reg_max=REFERENCE["reg_max"],
                             num_masks=REFERENCE["num_masks"], min_gt_side=16, contested=contested,
                             **REFERENCE["gains"])
        parts[contested] = loss(inputs("overlap"), REFERENCE["objects"], masks=ref["masks"])[1]
    for k, v in ref["items"].items():
        if k != "sem":
            assert_relative(parts["any"][k], v, k)
    assert abs(float(parts["kept"]["seg"]) - float(ref["items"]["seg"])) > 0.1 * float(ref["items"]["seg"])


def test_padded_targets_with_per_object_masks_in_slots_give_the_same_loss():
    ref = REFERENCE["cases"]["per_instance_semantic"]
    objects = REFERENCE["objects"]
    padded = pad_targets(objects, 3, max_boxes=4)                     # a slot more than the busiest image needs
    slots = torch.zeros(3, 4, *ref["masks"].shape[-2:])
    counts = [0, 0, 0]
    for row, image in enumerate(objects[:, 0].long().tolist()):
        slots[image, counts[image]] = ref["masks"][row]
        counts[image] += 1
    _, parts = loss_fn(False)(inputs("per_instance_semantic"), padded, masks=slots)
    for k, v in ref["items"].items():
        assert_relative(parts[k], v, k)


def test_semantic_targets_take_the_drawn_or_the_smallest_object():
    """An image with a large object of class 2 under a small one of class 0, another with one object of class 1:
    the index map and the per-object masks give the same per-class maps, the small object's class on top."""
    large, small, other = torch.zeros(6, 6), torch.zeros(6, 6), torch.zeros(6, 6)
    large[0:5, 0:5] = 1
    small[1:3, 1:3] = 1
    other[4:6, 2:6] = 1
    index = torch.zeros(2, 6, 6)
    index[0][large > 0], index[0][small > 0], index[1][other > 0] = 2, 1, 1       # row order: small, large
    image, labels = torch.tensor([0, 0, 1]), torch.tensor([0, 2, 1])
    a = semantic_targets(index, image, labels, 2, 3, overlap=True)
    b = semantic_targets(torch.stack([small, large, other]), image, labels, 2, 3, overlap=False)
    assert torch.equal(a, b) and a.shape == (2, 3, 6, 6)
    assert a[0, 0].sum() == 4 and a[0, 2].sum() == 25 - 4 and a[1, 1].sum() == 8 and a.sum() == 25 + 8


def test_the_seg_loss_names_what_it_takes():
    with pytest.raises(ValueError, match="a dict with 'maps', 'coefficients' and 'protos'"):
        loss_fn(True)([torch.zeros(1, 67, 8, 12)] * 3, torch.zeros(0, 6), masks=torch.zeros(1, 16, 24))
    out = inputs("overlap")
    with pytest.raises(ValueError, match=r"num_masks=4 channels: got \[\(3, 8, 8, 12\)"):
        YOLOv8SegLoss(3, (8, 16, 32), num_masks=4)(out, torch.zeros(0, 6), masks=torch.zeros(3, 16, 24))
    with pytest.raises(ValueError, match=r"one index map per image, Tensor\[3, H, W\]; got \(2, 16, 24\)"):
        loss_fn(True)(out, torch.zeros(0, 6), masks=torch.zeros(2, 16, 24))


YOLO26 = torch.load(Path(__file__).parent / "fixtures" / "yolo26-seg-loss.pt", weights_only=True)


def yolo26_inputs(case: str) -> dict:
    x = YOLO26["empty_inputs" if case == "empty" else "inputs"]
    out = {k: [t.clone().requires_grad_() for t in v] if isinstance(v, list) else v.clone().requires_grad_()
           for k, v in x.items()}
    out["coefficients"] = out.pop("one2many_coefficients")
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded"])
@pytest.mark.parametrize("case", ["overlap", "per_instance", "empty"])
def test_yolo26_seg_loss_is_the_references_branch_by_branch_with_its_mask_aware_assignment(case, padded):
    """Both branches' parts (the assignment scores each pair's predicted mask: per-object masks and index
    maps, where a smaller object cuts into a larger one's mask, assign differently), the weighted total and
    the gradients of every input, the one-to-one branch seeing the prototypes and semantic maps detached."""
    from yolokit.losses import YOLO26SegLoss

    ref = YOLO26["cases"][case]
    loss_fn = YOLO26SegLoss(YOLO26["num_classes"], YOLO26["strides"], num_masks=YOLO26["num_masks"],
                            overlap=ref["overlap"], **YOLO26["gains"])
    assert loss_fn.set_epoch(YOLO26["epoch"], YOLO26["epochs"]) == pytest.approx(ref["weights"], rel=1e-12)
    objects = torch.zeros(0, 6) if case == "empty" else YOLO26["objects"]
    out = yolo26_inputs(case)
    max_boxes = 3 if padded else None
    branches = loss_fn.branch_losses(out, objects, masks=ref["masks"], max_boxes=max_boxes)
    for name, (_, parts) in branches.items():
        want = ref["branches"][name]["items"]
        assert list(parts) == list(want), name
        for k, v in want.items():
            assert_relative(parts[k], v, f"{name} {k}")
    total, parts = loss_fn(out, objects, masks=ref["masks"], max_boxes=max_boxes)
    assert_relative(total * 3 if case != "empty" else total * 2, ref["total"], "total")
    for k, v in ref["items"].items():
        assert_relative(parts[k], v, f"reported {k}")
    (total * (2 if case == "empty" else 3)).backward()
    for name, theirs in ref["grads"].items():
        ours = out["coefficients" if name == "one2many_coefficients" else name]
        for i, (a, b) in enumerate(zip(ours if isinstance(ours, list) else [ours],
                                       theirs if isinstance(theirs, list) else [theirs], strict=True)):
            assert_relative(a.grad if a.grad is not None else torch.zeros_like(a), b, f"gradient of {name}[{i}]")
