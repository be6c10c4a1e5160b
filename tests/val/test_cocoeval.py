"""The array evaluator against pycocotools' COCOeval, bit for bit, on randomized hard cases."""

import contextlib
import io

import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections
from yolokit.val.cocoeval import evaluate_boxes
from yolokit.val.metrics import coco_evaluate


def random_case(seed: int, images: int = 12, classes: int = 4):
    """Boxes on a coarse grid (equal IoUs, duplicate boxes, areas of exactly 32^2 and 96^2),
    quantized scores (ties), empty images, absent classes, and one crowded (image, class)."""
    rng = np.random.default_rng(seed)
    gt, det = [], []
    image_ids = rng.permutation(np.arange(100, 100 + 3 * images, 3))  # not contiguous, not sorted
    for n, img in enumerate(image_ids):
        g = int(rng.integers(0, 7)) if n % 5 else 0
        xy = rng.integers(0, 20, (g, 2)) * 8.0
        wh = rng.choice([8.0, 16.0, 32.0, 40.0, 96.0, 120.0], (g, 2))
        boxes = np.concatenate([xy, xy + wh], 1)
        if g >= 2 and rng.random() < 0.5:
            boxes[1] = boxes[0]  # a duplicate ground truth box
        labels = rng.integers(0, classes - 1, g)  # the last class never has ground truth
        gt += [(img, b, c) for b, c in zip(boxes, labels, strict=True)]
        src = np.repeat(np.arange(g), rng.integers(0, 4, g))
        d_boxes = boxes[src] + rng.integers(-2, 3, (len(src), 4)) * 4.0
        d_labels = np.where(rng.random(len(src)) < 0.85, labels[src], rng.integers(0, classes, len(src)))
        n_fp = int(rng.integers(0, 8)) if n % 4 else 0
        fxy = rng.integers(0, 20, (n_fp, 2)) * 8.0
        d_boxes = np.concatenate([d_boxes, np.concatenate([fxy, fxy + rng.choice([16.0, 32.0, 64.0], (n_fp, 2))], 1)])
        d_labels = np.concatenate([d_labels, rng.integers(0, classes, n_fp)])
        if n == 1:  # more than 100 detections in one (image, class): the cut at 100
            extra = 130
            exy = rng.integers(0, 20, (extra, 2)) * 8.0
            d_boxes = np.concatenate([d_boxes, np.concatenate([exy, exy + 32.0], 1)])
            d_labels = np.concatenate([d_labels, np.zeros(extra, np.int64)])
        scores = rng.integers(1, 12, len(d_labels)) / 12.0  # many ties
        det += [(img, b, s, c) for b, s, c in zip(d_boxes, scores, d_labels, strict=True)]
    return image_ids, gt, det


def pycocotools_eval(image_ids, gt, det, classes):
    dataset = {"images": [{"id": int(i)} for i in image_ids],
               "categories": [{"id": c + 1} for c in range(classes)],
               "annotations": [{"id": n + 1, "image_id": int(img), "category_id": int(c) + 1, "iscrowd": 0,
                                "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])],
                                "area": float((b[2] - b[0]) * (b[3] - b[1]))} for n, (img, b, c) in enumerate(gt)]}
    results = [{"image_id": int(img), "category_id": int(c) + 1, "score": float(s),
                "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]} for img, b, s, c in det]
    return cocoeval(dataset, results, "bbox")


def cocoeval(dataset: dict, results: list[dict], iou_type: str):
    """pycocotools' evaluation of ``results`` against the ground truth ``dataset``, quietly."""
    COCO = pytest.importorskip("pycocotools.coco").COCO   # not on every machine (the GPU image)
    COCOeval = pytest.importorskip("pycocotools.cocoeval").COCOeval
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = dataset
        coco.createIndex()
        ev = COCOeval(coco, coco.loadRes(results), iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def ours(gt, det, classes):
    return evaluate_boxes(
        np.array([b for _, b, _ in gt]).reshape(-1, 4), np.array([c for _, _, c in gt], np.int64),
        np.array([i for i, _, _ in gt], np.int64),
        np.array([b for _, b, _, _ in det]).reshape(-1, 4), np.array([s for _, _, s, _ in det]),
        np.array([c for _, _, _, c in det], np.int64), np.array([i for i, _, _, _ in det], np.int64), classes)


@pytest.mark.parametrize("seed", range(12))
def test_equals_cocoeval_bit_for_bit(seed):
    image_ids, gt, det = random_case(seed)
    reference = pycocotools_eval(image_ids, gt, det, 4)
    result = ours(gt, det, 4)
    np.testing.assert_array_equal(result.stats, reference.stats)
    np.testing.assert_array_equal(result.precision, reference.eval["precision"][..., -1])
    np.testing.assert_array_equal(result.recall, reference.eval["recall"])
    assert (result.precision[..., 3, :] == -1).all()  # the class without ground truth
    assert result.stats[0] > 0


def test_detection_order_does_not_matter_beyond_ties():
    image_ids, gt, det = random_case(3)
    rng = np.random.default_rng(0)
    # distinct scores: any input order gives the same numbers
    det = [(img, b, s + 1e-6 * n, c) for n, (img, b, s, c) in enumerate(det)]
    shuffled = [det[i] for i in rng.permutation(len(det))]
    np.testing.assert_array_equal(ours(gt, det, 4).stats, ours(gt, shuffled, 4).stats)


def test_crowded_group_is_cut_at_100_detections():
    # one image, one class, one box; the true hit scores lowest among 150 detections
    gt = [(1, np.array([0.0, 0.0, 50.0, 50.0]), 0)]
    far = [(1, np.array([200.0, 200.0, 220.0, 220.0]), 0.9, 0) for _ in range(149)]
    hit = [(1, np.array([0.0, 0.0, 50.0, 50.0]), 0.1, 0)]
    assert ours(gt, far + hit, 1).stats[0] == 0.0  # cut away, as in pycocotools
    assert ours(gt, far[:99] + hit, 1).stats[0] == pytest.approx(0.01)  # kept as the 100th: precision 1/100


def test_rejects_bad_labels_and_lengths():
    box = np.array([[0.0, 0.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="gt_labels"):
        evaluate_boxes(box, np.array([2]), np.array([0]), box, np.array([1.0]), np.array([0]), np.array([0]), 2)
    with pytest.raises(ValueError, match="detections"):
        evaluate_boxes(box, np.array([0]), np.array([0]), box, np.array([1.0, 0.5]), np.array([0]), np.array([0]), 2)


@pytest.mark.parametrize("seed", range(3))
def test_coco_evaluate_backends_agree(seed):
    pytest.importorskip("pycocotools")
    image_ids, gt, det = random_case(seed + 20, images=8, classes=3)
    order = {int(i): n for n, i in enumerate(sorted(image_ids))}
    targets = [(np.zeros((0, 4)), np.zeros(0, np.int64)) for _ in image_ids]
    preds = [[] for _ in image_ids]
    for img, b, c in gt:
        boxes, labels = targets[order[int(img)]]
        targets[order[int(img)]] = (np.concatenate([boxes, b[None]]), np.append(labels, c))
    for img, b, s, c in det:
        preds[order[int(img)]].append((b, s, c))
    dets = [Detections(torch.tensor(np.array([p[0] for p in ps]).reshape(-1, 4), dtype=torch.float32),
                       torch.tensor([p[1] for p in ps], dtype=torch.float32),
                       torch.tensor([p[2] for p in ps], dtype=torch.long)) for ps in preds]
    shapes = [(300, 300)] * len(dets)
    a = coco_evaluate(dets, targets, shapes, 3)
    b = coco_evaluate(dets, targets, shapes, 3, backend="pycocotools")
    np.testing.assert_array_equal(a.stats, b.stats)
    np.testing.assert_array_equal(a.pr_precision, b.pr_precision)
    np.testing.assert_array_equal(a.per_class_ap, b.per_class_ap)
    assert (a.precision, a.recall) == (b.precision, b.recall)
    with pytest.raises(ValueError, match="backend"):
        coco_evaluate(dets, targets, shapes, 3, backend="fast")


def test_regular_box_wins_over_a_closer_ignored_one():
    # in the 'small' range the 34x34 box (area 1156 > 32^2) is ignored and the 30x30 one is not:
    # COCOeval matches the detection to the regular box although the ignored one overlaps more
    gt = [(1, np.array([0.0, 0.0, 30.0, 30.0]), 0), (1, np.array([0.0, 0.0, 34.0, 34.0]), 0),
          (2, np.array([0.0, 0.0, 20.0, 20.0]), 0)]
    det = [(1, np.array([0.0, 0.0, 33.0, 33.0]), 0.9, 0), (2, np.array([0.0, 0.0, 20.0, 21.0]), 0.8, 0)]
    reference = pycocotools_eval([1, 2], gt, det, 1)
    result = ours(gt, det, 1)
    np.testing.assert_array_equal(result.stats, reference.stats)
    np.testing.assert_array_equal(result.precision, reference.eval["precision"][..., -1])
    assert result.stats[3] == pytest.approx(reference.stats[3]) and 0 < result.stats[3] < 1


def test_equals_cocoeval_on_a_validation_like_set():
    from harness.inputs import evaluation_set

    data = evaluation_set(40, classes=3, max_det=300, seed=5)  # up to 300 ranked detections per image
    gt = [(i, b, c) for i, d in enumerate(data) for b, c in zip(d["gt_boxes"], d["gt_labels"], strict=True)]
    det = [(i, b, s, c) for i, d in enumerate(data)
           for b, s, c in zip(d["boxes"], d["scores"], d["labels"], strict=True)]
    reference = pycocotools_eval(range(len(data)), gt, det, 3)
    result = ours(gt, det, 3)
    np.testing.assert_array_equal(result.stats, reference.stats)
    np.testing.assert_array_equal(result.precision, reference.eval["precision"][..., -1])
    np.testing.assert_array_equal(result.recall, reference.eval["recall"])


def random_masks(boxes, rng, size=(200, 224)):
    """One mask per box on a 200 x 224 image: an ellipse or the box itself (pixel-exact), clipped to the
    image; some empty (a box off the image)."""
    h, w = size
    ys, xs = np.mgrid[:h, :w] + 0.5
    masks = np.zeros((len(boxes), h, w), bool)
    for m, (x1, y1, x2, y2) in zip(masks, boxes, strict=True):
        if rng.random() < 0.5:
            m[int(max(y1, 0)):int(max(y2, 0)), int(max(x1, 0)):int(max(x2, 0))] = True
        else:
            cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, max((x2 - x1) / 2, 1), max((y2 - y1) / 2, 1)
            m[((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1] = True
    return masks


@pytest.mark.parametrize("seed", [0, 1])
def test_mask_evaluation_equals_pycocotools_segm(seed):
    """The random sets' boxes drawn as masks (the detections' own shapes, not their ground truth's: IoUs of
    every size), scored by ``evaluate_masks`` and by ``COCOeval(..., "segm")`` on the masks' RLEs: the same
    12 numbers and the same precision array, to the last bit."""
    mask_utils = pytest.importorskip("pycocotools.mask")
    from yolokit.val.cocoeval import CroppedMasks, evaluate_masks

    rng = np.random.default_rng(100 + seed)
    image_ids, gt, det = random_case(seed, images=8)
    gt_masks = random_masks(np.array([b for _, b, _ in gt]).reshape(-1, 4), rng)
    det_masks = random_masks(np.array([b for _, b, _, _ in det]).reshape(-1, 4), rng)
    rle = lambda m: {**mask_utils.encode(np.asfortranarray(m)), "counts": mask_utils.encode(  # noqa: E731
        np.asfortranarray(m))["counts"].decode()}
    dataset = {"images": [{"id": int(i), "height": 200, "width": 224} for i in image_ids],
               "categories": [{"id": c + 1} for c in range(4)],
               "annotations": [{"id": n + 1, "image_id": int(img), "category_id": int(c) + 1, "iscrowd": 0,
                                "segmentation": rle(m), "area": float(m.sum()),
                                "bbox": list(mask_utils.toBbox(mask_utils.encode(np.asfortranarray(m))))}
                               for n, ((img, _, c), m) in enumerate(zip(gt, gt_masks, strict=True))]}
    results = [{"image_id": int(img), "category_id": int(c) + 1, "score": float(s), "segmentation": rle(m)}
               for (img, _, s, c), m in zip(det, det_masks, strict=True)]
    ev = cocoeval(dataset, results, "segm")
    ours = evaluate_masks(CroppedMasks.from_masks(gt_masks), [c for _, _, c in gt], [i for i, _, _ in gt],
                          CroppedMasks.from_masks(det_masks), [s for _, _, s, _ in det], [c for _, _, _, c in det],
                          [i for i, _, _, _ in det], 4)
    assert np.array_equal(ours.stats, ev.stats), (ours.stats, ev.stats)
    assert np.array_equal(ours.precision, ev.eval["precision"][..., -1])
    assert 0.01 < ours.stats[0] < 0.95 and (ours.stats[3:6] > -1).sum() >= 2   # numbers to compare, area ranges used


def test_cropped_masks_keep_their_pixels_and_pair_ious():
    masks = np.zeros((3, 6, 8), bool)
    masks[0, 1:4, 2:6] = True          # 12 px
    masks[1, 2:6, 4:8] = True          # 16 px, 4 shared with the first
    c = CroppedMasks_from(masks)
    assert c.bounds.tolist() == [[2, 1, 6, 4], [4, 2, 8, 6], [0, 0, 0, 0]] and c.area.tolist() == [12, 16, 0]
    iou = c.pair_iou(c, np.array([0, 0, 1, 2]), np.array([1, 0, 1, 2]))
    assert iou.tolist() == [4 / 24, 1.0, 1.0, 0.0]


def CroppedMasks_from(masks):
    from yolokit.val.cocoeval import CroppedMasks

    return CroppedMasks.from_masks(masks)
