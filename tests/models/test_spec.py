"""Model YAMLs -> Detector: the packaged architectures, the built-in variants from YAML, errors, configs."""

import warnings
from dataclasses import asdict

import pytest
import torch
import yaml
from torch import nn

import yolokit
from yolokit.models import SpecConfig, SpecError, build_model, config_from_dict, packaged_yamls
from yolokit.models.graph import LayerGraph
from yolokit.models.heads import AnchorHead, DFLHead

# Parameter counts (80 classes) of the published detection architectures, every scale: the
# figures Ultralytics' model files and model cards give.
REFERENCE_PARAMETERS = {
    "yolov8": {"n": 3_157_200, "s": 11_166_560, "m": 25_902_640, "l": 43_691_520, "x": 68_229_648},
    "yolov8-p2": {"n": 3_354_144, "s": 10_884_336, "m": 25_082_496, "l": 42_888_080, "x": 66_637_536},
    "yolov8-p6": {"n": 4_984_352, "s": 17_911_792, "m": 44_887_488, "l": 62_384_016, "x": 97_423_072},
    "yolo11": {"n": 2_624_080, "s": 9_458_752, "m": 20_114_688, "l": 25_372_160, "x": 56_966_176},
    "yolov5": {"n": 2_654_816, "s": 9_153_152, "m": 25_111_456, "l": 53_225_024, "x": 97_276_448},
}
STRIDES = {"yolov8": (8, 16, 32), "yolov8-p2": (4, 8, 16, 32), "yolov8-p6": (8, 16, 32, 64), "yolo11": (8, 16, 32),
           "yolov5": (8, 16, 32)}
BUILT_IN = {"yolov8n": "yolov8n.yaml", "yolov8s": "yolov8s.yaml", "yolov8m": "yolov8m.yaml",
            "yolov8l": "yolov8l.yaml", "yolov8x": "yolov8x.yaml", "yolov3": "yolov3.yaml",
            "yolov3-spp": "yolov3-spp.yaml", "yolov3-tiny": "yolov3-tiny.yaml"}
CASES = [(arch, scale) for arch, scales in REFERENCE_PARAMETERS.items() for scale in scales]


def meta_model(name, **kwargs):
    """Built on the meta device: every shape, no memory and no initialisation (fast for the x scales)."""
    with torch.device("meta"):
        return yolokit.create_model(name, **kwargs)


def first_conv(model):
    return model.backbone.get_submodule("0").conv.out_channels


def write(tmp_path, spec, name="net.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def small_spec(**override):
    spec = {"nc": 3, "scales": {"n": [0.5, 0.25, 1024], "s": [0.5, 0.5, 1024]},
            "backbone": [[-1, 1, "Conv", [32, 3, 2]], [-1, 1, "Conv", [64, 3, 2]], [-1, 1, "C2f", [64, True]],
                         [-1, 1, "Conv", [128, 3, 2]], [-1, 2, "C2f", [128, True]]],
            "head": [[-1, 1, "nn.Upsample", [None, 2, "nearest"]], [[-1, 2], 1, "Concat", [1]],
                     [-1, 1, "C2f", [64]], [[7, 4], 1, "Detect", ["nc"]]]}
    spec.update(override)
    return spec


def test_packaged_yamls_are_the_published_architectures_and_ours():
    assert packaged_yamls() == sorted(f"{a}.yaml" for a in [*REFERENCE_PARAMETERS, "yolov3", "yolov3-spp", "yolo26",
                                                              "yolov3-tiny", "yolov8-seg", "yolo11-seg", "yolo26-seg"])


@pytest.mark.parametrize("arch,scale", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_every_architecture_builds_at_every_scale_with_the_reference_size(arch, scale):
    model = meta_model(f"{arch}.yaml", scale=scale)
    assert sum(p.numel() for p in model.parameters()) == REFERENCE_PARAMETERS[arch][scale]
    assert model.strides == STRIDES[arch] and model.num_classes == 80
    assert isinstance(model.head, DFLHead) and model.head.light_cls == (arch == "yolo11")
    assert model.config == SpecConfig(model.name, model.config.spec, scale, 80)


@pytest.mark.parametrize("arch", list(REFERENCE_PARAMETERS))
def test_forward_gives_one_map_per_level_at_its_stride(arch):
    model = yolokit.create_model(f"{arch}.yaml", scale="n", num_classes=3).eval()
    size = (128, 192)
    with torch.no_grad():
        maps = model(torch.rand(1, 3, *size))
    assert [tuple(m.shape) for m in maps] == [(1, 64 + 3, size[0] // s, size[1] // s) for s in STRIDES[arch]]
    assert model.decode(maps).shape == (1, sum(size[0] * size[1] // s**2 for s in STRIDES[arch]), 4 + 3)


def test_scale_letter_in_the_name_picks_the_packaged_file_and_scale():
    assert meta_model("yolo11s.yaml").config.scale == "s" and meta_model("yolo11s.yaml").name == "yolo11s"
    p2 = meta_model("yolov8n-p2.yaml")
    assert (p2.name, p2.config.scale, p2.strides) == ("yolov8n-p2", "n", (4, 8, 16, 32))
    assert meta_model("yolov8-p2.yaml", scale="m").name == "yolov8m-p2"
    assert meta_model("yolo11s.yaml", scale="x").name == "yolo11x"   # the argument wins over the name
    assert meta_model("yolov3-tiny.yaml").config.scale is None
    with pytest.raises(FileNotFoundError, match="yolo12s.yaml: no such model file.*yolo11.yaml"):
        yolokit.create_model("yolo12s.yaml")
    assert meta_model("yolo11n").name == "yolo11n"           # a packaged file's name without .yaml, as the reference's
    with pytest.raises(ValueError, match="unknown model 'yolo12n'.*yolo11n, yolo26s"):
        yolokit.create_model("yolo12n")  # a name no packaged file has: the message names the forms


def test_scale_of_a_users_file(tmp_path):
    path = write(tmp_path, small_spec())
    with pytest.warns(UserWarning, match="no scale given; using 'n'"):
        first = yolokit.create_model(path)
    assert first.config.scale == "n" and first.name == "net-n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = yolokit.create_model(path, scale="s")
        own = yolokit.create_model(write(tmp_path, small_spec(scale="s"), "own.yaml"))
    assert chosen.config.scale == own.config.scale == "s" and chosen.name == "net-s"
    assert first_conv(chosen) == 16 and first_conv(first) == 8
    with pytest.raises(SpecError, match=r"net.yaml: unknown scale 'q'; the file has \['n', 's'\]"):
        yolokit.create_model(path, scale="q")
    plain = write(tmp_path, {k: v for k, v in small_spec().items() if k != "scales"}, "plain.yaml")
    assert first_conv(yolokit.create_model(plain)) == 32
    with pytest.raises(SpecError, match="has no 'scales'"):
        yolokit.create_model(plain, scale="n")


def test_class_count_from_the_argument_else_the_file(tmp_path):
    path = write(tmp_path, small_spec())
    assert yolokit.create_model(path, scale="n").num_classes == 3
    assert yolokit.create_model(path, scale="n", num_classes=7).num_classes == 7
    assert yolokit.create_model("yolo11n.yaml").num_classes == 80


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_built_in_variants_from_our_yaml_files_have_the_same_tensors_in_the_same_order(name):
    with torch.device("meta"):
        ours, theirs = yolokit.create_model(name), yolokit.create_model(BUILT_IN[name])
    assert theirs.name == name and isinstance(theirs.config, SpecConfig)
    shapes = [tuple(v.shape) for v in ours.state_dict().values()]
    assert shapes == [tuple(v.shape) for v in theirs.state_dict().values()]
    assert type(ours.head) is type(theirs.head) and ours.strides == theirs.strides
    if isinstance(ours.head, AnchorHead):
        assert ours.head.anchors == theirs.head.anchors


def _same_values_and_outputs(name):
    torch.manual_seed(3)
    built_in = yolokit.create_model(name, num_classes=3).eval()
    torch.manual_seed(3)
    from_yaml = yolokit.create_model(BUILT_IN[name], num_classes=3).eval()
    assert all(torch.equal(a, b) for a, b in zip(built_in.state_dict().values(), from_yaml.state_dict().values(),
                                                  strict=True))  # the same construction order
    with torch.no_grad():   # other values everywhere, then the built-in's state loaded by position
        for t in from_yaml.state_dict().values():
            t.copy_(torch.rand(t.shape) + 0.5 if t.is_floating_point() else t + 1)
        from_yaml.load_state_dict(dict(zip(from_yaml.state_dict(), built_in.state_dict().values(), strict=True)))
        x = torch.rand(2, 3, 64, 96)
        for a, b in zip(built_in(x), from_yaml(x), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["yolov8n", "yolov8s", "yolov3-tiny", "yolov3-spp"])
def test_built_in_variants_from_yaml_start_from_the_same_values_and_compute_the_same(name):
    _same_values_and_outputs(name)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["yolov8m", "yolov8l", "yolov8x", "yolov3"])
def test_built_in_variants_from_yaml_start_from_the_same_values_and_compute_the_same_large(name):
    _same_values_and_outputs(name)


def test_layers_are_named_by_row_and_split_at_the_head():
    model = meta_model("yolo11n.yaml")
    assert isinstance(model.backbone, LayerGraph) and isinstance(model.neck, LayerGraph)
    assert model.backbone.rows == tuple(range(11)) and model.neck.rows == tuple(range(11, 23))
    assert model.backbone.outputs == (4, 6, 10) and model.neck.inputs == (4, 6, 10)
    assert model.neck.outputs == (16, 19, 22) and model.neck.out_channels == (64, 128, 256)
    assert model.backbone.strides == (8, 16, 32) and model.backbone.out_channels == (128, 128, 256)
    keys = list(model.state_dict())
    assert keys[0] == "backbone.0.conv.weight" and "neck.22.m.0.m.0.cv1.conv.weight" in keys   # c3k: True
    assert "neck.16.m.0.cv1.conv.weight" in keys and "neck.16.m.0.m.0.cv1.conv.weight" not in keys  # c3k: False
    assert "backbone.10.m.0.attn.qkv.conv.weight" in keys and "head.cls.0.0.0.conv.weight" in keys
    large = meta_model("yolo11m.yaml")   # scales m, l and x switch every C3k2 to C3k inner blocks
    assert "neck.16.m.0.m.0.cv1.conv.weight" in large.state_dict() and "backbone.2.m.0.m.0.cv1.conv.weight" in \
        large.state_dict()


def test_a_repeated_block_without_its_own_repeat_count_is_stacked(tmp_path):
    spec = small_spec(backbone=[[-1, 1, "Conv", [32, 3, 2]], [-1, 3, "Bottleneck", [32]], [-1, 1, "Conv", [64, 3, 2]]],
                      head=[[[1, 2], 1, "Detect", ["nc"]]])
    model = yolokit.create_model(write(tmp_path, spec), scale="s")   # depth 0.5: 3 repeats -> 2
    assert isinstance(model.backbone.get_submodule("1"), nn.Sequential) and len(model.backbone.get_submodule("1")) == 2
    assert model.strides == (2, 4) and len(model.neck.rows) == 0   # the head reads the backbone directly


def _error(tmp_path, spec, match):
    path = write(tmp_path, spec)
    with pytest.raises(SpecError, match=match) as info:
        yolokit.create_model(path, scale="n")
    assert str(path) in str(info.value)
    return info.value


def test_unknown_module_names_file_layer_and_module(tmp_path):
    spec = small_spec()
    spec["head"][2] = [-1, 1, "C2fancy", [64]]
    _error(tmp_path, spec, r"layer 7 \(C2fancy\): unknown module 'C2fancy'.*register_module\('C2fancy'")


@pytest.mark.parametrize("frm,why", [(9, "from 9 is not an earlier layer"), (-9, "from -9 is not an earlier layer"),
                                     ([-1, 7], "from 7 is not an earlier layer"), ("x", "from must be a row index")])
def test_wrong_from_index_names_file_layer_and_module(tmp_path, frm, why):
    spec = small_spec()
    spec["head"][1] = [frm, 1, "Concat", [1]]
    _error(tmp_path, spec, rf"layer 6 \(Concat\): {why}")


def test_first_row_reads_the_images_only(tmp_path):
    spec = small_spec()
    spec["backbone"][0] = [0, 1, "Conv", [32, 3, 2]]
    _error(tmp_path, spec, r"layer 0 \(Conv\): from 0 is not -1 \(the images\)")


@pytest.mark.parametrize("row,why", [
    ([-1, 1, "Conv", ["wide", 3, 2]], r"layer 3 \(Conv\): the first argument must be the output channels"),
    ([-1, 1, "Conv", [128, 3, 2, None, 1, 1, "yes"]], r"layer 3 \(Conv\): cannot be built .*act must be true or false"),
    ([-1, 1, "Conv", [128, 3, 2, None, 1, 1, True, 9]], r"layer 3 \(Conv\): cannot be built .*TypeError"),
    ([-1, 0, "Conv", [128, 3, 2]], r"layer 3 \(Conv\): repeats must be an integer >= 1"),
    ([-1, 1, "C2PSA", [512]], r"layer 3 \(C2PSA\): cannot be built .*C2PSA keeps its channels"),
    ([-1, 1, "Conv", 128], r"layer 3 \(Conv\): args must be a list"),
    ([-1, 1, 7, [128]], r"layer 3 \(\?\): a row is \[from, repeats, module name, args\]"),
])
def test_bad_argument_names_file_layer_and_module(tmp_path, row, why):
    spec = small_spec()
    spec["backbone"][3] = row
    _error(tmp_path, spec, why)


def test_maps_that_do_not_fit_and_bad_heads_name_the_layer(tmp_path):
    spec = small_spec()
    spec["head"][1] = [[-1, 0], 1, "Concat", [1]]   # stride 4 joined with stride 2
    _error(tmp_path, spec, r"layer 6 \(Concat\): does not run on the maps it reads \(channels x height x width "
                           r"for a 256 x 256 input: 32x64x64, 8x128x128\): RuntimeError")
    spec = small_spec()
    spec["head"][3] = [[7, 4], 1, "Detect", [5]]
    _error(tmp_path, spec, r"layer 8 \(Detect\): args are \[nc\] with nc the class count \(3\)")
    spec = small_spec()
    spec["head"].insert(0, [-1, 1, "Detect", ["nc"]])
    _error(tmp_path, spec, r"layer 5 \(Detect\): only the last row may be a head")
    spec = small_spec()
    spec["head"][3] = [-1, 1, "Conv", [8]]
    _error(tmp_path, spec, r"layer 8 \(Conv\): the last row must be a detection head")
    _error(tmp_path, small_spec(end2end="yes"), r"layer 8 \(Detect\): end2end must be true or false, got 'yes'")
    _error(tmp_path, small_spec(reg_max=0), r"layer 8 \(Detect\): reg_max must be an integer >= 1, got 0")


def test_nothing_in_a_yaml_is_evaluated(tmp_path):
    spec = small_spec()
    spec["backbone"][0] = [-1, 1, "__import__('os').system", ["true"]]
    _error(tmp_path, spec, r"layer 0 \(__import__\('os'\).system\): unknown module")
    spec = small_spec()
    spec["backbone"][0] = [-1, 1, "nn.Linear", [3, 3]]   # torch.nn is not a namespace rows reach into
    _error(tmp_path, spec, r"layer 0 \(nn.Linear\): unknown module")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backbone: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(SpecError, match="bad.yaml: not valid YAML"):
        yolokit.create_model(bad)


def test_config_is_plain_data_that_rebuilds_the_model(tmp_path):
    torch.manual_seed(0)
    model = yolokit.create_model("yolov8n-p2.yaml", num_classes=5).eval()
    stored = asdict(model.config)
    assert set(stored) == {"name", "spec", "scale", "num_classes", "family"} and stored["family"] == "spec"
    torch.save({"model_config": stored}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)["model_config"]
    config = config_from_dict(loaded)
    assert config == model.config and config.num_classes == 5 and config.scale == "n"
    rebuilt = build_model(config).eval()
    rebuilt.load_state_dict(model.state_dict())
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), rebuilt(x), strict=True))
    with pytest.raises(ValueError, match="unknown spec config fields"):
        config_from_dict({**stored, "depth": 1})


def test_fuse_and_activation_checkpointing_work_on_spec_models():
    from yolokit.accel.checkpointing import enable_activation_checkpointing

    torch.manual_seed(0)
    model = yolokit.create_model("yolo11n.yaml", num_classes=3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    units = model.checkpoint_units()
    names = [n for n, _ in units]
    assert names[:3] == ["backbone.0", "backbone.1", "backbone.2"] and "neck.11" not in names  # Upsample: no units
    assert "neck.22" in names and all(dict(model.named_modules())[n] is m for n, m in units)
    x = torch.rand(2, 3, 64, 64)
    model.train()
    plain = model(x)
    sum(m.square().mean() for m in plain).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    enable_activation_checkpointing(units)
    again = model(x)
    sum(m.square().mean() for m in again).backward()
    for a, b in zip(plain, again, strict=True):
        torch.testing.assert_close(b, a)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)
    model.eval()
    with torch.no_grad():
        before = model(x)
        model.fuse(channels_last=False)
        after = model(x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_dict_source_and_anchor_heads():
    from yolokit.models.spec_config import CFG

    spec = yaml.safe_load((CFG / "yolov3-tiny.yaml").read_text())
    spec["anchors"] = [[10, 14, 23, 27], [81, 82, 135, 169]]   # flat per level, as YOLOv5-era files write them
    model = yolokit.create_model(spec, num_classes=2)
    assert isinstance(model.head, AnchorHead) and model.head.anchors == (((10, 14), (23, 27)), ((81, 82), (135, 169)))
    assert [m.shape[1] for m in model(torch.zeros(1, 3, 64, 64))] == [2 * 7, 2 * 7]
