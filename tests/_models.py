"""Small networks for tests whose subject is a path of the trainer, not an architecture."""

from pathlib import Path

import torch

# tests/fixtures/tiny.yaml: three levels (strides 8, 16, 32), a C2f block, SPPF and the YOLOv8 Detect head,
# 4 to 32 channels. A step traces, compiles and records in a fraction of yolov8n's time; the architectures
# themselves are checked parameter for parameter in tests/models.
TINY = str(Path(__file__).resolve().parent / "fixtures" / "tiny.yaml")
TINY_SEG = str(Path(__file__).resolve().parent / "fixtures" / "tiny-seg.yaml")   # the same, with a Segment head


def lively(model):
    """``model`` with its convolutions drawn at Kaiming's scale (the DFL's fixed bins kept): activations of
    order 1, so that scores and boxes vary from point to point."""
    torch.manual_seed(0)
    with torch.no_grad():
        for conv in model.modules():
            if isinstance(conv, torch.nn.Conv2d) and conv.weight.requires_grad:
                torch.nn.init.kaiming_normal_(conv.weight)
        if not hasattr(model.head, "branches"):    # YOLOv3's anchor head: its own bias, the maps at order 1
            model.head.reset_bias()
            return model.eval()
        for box, cls in (pair for boxes, classes in model.head.branches() for pair in zip(boxes, classes, strict=True)):
            box[-1].bias.fill_(3.0)          # each side about 3 strides from its point
            cls[-1].weight.mul_(10 / max(cls[-1].weight.std().item(), 1e-6) / cls[-1].weight.shape[1] ** 0.5)
            cls[-1].bias.fill_(-1.0)
    return model.eval()
