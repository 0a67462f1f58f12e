"""Test support for S3: a moto server on loopback, and a fault-injecting HTTP proxy in front of it.

Everything here talks real HTTP on 127.0.0.1; nothing patches a client.

* :class:`MotoServer` runs ``moto.server`` in a subprocess (its own interpreter, so the server
  does not compete with the tests for the GIL) on a free port. :meth:`MotoServer.reset` wipes
  its state (``POST /moto-api/reset``); :meth:`MotoServer.create_bucket` makes a bucket.
* :class:`FaultProxy` is a small threaded HTTP/1.1 reverse proxy. For a configurable share of
  requests it answers ``503 SlowDown`` or ``500 InternalError`` itself, resets the connection
  before forwarding (``"reset"``), or forwards the request and then resets the connection
  instead of answering (``"lost"``: the request took effect but the client never hears so).
"""

from __future__ import annotations

import functools
import http.client
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOOPBACK = "127.0.0.1"
FAULT_MODES = ("503", "500", "reset", "lost")

_S3_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
}
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of the call)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _post(url: str, data: bytes = b"") -> bytes:
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "text/plain"})  # else Flask eats it
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read()


class MotoServer:
    """``moto.server`` in a subprocess on ``127.0.0.1:<free port>``.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
    """

    def __init__(self, *, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.endpoint_url = f"http://{LOOPBACK}:{self.port}"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)],
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/moto-api/data.json", timeout=1).close()
                break
            except (urllib.error.URLError, OSError):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.endpoint_url}")
                time.sleep(0.05)

    def reset(self) -> None:
        """Delete every bucket and object and switch IAM authentication off again."""
        _post(f"{self.endpoint_url}/moto-api/reset-auth", b"inf")
        _post(f"{self.endpoint_url}/moto-api/reset")

    def enable_auth(self) -> None:
        """From now on moto checks signatures and IAM policies (until :meth:`reset`)."""
        _post(f"{self.endpoint_url}/moto-api/reset-auth", b"0")

    def client(self, service: str = "s3"):
        """A boto3 client for this server with moto's dummy credentials (for setup and checks)."""
        if service == "s3":
            return _boto3_client(self.endpoint_url, "testing", "testing", "us-east-1")
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args) -> None:  # keep test output quiet
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if "chunked" in (self.headers.get("Transfer-Encoding") or ""):
            self._reply(501, b"chunked request bodies are not supported by the test proxy")
            return
        body = self.rfile.read(length) if length else b""
        fault = self.server.proxy._pick(self.command, self.path)
        if fault in _S3_ERRORS:
            status, code, message = _S3_ERRORS[fault]
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>fault</RequestId></Error>"
            ).encode()
            self._reply(status, xml, {"Content-Type": "application/xml"})
            return
        if fault == "reset":
            self._reset()
            return
        proxy = self.server.proxy
        with proxy._lock:
            proxy._inflight += 1
            proxy.max_inflight = max(proxy.max_inflight, proxy._inflight)
        try:
            if proxy.latency:
                time.sleep(proxy.latency)
            status, headers, data = self._forward(body)
        finally:
            with proxy._lock:
                proxy._inflight -= 1
        if fault == "lost":
            self._reset()
            return
        self._reply(status, data, headers)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        up = self.server.proxy.upstream
        for attempt in range(2):  # the kept-alive upstream connection may have been closed
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*up, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                resp = self._upstream.getresponse()
                data = resp.read()
                out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
                if self.command == "HEAD":  # keep the upstream's length for HEAD responses
                    out += [(k, v) for k, v in resp.getheaders() if k.lower() == "content-length"]
                return resp.status, out, data
            except (http.client.HTTPException, OSError):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _reply(self, status: int, data: bytes, headers=()) -> None:
        self.send_response(status)
        items = headers.items() if isinstance(headers, dict) else headers
        has_length = False
        for k, v in items:
            has_length |= k.lower() == "content-length"
            self.send_header(k, v)
        if not has_length:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _reset(self) -> None:
        """Close the client connection with a TCP RST, without any response."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        try:
            self.connection.close()
        except OSError:
            pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        if self._upstream is not None:
            self._upstream.close()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy

    def handle_error(self, request, client_address) -> None:  # a reset client is expected here
        pass


class FaultProxy:
    """A reverse proxy on ``127.0.0.1:<free port>`` that injects S3 faults.

    Args:
        upstream_url: ``http://127.0.0.1:<port>`` of the real server (loopback only).
        rate: share of requests (0..1) that get a fault.
        modes: the faults to choose from, uniformly: ``"503"`` (SlowDown), ``"500"``
            (InternalError), ``"reset"`` (connection reset before forwarding) and ``"lost"``
            (forwarded, then the connection is reset instead of answering).
        seed: seed of the random choice, so a test sees the same sequence each run.

    Attributes:
        endpoint_url: where clients should connect instead of the upstream.
        counts: how many faults of each mode were injected, and ``"ok"`` for forwarded requests.
        latency: seconds each forwarded request is held before forwarding (makes concurrency
            observable).
        max_inflight: the most requests that were being forwarded at the same time.
    """

    def __init__(self, upstream_url: str, *, rate: float = 0.0,
                 modes: Sequence[str] = FAULT_MODES, seed: int = 0) -> None:
        host, _, port = upstream_url.removeprefix("http://").rstrip("/").partition(":")
        if host not in (LOOPBACK, "localhost"):
            raise ValueError(f"the fault proxy only forwards to loopback, not {upstream_url}")
        self.upstream = (host, int(port))
        self.counts: Counter[str] = Counter()
        self.latency = 0.0
        self.max_inflight = 0
        self._inflight = 0
        self._lock = threading.Lock()
        self.set_faults(rate, modes, seed=seed)
        self._server = _ProxyServer((LOOPBACK, 0), _ProxyHandler)
        self._server.proxy = self
        self.endpoint_url = f"http://{LOOPBACK}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy",
                                        daemon=True)
        self._thread.start()

    def set_faults(self, rate: float, modes: Sequence[str] = FAULT_MODES, *, seed: int = 0,
                   when: Callable[[str, str], bool] | None = None) -> None:
        """Change the fault share and modes; ``when(method, path)`` limits which requests qualify.

        ``rate=1.0`` makes every (qualifying) request fail.
        """
        unknown = set(modes) - set(FAULT_MODES)
        if unknown or not modes:
            raise ValueError(f"unknown fault modes {sorted(unknown)}; choose from {FAULT_MODES}")
        with self._lock:
            self.rate, self.modes, self.when = rate, tuple(modes), when
            self._rng = random.Random(seed)

    def _pick(self, method: str, path: str) -> str | None:
        with self._lock:
            fault = None
            if (self.when is None or self.when(method, path)) and self._rng.random() < self.rate:
                fault = self._rng.choice(self.modes)
            self.counts[fault or "ok"] += 1
            return fault

    @property
    def faults(self) -> int:
        """Number of faults injected so far."""
        return sum(n for mode, n in self.counts.items() if mode != "ok")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass(frozen=True)
class S3Location:
    """A place on an S3 endpoint to run a test against.

    Attributes:
        url: ``s3://<bucket>/<prefix>`` to give to ``ShardWriter``/``ShardReader``/``open_backend``.
        storage_options: everything a client needs (``endpoint_url``, ``key``, ``secret``,
            region); a plain dict, so it can be handed to spawned ranks.
        bucket: the bucket (exists, empty at the start of the test).
        prefix: the key prefix inside the bucket that ``url`` points at.
        endpoint_url: the real server, bypassing any fault proxy, for checking results.
    """

    url: str
    storage_options: dict
    bucket: str
    prefix: str
    endpoint_url: str

    def client(self):
        """A boto3 S3 client straight to the server (not through a proxy), for checks."""
        opts = self.storage_options
        return _boto3_client(self.endpoint_url, opts.get("key"), opts.get("secret"),
                             opts.get("client_kwargs", {}).get("region_name"))

    def keys(self) -> list[str]:
        """Every object key in the bucket, sorted (straight to the server)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def open_uploads(self) -> list[dict]:
        """Multipart uploads still open in the bucket (ListMultipartUploads)."""
        return self.client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])

    def backend(self, **kwargs):
        """An :class:`~shardstore.backends.s3.S3Backend` rooted at ``url``."""
        from shardstore.backends.s3 import S3Backend

        return S3Backend(self.url, storage_options=self.storage_options, **kwargs)

    def through(self, endpoint_url: str) -> S3Location:
        """The same location, reached via another endpoint (e.g. a :class:`FaultProxy`)."""
        return replace(self, storage_options={**self.storage_options, "endpoint_url": endpoint_url})


@functools.lru_cache(maxsize=16)
def _boto3_client(endpoint_url: str, key: str | None, secret: str | None, region: str | None):
    import boto3  # clients are thread-safe and slow to create: make each one once

    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id=key,
                        aws_secret_access_key=secret, region_name=region)


def moto_location(server: MotoServer, bucket: str, prefix: str) -> S3Location:
    """An :class:`S3Location` on ``server`` with moto's dummy credentials."""
    return S3Location(
        url=f"s3://{bucket}/{prefix}",
        storage_options={"endpoint_url": server.endpoint_url, "key": "testing",
                         "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}},
        bucket=bucket,
        prefix=prefix,
        endpoint_url=server.endpoint_url,
    )
