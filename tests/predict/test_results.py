"""Result: labels, COCO records, JSON, crops and drawing of one image's detections."""

import json
import sys
import types

import cv2
import numpy as np
import pytest
import torch

from yolokit.predict import Result
from yolokit.viz import class_colour


def make_result(image=None):
    image = torch.zeros(3, 100, 200, dtype=torch.uint8) if image is None else image
    image[:, 10:50, 20:60] = 255  # a white square where the first box is
    return Result(boxes=torch.tensor([[20.0, 10.0, 60.0, 50.0], [100.5, 20.25, 199.9, 99.5]]),
                  scores=torch.tensor([0.9, 0.4]), labels=torch.tensor([1, 0]), names=["cat", "dog"],
                  path="in/x.jpg", name="x.jpg", orig_shape=(100, 200), image=image)


def test_yolo_label_lines_are_normalized_centre_size():
    lines = make_result().txt_lines()
    assert lines[0] == "1 0.200000 0.300000 0.200000 0.400000"
    cls, *values = lines[1].split()
    assert cls == "0" and [float(v) for v in values] == pytest.approx([0.751, 0.59875, 0.497, 0.7925], abs=1e-6)
    assert make_result().txt_lines(save_conf=True)[0].endswith(" 0.9")


def test_coco_records_and_json():
    coco = make_result().coco(image_id=42)
    assert coco[0] == {"image_id": 42, "category_id": 1, "bbox": [20.0, 10.0, 40.0, 40.0], "score": 0.9}
    assert coco[1]["bbox"] == pytest.approx([100.5, 20.25, 99.4, 79.25], abs=1e-3)
    records = json.loads(make_result().to_json())
    assert records[0] == {"name": "dog", "class": 1, "confidence": 0.9,
                          "box": {"x1": 20.0, "y1": 10.0, "x2": 60.0, "y2": 50.0}}
    assert records[1]["name"] == "cat" and records[1]["confidence"] == pytest.approx(0.4)
    mapped = make_result().coco(image_id=205, category_ids=[3, 7])  # a COCO json's ids of classes 0 and 1
    assert [(r["image_id"], r["category_id"]) for r in mapped] == [(205, 7), (205, 3)]


def test_a_result_without_pixels_saves_but_does_not_draw():
    result = make_result()
    result.image = None   # validation's results
    assert len(result.txt_lines()) == 2 and len(result.coco(1)) == 2
    with pytest.raises(ValueError, match="holds no image"):
        result.plot()
    with pytest.raises(ValueError, match="holds no image"):
        result.crops()


def test_crops_cut_the_boxes_out_of_the_original():
    crops = make_result().crops()
    assert [c for c, _ in crops] == [1, 0]
    assert crops[0][1].shape == (40, 40, 3) and (crops[0][1] == 255).all()
    assert crops[1][1].shape == (80, 100, 3)  # floor/ceil outwards, clipped to the image


def test_plot_draws_on_a_copy_in_class_colours():
    result = make_result()
    drawn = result.plot()
    assert drawn.shape == (100, 200, 3) and drawn.dtype == np.uint8
    assert (np.abs(drawn.astype(int) - class_colour(1)).sum(-1) < 10).sum() > 100  # the "dog" box outline
    assert int(result.image.sum()) == 255 * 3 * 40 * 40  # the source image is left as it was
    floats = make_result(torch.zeros(3, 100, 200)).orig_img
    assert floats.dtype == np.uint8 and floats.max() == 255  # float [0, 1] images come back as uint8


def test_summary_and_repr():
    result = make_result()
    assert len(result) == 2 and result.summary() == "1 dog, 1 cat"
    assert repr(result) == "Result(path='in/x.jpg', 200x100, 2 detections: 1 dog, 1 cat)"  # width x height
    empty = Result(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long), [], "v.mp4", "v.mp4",
                   (4, 6), torch.zeros(3, 4, 6, dtype=torch.uint8), frame=3)
    assert empty.summary() == "no detections" and repr(empty) == "Result(path='v.mp4', frame=3, 6x4, no detections)"
    assert empty.txt_lines() == [] and empty.crops() == [] and empty.to_json() == "[]"


def test_repr_stays_one_short_line_with_80_classes():
    names = [f"a long class name {k}" for k in range(80)]
    labels = torch.cat([torch.arange(80), torch.zeros(5, dtype=torch.long)])        # class 0 six times
    result = Result(torch.zeros(85, 4), torch.full((85,), 0.5), labels, names, "images/x.jpg", "x.jpg", (480, 640),
                    torch.zeros(3, 480, 640, dtype=torch.uint8))
    text = repr(result)
    assert len(text) < 300 and "\n" not in text and str(result) == text
    assert text.startswith("Result(path='images/x.jpg', 640x480, 85 detections: 6 a long class name 0, 1 a long")
    assert text.endswith(", +75 classes)")        # five classes named, the count of the others
    assert result.summary().count(",") == 79      # summary() alone lists them all


def test_repr_png_is_the_drawn_image():
    result = make_result()
    png = result._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    decoded = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)[..., ::-1]
    np.testing.assert_array_equal(decoded, result.plot())          # lossless, RGB as plot() returns it
    result.image = None
    assert result._repr_png_() is None           # a notebook shows the repr line instead


def test_show_outside_ipython_draws_the_plot_with_matplotlib(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.delitem(sys.modules, "IPython", raising=False)       # a plain Python session
    result = make_result()
    assert result.show() is None                                      # Agg: plt.show() returns at once
    try:
        images = plt.gca().get_images()
        assert len(images) == 1
        np.testing.assert_array_equal(images[0].get_array(), result.plot())
        assert plt.gca().get_title() == "in/x.jpg"
    finally:
        plt.close("all")


def test_show_in_ipython_displays_the_result(monkeypatch):
    shown = []
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    monkeypatch.setitem(sys.modules, "IPython.display", types.SimpleNamespace(display=shown.append))
    result = make_result()
    assert result.show() is None and shown == [result]       # IPython then asks it for _repr_png_


def make_seg_result():
    """Two detections with masks: a 40 x 30 rectangle and a disc of radius 15, on a 100 x 200 image."""
    result = make_result()
    masks = torch.zeros(2, 100, 200, dtype=torch.bool)
    masks[0, 15:45, 20:60] = True
    ys, xs = torch.meshgrid(torch.arange(100.0), torch.arange(200.0), indexing="ij")
    masks[1] = (xs - 150) ** 2 + (ys - 60) ** 2 <= 15**2
    result.masks = masks
    return result


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")   # pycocotools' decode, NumPy 2
def test_masks_give_polygon_rows_coco_rles_and_filled_drawings():
    mask_utils = pytest.importorskip("pycocotools.mask")
    result = make_seg_result()
    rect, disc = result.polygons()
    assert rect.tolist() == [[20, 15], [20, 44], [59, 44], [59, 15]]       # the rectangle's corners
    assert len(disc) > 8 and np.abs(np.hypot(disc[:, 0] - 150, disc[:, 1] - 60) - 15).max() < 1.5
    cls, *values = result.txt_lines(save_conf=True)[0].split()
    assert cls == "1" and values[-1] == "0.9" and [float(v) for v in values[:-1]] == pytest.approx(
        [0.1, 0.15, 0.1, 0.44, 0.295, 0.44, 0.295, 0.15])
    for row, mask in zip(result.coco(image_id=3), result.masks.numpy(), strict=True):
        rle = {**row["segmentation"], "counts": row["segmentation"]["counts"].encode()}
        assert row["segmentation"]["size"] == [100, 200] and np.array_equal(mask_utils.decode(rle), mask)
    drawn = result.plot()
    plain = make_result().plot()
    assert (drawn[30, 40] != plain[30, 40]).all() and (drawn[65, 150] != plain[65, 150]).any()   # tinted
    assert (drawn[5, 5] == plain[5, 5]).all() and (drawn[90, 30] == plain[90, 30]).all()   # elsewhere as before
    with pytest.raises(ValueError, match="has no masks"):
        make_result().polygons()


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")   # pycocotools' decode, NumPy 2
def test_a_result_of_mask_crops_writes_and_draws_what_its_whole_masks_give_without_making_them():
    """``predict``'s results hold each mask inside its box (``MaskCrops``): outlines (a crop filled to its edges
    included), label rows, COCO RLEs and the drawing equal those of the whole masks, and ``masks`` makes the
    whole masks only when read."""
    pytest.importorskip("pycocotools")
    from yolokit.ops.masks import MaskCrops

    whole = make_seg_result()
    windows = torch.tensor([[20, 15, 60, 45], [130, 40, 172, 82]])      # the rectangle's own bounds; the disc's box
    crops = [whole.masks[k, y1:y2, x1:x2].clone() for k, (x1, y1, x2, y2) in enumerate(windows.tolist())]
    result = make_result()
    result.masks = MaskCrops(windows, crops)
    assert [p.tolist() for p in result.polygons()] == [p.tolist() for p in whole.polygons()]
    assert result.txt_lines(save_conf=True) == whole.txt_lines(save_conf=True)
    assert result.coco(image_id=3) == whole.coco(image_id=3)
    assert np.array_equal(result.plot(), whole.plot())
    assert isinstance(result.__dict__["_masks"], MaskCrops)               # none of the above made whole masks
    assert torch.equal(result.masks, whole.masks) and isinstance(result.__dict__["_masks"], torch.Tensor)
    result.masks = MaskCrops(torch.tensor([[190, 90, 210, 100]]), [torch.ones(10, 20, dtype=torch.bool)])
    with pytest.raises(ValueError, match=r"mask window \[190, 90, 210, 100\] lies outside the 100x200 image"):
        result.plot()
