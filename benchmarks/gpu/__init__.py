"""The sections of ``python benchmarks/gpu.py --all``: the GPU pass's measurements, one module each.

- ``common``: settings, result rows with their targets, the section clock, the training step.
- ``precision``: mixed precision against fp32, channels_last on against off.
- ``memory``: activation checkpointing, the batch finder, surviving an OOM mid-run.
- ``feeding``: GPU utilisation while the real data loader feeds training; loader images/s per core.
- ``augment``: the augmentation on the device (``augment_on="device"``): the batched pass, the decode alone.
- ``epoch``: the trainer itself on a COCO-sized synthetic set: images/s, data%, GPU busy.
- ``flops``: model FLOPs utilisation, and the step time against the reference (Ultralytics).
- ``suite``: the ``gpu``-marked tests of the checkout, run as a subprocess.
- ``parity_runs``: ``benchmarks/parity.py``'s seeds on both trainers at yolov8s 640 (issue 61), run by run.
"""
