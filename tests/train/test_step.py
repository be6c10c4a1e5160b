"""forward_backward: the one micro-batch step of the trainer, the batch finder and the benchmarks."""

import pytest
import torch
from torch import nn

from yolokit.accel.amp import Precision
from yolokit.train.step import forward_backward


class SeesLayout(nn.Module):
    """A 1x1 convolution that records whether its input came channels_last."""

    def __init__(self):
        super().__init__()
        self.conv, self.layouts = nn.Conv2d(3, 2, 1), []

    def forward(self, x):
        self.layouts.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return [self.conv(x)]


def criterion(maps, targets, max_boxes=None):
    loss = (maps[0] ** 2).mean() + targets.sum() * 0
    return loss, {"sq": loss.detach(), "max_boxes": torch.tensor(float(max_boxes))}


@pytest.mark.parametrize("channels_last", [False, True])
def test_backpropagates_the_weighted_loss_and_returns_it_unweighted(channels_last):
    torch.manual_seed(0)
    net, images, targets = SeesLayout(), torch.rand(4, 3, 5, 6), torch.zeros(2, 6)
    loss, parts = forward_backward(net, criterion, Precision("fp32", torch.device("cpu")), images, targets,
                                   max_boxes=7, weight=4.0, channels_last=channels_last)
    assert net.layouts == [channels_last] and not loss.requires_grad and float(parts["max_boxes"]) == 7
    reference = SeesLayout()
    reference.load_state_dict(net.state_dict())
    expected, _ = criterion(reference(images), targets, max_boxes=7)
    unweighted = torch.autograd.grad(expected, reference.conv.weight)[0]
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(net.conv.weight.grad, 4.0 * unweighted)  # the weight scales the gradient only
