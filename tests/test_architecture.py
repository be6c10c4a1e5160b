"""The import directions and the module size limit of ARCHITECTURE.md, read from the source."""

import ast
import re
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "yolokit"

# Which yolokit subpackages each part may import (besides itself): ARCHITECTURE.md's
# "accel -> torch only. ops -> torch, torchvision. models, losses, data -> ops ... predict ->
# models, data, interop, viz, ops. train -> all of the above. cli -> anything."
# val (the validation pass and the metrics over arrays) left train so that it is reachable
# without the trainer: it sits below train, beside predict, and imports ops, data and accel.
ALLOWED = {
    "accel": set(),
    "ops": set(),
    "models": {"ops"},
    "losses": {"ops"},
    "data": {"ops"},
    "interop": {"ops", "models"},
    "train": {"ops", "models", "losses", "data", "accel", "interop", "viz", "predict", "val"},
    "viz": {"ops"},
    "predict": {"ops", "models", "data", "interop", "viz"},
    "val": {"ops", "data", "accel"},
    # deploy: a model as another runtime's file, checked, then run and validated again
    "deploy": {"ops", "models", "interop", "data", "val"},
    "cli": {"ops", "models", "losses", "data", "accel", "interop", "train", "viz", "predict", "val", "deploy", ""},
    # testing (the pytest plugin: fixtures and assertions for users' tests) -> anything public but cli
    "testing": {"ops", "models", "losses", "data", "accel", "interop", "train", "viz", "predict", "val", "deploy",
                ""},
    "__init__": set(),  # the public face names modules by path and imports them on first use
}
# Third-party modules each part may import (the standard library is always allowed).
THIRD_PARTY = {
    "accel": {"torch"},
    "ops": {"torch", "torchvision"},
}
MAX_LINES = 400  # "A module stays under ~400 lines"

# Inside a part: which of its own pieces each piece may import. A piece is a subpackage (data/sources/) or
# the part's top level (TOP: the modules directly in its folder); the name of a top-level module (buffers)
# allows that module only. Read from the code once data/ and train/ were grouped in subpackages
# (docs/architecture.md, "Inside data and train").
TOP = ""
INSIDE = {
    "data": {
        "sources": set(),                          # reading a split and its pixels: the bottom of data/
        "augment": {"sources", "buffers"},         # pixels through sources; recipes into the workers' buffers
        "store": {"sources", "workers"},           # the split index, the readers write_shards reads with;
                                                   # the workers' SharedArray (a shard lost, seen by all)
        TOP: {TOP, "sources", "augment", "store"},   # the dataset and the loader assemble the three
    },
    "train": {
        "trackers": {"callbacks"},                 # of the run, only the hooks they implement
        "sweeps": {TOP, "trackers"},               # a sweep trains runs
        TOP: {TOP, "trackers"},                    # the run builds its trackers and imports no sweep
    },
}
# Imports inside a function that cross INSIDE, each with its reason (at module level they stay refused).
LATE = {
    ("data/sources/readers.py", "yolokit.data.store.stream"):
        "a split may be shards: load_split and yolo_index open them through the store when they meet one",
}


def imports_of(path, root=SRC):
    rel = path.relative_to(root)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
                yield node.lineno, ".".join(["yolokit", *base] + ([node.module] if node.module else []))
            else:
                yield node.lineno, node.module or ""


def part_of(path):
    rel = path.relative_to(SRC)
    if rel.parts == ("__main__.py",):  # `python -m yolokit` is the command itself
        return "cli"
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


FILES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_the_architecture(path):
    home = part_of(path)
    allowed = ALLOWED.get(home)
    assert allowed is not None, f"{path.relative_to(SRC)} belongs to no part named in ARCHITECTURE.md"
    bad = []
    for line, name in imports_of(path):
        parts = name.split(".")
        if parts[0] == "yolokit":
            target = parts[1] if len(parts) > 1 else ""
            if target == "cli" and home != "cli":
                bad.append(f"{line}: nothing imports cli")
            elif target != home and target not in allowed:
                bad.append(f"{line}: {home} imports yolokit.{target}")
        elif (home in THIRD_PARTY and parts[0] not in sys.stdlib_module_names and parts[0] != "__future__"
              and parts[0] not in THIRD_PARTY[home]):
            bad.append(f"{line}: {home} imports {parts[0]}")
    assert not bad, f"{path.relative_to(SRC)}: " + "; ".join(bad)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_modules_stay_under_the_size_limit(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)}: {lines} lines (the limit is {MAX_LINES})"


def _deferred_lines(tree):
    """Line numbers of the imports inside a function (run when it is called, not when the module loads)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def inside_violation(part, home, target, root=SRC):
    """Why ``home`` (a piece of ``part``: a subpackage's name or TOP) may not import the module ``target``;
    None when INSIDE allows it, or when ``target`` is not a module of ``part``'s pieces."""
    names = target.split(".")
    if names[:2] != ["yolokit", part] or len(names) < 3 or part not in INSIDE:
        return None
    piece = names[2] if (root / part / names[2]).is_dir() else TOP
    allowed = INSIDE[part][home]
    if piece == home != TOP or piece in allowed or (piece == TOP and names[2] in allowed):
        return None
    return f"{part}.{home or '(top level)'} imports {target}"


def inside_problems(path, root=SRC):
    """``file:line: what`` for each import of ``path`` that INSIDE refuses (LATE excepted, inside functions)."""
    rel = path.relative_to(root)
    if rel.parts[0] not in INSIDE or len(rel.parts) < 2:
        return []
    part, home = rel.parts[0], rel.parts[1] if len(rel.parts) > 2 else TOP
    if home not in INSIDE[part]:
        return [f"{rel.as_posix()}: {part}/{home}/ is a piece of {part} with no row in INSIDE"]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    deferred = _deferred_lines(tree)
    bad = []
    for line, name in imports_of(path, root):
        why = inside_violation(part, home, name, root)
        if why and not (line in deferred and (rel.as_posix(), name) in LATE):
            bad.append(f"{rel.as_posix()}:{line}: {why}")
    return bad


@pytest.mark.parametrize("path", [f for f in FILES if f.relative_to(SRC).parts[0] in INSIDE],
                         ids=lambda p: str(p.relative_to(SRC)))
def test_the_pieces_of_data_and_train_import_in_their_direction(path):
    bad = inside_problems(path)
    assert not bad, "; ".join(bad)


def test_the_layout_rule_sees_a_violation(tmp_path):
    """Not vacuous: made-up imports against the direction are refused, with the file, the line and the import;
    nested files still belong to their part; a LATE exception holds only inside a function."""
    assert inside_violation("data", "sources", "yolokit.data.augment.mosaic") == \
        "data.sources imports yolokit.data.augment.mosaic"
    assert inside_violation("data", "sources", "yolokit.data.loader") is not None
    assert inside_violation("data", "augment", "yolokit.data.store.cache") is not None
    assert inside_violation("data", "augment", "yolokit.data.dataset") is not None     # buffers only
    assert inside_violation("train", "trackers", "yolokit.train.trainer") is not None
    assert inside_violation("train", TOP, "yolokit.train.sweeps.tuning") == \
        "train.(top level) imports yolokit.train.sweeps.tuning"
    allowed = [("data", "store", "yolokit.data.sources.labels"), ("data", "augment", "yolokit.data.buffers"),
               ("data", TOP, "yolokit.data.store.shards"), ("train", "sweeps", "yolokit.train.trainer"),
               ("train", "trackers", "yolokit.train.callbacks"), ("data", "sources", "yolokit.ops.geometry")]
    for part, home, target in allowed:
        assert inside_violation(part, home, target) is None, (part, home, target)
    assert part_of(SRC / "data" / "sources" / "readers.py") == "data"
    root = tmp_path / "yolokit"
    for piece in ("data/sources", "data/augment", "data/store"):
        (root / piece).mkdir(parents=True)
    probe = root / "data" / "sources" / "readers.py"
    probe.write_text("import os\nfrom yolokit.data.augment.mosaic import mosaic4\n\n\ndef f():\n"
                     "    from yolokit.data.store.stream import shard_index\n")
    assert inside_problems(probe, root) == [
        "data/sources/readers.py:2: data.sources imports yolokit.data.augment.mosaic"]
    probe.write_text("from yolokit.data.store.stream import shard_index\n")      # LATE: inside a function only
    assert inside_problems(probe, root) == [
        "data/sources/readers.py:1: data.sources imports yolokit.data.store.stream"]
    (root / "data" / "extra").mkdir()
    (root / "data" / "extra" / "x.py").write_text("")
    assert "no row in INSIDE" in inside_problems(root / "data" / "extra" / "x.py", root)[0]


def test_each_late_exception_is_still_needed():
    for (file, module), why in LATE.items():
        path = SRC / file
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deferred = _deferred_lines(tree)
        assert any(n == module and line in deferred for line, n in imports_of(path)), f"LATE: {file} no longer " \
            f"imports {module} inside a function ({why}): drop the exception"


def test_the_trainer_reads_as_its_epoch_loop():
    """The loop stays in sight: device-failure reports, lost images and checkpoint writes have homes of their
    own (train/incidents.py, train/checkpoint.py, train/feeding.py), and the step is train/step.py's."""
    trainer = (SRC / "train" / "trainer.py").read_text(encoding="utf-8")
    assert len(trainer.splitlines()) <= 260, "train/trainer.py passed 260 lines: give the new concern its own home"
    assert "def train_step" not in trainer
    assert re.search(r"^from yolokit\.train\.step import [\w, ]*\btrain_step\b", trainer, re.MULTILINE)


def test_the_check_sees_a_violation(tmp_path):
    fake = SRC / "losses" / "_probe_.py"
    try:
        fake.write_text("from yolokit.models import create_model\nimport numpy\n")
        assert ("1", "yolokit.models") in {(str(lineno), n) for lineno, n in imports_of(fake)}
        with pytest.raises(AssertionError, match="losses imports yolokit.models"):
            test_imports_follow_the_architecture(fake)
    finally:
        fake.unlink()


def test_accel_alone_imports_only_torch():
    import subprocess
    import sys

    code = ("import sys, yolokit.accel, yolokit; "
            "print(sorted(m for m in ('torchvision', 'numpy', 'cv2', 'yolokit.models') if m in sys.modules)); "
            "yolokit.create_model; print('yolokit.models' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert "torchvision" not in out[0] and "cv2" not in out[0] and "yolokit.models" not in out[0]
    assert out[1] == "True"  # public names still resolve, on first use


def _module_name(path):
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(files, *, anywhere=False):
    """Each module's ``yolokit`` imports: module-level ones, or also those in functions and
    ``TYPE_CHECKING`` blocks (``anywhere``)."""
    names = {_module_name(f): f for f in files}
    graph = {}
    for name, path in names.items():
        targets = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree) if anywhere else tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("yolokit") and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in names else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in names}
        graph[name] = targets & names.keys()
    return graph


def import_cycles(files):
    """Cycles of module-level ``yolokit`` imports (imports inside functions are deferred by design)."""
    graph = import_graph(files)
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_two_modules_import_each_other_even_when_deferred():
    """A deferred import or a type-only one still ties two modules: one of them should hold what both need."""
    graph = import_graph(FILES, anywhere=True)
    assert sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a != b and a in graph[b]}) == []


def test_no_module_imports_itself_in_a_circle(tmp_path):
    assert import_cycles(FILES) == []
    a, b = SRC / "accel" / "_probe_a.py", SRC / "accel" / "_probe_b.py"   # the check sees one
    try:
        a.write_text("from yolokit.accel._probe_b import x\n")
        b.write_text("from yolokit.accel._probe_a import y\n")
        assert ["yolokit.accel._probe_a", "yolokit.accel._probe_b", "yolokit.accel._probe_a"] in import_cycles(
            [*FILES, a, b])
    finally:
        a.unlink()
        b.unlink()
