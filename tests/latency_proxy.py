"""A store at a distance on loopback: a TCP relay in front of an S3 endpoint that adds a set latency to every
HTTP request and caps the bandwidth of what comes back, shared by all connections.

The relay forwards bytes unchanged (S3 signatures sign the Host header and the body, so nothing is
rewritten). A request is the first bytes a client sends on a connection, or the first it sends after the
store answered: those wait ``latency`` seconds before they go on, and their request line is counted
(``requests``: ``(method, path)`` -> count). The store's answers pass through a token bucket of
``bandwidth`` bytes per second.

    with LatencyProxy("127.0.0.1", 8333, latency=0.03, bandwidth=200e6) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        ...
        proxy.gets("chunk-0-3.bin")     # GET requests whose path ends so
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time


class _Bucket:
    """Bytes per second shared by every connection: a send of n bytes waits until the bucket has them."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.free_at, self.lock = rate, 0.0, threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + n / self.rate
        time.sleep(max(0.0, self.free_at - time.monotonic()))


class LatencyProxy:
    """A relay on ``127.0.0.1`` (a free port) to ``host:port``.

    Args:
        host, port: the store's S3 endpoint.
        latency: seconds each HTTP request waits before it reaches the store.
        bandwidth: bytes per second of the store's answers, all connections together (None: no cap).
    """

    def __init__(self, host: str, port: int, *, latency: float = 0.03, bandwidth: float | None = 200e6) -> None:
        self.target, self.latency, self.bucket = (host, port), latency, _Bucket(bandwidth)
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes_out = 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gets(self, suffix: str = "") -> int:
        """GET requests whose path (without its query) ends with ``suffix``."""
        with self._lock:
            return sum(n for (method, path), n in self.requests.items()
                       if method == "GET" and path.split("?")[0].endswith(suffix))

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_out = 0

    def start(self) -> LatencyProxy:
        self._spawn(self._accept)
        return self

    def stop(self) -> None:
        self._stop.set()
        for s in [self._server, *self._sockets]:
            _close(s)
            s.close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name="latency-proxy")
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            answered = threading.Event()          # set: the store has answered since the last request
            answered.set()
            self._spawn(self._up, client, upstream, answered)
            self._spawn(self._down, upstream, client, answered)

    def _up(self, client: socket.socket, upstream: socket.socket, answered: threading.Event) -> None:
        """Client to store: the first bytes of each request wait ``latency``, and its request line is counted."""
        try:
            while data := client.recv(1 << 16):
                if answered.is_set():                        # a new request
                    answered.clear()
                    line = data.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
                    if len(line) == 3:
                        with self._lock:
                            self.requests[(line[0], line[1])] += 1
                    time.sleep(self.latency)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, answered: threading.Event) -> None:
        """Store to client, through the bandwidth cap."""
        try:
            while data := upstream.recv(1 << 16):
                answered.set()
                self.bucket.take(len(data))
                with self._lock:
                    self.bytes_out += len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)


def main(argv: list[str] | None = None) -> None:
    """``python tests/latency_proxy.py HOST:PORT --latency 0.03 --bandwidth 200`` serves until stopped (a
    process of its own, as benchmarks/shards.py runs it); its first line is the endpoint."""
    import argparse
    import signal

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="the store's HOST:PORT")
    p.add_argument("--latency", type=float, default=0.03, help="seconds added to each request")
    p.add_argument("--bandwidth", type=float, default=200.0, help="MB/s of the answers, all connections (0: no cap)")
    args = p.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    with LatencyProxy(host, int(port), latency=args.latency, bandwidth=args.bandwidth * 1e6 or None) as proxy:
        print(proxy.endpoint, flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    import signal as _signal

    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})   # for sigwait, in every thread
    main()
