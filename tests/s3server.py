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

import http.client
import json
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
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=10) as r:
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

    def client(self, service: str = "s3", **kwargs):
        """A boto3 client for this server (for setup and for checking results)."""
        import boto3

        kwargs.setdefault("aws_access_key_id", "testing")
        kwargs.setdefault("aws_secret_access_key", "testing")
        return boto3.client(service, endpoint_url=self.endpoint_url, region_name="us-east-1", **kwargs)

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
        status, headers, data = self._forward(body)
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
    """

    def __init__(self, upstream_url: str, *, rate: float = 0.0,
                 modes: Sequence[str] = FAULT_MODES, seed: int = 0) -> None:
        host, _, port = upstream_url.removeprefix("http://").rstrip("/").partition(":")
        if host not in (LOOPBACK, "localhost"):
            raise ValueError(f"the fault proxy only forwards to loopback, not {upstream_url}")
        self.upstream = (host, int(port))
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.set_faults(rate, modes, seed=seed)
        self._server = _ProxyServer((LOOPBACK, 0), _ProxyHandler)
        self._server.proxy = self
        self.endpoint_url = f"http://{LOOPBACK}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
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


def list_open_uploads(server: MotoServer, bucket: str) -> list[dict]:
    """Multipart uploads still open in ``bucket`` (ListMultipartUploads, straight to the server)."""
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def moto_state(server: MotoServer) -> dict:
    """moto's model data (for debugging a failing test)."""
    with urllib.request.urlopen(f"{server.endpoint_url}/moto-api/data.json", timeout=10) as r:
        return json.loads(r.read())
