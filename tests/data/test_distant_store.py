"""The store at a distance (tests/latency_proxy.py): the relay adds its latency to each request, caps the
bandwidth, changes no byte and counts the requests; shards read through it as from the store itself."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from yolokit.data import make_shapes


def _client(store, endpoint: str):
    """A boto3 client of the test identity at ``endpoint`` (the relay's)."""
    import boto3
    from s3store import ACCESS_KEY, REGION, SECRET_KEY

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name=REGION)


def test_each_request_waits_its_latency_and_the_answers_their_bandwidth(s3_env):
    from latency_proxy import LatencyProxy

    client = s3_env.client()
    s3_env.bucket("distant-bytes")
    big = bytes(range(256)) * (4 << 12)                               # 4 MiB
    client.put_object(Bucket="distant-bytes", Key="big.bin", Body=big)
    client.put_object(Bucket="distant-bytes", Key="small.txt", Body=b"hello")
    with LatencyProxy("127.0.0.1", s3_env.ports["s3"], latency=0.05, bandwidth=20e6) as proxy:
        far = _client(s3_env, proxy.endpoint)
        assert far.get_object(Bucket="distant-bytes", Key="small.txt")["Body"].read() == b"hello"   # warm up
        start = time.perf_counter()
        for _ in range(5):
            assert far.get_object(Bucket="distant-bytes", Key="small.txt")["Body"].read() == b"hello"
        assert time.perf_counter() - start >= 5 * 0.05                # at least the latency, each time
        start = time.perf_counter()
        assert far.get_object(Bucket="distant-bytes", Key="big.bin")["Body"].read() == big
        assert time.perf_counter() - start >= len(big) / 20e6         # at least its bytes at 20 MB/s
        assert proxy.gets("/distant-bytes/small.txt") == 6 and proxy.gets("big.bin") == 1
        assert proxy.bytes_out >= len(big)
        proxy.reset()
        assert proxy.gets() == 0


@pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs yolokit[stream]")
def test_shards_read_through_the_distance_as_from_the_store(distant_env, tmp_path):
    from yolokit.data.sources.readers import load_split
    from yolokit.data.store.shards import write_shards

    src = make_shapes(tmp_path / "set", seed=4, n_train=4, n_val=12, imgsz=64)
    url = "s3://distant-shards/set"
    _client(None, distant_env.endpoint).create_bucket(Bucket="distant-shards")
    write_shards(src, url, chunk_bytes="8KB", splits=["val"])
    folder, sharded = load_split(src, "val"), load_split(url, "val")
    distant_env.reset()
    for i in range(len(folder)):
        assert sharded.image_bytes(i).tobytes() == Path(folder.paths[i]).read_bytes()
    chunks = len(sharded.store.files)
    assert chunks >= 3 and distant_env.gets(".bin") == chunks     # each chunk fetched once, through the relay
