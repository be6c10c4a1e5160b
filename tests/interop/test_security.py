"""Loading never runs code from a file: crafted pickles are refused through every entry point."""

import os
import pickle
import shlex
import sys
import types

import pytest
import torch

import yolokit
from yolokit.interop import UnsafeFileError
from yolokit.interop.native import load_native
from yolokit.interop.safe_load import StandIn, load_pickled, module_state_dict, pickle_globals
from yolokit.interop.ultralytics import load_ultralytics, read_ultralytics

ENTRY_POINTS = {
    "yolokit.load": yolokit.load,
    "interop.load_ultralytics": load_ultralytics,
    "interop.read_ultralytics": read_ultralytics,
    "interop.load_native": load_native,
    "safe_load.load_pickled": load_pickled,
}


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


@pytest.fixture(scope="module")
def payloads(tmp_path_factory, their):
    """A folder with the payload in every container a loader might meet; its marker; the file names."""
    tmp_path = tmp_path_factory.mktemp("payloads")
    marker = tmp_path / "pwned"
    files = {}
    files["zip.pt"] = {"model": Payload(marker), "epoch": 1}
    files["legacy.pt"] = Payload(marker)
    files["protocol4.pt"] = {"state_dict": {"w": torch.zeros(1)}, "hook": Payload(marker)}
    for name, obj in files.items():
        kwargs = {"_use_new_zipfile_serialization": False} if name == "legacy.pt" else {}
        if name == "protocol4.pt":
            kwargs["pickle_protocol"] = 4
        torch.save(obj, tmp_path / name, **kwargs)
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps(Payload(marker)))
    # inside an otherwise valid Ultralytics checkpoint (a stand-in DetectionModel)
    their.write(tmp_path / "hidden.pt", "yolov8n", 2, extra={"git": {"hook": Payload(marker)}})
    yield tmp_path, marker, sorted(files) + ["raw.pkl", "hidden.pt"]
    assert not marker.exists(), "a payload ran while loading"


def test_the_payload_is_live(tmp_path):
    """Control: a plain unpickler does run it, so the refusals below mean something."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_payload_refused_by_every_entry_point(payloads, entry):
    tmp_path, marker, names = payloads
    for name in names:
        with pytest.raises(UnsafeFileError, match=rf"{name}: refused to load: it refers to posix\.system"):
            ENTRY_POINTS[entry](tmp_path / name)
        assert not marker.exists()


def _save_with_foreign_class(path, global_name):
    """torch.save of an object whose class pickles as ``global_name`` (registered only meanwhile)."""
    module_name, cls_name = global_name.rsplit(".", 1)
    parts = module_name.split(".")
    added = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in sys.modules]
    cls = type(cls_name, (), {"__module__": module_name})
    try:
        for name in added:
            sys.modules[name] = types.ModuleType(name)
        setattr(sys.modules[module_name], cls_name, cls)
        torch.save({"model": cls(), "ema": None}, path)
    finally:
        for name in added:
            del sys.modules[name]


@pytest.mark.parametrize("global_name", ["evil.tools.Gadget", "ultralytics.nn.tasks.PoseModel"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_unexpected_globals_refused_by_every_entry_point(tmp_path, global_name, entry):
    _save_with_foreign_class(tmp_path / "odd.pt", global_name)
    with pytest.raises(UnsafeFileError, match=rf"odd\.pt: refused to load: it refers to {global_name}, "):
        ENTRY_POINTS[entry](tmp_path / "odd.pt")


def test_callable_globals_of_builtins_are_refused(tmp_path, marker):
    class CallsEval:
        def __reduce__(self):
            return eval, (f"open({str(marker)!r}, 'w').close()",)

    torch.save([CallsEval()], tmp_path / "eval.pt")
    with pytest.raises(UnsafeFileError, match=r"eval\.pt: refused to load: it refers to builtins\.eval"):
        yolokit.load(tmp_path / "eval.pt")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_globals_are_listed_without_unpickling(payloads):
    tmp_path, marker, names = payloads
    for name in names:
        assert "posix.system" in pickle_globals(tmp_path / name), name
    assert "ultralytics.nn.tasks.DetectionModel" in pickle_globals(tmp_path / "hidden.pt")


def test_error_message_never_suggests_turning_weights_only_off(tmp_path, marker):
    torch.save(Payload(marker), tmp_path / "p.pt")
    with pytest.raises(UnsafeFileError) as info:
        yolokit.load(tmp_path / "p.pt")
    assert "weights_only" not in str(info.value) and "never runs code" in str(info.value)


def test_stand_ins_keep_state_but_never_take_dunder_names():
    stand_in = StandIn()
    stand_in.__setstate__({"_parameters": {}, "__setstate__": print, "__class__": dict, "names": {0: "a"}})
    assert type(stand_in) is StandIn and "__setstate__" not in vars(stand_in) and stand_in.names == {0: "a"}


def test_module_tree_walk_reads_tensors_only_and_refuses_loops():
    root, child = StandIn(), StandIn()
    child.__setstate__({"_parameters": {"weight": torch.ones(2), "junk": "text"}, "_buffers": {"mean": torch.zeros(2)},
                        "_non_persistent_buffers_set": {"mean"}})
    root.__setstate__({"_modules": {"0": child, "1": None}, "_parameters": {"scale": torch.ones(1)}})
    assert list(module_state_dict(root)) == ["scale", "0.weight"]
    root.__setstate__({"_modules": {"0": child, "1": child}})  # shared, as Ultralytics shares its SiLU
    assert list(module_state_dict(root)) == ["scale", "0.weight", "1.weight"]
    child.__setstate__({"_modules": {"back": root}})
    with pytest.raises(ValueError, match="loops back"):
        module_state_dict(root)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_files_that_are_not_pickles_are_not_called_unsafe(tmp_path, entry):
    (tmp_path / "text.pt").write_text("just text")
    with pytest.raises(ValueError, match=r"text\.pt: (not a torch file|unknown weights format)") as info:
        ENTRY_POINTS[entry](tmp_path / "text.pt")
    assert not isinstance(info.value, UnsafeFileError)
