"""Two litdata defects, each as a short reproduction ready to report upstream (litdata 0.2.x, obstore).

    python benchmarks/litdata_defects.py               # starts a loopback S3 store (SeaweedFS, tests/s3store.py)
    python benchmarks/litdata_defects.py --endpoint http://127.0.0.1:8333   # any S3 store; AWS_* keys set

Each case writes a tiny dataset with litdata's ``BinaryWriter`` (20 items of 4 KB, chunks of 16 KB), puts it in
the store with boto3, and reads item 0 with ``StreamingDataset(...)[0]`` in a fresh interpreter under a
time limit, so that a read that never returns is reported instead of waiting here too.

1. **obstore and an http:// endpoint.** With ``AWS_ENDPOINT_URL=http://...`` (a store on loopback or inside
   a cluster: MinIO, SeaweedFS, Ceph), boto3 reads ``index.json``, but every chunk download goes through
   obstore, whose client is built with fixed ``_OBSTORE_CLIENT_OPTIONS`` that leave out ``allow_http``: the
   download fails with "HTTP error: builder error". Neither ``storage_options`` (they go to boto3) nor
   ``AWS_ALLOW_HTTP=true`` reaches that client. Expected: the item, as with an https endpoint.
   (yolokit adds ``allow_http`` to that dict for an http endpoint: ``data/store/remote.allow_plain_http``.)
2. **A chunk shorter than index.json says waits forever.** An upload cut short leaves a chunk of fewer
   bytes than ``chunk_bytes``. Reading an item of it (whole chunks downloaded) never returns: the reader
   waits for the rest of a file that will not grow. Expected: an error naming the chunk. (yolokit
   compares each chunk's size with the index before its first read: ``data/store/stream.ShardStore._read``.)
3. Not yet narrowed down, so not ready to report: reading by byte ranges (litdata's default for an item
   read by index) gets an empty item from SeaweedFS, with or without ``allow_http``: ``struct.error:
   unpack_from requires a buffer of at least 8 bytes``. yolokit downloads whole chunks (the private
   ``_on_demand_bytes = False``), which reads correctly. Whether the store or litdata is at fault needs
   a run against AWS S3 or MinIO.

What it printed here (2026-11-28, litdata 0.2.76, obstore 0.12.1, SeaweedFS on loopback, --limit 30):

    1. an http:// endpoint, whole chunks: error: obstore.exceptions.GenericError: Generic S3 error: Error
       performing GET http://127.0.0.1:34155/litdata-defects/whole/chunk-0-0.bin ... HTTP error: builder error
       with allow_http added: item read: ['index', 'payload']
    2. chunk-0-0.bin cut to half its bytes, both added: no answer after 30 s
    3. byte ranges (the default), allow_http added: error: struct.error: unpack_from requires a buffer ...
       without allow_http: error: struct.error: unpack_from requires a buffer ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

READ = textwrap.dedent("""
    import sys
    from litdata import StreamingDataset
    from litdata.streaming import downloader
    if "allow_http" in sys.argv[3]:          # the first defect worked around, to reach the others
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    dataset = StreamingDataset(sys.argv[1], cache_dir=sys.argv[2])
    if "whole_chunks" in sys.argv[3]:        # download whole chunks, not byte ranges (as yolokit reads)
        dataset._on_demand_bytes = False
    item = dataset[0]
    print("item read:", sorted(item) if isinstance(item, dict) else type(item).__name__)
""")


def write_dataset(folder: Path) -> Path:
    """20 items of 4 KB in chunks of 16 KB, by litdata's own writer."""
    from litdata.streaming.writer import BinaryWriter

    out = folder / "ds"
    out.mkdir()
    writer = BinaryWriter(str(out), chunk_bytes="16KB")
    for i in range(20):
        writer[i] = {"index": i, "payload": bytes([i]) * 4096}
    writer.done()
    writer.merge()
    return out


def upload(client, local: Path, bucket: str, prefix: str, *, cut: str | None = None) -> None:
    """Every file of ``local`` under ``s3://bucket/prefix``; the file named ``cut`` with half its bytes."""
    for path in sorted(local.iterdir()):
        body = path.read_bytes()
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=body[:len(body) // 2]
                          if path.name == cut else body)


def read_item(url: str, env: dict, limit: float, workaround: str = "-") -> str:
    with tempfile.TemporaryDirectory() as cache:
        try:
            done = subprocess.run([sys.executable, "-c", READ, url, cache, workaround], env=env, capture_output=True,
                                  text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return f"no answer after {limit:.0f} s"
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1]
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    said = [line.strip() for line in lines
            if re.match(r"^[\w.]+(Error|Exception|error)\b", line) or "builder error" in line]
    return "error: " + " / ".join(dict.fromkeys(s[:200] for s in said[-2:])) if said else f"exit {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="an S3 endpoint (default: start SeaweedFS on loopback)")
    p.add_argument("--limit", type=float, default=60.0, help="seconds a read may take")
    args = p.parse_args(argv)
    import boto3
    import litdata

    with tempfile.TemporaryDirectory() as tmp:
        store = None
        env = dict(os.environ)
        if args.endpoint is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from s3store import SeaweedS3

            store = SeaweedS3(Path(tmp) / "s3").start()
            env.update(store.env)
        else:
            env["AWS_ENDPOINT_URL"] = args.endpoint
        try:
            client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                                  aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                                  aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                                  region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"))
            bucket = "litdata-defects"
            client.create_bucket(Bucket=bucket)
            local = write_dataset(Path(tmp))
            first = sorted(p.name for p in local.glob("*.bin"))[0]
            upload(client, local, bucket, "whole")
            upload(client, local, bucket, "cut", cut=first)
            try:
                import obstore
                obstore_version = obstore.__version__
            except ImportError:
                obstore_version = "not installed"
            print(f"litdata {litdata.__version__}, obstore {obstore_version}, python {sys.version.split()[0]}, "
                  f"endpoint {env['AWS_ENDPOINT_URL']}")
            whole, cut = f"s3://{bucket}/whole", f"s3://{bucket}/cut"
            cases = [("1. an http:// endpoint, whole chunks", whole, "whole_chunks"),
                     ("   with allow_http added", whole, "allow_http,whole_chunks"),
                     (f"2. {first} cut to half its bytes, both added", cut, "allow_http,whole_chunks"),
                     ("3. byte ranges (the default), allow_http added", whole, "allow_http"),
                     ("   without allow_http", whole, "-")]
            for what, url, workaround in cases:
                print(f"{what}: {read_item(url, env, args.limit, workaround)}", flush=True)
        finally:
            if store is not None:
                store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
