"""Where shards live: a local folder or an S3-compatible bucket, behind one small interface.

`Place(url)` reads, writes, lists (`names`) and sizes files under a folder or an ``s3://bucket/prefix``.
S3 goes through boto3 (a dependency of the `stream` extra's engine), configured only from the
standard variables: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_DEFAULT_REGION``, ``AWS_PROFILE`` and the files boto3 reads. No credential passes through
yolokit's own code, so none can reach a log line, a config.yaml, a tracker or a checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse


class StoreError(RuntimeError):
    """The object store cannot be reached, or refuses us, after retries."""


class StoreStopped(StoreError):
    """The store stopped for one of several processes, and all of them raise it together, at the same
    step (``accel.agreement.first_failure``): the message is the first failing rank's."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

    @classmethod
    def of(cls, failure: tuple[int, str], here: int) -> StoreStopped:
        """From ``first_failure``'s (rank, message), raised on rank ``here`` (another's is named)."""
        rank, message = failure
        return cls(message if rank == here else f"{message} (rank {rank})", rank)


class CredentialsError(StoreError):
    """The object store refused the credentials (wrong key or secret, or no access)."""


def no_bucket(bucket: str) -> str:
    """The error of a bucket that does not exist: yolokit does not create buckets (where, and with which
    settings, is the store owner's choice), so it says how."""
    return (f"s3://{bucket}: no such bucket; create it first (aws s3 mb s3://{bucket}, with --endpoint-url "
            "$AWS_ENDPOINT_URL for a store other than AWS, or in the store's console)")


def one_line(exc: BaseException) -> str:
    """A StoreError's own message, also when a loader worker raised it (the loader passes the worker's
    whole traceback as the message: its last line is the error)."""
    text = str(exc).strip()
    last = text.splitlines()[-1] if text else type(exc).__name__
    name, sep, rest = last.partition(": ")
    return rest if sep and name.rsplit(".", 1)[-1].endswith("Error") else last


_DENIED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
           "403", "Forbidden", "AuthorizationHeaderMalformed"}


def is_remote(url: str | os.PathLike) -> bool:
    """Whether ``url`` names an object store (``s3://...``) rather than a local path."""
    return str(url).startswith("s3://")


def join(url: str, *parts: str) -> str:
    """``url`` and ``parts`` joined with "/" (a local path or an ``s3://`` url alike)."""
    out = str(url).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def endpoint() -> str | None:
    """The S3 endpoint boto3 will use from the environment (None: AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def store_retries() -> int:
    """Attempts of each S3 request: ``$YOLOKIT_STORE_RETRIES`` (a whole number, at least 1), else 4."""
    text = os.environ.get("YOLOKIT_STORE_RETRIES", "4")
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"YOLOKIT_STORE_RETRIES must be a whole number of attempts, at least 1; got {text!r}")
    return value


class Place:
    """A folder or an ``s3://bucket/prefix``, with the few operations shards need.

    Args:
        url: local folder path or ``s3://bucket/prefix``.
        retries: attempts of each S3 request before `StoreError` (with backoff 0.5 s, 1 s, 2 s, ...);
            None: ``$YOLOKIT_STORE_RETRIES``, else 4.
    """

    def __init__(self, url: str | os.PathLike, *, retries: int | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.remote = is_remote(self.url)
        self.retries = store_retries() if retries is None else retries
        if self.remote:
            parsed = urlparse(self.url)
            self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
            if not self.bucket:
                raise ValueError(f"{url}: an s3 url names a bucket: s3://bucket/prefix")
        self._client = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}     # a boto3 client is per process

    # ------------------------------------------------------------------ s3

    def client(self):
        """This process's boto3 client (a forked loader worker makes its own: sockets are not shared)."""
        if self._client is None or self._client[0] != os.getpid():
            try:
                import boto3
                from botocore.config import Config
            except ImportError as err:
                raise ImportError("s3:// needs boto3: pip install 'yolokit[stream]'") from err

            self._client = (os.getpid(), boto3.client("s3", config=Config(
                retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=60)))
        return self._client[1]

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}".lstrip("/") if name else self.prefix

    def _call(self, what: str, fn):
        """``fn()`` with retries and backoff on transport errors; credentials refused: at once."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        delay, last = 0.5, None
        for attempt in range(self.retries):
            try:
                return fn()
            except NoCredentialsError as err:
                raise CredentialsError(f"{what}: no S3 credentials (set AWS_ACCESS_KEY_ID and "
                                       "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)") from err
            except ClientError as err:
                code = str(err.response.get("Error", {}).get("Code", ""))
                status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in _DENIED or status == 403:
                    raise CredentialsError(f"{what}: the store refused the credentials ({code or status}); "
                                           "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY") from err
                if code == "NoSuchBucket":
                    raise FileNotFoundError(no_bucket(self.bucket)) from err
                if code in ("NoSuchKey", "404", "NotFound"):
                    raise FileNotFoundError(f"{what}: not found ({code})") from err
                last = err
            except BotoCoreError as err:
                last = err
            if attempt + 1 < self.retries:
                time.sleep(delay)
                delay *= 2
        raise StoreError(f"{what}: the store did not answer after {self.retries} tries ({last})")

    # ------------------------------------------------------------------ operations

    def where(self, name: str) -> str:
        """The full url or path of ``name`` here."""
        return join(self.url, name)

    def check(self) -> None:
        """Reach the store once (credentials and bucket), before any work. Local: nothing to check."""
        if self.remote:
            try:
                self._call(f"s3://{self.bucket}", lambda: self.client().head_bucket(Bucket=self.bucket))
            except FileNotFoundError:
                raise FileNotFoundError(no_bucket(self.bucket)) from None

    def read(self, name: str) -> bytes:
        """The bytes of ``name``. Raises FileNotFoundError when missing, StoreError when unreachable."""
        if not self.remote:
            return Path(self.where(name)).read_bytes()
        return self._call(self.where(name), lambda: self.client().get_object(
            Bucket=self.bucket, Key=self._key(name))["Body"].read())

    def size(self, name: str) -> int | None:
        """The size of ``name`` in bytes, None when missing."""
        try:
            if not self.remote:
                return os.path.getsize(self.where(name))
            return int(self._call(self.where(name), lambda: self.client().head_object(
                Bucket=self.bucket, Key=self._key(name)))["ContentLength"])
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        """Every file under here (recursively), as names relative to it, sorted. Raises StoreError or
        FileNotFoundError (no such bucket) as the other operations do."""
        if not self.remote:
            root = Path(self.url)
            return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) \
                if root.is_dir() else []
        prefix = f"{self.prefix}/" if self.prefix else ""

        def listing() -> list[str]:
            pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            return [o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])]

        return sorted(self._call(self.url, listing))

    def write(self, name: str, data: bytes) -> None:
        """``name`` holds ``data`` afterwards, whole or not at all (local: a temporary file renamed)."""
        if self.remote:
            self._call(self.where(name), lambda: self.client().put_object(
                Bucket=self.bucket, Key=self._key(name), Body=data))
            return
        target = Path(self.where(name))
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_umask())        # as any file written here (mkstemp's is the owner's only)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def fetch(self, name: str, local: str | os.PathLike) -> Path:
        """The file ``name`` as a local file: itself for a folder, else downloaded (streamed) to ``local``."""
        if not self.remote:
            path = Path(self.where(name))
            if not path.is_file():
                raise FileNotFoundError(f"{path}: not found")
            return path
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}")
        try:
            def download() -> None:        # one stream, 1 MB at a time (no transfer threads and their buffers)
                body = self.client().get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
                with open(tmp, "wb") as f:
                    for part in body.iter_chunks(1 << 20):
                        f.write(part)

            self._call(self.where(name), download)
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)
        return local

    def remove(self, name: str) -> None:
        """Delete ``name`` here (nothing when it is missing)."""
        if self.remote:
            self._call(self.where(name), lambda: self.client().delete_object(Bucket=self.bucket, Key=self._key(name)))
        else:
            Path(self.where(name)).unlink(missing_ok=True)

    def put_file(self, name: str, local: str | os.PathLike) -> None:
        """Copy the local file ``local`` to ``name`` here (whole or not at all)."""
        if self.remote:
            self._call(self.where(name), lambda: self.client().upload_file(
                str(local), self.bucket, self._key(name)))
            return
        target = Path(self.where(name))
        if Path(local).resolve() == target.resolve():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part")
        shutil.copyfile(local, tmp)
        os.replace(tmp, target)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def allow_plain_http() -> None:
    """Let the engine's fast S3 path (obstore) talk to an ``http://`` endpoint, as boto3 does.

    litdata 0.2.76 builds its obstore client with fixed client options that leave out
    ``allow_http``, so an ``http://`` endpoint (a store on loopback or inside a cluster) fails with
    "builder error" on every chunk download. With an http endpoint set we add that one option;
    https endpoints and AWS itself are untouched.
    """
    url = endpoint()
    if not url or not url.startswith("http://"):
        return
    try:
        from litdata.streaming import downloader
    except ImportError:
        return
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


def quiet_cap_advice(record: logging.LogRecord) -> bool:
    """Leaves out litdata's advice to cache 25GB or more, given for its own prefetching over many workers
    (printed by every worker): the sampler here reads chunk after chunk, and the cap is the user's."""
    return "max_cache_size` is less than" not in str(record.msg)


def quiet_litdata_threads() -> None:
    """A litdata download thread that fails prints no traceback (one debug line instead): the read that
    waits for its chunk fails too, and yolokit says that in one line (a stopped store, a lost chunk).
    Both ways such a thread reports are covered: its own crash report (`PrepareChunksThread._report_crash`,
    which prints the traceback itself) and `threading.excepthook`, where other threads' failures still
    print as before. Installed once per process."""
    from litdata.streaming import reader

    def quiet(where: str, exc: BaseException) -> None:
        logging.getLogger("yolokit.data").debug("litdata's %s stopped: %s: %s", where, type(exc).__name__,
                                                (str(exc).splitlines() or [""])[0])

    chunks = getattr(reader, "PrepareChunksThread", None)
    if chunks is not None and hasattr(chunks, "_report_crash"):       # its error stays kept for the read
        chunks._report_crash = lambda self, exc: quiet("chunk thread", exc)
    previous = threading.excepthook
    if getattr(previous, "yolokit_quiet_litdata", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and type(args.thread).__module__.startswith("litdata."):
            return quiet(f"thread {args.thread.name}", args.exc_value)
        previous(args)

    hook.yolokit_quiet_litdata = True
    threading.excepthook = hook
