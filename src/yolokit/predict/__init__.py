"""Prediction on files, folders, globs, lists, videos, cameras and streams, with constant memory.

Examples:
    >>> import yolokit
    >>> from yolokit.predict import predict, predict_iter
    >>> model = yolokit.load("runs/train/weights/model.pt").fuse()
    >>> for result in predict_iter(model, "path/to/images", batch=16):   # one Result per image
    ...     print(result.path, result.summary())
    >>> results = predict(model, "clip.mp4", out="runs/predict", save_txt=True)  # annotated video + labels
"""

from yolokit.predict.predictor import batches, predict, predict_iter
from yolokit.predict.results import Result
from yolokit.predict.saving import ResultWriter, next_run_dir
from yolokit.predict.sources import Frame, frames

__all__ = ["Frame", "Result", "ResultWriter", "batches", "frames", "next_run_dir", "predict", "predict_iter"]
