"""The public face: what ``import yolokit`` offers, pinned, and reachable the way it says.

A name added to or removed from an ``__all__`` is a change of the public API: update the
list here in the same commit, on purpose.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import yolokit

PUBLIC = {
    "yolokit": """
        Detections Detector __version__ accel create_model data deploy export interop list_models load
        losses models ops predict save train tune val viz
    """,
    "deploy": """
        ExportError ExportedModel FORMATS TOLERANCES check_export export format_of load load_exported
    """,
    "accel": """
        Accumulator BatchNormSync DeviceMonitor GracefulStop Interrupted LaunchError MuSGD Precision
        RankExchange StepGraphs TrainingDiverged Watchdog accumulation_steps all_reduce_gradients configure
        disable_activation_checkpointing distributed enable_activation_checkpointing find_batch_size
        is_oom_error launch musgd_param_groups predict_batch_size prepare_model resolve_precision
        retry_step run_batch split_batch
    """,
    "data": """
        Albumentations AspectRatioBatchSampler AugmentConfig DatasetError DetectionDataset
        DetectionLoader ImageError RectBatchSampler SHAPE_NAMES ShardedBatchSampler VideoFrame
        apply_hsv_lut apply_hsv_lut_batch augment_hsv build_dataloader collate flip_lr flip_ud
        hsv_lut image_tensor letterbox make_shapes mixup mosaic4 random_affine random_flip
        read_image read_video scale_boxes to_device transform_boxes verify_image
        CredentialsError ShardSummary StoreError shard_index write_shards write_split
    """,
    "interop": """
        UnsafeFileError export_onnx load read_darknet_header save
    """,
    "losses": """
        AnchorMatcher DetectionLoss PaddedTargets TaskAlignedAssigner YOLO26Loss YOLO26SegLoss YOLOv3Loss
        YOLOv8Loss YOLOv8SegLoss pad_targets
    """,
    "models": """
        Detector LayerGraph MODELS ModelSummary ModuleRule SpecConfig SpecError TimmBackbone
        YOLOv3Config YOLOv8Config build_model config_from_dict create_model list_models
        packaged_yamls prefers_channels_last register_module registered_modules unregister_module
    """,
    "ops": """
        Detections LetterboxPlan MaskCrops anchor_to_box box_area box_convert box_iou box_to_dist ciou
        clip_boxes decode_masks dfl_expectation diou dist_to_box end_to_end_detections end_to_end_points
        giou grid_points iou letterbox_plan mask_crops_in_original mask_logits masks_in_original
        nms_points non_max_suppression top_k_points top_k_predictions unletterbox_boxes
    """,
    "predict": """
        Frame Result ResultWriter batches frames next_run_dir predict predict_iter
    """,
    "train": """
        Callback Comparison Parts Progress RunResults TrainConfig Trainer compare_runs read_results train
    """,
    "val": """
        EvalResult coco_evaluate mask_scores polygon_masks validate
    """,
    "viz": """
        CURVE_KEYS PALETTE class_colour curve_keys draw_detections epoch_rows run_curves smooth
    """,
    "testing": """
        LearningCurve TINY_WIDTH assert_detections_close assert_learns assert_weights_equal tiny_model
    """,
}
# Imported by name only (``import yolokit.testing``), not reached lazily as ``yolokit.<name>``: the pytest
# plugin's package, a tool for tests (its docstring says why); ``cli`` is the command.
BY_NAME_ONLY = {"cli", "testing"}


@pytest.mark.parametrize("package", list(PUBLIC))
def test_the_public_names_are_pinned_and_each_one_resolves(package):
    module = importlib.import_module(package if package == "yolokit" else f"yolokit.{package}")
    assert sorted(module.__all__) == sorted(PUBLIC[package].split())
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_every_subpackage_is_pinned():
    found = {m.name for m in pkgutil.iter_modules(yolokit.__path__) if not m.name.startswith("_")}
    assert found - BY_NAME_ONLY == set(yolokit.SUBPACKAGES) == set(PUBLIC) - {"yolokit"} - BY_NAME_ONLY
    assert found >= BY_NAME_ONLY and not BY_NAME_ONLY & set(yolokit.__all__)


# Subpackages inside a part (data.sources, train.sweeps, ...): each says what it offers, though only the
# parts' own __all__ are the public API pinned above (their names import from the part).
NESTED = sorted(".".join(p.parent.relative_to(Path(yolokit.__file__).parent).parts)
                for p in Path(yolokit.__file__).parent.glob("*/*/__init__.py"))


@pytest.mark.parametrize("package", NESTED)
def test_each_subpackage_inside_a_part_has_a_docstring_and_offers_what_it_names(package):
    module = importlib.import_module(f"yolokit.{package}")
    assert (module.__doc__ or "").strip(), f"yolokit.{package} has no docstring"
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"


@pytest.mark.parametrize("package", [p for p in yolokit.SUBPACKAGES if p != "viz"] + NESTED)
def test_no_module_is_shadowed_by_a_name_of_its_package(package):
    module = importlib.import_module(f"yolokit.{package}")
    for info in pkgutil.iter_modules(module.__path__):
        importlib.import_module(f"yolokit.{package}.{info.name}")
        value = getattr(module, info.name)
        assert isinstance(value, types.ModuleType), f"yolokit.{package}.{info.name} is {value!r}, not the module"


def test_import_yolokit_reaches_every_subpackage_lazily_and_validation_without_the_trainer():
    """Also: no subpackage imports torch._dynamo (torch.compile's front end) before something compiles."""
    code = (
        "import sys, yolokit\n"
        "assert 'torch' not in sys.modules and 'yolokit.train' not in sys.modules\n"
        "from yolokit.val import validate, coco_evaluate\n"
        "assert 'yolokit.train' not in sys.modules, 'validation pulled in the trainer'\n"
        "assert yolokit.val.validate is validate and yolokit.train.Callback.__name__ == 'Callback'\n"
        f"mods = [getattr(yolokit, s) for s in {yolokit.SUBPACKAGES!r}]\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported (a second of every process start)'\n"
        "print(' '.join(m.__name__ for m in mods))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [f"yolokit.{s}" for s in yolokit.SUBPACKAGES]
