import numpy as np
import pytest
import torch

from yolokit.ops.nms import Detections, non_max_suppression


def make_preds(boxes, scores):
    return torch.cat((torch.tensor(boxes, dtype=torch.float32), torch.tensor(scores, dtype=torch.float32)), 1)[None]


def test_suppresses_overlaps_within_class_only():
    boxes = [[0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10], [50, 50, 60, 60]]
    scores = [[0.9, 0.0], [0.8, 0.0], [0.0, 0.7], [0.6, 0.0]]
    (det,) = non_max_suppression(make_preds(boxes, scores), conf=0.25, iou=0.5)
    assert det.scores.tolist() == pytest.approx([0.9, 0.7, 0.6])
    assert det.labels.tolist() == [0, 1, 0]
    (agn,) = non_max_suppression(make_preds(boxes, scores), conf=0.25, iou=0.5, agnostic=True)
    assert agn.scores.tolist() == pytest.approx([0.9, 0.6])


def test_conf_classes_and_max_det():
    boxes = [[i * 20, 0, i * 20 + 10, 10] for i in range(5)]
    scores = [[0.1 * (i + 1), 0.0] if i % 2 == 0 else [0.0, 0.1 * (i + 1)] for i in range(5)]
    (det,) = non_max_suppression(make_preds(boxes, scores), conf=0.25, iou=0.5)
    assert det.scores.tolist() == pytest.approx([0.5, 0.4, 0.3])  # 0.1 and 0.2 fall below conf
    (only1,) = non_max_suppression(make_preds(boxes, scores), conf=0.0, iou=0.5, classes=[1])
    assert only1.labels.tolist() == [1, 1]
    (top2,) = non_max_suppression(make_preds(boxes, scores), conf=0.0, iou=0.5, max_det=2)
    assert top2.scores.tolist() == pytest.approx([0.5, 0.4])


def test_multi_label_keeps_both_classes_of_one_point():
    (det,) = non_max_suppression(make_preds([[0, 0, 10, 10]], [[0.9, 0.8]]), conf=0.5, multi_label=True)
    assert sorted(det.labels.tolist()) == [0, 1]
    (single,) = non_max_suppression(make_preds([[0, 0, 10, 10]], [[0.9, 0.8]]), conf=0.5)
    assert single.labels.tolist() == [0]


def test_matches_reference_greedy_nms_on_random_input():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(200, 2, generator=g) * 100
    boxes = torch.cat((xy, xy + torch.rand(200, 2, generator=g) * 30 + 1), 1)
    scores = torch.rand(200, 3, generator=g)
    (det,) = non_max_suppression(torch.cat((boxes, scores), 1)[None], conf=0.3, iou=0.45, max_det=1000)
    best, label = scores.max(1)
    keep = best > 0.3
    b, s, lab = boxes[keep], best[keep], label[keep]
    order = s.argsort(descending=True)
    kept = []
    for i in order.tolist():  # plain greedy NMS per class
        if all(lab[j] != lab[i] or _iou(b[i], b[j]) <= 0.45 for j in kept):
            kept.append(i)
    assert det.scores.tolist() == pytest.approx(s[kept].tolist())
    assert torch.equal(det.labels, lab[kept])


def _iou(a, b):
    lt, rb = torch.maximum(a[:2], b[:2]), torch.minimum(a[2:], b[2:])
    inter = (rb - lt).clamp(min=0).prod()
    return inter / ((a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod() - inter)


def test_empty_and_batched_inputs():
    preds = torch.zeros(3, 10, 6)
    out = non_max_suppression(preds, conf=0.25)
    assert len(out) == 3 and all(len(d) == 0 and d.boxes.shape == (0, 4) for d in out)
    with pytest.raises(ValueError, match="Tensor\\[B, P, 4 \\+ C\\]"):
        non_max_suppression(torch.zeros(10, 6))


def test_detections_numpy_and_repr():
    det = Detections(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([0.5]), torch.tensor([2]))
    arr = det.numpy()
    assert isinstance(arr.boxes, np.ndarray) and arr.boxes.dtype == np.float32 and arr.labels.dtype == np.int64
    assert arr.boxes.tolist() == [[1, 2, 3, 4]] and len(arr) == 1
    text = repr(det)
    assert "n=1" in text and "label=2" in text and "score=0.500" in text


@pytest.mark.parametrize("iou", [0.3, 0.7])
def test_many_candidates_keep_what_one_full_nms_keeps(iou):
    """With far more candidates than max_det, NMS over the best ones (grown as needed) keeps
    exactly the best max_det boxes of one NMS over all candidates."""
    from torchvision.ops import batched_nms

    g = torch.Generator().manual_seed(1)
    n = 3000
    xy = torch.rand(n, 2, generator=g) * 600
    boxes = torch.cat((xy, xy + torch.rand(n, 2, generator=g) * 120 + 2), 1)
    scores = torch.rand(n, 4, generator=g)
    for max_det in (10, 300, 5000):
        (det,) = non_max_suppression(torch.cat((boxes, scores), 1)[None], conf=0.01, iou=iou, max_det=max_det)
        best, label = scores.max(1)
        full = batched_nms(boxes.double(), best.double(), label, iou)[:max_det]
        assert det.scores.tolist() == pytest.approx(best[full].tolist())
        assert torch.equal(det.labels, label[full]) and torch.equal(det.boxes, boxes[full])


def test_multi_label_matches_a_reference_loop_over_point_class_pairs():
    g = torch.Generator().manual_seed(1)
    xy = torch.rand(150, 2, generator=g) * 100
    boxes = torch.cat((xy, xy + torch.rand(150, 2, generator=g) * 30 + 1), 1)
    scores = torch.rand(150, 3, generator=g)
    (det,) = non_max_suppression(torch.cat((boxes, scores), 1)[None], conf=0.4, iou=0.5, multi_label=True,
                                 max_det=1000)
    point, label = (scores > 0.4).nonzero(as_tuple=True)  # every (point, class) above conf is a candidate
    b, s, lab = boxes[point], scores[point, label], label
    kept = []
    for i in s.argsort(descending=True).tolist():  # plain greedy NMS per class
        if all(lab[j] != lab[i] or _iou(b[i], b[j]) <= 0.5 for j in kept):
            kept.append(i)
    assert det.scores.tolist() == pytest.approx(s[kept].tolist())
    assert torch.equal(det.labels, lab[kept])
    assert len(det) > len(non_max_suppression(torch.cat((boxes, scores), 1)[None], conf=0.4, iou=0.5)[0])


def _greedy_rows(preds, conf, iou, max_det):
    """The reference for ``detection_rows``: per image and per class, a plain Python greedy NMS."""
    from torchvision.ops import box_iou

    rows = []
    for i, p in enumerate(preds):
        scores, labels = p[:, 4:].max(1)
        for c in labels.unique().tolist():
            idx = torch.nonzero((labels == c) & (scores > conf)).flatten()
            idx = idx[scores[idx].argsort(descending=True)]
            kept = []
            for j in idx.tolist():
                if all(box_iou(p[j:j + 1, :4], p[k:k + 1, :4]).item() <= iou for k in kept):
                    kept.append(j)
            rows += [[i, *p[j, :4].tolist(), scores[j].item(), c] for j in kept[:max_det]]
    return torch.tensor(rows).reshape(-1, 7)


def _by_image_class_score(rows):
    for column, descending in ((5, True), (6, False), (0, False)):      # stable sorts: the last is the first key
        rows = rows[torch.sort(rows[:, column], descending=descending, stable=True).indices]
    return rows


def test_detection_rows_is_greedy_nms_per_image_and_class_capped_per_group():
    from yolokit.ops.nms import detection_rows

    g = torch.Generator().manual_seed(3)
    xy = torch.rand(3, 200, 2, generator=g) * 80                    # clustered boxes: much to suppress
    wh = 10 + torch.rand(3, 200, 2, generator=g) * 30
    scores = torch.rand(3, 200, 4, generator=g) ** 3
    preds = torch.cat((xy, xy + wh, scores), -1)
    preds[2, :, 4:] *= 0.01                                           # an image with nothing above conf
    for max_det in (2, 300):
        got, want = detection_rows(preds, conf=0.2, iou=0.5, max_det=max_det), _greedy_rows(preds, 0.2, 0.5, max_det)
        got, want = _by_image_class_score(got), _by_image_class_score(want)
        assert got.shape == want.shape and len(want) >= (16 if max_det == 2 else 40)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        groups = torch.unique(got[:, [0, 6]], dim=0, return_counts=True)[1]
        assert int(groups.max()) <= max_det and not (got[:, 0] == 2).any()
    assert detection_rows(preds[2:], conf=0.2, iou=0.5, max_det=10).shape == (0, 7)


@pytest.mark.parametrize("kept", [0, 1, 5])
def test_detection_rows_under_torch_export_keeps_any_number_of_boxes(kept):
    """torch.export of ``detection_rows`` (a dynamic batch and number of points) gives the eager rows whether
    it keeps none, one or several boxes, and boxes below zero (as a decode gives at an image's edge) too."""
    from yolokit.ops.nms import detection_rows

    class Rows(torch.nn.Module):
        def forward(self, predictions):
            return detection_rows(predictions, conf=0.5, iou=0.5, max_det=10)

    g = torch.Generator().manual_seed(kept)
    example = torch.rand(2, 40, 7, generator=g)
    dims = {0: torch.export.Dim("batch", min=1, max=64), 1: torch.export.Dim("points", min=1, max=4096)}
    exported = torch.export.export(Rows(), (example,), dynamic_shapes={"predictions": dims}).module()
    preds = torch.rand(3, 60, 7, generator=g) * 0.4                 # no score above 0.5
    preds[..., :2] -= 20                                              # corners beyond the image
    preds[..., 2:4] += 10
    preds[1, :kept, 4] = 0.9                                          # `kept` boxes of one class, apart
    preds[1, :kept, :4] = torch.arange(kept)[:, None] * 30.0 + torch.tensor([-20.0, -20.0, 5.0, 5.0])
    want = Rows()(preds)
    assert want.shape == (kept, 7)
    torch.testing.assert_close(exported(preds), want, rtol=0, atol=0)
