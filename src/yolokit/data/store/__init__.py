"""The store: where images live and how they are kept. Shards (written by `shards`, read by `stream`
through litdata) in a local folder or an S3-compatible bucket (`remote`), and the decoded images a run
keeps in RAM or on disk (`cache`).

The layout (tests/test_architecture.py): the store builds on `yolokit.data.sources` (the split index,
the images, and the readers `write_shards` reads a dataset with) and on the loader workers' shared
arrays (`yolokit.data.workers`); it imports nothing of `yolokit.data.augment`.
"""

from yolokit.data.store.cache import DiskCache, RamCache
from yolokit.data.store.remote import CredentialsError, Place, StoreError
from yolokit.data.store.shards import ShardSummary, write_shards, write_split
from yolokit.data.store.stream import ShardLost, ShardStore, shard_index

__all__ = [
    "CredentialsError", "DiskCache", "Place", "RamCache", "ShardLost", "ShardStore", "ShardSummary", "StoreError",
    "shard_index", "write_shards", "write_split",
]
