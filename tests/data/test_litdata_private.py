"""The private names of litdata that yolokit's shard reader touches, each checked by name: a litdata release
that removes or renames one fails here with what it is used for, before a training run meets it.

litdata is pinned below 0.3 (pyproject.toml, the ``stream`` extra); the names are those of 0.2.76.
Each was checked against its public API, and none has a public replacement there:
- ``allow_http``: ``storage_options`` go to boto3 only, and obstore's client does not read
  ``AWS_ALLOW_HTTP`` once litdata passes its own client options (the defect is reproduced, ready to
  report, by ``benchmarks/litdata_defects.py``);
- the download thread's crash report: no option quiets it;
- the cache and memory-mapping of every chunk: only iterating the dataset makes its cache, and that
  starts downloading the chunks of its own order;
- whole chunks instead of byte ranges: no argument of ``StreamingDataset`` says it.

One public behaviour is relied on and tested elsewhere (tests/data/test_prefetch.py): a reader given
``Dir(path=folder, url=...)`` whose folder holds ``index.json`` opens without asking the store.
"""

import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")

SRC = Path(__file__).resolve().parents[2] / "src" / "yolokit" / "data" / "store"
# (module, attribute path, where yolokit uses it, what for)
PRIVATE = [
    ("litdata.streaming.downloader", "_OBSTORE_CLIENT_OPTIONS", "remote.py",
     "allow_plain_http adds allow_http for an http:// endpoint (litdata's obstore client leaves it out)"),
    ("litdata.streaming.reader", "PrepareChunksThread._report_crash", "remote.py",
     "quiet_litdata_threads: a failed download thread says one debug line, not a traceback"),
    ("litdata.utilities.env", "_WorkerEnv", "stream.py",
     "_map_chunks makes the reader's cache before its first read by index"),
    ("litdata", "StreamingDataset._create_cache", "stream.py", "_map_chunks, as above"),
    ("litdata", "StreamingDataset._create_shuffler", "stream.py", "_map_chunks, as above"),
    ("litdata.streaming.cache", "Cache.__init__:_reader", "stream.py",
     "_map_chunks reaches the cache's reader to memory-map every cached chunk"),
    ("litdata", "StreamingDataset.__init__:_on_demand_bytes", "stream.py",
     "_open asks for whole chunks (the sampler reads chunk by chunk), not byte ranges"),
]


def resolve(module: str, path: str) -> bool:
    """Whether ``module.path`` exists; ``Class.method:name``: ``name`` is set in that method's source."""
    path, _, assigned = path.partition(":")
    value = importlib.import_module(module)
    for part in path.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return not assigned or f"self.{assigned}" in inspect.getsource(value)


@pytest.mark.parametrize("module, path, where, why", PRIVATE, ids=[p for _, p, _, _ in PRIVATE])
def test_litdata_still_has_the_private_name(module, path, where, why):
    import litdata

    assert resolve(module, path), (
        f"litdata {litdata.__version__} has no {module}.{path.replace(':', ' setting self.')}: "
        f"yolokit.data.store.{where[:-3]} uses it ({why}); pin litdata below {litdata.__version__} "
        "in the stream extra, or replace that use")


def test_the_list_names_what_the_code_uses():
    """Each listed name appears in the file said to use it (the list follows the code)."""
    for _, path, where, _ in PRIVATE:
        name = path.replace(":", ".").split(".")[-1]
        assert name in (SRC / where).read_text(), f"{where} no longer uses {name}: drop it from PRIVATE"
    assert not resolve("litdata", "StreamingDataset.no_such_name")        # the check can fail
