import argparse

import pytest

from yolokit.data import AugmentConfig
from yolokit.train.config import TrainConfig, add_config_flags, config_from_args


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_yolov8_defaults():
    c = TrainConfig()
    assert (c.lr0, c.lrf, c.momentum, c.weight_decay) == (0.01, 0.01, 0.937, 5e-4)
    assert (c.warmup_epochs, c.warmup_momentum, c.warmup_bias_lr, c.nbs) == (3.0, 0.8, None, 64)  # None: by model
    assert (c.ema_decay, c.ema_tau, c.close_mosaic) == (0.9999, 2000.0, 10)
    a = c.augment
    assert ((a.hsv_h, a.hsv_s, a.hsv_v, a.translate, a.scale, a.fliplr, a.mosaic)
            == (0.015, 0.7, 0.4, 0.1, 0.5, 0.5, 1.0))
    assert a == AugmentConfig()   # one source of the augmentation defaults: the data pipeline's


def test_augmentation_nested_or_flat_from_yaml_flags_and_replace(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 5\naugment:\n  mosaic: 0.5\n  fliplr: 0.0\nhsv_h: 0.02\n")
    c = parse(["--config", str(path), "--fliplr", "0.25", "--mixup", "0.1"])
    assert (c.augment.mosaic, c.augment.fliplr, c.augment.hsv_h, c.augment.mixup) == (0.5, 0.25, 0.02, 0.1)
    assert c.augment.scale == AugmentConfig.scale                  # untouched fields keep their defaults
    assert TrainConfig.from_yaml(_dump(tmp_path, c)) == c          # config.yaml writes it nested
    assert "augment" in c.to_dict() and "hsv_h" not in c.to_dict()
    d = c.replace(mosaic=0.0, epochs=2)
    assert (d.augment.mosaic, d.augment.fliplr, d.epochs, c.augment.mosaic) == (0.0, 0.25, 2, 0.5)
    assert TrainConfig.from_dict({"augment": {"mosaic": 0.0}}).augment == AugmentConfig(mosaic=0.0)
    with pytest.raises(ValueError, match="unknown augment fields: mosaik"):
        TrainConfig.from_dict({"augment": {"mosaik": 0.0}})
    nine = parse(["--mosaic-tiles", "9"])                           # an integer field of the augmentation
    assert nine.augment.mosaic_tiles == 9 and TrainConfig.from_yaml(_dump(tmp_path, nine)) == nine
    with pytest.raises(ValueError, match="mosaic_tiles must be 4 or 9, got 3"):
        parse(["--mosaic-tiles", "3"])


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 5\nlr0: 0.02\nbatch: auto\n")
    c = parse(["--config", str(path), "--lr0", "0.03", "--no-ema", "--batch", "8"])
    assert c.epochs == 5 and c.lr0 == 0.03 and c.ema is False and c.batch == 8
    assert parse(["--batch", "auto"]).batch == "auto"
    again = TrainConfig.from_yaml(_dump(tmp_path, c))
    assert again == c


def _dump(tmp_path, config):
    out = tmp_path / "resolved.yaml"
    out.write_text(config.to_yaml())
    return out


@pytest.mark.parametrize("bad, message", [
    ({"imgsz": 0}, "positive multiple of the model's stride"),
    ({"batch": "many"}, "batch"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"precision": "fp8"}, "precision"),
    ({"checkpointing": "head"}, "checkpointing"),
    ({"compile": "fast"}, "compile must be true, false or one of default, reduce-overhead"),
    ({"val_interval": 0}, "val_interval must be >= 1 epochs"),   # was a ZeroDivisionError after the first epoch
    ({"warmup_bias_lr": -0.1}, "warmup_bias_lr must be >= 0, got -0.1"),
])
def test_bad_values_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**bad)


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epoch: 5\n")
    with pytest.raises(ValueError, match="epoch"):
        TrainConfig.from_yaml(path)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        TrainConfig.from_yaml(tmp_path / "nope.yaml")


def test_dashed_aliases_of_underscored_flags():
    c = parse(["--channels-last", "--close_mosaic", "3", "--warmup-epochs", "1.5"])
    assert c.channels_last is True and c.close_mosaic == 3 and c.warmup_epochs == 1.5
    assert parse([]).channels_last is None and parse(["--no-channels-last"]).channels_last is False


def test_rect_and_multi_scale_from_flags_and_yaml(tmp_path):
    assert (parse([]).rect, parse([]).multi_scale) == (False, False)
    c = parse(["--rect", "--multi-scale"])
    assert c.rect is True and c.multi_scale is True and parse(["--multi_scale"]).multi_scale is True
    path = tmp_path / "c.yaml"
    path.write_text("rect: true\nmulti_scale: true\n")
    assert parse(["--config", str(path), "--no-rect"]) == TrainConfig(multi_scale=True)
    assert TrainConfig.from_yaml(_dump(tmp_path, c)) == c


def test_compile_takes_a_mode_from_flags_and_yaml(tmp_path):
    assert parse([]).compile is False and parse(["--compile"]).compile == "default"
    assert parse(["--compile", "reduce-overhead"]).compile == "reduce-overhead"
    assert parse(["--compile", "false"]).compile is False and TrainConfig(compile=True).compile == "default"
    path = tmp_path / "c.yaml"
    path.write_text("compile: true\n")
    assert TrainConfig.from_yaml(path).compile == "default"
    c = parse(["--compile", "max-autotune"])
    assert TrainConfig.from_yaml(_dump(tmp_path, c)) == c


def test_every_flag_says_what_it_means():
    """`yolokit train --help` (and the command-line reference generated from it) gives each TrainConfig
    and AugmentConfig field the comment beside it in the source, with its continuation lines, never
    the section heading below it."""
    import argparse
    import dataclasses

    from yolokit.data import AugmentConfig
    from yolokit.train.config import add_config_flags, field_help

    meaning = field_help(TrainConfig)
    assert meaning["model"].endswith("None: the architecture of `weights`, else yolov8n")   # two lines
    assert meaning["nbs"] == "nominal batch: images one optimizer step represents"      # not "optimizer and ..."
    assert field_help(AugmentConfig)["fliplr"] == "probability of a left-right flip"    # the docstring's line
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "augment"]
    names += [f.name for f in dataclasses.fields(AugmentConfig)]
    assert set(helps) == {*names, "config"}
    vague = [n for n in names if len(helps[n].split("(default:")[0].strip()) < 8]
    assert not vague, f"flags without a meaning: {vague}"
    assert helps["epochs"] == "passes over the training images (default: 100)"
    parser.format_help()                                  # a % in a comment would break argparse here
