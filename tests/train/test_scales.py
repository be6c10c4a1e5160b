"""Multi-scale sizes: drawn from (seed, epoch, step) only, multiples of the stride in [0.5, 1.5] x imgsz;
a resized batch keeps its boxes on its pixels."""

import pytest
import torch

from yolokit.train.scales import MultiScale, resize_batch, size_range, step_size


@pytest.mark.parametrize("imgsz,stride", [(64, 32), (96, 32), (640, 32), (320, 64)])
def test_sizes_are_strides_within_half_to_one_and_a_half_imgsz(imgsz, stride):
    lo, hi = size_range(imgsz, stride)
    sizes = [step_size(7, epoch, step, imgsz, stride) for epoch in range(4) for step in range(50)]
    assert all(s % stride == 0 and 0.5 * imgsz <= s <= 1.5 * imgsz and lo <= s <= hi for s in sizes)
    assert min(sizes) == lo and max(sizes) == hi            # both ends are drawn
    assert len(set(sizes)) == (hi - lo) // stride + 1        # and everything between


def test_size_range_ends():
    assert size_range(640, 32) == (320, 960) and size_range(64, 32) == (32, 96)
    assert size_range(32, 32) == (32, 32)                    # at least one stride
    assert size_range(96, 64) == (64, 128)                   # 1.5 x 96 = 144 rounds down to the stride


def test_a_step_size_depends_on_seed_epoch_and_step_only():
    draws = [step_size(3, e, k, 640, 32) for e in range(3) for k in range(20)]
    assert draws == [step_size(3, e, k, 640, 32) for e in range(3) for k in range(20)]   # any order, any process
    assert [step_size(3, 0, k, 640, 32) for k in reversed(range(20))] == draws[:20][::-1]
    assert len(set(draws)) > 5                                                           # steps differ
    assert draws != [step_size(4, e, k, 640, 32) for e in range(3) for k in range(20)]   # so do seeds
    assert draws[:20] != draws[20:40]                                                    # and epochs


def _painted(h, w, box):
    images = torch.zeros(2, 3, h, w)
    x1, y1, x2, y2 = box
    images[1, :, y1:y2, x1:x2] = 1.0
    targets = torch.tensor([[1.0, 2.0, x1, y1, x2, y2]])
    return images, targets


def _extent(image):
    ys, xs = torch.nonzero(image[0] > 0.5, as_tuple=True)
    return torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32)


@pytest.mark.parametrize("h,w,size,expected", [(64, 64, 96, (96, 96)), (64, 64, 32, (32, 32)),
                                               (96, 128, 160, (128, 160)), (128, 96, 64, (64, 64)),
                                               (64, 128, 192, (96, 192))])
def test_resized_batches_keep_their_boxes_on_the_pixels(h, w, size, expected):
    images, targets = _painted(h, w, (10, 14, 42, 40))
    out, rows = resize_batch(images, targets, size, 32)
    assert tuple(out.shape) == (2, 3, *expected)
    assert out.shape[-2] % 32 == 0 and out.shape[-1] % 32 == 0 and max(out.shape[-2:]) == size   # the long side
    assert torch.equal(rows[:, :2], targets[:, :2])
    torch.testing.assert_close(rows[0, 2:], _extent(out[1]), atol=1.0, rtol=0)    # the box is where the paint is
    gain = torch.tensor([expected[1] / w, expected[0] / h] * 2)
    torch.testing.assert_close(rows[0, 2:], targets[0, 2:] * gain)
    assert out[0].abs().max() == 0                                                 # the other image stays empty


def test_the_switch_off_passes_batches_through_and_probes_imgsz():
    images, targets = _painted(64, 64, (4, 4, 20, 20))
    off = MultiScale(64, 32, seed=0, enabled=False)
    assert off(images, targets, 0, 0) == (images, targets) and off.largest == 64 and off.size(3, 5) == 64
    on = MultiScale(64, 32, seed=0)
    assert on.largest == 96
    sizes = {on(images, targets, 1, k)[0].shape[-1] for k in range(20)}
    assert sizes == {32, 64, 96} and all(on.size(1, k) == step_size(0, 1, k, 64, 32) for k in range(20))
