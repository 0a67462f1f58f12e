"""Benchmark of the S3 backend: ShardWriter/ShardReader vs DCP's FsspecWriter/FsspecReader on s3://.

Issue 4's targets, measured in one run against one moto server (``python -m moto.server`` in its
own process on 127.0.0.1, started here): a 2-rank save of bf16/fp32 DTensor shards and its
2-rank load, shardstore (parallel multipart uploads, merged concurrent ranged GETs) against DCP's
``FsspecWriter``/``FsspecReader`` on the same endpoint with the same credentials (s3fs
underneath: one file per rank uploaded part after part, reads through s3fs's read-ahead
buffer). Targets: >= 2x on save and on load. shardstore runs twice: with a new backend (and S3
client) per save/load, which is what ``ShardWriter("s3://...")`` does, and with a child of a
long-lived backend, which is what ``CheckpointManager`` does.

Why a moto log and CPU seconds: throughput on an object store is requests as much as bytes, so
every case reports how many HTTP requests it made and at what rate, counted from moto's own
request log (one werkzeug line per request, written after the answer) cut between cases by a
sentinel request, so nothing sits between client and server. And moto is a Python process on
the same few cores as the ranks, so every case also reports the CPU seconds the ranks and the
server used: on a shared machine those say more about cost than wall time. The "raw limit" row
is what the server takes with no checkpoint format at all: each rank PUTs (then GETs) its share
as whole ``part_size`` objects, all at once, through s3fs.

A second table (full runs only) sweeps the S3 backend's ``part_size`` and ``max_concurrency``,
to check the defaults on this setup.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from benchmarks.common import (
    MiB,
    alternate,
    bench_dir,
    bench_main,
    clear_state_cache,
    collective_time,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    is_smoke,
    layout_bytes,
    make_sharded_state,
    median,
    run_ranks,
    sized,
)
from shardstore import ShardReader, ShardWriter
from shardstore.backends.s3 import DEFAULT_MAX_CONCURRENCY, DEFAULT_PART_SIZE, S3Backend
from shardstore.config import WriteOptions

logger = logging.getLogger(__name__)

WORLD = 2
DTYPES = ("bfloat16", "float32")
NTENSORS = 32
BUCKET = "shardstore-bench"
LOOPBACK = "127.0.0.1"
MOTO_START_S = 60.0

#: DCP writer variants: the default (one I/O thread per rank) and one with as many threads as
#: ShardWriter uses files per rank, so the comparison is not only "threads vs no threads".
DCP_THREADS = (1, WriteOptions().threads)


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


_LOG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


def _operation(method: str, target: str) -> str:
    """The S3 operation of one logged request (close enough to tell the traffic apart)."""
    path, _, query = target.partition("?")
    params = {p.partition("=")[0] for p in query.split("&") if p}
    is_bucket = path.strip("/").count("/") == 0
    if method == "PUT":
        return "UploadPart" if "partNumber" in params else "PutObject"
    if method == "POST":
        if "uploads" in params:
            return "CreateMultipartUpload"
        if "uploadId" in params:
            return "CompleteMultipartUpload"
        return "DeleteObjects" if "delete" in params else "POST"
    if method == "GET":
        if "uploads" in params:
            return "ListMultipartUploads"
        return "ListObjects" if is_bucket else "GetObject"
    if method == "HEAD":
        return "HeadBucket" if is_bucket else "HeadObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in params else "DeleteObject"
    return method


class MotoServer:
    """``python -m moto.server`` on ``127.0.0.1:<free port>``, its request log in a file.

    The server runs in its own interpreter, so it competes with the ranks for the CPU but not
    for a GIL. :meth:`cut` returns the requests logged since the previous cut.

    Args:
        logdir: Folder for the request log.
    """

    def __init__(self, logdir: str) -> None:
        self.endpoint_url = f"http://{LOOPBACK}:{_free_port()}"
        self.storage_options: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        self._log_path = os.path.join(logdir, "moto-requests.log")
        self._log_out = open(self._log_path, "wb")
        port = self.endpoint_url.rpartition(":")[2]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", port],
            stdout=self._log_out,
            stderr=subprocess.STDOUT,
        )
        self._log_in = open(self._log_path, errors="replace")
        self._pending = ""
        self._marks = 0
        deadline = time.monotonic() + MOTO_START_S
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # it answers: up
            except (urllib.error.URLError, OSError) as e:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.endpoint_url}: {e}") from e
                time.sleep(0.05)

    def _request(self, method: str, path: str) -> None:
        req = urllib.request.Request(f"{self.endpoint_url}{path}", method=method)
        urllib.request.urlopen(req, timeout=30).close()

    def create_bucket(self, name: str) -> None:
        """Create a bucket (moto checks no signatures unless told to)."""
        self._request("PUT", f"/{name}")

    def cut(self) -> collections.Counter[str]:
        """Requests logged since the previous cut, by S3 operation.

        A sentinel ``HEAD /<bucket>?bench-mark=<n>`` is sent and the log read up to its line.
        Werkzeug logs a request after answering it, so a short pause first lets the handler
        threads of requests already answered write their lines.
        """
        self._marks += 1
        token = f"bench-mark={self._marks}"
        time.sleep(0.05)
        self._request("HEAD", f"/{BUCKET}?{token}")
        counts: collections.Counter[str] = collections.Counter()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = self._pending + self._log_in.read()
            lines = text.split("\n")
            self._pending = lines.pop()
            for i, line in enumerate(lines):
                if token in line:
                    self._pending = "\n".join(lines[i + 1:] + [self._pending])
                    return counts
                m = _LOG_LINE.search(line)
                if m and "bench-mark=" not in m.group(2) and not m.group(2).startswith("/moto-api"):
                    counts[_operation(m.group(1), m.group(2))] += 1
            time.sleep(0.01)
        raise RuntimeError(f"moto's request log {self._log_path} never showed the sentinel {token}")

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the server process has used so far."""
        with open(f"/proc/{self._proc.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log_in.close()
        self._log_out.close()


@contextlib.contextmanager
def moto_server(logdir: str) -> Iterator[MotoServer]:
    """A :class:`MotoServer` with the benchmark bucket, stopped afterwards."""
    server = MotoServer(logdir)
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- on every rank


#: Long-lived root backends of this rank process, by options (the "client reused" cases).
_ROOTS: dict[str, S3Backend] = {}


def _root(so: dict[str, Any], opts: dict[str, Any]) -> S3Backend:
    """This process's long-lived backend on the bucket: its S3 client is made once, then reused."""
    key = json.dumps([so, opts], sort_keys=True)
    if key not in _ROOTS:
        _ROOTS[key] = S3Backend(f"s3://{BUCKET}", storage_options=so, **opts)
        _ROOTS[key].exists(".warm")  # creates the client and opens a connection
    return _ROOTS[key]


@contextlib.contextmanager
def _storage(url: str, kind: str, so: dict[str, Any], opts: dict[str, Any]) -> Iterator[S3Backend]:
    """The backend a case uses: a new one per save/load (``shardstore``), or a child of the
    process's long-lived root backend, sharing its client (``shardstore-reuse``, what
    ``CheckpointManager`` does)."""
    if kind == "shardstore-reuse":
        yield _root(so, opts).child(url.removeprefix(f"s3://{BUCKET}/"))
        return
    backend = S3Backend(url, storage_options=so, **opts)
    try:
        yield backend
    finally:
        backend.close()


def _collective(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``collective_time`` plus this process's CPU seconds (all its threads) over the same span."""
    cpu0 = time.process_time()
    seconds, result = collective_time(fn)
    return seconds, time.process_time() - cpu0, result


def rank_warm(so: dict[str, Any], opts: dict[str, Any]) -> None:
    """Load botocore's S3 model, open s3fs's cached filesystem and the long-lived root backend."""
    import fsspec.core

    with _storage(f"s3://{BUCKET}/warm", "shardstore", so, opts) as backend:
        backend.list()
    _root(so, opts)
    fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}", **so)
    fs.ls(BUCKET)


def rank_child_shares_client(so: dict[str, Any]) -> bool:
    """Whether ``S3Backend.child`` shares its parent's S3 client and in-flight limit here."""
    root = _root(so, {"part_size": DEFAULT_PART_SIZE, "max_concurrency": DEFAULT_MAX_CONCURRENCY})
    child = root.child("probe")
    return child._fs is root._fs and child._slots is root._slots


def rank_save(url: str, kind: str, total: int, so: dict[str, Any], opts: dict[str, Any]) -> tuple[float, float]:
    """Save this rank's shards to ``url``; return (seconds, CPU seconds), writer creation included."""
    state = make_sharded_state(total, DTYPES, NTENSORS, seed=0, cache=True)

    def save() -> None:
        if kind == "dcp":
            dcp.save(state, storage_writer=FsspecWriter(url, thread_count=opts["thread_count"], **so))
            return
        with _storage(url, kind, so, opts) as backend:
            dcp.save(state, storage_writer=ShardWriter(backend))

    seconds, cpu, _ = _collective(save)
    return seconds, cpu


def rank_load(url: str, kind: str, total: int, so: dict[str, Any], opts: dict[str, Any]) -> tuple[float, float]:
    """Load ``url`` into empty shards; return (seconds, CPU seconds); raise if a shard differs."""
    state = make_sharded_state(total, DTYPES, NTENSORS, empty=True, cache=True)

    def load() -> None:
        if kind == "dcp":
            dcp.load(state, storage_reader=FsspecReader(url, **so))
            return
        with _storage(url, kind, so, opts) as backend:
            dcp.load(state, storage_reader=ShardReader(backend))

    seconds, cpu, _ = _collective(load)
    want = make_sharded_state(total, DTYPES, NTENSORS, seed=0, cache=True)
    bad = [k for k in want if not torch.equal(state[k].to_local(), want[k].to_local())]
    if bad:
        raise RuntimeError(f"rank {dist.get_rank()}: {kind} load of {url} returned wrong values for {bad[:3]}")
    return seconds, cpu


def rank_raw(url: str, op: str, nbytes: int, part: int, so: dict[str, Any]) -> tuple[float, float]:
    """The server's limit: PUT (or GET) this rank's share as whole ``part``-byte objects at once."""
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(url, **so)
    rank = dist.get_rank()
    part = min(part, nbytes)
    count = max(1, -(-nbytes // part))
    paths = [f"{root}/r{rank}-{i}" for i in range(count)]
    if op == "put":
        body = os.urandom(part)
        seconds, cpu, _ = _collective(lambda: fs.pipe({p: body for p in paths}))
        return seconds, cpu
    seconds, cpu, got = _collective(lambda: fs.cat(paths))
    if sum(len(v) for v in got.values()) != count * part:
        raise RuntimeError(f"rank {rank}: raw GETs of {url} returned {sum(len(v) for v in got.values())} bytes")
    return seconds, cpu


def rank_clear() -> None:
    """Free the states and close the backends this benchmark kept in the rank processes."""
    clear_state_cache()
    while _ROOTS:
        _ROOTS.popitem()[1].close()


# --------------------------------------------------------------------------- driver


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One repetition of one case: slowest rank's seconds, CPU seconds, the server's requests."""

    seconds: float
    ranks_cpu: float
    server_cpu: float
    requests: collections.Counter[str]


class _Cases:
    """Timed cases that also record each repetition's CPU use and server requests."""

    def __init__(self, server: MotoServer) -> None:
        self.server = server
        self.samples: dict[str, list[_Sample]] = collections.defaultdict(list)

    def timed(self, name: str, fn: Callable[[], list[tuple[float, float]]],
              after: Callable[[], None] | None = None) -> Callable[[], float]:
        """A case for :func:`alternate`: ``fn`` returns every rank's (seconds, CPU seconds)."""

        def case() -> float:
            self.server.cut()  # anything stray before the case is not its traffic
            cpu0 = self.server.cpu_seconds()
            results = fn()
            requests = self.server.cut()
            sample = _Sample(max(r[0] for r in results), sum(r[1] for r in results),
                             self.server.cpu_seconds() - cpu0, requests)
            self.samples[name].append(sample)
            if after is not None:
                after()
            return sample.seconds

        return case

    def median(self, name: str, what: str) -> float:
        """Median over the repetitions of ``seconds``, ``ranks_cpu``, ``server_cpu`` or ``requests``."""
        if what == "requests":
            return median([sum(s.requests.values()) for s in self.samples[name]])
        return median([getattr(s, what) for s in self.samples[name]])

    def breakdown(self, name: str) -> str:
        """The requests of the case's last repetition, by operation."""
        last = self.samples[name][-1].requests
        return ", ".join(f"{n} {op}" for op, n in last.most_common())

    def row(self, name: str, nbytes: int) -> list[str]:
        """MB/s, time, requests, requests/s, ranks' and server's CPU seconds of a case."""
        t = self.median(name, "seconds")
        n = self.median(name, "requests")
        return [_mbps(nbytes, t), fmt_seconds(t), f"{n:.0f}", f"{n / t:.1f}",
                f"{self.median(name, 'ranks_cpu'):.2f}", f"{self.median(name, 'server_cpu'):.2f}"]


def _delete(server: MotoServer, url: str) -> None:
    """Remove every object below ``url`` (not timed; keeps moto's memory flat)."""
    backend = S3Backend(url, storage_options=server.storage_options)
    try:
        backend.delete(backend.list())
    finally:
        backend.close()


def _mbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:.0f} MB/s"


def _keep_last(server: MotoServer) -> Callable[[str], None]:
    """A function that deletes the previously given checkpoint URL each time it gets a new one."""
    kept: list[str] = []

    def keep(url: str) -> None:
        kept.append(url)
        while len(kept) > 1:
            _delete(server, kept.pop(0))

    return keep


def _reuse_note(shares: bool | None) -> str:
    """What the 'client reused' rows mean, and whether ``S3Backend.child`` really shares the client."""
    if shares is None:
        return ""
    text = ("'root.child(name)' is a child of a backend the rank made once (before timing) for the bucket, as "
            "CheckpointManager does, meant to share its S3 client and connections (DCP's s3fs filesystem is "
            "likewise made once per process and cached by fsspec). ")
    if shares:
        return text + "Checked: the child shares its root's client. "
    return text + ("Checked: it does NOT here (S3Backend.child() builds a new client and in-flight limit), so "
                   "that row pays for a new client too. ")


def _bottleneck(cases: _Cases, nbytes: int, load0: float, load1: float) -> str:
    """What the CPU numbers say about the limit, in one note."""

    def ms_per_mb(name: str, what: str) -> str:
        return f"{cases.median(name, what) / (nbytes / 1e6) * 1e3:.1f}"

    def busy(name: str, what: str, n: int = 1) -> float:
        return cases.median(name, what) / cases.median(name, "seconds") / n

    cores = os.cpu_count() or 1
    used = {op: (busy(f"{op} shardstore", "server_cpu") + busy(f"{op} shardstore", "ranks_cpu")) / cores
            for op in ("save", "load")}
    if max(load0, load1) > cores or min(used.values()) > 0.7:
        verdict = (f"What limits throughput here is CPU, not the loopback network: moto is one Python process "
                   f"(its request handling holds one GIL, so at most one core) on a {cores}-core machine that it "
                   "shares with both ranks")
    else:
        verdict = (f"The machine's {cores} cores were not saturated: at this size fixed per-save costs (client "
                   "set-up, listing, metadata round trips) weigh as much as bandwidth; moto is one Python process "
                   "(at most one core)")
    return (
        f"{verdict} (1-min load average {load0:.1f} before, {load1:.1f} after the cases; above {cores} means "
        f"processes waited for a core). During the shardstore save moto used {busy('save shardstore', 'server_cpu'):.0%} "
        f"of a core and the ranks {busy('save shardstore', 'ranks_cpu', WORLD):.0%} each; during its load "
        f"{busy('load shardstore', 'server_cpu'):.0%} and {busy('load shardstore', 'ranks_cpu', WORLD):.0%}. "
        f"CPU per MB, shardstore vs DCP: save moto {ms_per_mb('save shardstore', 'server_cpu')} vs "
        f"{ms_per_mb('save dcp-t1', 'server_cpu')} ms, ranks {ms_per_mb('save shardstore', 'ranks_cpu')} vs "
        f"{ms_per_mb('save dcp-t1', 'ranks_cpu')} ms; load moto {ms_per_mb('load shardstore', 'server_cpu')} vs "
        f"{ms_per_mb('load dcp-t1', 'server_cpu')} ms, ranks {ms_per_mb('load shardstore', 'ranks_cpu')} vs "
        f"{ms_per_mb('load dcp-t1', 'ranks_cpu')} ms."
    )


def _compare(server: MotoServer, total: int, reps: int, *, quick: bool) -> dict[str, Any]:
    so = server.storage_options
    nbytes = layout_bytes(total, DTYPES, NTENSORS)
    per_rank = nbytes // WORLD
    raw_part = min(DEFAULT_PART_SIZE, per_rank)
    cases = _Cases(server)
    default = {"part_size": DEFAULT_PART_SIZE, "max_concurrency": DEFAULT_MAX_CONCURRENCY}
    kinds: dict[str, tuple[str, dict[str, Any]]] = {"shardstore": ("shardstore", default)}
    if not is_smoke():
        kinds["shardstore-reuse"] = ("shardstore-reuse", default)
    dcp_threads = DCP_THREADS[:1] if quick else DCP_THREADS
    for n in dcp_threads:
        kinds[f"dcp-t{n}"] = ("dcp", {"thread_count": n})
    counter = itertools.count()
    latest: dict[str, str] = {}
    keepers = {name: _keep_last(server) for name in kinds}

    def save(name: str) -> list[tuple[float, float]]:
        kind, opts = kinds[name]
        latest[name] = f"s3://{BUCKET}/save-{name}-{next(counter)}"
        return run_ranks(WORLD, rank_save, latest[name], kind, total, so, opts)

    def load(name: str) -> list[tuple[float, float]]:
        kind, opts = kinds[name]
        return run_ranks(WORLD, rank_load, latest[name], kind, total, so, opts)

    def raw(op: str) -> list[tuple[float, float]]:
        return run_ranks(WORLD, rank_raw, f"s3://{BUCKET}/raw", op, per_rank, raw_part, so)

    save_cases = {f"save {n}": cases.timed(f"save {n}", functools.partial(save, n),
                                           lambda n=n: keepers[n](latest[n])) for n in kinds}
    load_cases = {f"load {n}": cases.timed(f"load {n}", functools.partial(load, n))
                  for n in kinds if n.startswith("shardstore") or n == "dcp-t1"}
    if not is_smoke():
        save_cases["save raw"] = cases.timed("save raw", functools.partial(raw, "put"))
        load_cases["load raw"] = cases.timed("load raw", functools.partial(raw, "get"))
    shares = None if "shardstore-reuse" not in kinds else all(run_ranks(WORLD, rank_child_shares_client, so))
    load0 = os.getloadavg()[0]
    alternate(save_cases, reps=reps)
    alternate(load_cases, reps=reps)
    load1 = os.getloadavg()[0]
    for url in [*latest.values(), f"s3://{BUCKET}/raw"]:
        _delete(server, url)

    parts = f"part_size={fmt_bytes(DEFAULT_PART_SIZE)}, max_concurrency={DEFAULT_MAX_CONCURRENCY}"
    labels = {
        "save shardstore": f"ShardWriter(S3Backend(url, {parts}))",
        "save shardstore-reuse": "ShardWriter(root.child(name)): S3 client reused",
        **{f"save dcp-t{n}": f"DCP FsspecWriter(thread_count={n})" for n in dcp_threads},
        "save raw": f"raw limit: concurrent PutObject of {fmt_bytes(raw_part)}",
        "load shardstore": f"ShardReader(S3Backend(url, {parts}))",
        "load shardstore-reuse": "ShardReader(root.child(name)): S3 client reused",
        "load dcp-t1": "DCP FsspecReader",
        "load raw": f"raw limit: concurrent GetObject of {fmt_bytes(raw_part)}",
    }
    rows = []
    for name, label in labels.items():
        if name not in cases.samples:
            continue
        op = name.split()[0]
        ratio = cases.median(f"{op} dcp-t1", "seconds") / cases.median(name, "seconds")
        rows.append([op, label, *cases.row(name, nbytes), fmt_ratio(ratio)])

    def ms_per_mb(name: str, what: str) -> str:
        return f"{cases.median(name, what) / (nbytes / 1e6) * 1e3:.1f}"

    def busy(name: str, what: str) -> str:
        return f"{cases.median(name, what) / cases.median(name, 'seconds'):.0%}"

    s_ratio = cases.median("save dcp-t1", "seconds") / cases.median("save shardstore", "seconds")
    l_ratio = cases.median("load dcp-t1", "seconds") / cases.median("load shardstore", "seconds")
    return {
        "title": f"S3 (moto server, loopback): {WORLD} ranks, {fmt_bytes(nbytes)} of bf16/fp32 DTensor shards "
                 f"({NTENSORS} tensors)",
        "columns": ["operation", "writer / reader", "MB/s", "time", "requests", "requests/s",
                    "ranks CPU s", "moto CPU s", "vs DCP default"],
        "rows": rows,
        "notes": [
            f"Medians of {reps} alternated repetitions; time is the slowest rank's, between barriers, with the "
            "writer/reader created inside it. 'S3Backend(url, ...)' is what ShardWriter(url) does: a new S3 "
            "client per save/load. " + _reuse_note(shares) + "MB/s = checkpoint tensor bytes / time "
            "(decimal MB). 'vs DCP default' = DCP FsspecWriter(thread_count=1)/FsspecReader time / this row's "
            "time; > 1 means faster (targets for shardstore: >= 2x). Every load was checked equal to the saved "
            "shards.",
            "Requests are counted from moto's request log (one line per HTTP request, cut between cases by a "
            "sentinel request); requests/s = requests / time. CPU s: CPU seconds used during the case by both "
            "rank processes together (all threads) and by the moto server process.",
            f"Requests of one repetition: shardstore save: {cases.breakdown('save shardstore')}. "
            f"DCP save: {cases.breakdown('save dcp-t1')}. shardstore load: {cases.breakdown('load shardstore')}. "
            f"DCP load: {cases.breakdown('load dcp-t1')}.",
            "Raw limit: each rank PUTs (GETs) its share as whole objects, all at once through s3fs (no multipart, "
            "no ranges, no format): what this server takes from the same 2 client processes.",
            _bottleneck(cases, nbytes, load0, load1),
            "Where moto's CPU goes (py-spy): UploadPart reads the body, MD5s it and writes it to a temp file; "
            "CompleteMultipartUpload joins all parts in Python (several full copies plus another temp-file write "
            "and MD5), so a multipart object costs moto about twice a single PutObject per byte; and every ranged "
            "GET reads the whole object from its temp file before slicing, so k ranges of one object cost k times "
            "its size. None of this exists on real S3, where the server side scales out and per-request latency, "
            "not server CPU, is what parallel requests hide.",
        ],
        "plot": {"x": "writer / reader", "y": ["MB/s"], "kind": "bar", "ylabel": "MB/s (decimal)"},
        "summary": [
            [f"S3 save {WORLD} ranks (moto)", _mbps(nbytes, cases.median("save shardstore", "seconds")),
             _mbps(nbytes, cases.median("save dcp-t1", "seconds")), fmt_ratio(s_ratio)],
            [f"S3 load {WORLD} ranks (moto)", _mbps(nbytes, cases.median("load shardstore", "seconds")),
             _mbps(nbytes, cases.median("load dcp-t1", "seconds")), fmt_ratio(l_ratio)],
        ],
    }


def _sweep(server: MotoServer, total: int, reps: int, configs: list[tuple[int, int]]) -> dict[str, Any]:
    so = server.storage_options
    nbytes = layout_bytes(total, DTYPES, NTENSORS)
    cases = _Cases(server)
    names = {f"{fmt_bytes(p)} x {c}": {"part_size": p, "max_concurrency": c} for p, c in configs}
    counter = itertools.count()
    latest: dict[str, str] = {}
    keepers = {name: _keep_last(server) for name in names}

    def save(name: str) -> list[tuple[float, float]]:
        latest[name] = f"s3://{BUCKET}/sweep-{next(counter)}"
        return run_ranks(WORLD, rank_save, latest[name], "shardstore-reuse", total, so, names[name])

    def load(name: str) -> list[tuple[float, float]]:
        return run_ranks(WORLD, rank_load, latest[name], "shardstore-reuse", total, so, names[name])

    for opts in names.values():
        run_ranks(WORLD, rank_warm, so, opts)
    alternate({n: cases.timed(f"save {n}", functools.partial(save, n), lambda n=n: keepers[n](latest[n]))
               for n in names}, reps=reps)
    alternate({n: cases.timed(f"load {n}", functools.partial(load, n)) for n in names}, reps=reps)
    for url in latest.values():
        _delete(server, url)
    default = f"{fmt_bytes(DEFAULT_PART_SIZE)} x {DEFAULT_MAX_CONCURRENCY}"
    ref = default if default in names else next(iter(names))
    rows = []
    for n, opts in names.items():
        s = cases.median(f"save {n}", "seconds")
        l = cases.median(f"load {n}", "seconds")
        rows.append([
            fmt_bytes(opts["part_size"]), opts["max_concurrency"],
            _mbps(nbytes, s), f"{cases.median(f'save {n}', 'requests'):.0f}",
            f"{cases.median(f'save {n}', 'server_cpu'):.2f}", fmt_ratio(cases.median(f"save {ref}", "seconds") / s),
            _mbps(nbytes, l), f"{cases.median(f'load {n}', 'requests'):.0f}",
            f"{cases.median(f'load {n}', 'server_cpu'):.2f}", fmt_ratio(cases.median(f"load {ref}", "seconds") / l),
        ])
    best_s = min(names, key=lambda n: cases.median(f"save {n}", "seconds"))
    best_l = min(names, key=lambda n: cases.median(f"load {n}", "seconds"))
    file_size = nbytes / WORLD / WriteOptions().threads
    return {
        "title": f"S3 (moto): S3Backend part_size x max_concurrency, {WORLD} ranks, {fmt_bytes(nbytes)}",
        "columns": ["part_size", "max_concurrency", "save MB/s", "save requests", "save moto CPU s",
                    f"save vs {ref}", "load MB/s", "load requests", "load moto CPU s", f"load vs {ref}"],
        "rows": rows,
        "notes": [
            "ShardWriter/ShardReader given a child of a long-lived S3Backend(bucket, part_size=..., "
            f"max_concurrency=...) per rank (client made before timing); medians of {reps} "
            f"alternated repetitions. Fastest here: save {best_s}, load {best_l} (default {default}).",
            f"Each rank writes {WriteOptions().threads} data objects of about {fmt_bytes(file_size)}. part_size is "
            "also the size of one ranged GET; max_concurrency bounds parts in flight per rank (writes) and GETs "
            "in flight per merged range (reads). On moto, fewer and larger GETs cost less server CPU (each ranged "
            "GET reads the whole object); on real S3 smaller parts and more concurrency hide latency instead.",
        ],
    }


def run(quick: bool) -> list[dict[str, Any]]:
    """S3 save/load: ShardWriter/ShardReader vs DCP FsspecWriter/FsspecReader on one moto server."""
    total = sized(quick, full=384 * MiB, quick_size=96 * MiB, smoke=4 * MiB)
    reps = sized(quick, full=5, quick_size=2, smoke=1)
    sweep_total = sized(quick, full=256 * MiB, quick_size=96 * MiB, smoke=4 * MiB)
    sweep_reps = sized(quick, full=3, quick_size=1, smoke=1)
    configs = sized(
        quick,
        full=[(8 * MiB, 8), (16 * MiB, 4), (16 * MiB, 8), (16 * MiB, 16), (32 * MiB, 8), (64 * MiB, 8)],
        quick_size=[],
        smoke=[],
    )
    t0 = time.perf_counter()
    with bench_dir("s3") as d, moto_server(d) as server:
        try:
            logger.info("moto server up at %s after %.1f s", server.endpoint_url, time.perf_counter() - t0)
            default = {"part_size": DEFAULT_PART_SIZE, "max_concurrency": DEFAULT_MAX_CONCURRENCY}
            run_ranks(WORLD, rank_warm, server.storage_options, default)
            logger.info("ranks warm after %.1f s", time.perf_counter() - t0)
            tables = [_compare(server, total, reps, quick=quick or is_smoke())]
            logger.info("comparison done after %.1f s", time.perf_counter() - t0)
            if configs:
                tables.append(_sweep(server, sweep_total, sweep_reps, configs))
                logger.info("sweep done after %.1f s", time.perf_counter() - t0)
        finally:
            run_ranks(WORLD, rank_clear)
    return tables


if __name__ == "__main__":
    bench_main(run)
