"""The Backend contract, written once and run against every backend.

Each backend only supplies a :class:`Case` through the ``case`` fixture: POSIX on ``tmp_path``,
fsspec on ``memory://`` (a unique root per test) and S3 on moto (a fresh bucket per test). The S3
case also reports open multipart uploads, so "abort leaves nothing" covers those too.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from shardstore.backends import Backend, open_backend
from shardstore.backends.s3 import MIN_PART_SIZE, S3Backend
from shardstore.errors import CheckpointExistsError, InvalidCheckpointError, TruncatedFileError

PART = MIN_PART_SIZE  # S3 part size used here: the smallest S3 allows, so 11 MiB is 3 parts


@dataclass
class Case:
    backend: Backend
    open_uploads: Callable[[], list] = list  # multipart uploads still open (S3 only)


@pytest.fixture(params=["posix", "memory", "s3"])
def case(request, tmp_path) -> Iterator[Case]:
    if request.param == "posix":
        yield Case(open_backend(str(tmp_path / "root")))
    elif request.param == "memory":
        url = f"memory://contract-{uuid.uuid4().hex}/root"
        backend = open_backend(url)
        yield Case(backend)
        import fsspec

        fs = fsspec.filesystem("memory")
        top = url.removeprefix("memory://").split("/")[0]
        if fs.exists(top):
            fs.rm(top, recursive=True)
    else:
        s3 = request.getfixturevalue("s3_url")
        backend = S3Backend(s3.url, storage_options=s3.storage_options, part_size=PART,
                            max_concurrency=4)
        assert isinstance(open_backend(s3.url, s3.storage_options), S3Backend)
        yield Case(backend, s3.open_uploads)
        backend.close()


def payload(n: int, seed: int = 0) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n] if seed == 0 else os.urandom(n)


def write(backend: Backend, path: str, data: bytes, chunk: int = 1 << 20) -> None:
    with backend.open_writer(path) as w:
        for i in range(0, len(data), chunk):
            w.write(memoryview(data)[i:i + chunk])


def test_write_then_read_ranges(case: Case) -> None:
    b = case.backend
    data = os.urandom(1000)
    write(b, "rank0/data.bin", data, chunk=300)
    got = b.read_ranges("rank0/data.bin", [(0, 10), (990, 10), (123, 456), (0, 1000), (5, 0)])
    assert [bytes(g) for g in got] == [data[:10], data[990:], data[123:579], data, b""]
    assert b.size("rank0/data.bin") == 1000
    assert b.exists("rank0/data.bin")


def test_multipart_file_round_trips(case: Case) -> None:
    b = case.backend
    data = os.urandom(2 * PART + 12345)  # three parts on S3, written in odd-sized chunks
    write(b, "big.bin", data, chunk=777_777)
    assert b.size("big.bin") == len(data)
    ranges = [(0, len(data)), (PART - 3, 6), (PART - 100, PART + 200), (len(data) - 1, 1)]
    got = b.read_ranges("big.bin", ranges)
    assert [bytes(g) for g in got] == [data[s:s + n] for s, n in ranges]
    assert case.open_uploads() == []


def test_empty_file(case: Case) -> None:
    b = case.backend
    w = b.open_writer("empty")
    w.close()
    assert b.exists("empty") and b.size("empty") == 0
    assert [bytes(x) for x in b.read_ranges("empty", [(0, 0)])] == [b""]


def test_reopening_a_writer_replaces_the_file(case: Case) -> None:
    b = case.backend
    write(b, "f", b"first version")
    write(b, "f", b"second")
    assert bytes(b.read_ranges("f", [(0, 6)])[0]) == b"second"
    assert b.size("f") == 6


@pytest.mark.parametrize("start,length", [(90, 20), (100, 1), (500, 10)])
def test_short_read_raises_truncated(case: Case, start: int, length: int) -> None:
    b = case.backend
    write(b, "short.bin", payload(100))
    with pytest.raises(TruncatedFileError, match="short.bin"):
        b.read_ranges("short.bin", [(0, 10), (start, length)])


def test_missing_files(case: Case) -> None:
    b = case.backend
    assert not b.exists("nope")
    with pytest.raises(FileNotFoundError):
        b.size("nope")
    with pytest.raises(FileNotFoundError):
        b.read_small("nope")
    assert b.list() == []
    assert b.list("nope") == []


def test_publish_never_overwrites_without_overwrite(case: Case) -> None:
    b = case.backend
    b.publish("index", b"first", overwrite=False)
    with pytest.raises(CheckpointExistsError, match="index"):
        b.publish("index", b"second", overwrite=False)
    assert b.read_small("index") == b"first"
    b.publish("index", b"third", overwrite=True)
    assert b.read_small("index") == b"third"
    assert b.list() == ["index"]


def test_list_is_recursive_relative_and_sorted(case: Case) -> None:
    b = case.backend
    for path in ["z", "a/2", "a/1", "a/b/c", "ab"]:
        write(b, path, path.encode())
    assert b.list() == ["a/1", "a/2", "a/b/c", "ab", "z"]
    assert b.list("a") == ["a/1", "a/2", "a/b/c"]
    assert b.list("a/b") == ["a/b/c"]
    assert b.list("z") == ["z"]


def test_delete_ignores_missing(case: Case) -> None:
    b = case.backend
    for path in ["x/1", "x/2", "y"]:
        write(b, path, b"data")
    b.delete(["x/1", "y", "never-existed"])
    assert b.list() == ["x/2"]
    assert not b.exists("x/1") and b.exists("x/2")
    b.delete([])
    b.delete(b.list())
    assert b.list() == []


def test_child_is_rooted_at_the_sub_directory(case: Case) -> None:
    b = case.backend
    step = b.child("step-100")
    assert step.url == f"{b.url}/step-100"
    write(step, "rank0/data", b"payload")
    step.publish("index", b"idx", overwrite=False)
    assert step.list() == ["index", "rank0/data"]
    assert b.list() == ["step-100/index", "step-100/rank0/data"]
    assert b.read_small("step-100/index") == b"idx"
    assert bytes(b.child("step-100").child("rank0").read_ranges("data", [(0, 7)])[0]) == b"payload"
    with pytest.raises(CheckpointExistsError):
        b.publish("step-100/index", b"other", overwrite=False)


def test_abort_leaves_nothing(case: Case) -> None:
    b = case.backend
    small = b.open_writer("small")
    small.write(b"partial")
    small.abort()
    big = b.open_writer("big")  # past one part: on S3 a multipart upload is open now
    big.write(payload(PART + 1000))
    big.write(payload(10))
    big.abort()
    big.abort()  # idempotent
    with pytest.raises(RuntimeError):  # the context manager aborts on an exception
        with b.open_writer("ctx") as w:
            w.write(payload(PART + 1))
            raise RuntimeError("serialisation failed")
    assert b.list() == []
    assert not b.exists("big")
    assert case.open_uploads() == []


@pytest.mark.parametrize("bad", ["../escape", "/abs", "a/../../b", "", "a//b", "c:/x"])
def test_paths_cannot_leave_the_root(case: Case, bad: str) -> None:
    b = case.backend
    with pytest.raises(InvalidCheckpointError):
        b.open_writer(bad)
    with pytest.raises(InvalidCheckpointError):
        b.read_ranges(bad, [(0, 1)])
    with pytest.raises(InvalidCheckpointError):
        b.publish(bad, b"x", overwrite=True)
    with pytest.raises(InvalidCheckpointError):
        b.child(bad)


def test_s3_child_shares_the_parent_client_and_in_flight_limit(s3_url):
    root = s3_url.backend()
    child = root.child("step-1")
    assert child._fs is root._fs and child._slots is root._slots
    assert child.url == f"{root.url}/step-1"
