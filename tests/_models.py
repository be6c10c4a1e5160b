"""Small networks for tests whose subject is a path of the trainer, not an architecture."""

from pathlib import Path

# tests/fixtures/tiny.yaml: three levels (strides 8, 16, 32), a C2f block, SPPF and the YOLOv8 Detect head,
# 4 to 32 channels. A step traces, compiles and records in a fraction of yolov8n's time; the architectures
# themselves are checked parameter for parameter in tests/models.
TINY = str(Path(__file__).resolve().parent / "fixtures" / "tiny.yaml")
