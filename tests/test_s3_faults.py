"""S3-specific behaviour against moto over HTTP: faults, clear errors, concurrency, configuration.

Faults come from the :class:`~s3server.FaultProxy` between the client and moto (``faulty_s3``):
503 SlowDown, 500 InternalError, connections reset before forwarding, and "lost" answers (the
request took effect, the client never hears). What is really stored is always checked straight
against moto, never through the backend under test.
"""

from __future__ import annotations

import os
import pickle
import random
import time
import tracemalloc
from collections.abc import Callable

import pytest
from s3server import S3Location, free_port, moto_location

from shardstore.backends.retry import RetryPolicy
from shardstore.backends.s3 import MIN_PART_SIZE, S3Backend
from shardstore.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    StorageAccessDeniedError,
    StorageError,
    StorageUnreachableError,
)

PART = MIN_PART_SIZE
QUICK = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)  # where slowness isn't the point


def write(backend: S3Backend, path: str, data: bytes, chunk: int = 1 << 20) -> None:
    with backend.open_writer(path) as w:
        for i in range(0, len(data), chunk):
            w.write(memoryview(data)[i:i + chunk])


def round_trip(backend: S3Backend, files: dict[str, bytes], seed: int = 0) -> None:
    """Write ``files`` and an index, then read everything back in whole and in pieces."""
    for path, data in files.items():
        write(backend, path, data)
    backend.publish("index", b"the index", overwrite=False)
    rng = random.Random(seed)
    for path, data in files.items():
        assert backend.size(path) == len(data)
        ranges = [(0, len(data))]  # whole (in part_size pieces), then small random ranges
        for _ in range(8):
            start = rng.randrange(len(data))
            ranges.append((start, rng.randrange(1, min(1 << 16, len(data) - start) + 1)))
        got = backend.read_ranges(path, ranges)
        assert [bytes(g) == data[s:s + n] for g, (s, n) in zip(got, ranges)] == [True] * len(ranges)
    assert backend.read_small("index") == b"the index"
    assert backend.list() == sorted([*files, "index"])


def once(pred: Callable[[str, str], bool]) -> Callable[[str, str], bool]:
    """A proxy filter that picks only the first request matching ``pred(method, path)``."""
    fired = []

    def when(method: str, path: str) -> bool:
        if fired or not pred(method, path):
            return False
        fired.append(path)
        return True

    return when


# -- transient faults -------------------------------------------------------------------------


def test_five_percent_faults_change_nothing(faulty_s3) -> None:
    backend = faulty_s3.backend(part_size=PART, max_concurrency=4)
    files = {f"rank{r}/data.bin": os.urandom(2 * PART + 1000 * r + 1) for r in range(2)}
    round_trip(backend, files)
    backend.delete(["rank0/data.bin"])
    assert backend.list() == ["index", "rank1/data.bin"]

    proxy = faulty_s3.proxy
    assert proxy.faults >= 3, proxy.counts  # the faults really happened...
    direct = faulty_s3.direct  # ...and what is stored is exactly what was meant
    assert direct.keys() == ["ckpt/index", "ckpt/rank1/data.bin"]
    body = direct.client().get_object(Bucket=direct.bucket, Key="ckpt/rank1/data.bin")["Body"]
    assert body.read() == files["rank1/data.bin"]
    assert direct.open_uploads() == []


LOST_ANSWERS = {  # the request took effect, but its answer never arrived; multipart?
    "create-upload": (lambda m, p: m == "POST" and p.endswith("?uploads"), True),
    "upload-part": (lambda m, p: m == "PUT" and "partNumber=" in p, True),
    "complete-upload": (lambda m, p: m == "POST" and "uploadId=" in p, True),
    "conditional-publish": (lambda m, p: m == "PUT" and p.endswith("/index"), False),
    "ranged-get": (lambda m, p: m == "GET" and "rank0" in p, False),
    "delete": (lambda m, p: m == "POST" and p.endswith("?delete"), False),
}


@pytest.mark.parametrize("request_kind", sorted(LOST_ANSWERS))
def test_lost_answers_are_recovered_exactly(faulty_s3, request_kind: str) -> None:
    """A retried request that already took effect must not fail, duplicate or orphan anything."""
    pick, multipart = LOST_ANSWERS[request_kind]
    faulty_s3.proxy.set_faults(1.0, ["lost"], when=once(pick))
    backend = faulty_s3.backend(part_size=PART)
    data = os.urandom(PART + 99 if multipart else 10_000)
    round_trip(backend, {"rank0/data.bin": data})
    with pytest.raises(CheckpointExistsError):  # the index really is there, once
        backend.publish("index", b"another index", overwrite=False)
    backend.delete(["rank0/data.bin"])

    assert faulty_s3.proxy.counts["lost"] == 1
    assert faulty_s3.direct.keys() == ["ckpt/index"]
    assert faulty_s3.direct.open_uploads() == []


# -- persistent faults: fail fast and clearly, leave nothing --------------------------------


def test_every_request_failing_fails_the_write_clearly(faulty_s3) -> None:
    faulty_s3.proxy.set_faults(1.0, ["503", "500", "reset"])
    backend = faulty_s3.backend(part_size=PART)  # the default retry policy
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        write(backend, "rank0/data.bin", os.urandom(2 * PART + 1))
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "s3://shardstore-test/ckpt/rank0/data.bin" in message
    assert "after 6 attempts" in message

    quick = faulty_s3.backend(part_size=PART, retry=QUICK)
    with pytest.raises(StorageError, match="index"):
        quick.publish("index", b"idx", overwrite=False)
    with pytest.raises(StorageError):  # a failing store is an error, never "not there"
        quick.exists("index")
    with pytest.raises(StorageError):
        quick.list()

    faulty_s3.proxy.set_faults(0.0)
    assert backend.list() == []
    assert faulty_s3.direct.keys() == []
    assert faulty_s3.direct.open_uploads() == []


def test_failing_parts_abort_the_upload(faulty_s3) -> None:
    faulty_s3.proxy.set_faults(1.0, ["500"], when=lambda m, p: "partNumber=" in p)
    backend = faulty_s3.backend(part_size=PART, retry=QUICK)
    with pytest.raises(StorageError, match=r"InternalError.*HTTP 500|after 3 attempts"):
        write(backend, "rank0/data.bin", os.urandom(3 * PART))
    assert faulty_s3.proxy.counts["500"] >= 3
    assert faulty_s3.direct.keys() == []
    assert faulty_s3.direct.open_uploads() == []


def test_missing_bucket_is_named(s3_url: S3Location) -> None:
    missing = S3Backend("s3://no-such-bucket/run", storage_options=s3_url.storage_options)
    started = time.monotonic()
    expected = f"bucket 'no-such-bucket' does not exist at {s3_url.endpoint_url}"
    for op in (lambda: missing.exists("index"), lambda: missing.read_small("index"),
               lambda: missing.list(), lambda: missing.publish("index", b"x", overwrite=False),
               lambda: write(missing, "data", b"x"),
               lambda: write(missing, "big", bytes(PART + 1))):
        with pytest.raises(BucketNotFoundError, match=expected):
            op()
    assert time.monotonic() - started < 5


def test_unreachable_endpoint_fails_fast(s3_url: S3Location) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    backend = s3_url.through(endpoint).backend()
    started = time.monotonic()
    for op in (lambda: backend.exists("index"), lambda: write(backend, "data", b"x"),
               lambda: backend.read_ranges("data", [(0, 1)])):
        with pytest.raises(StorageUnreachableError,
                           match=f"cannot reach the S3 endpoint {endpoint}"):
            op()
    assert time.monotonic() - started < 5


def test_rejected_credentials_are_explained(moto_server, s3_url: S3Location) -> None:
    """moto checks signatures and IAM policies once authentication is switched on."""
    iam = moto_server.client("iam")
    iam.create_user(UserName="writer")
    iam.put_user_policy(UserName="writer", PolicyName="s3", PolicyDocument=(
        '{"Version": "2012-10-17", "Statement": '
        '[{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'))
    good = iam.create_access_key(UserName="writer")["AccessKey"]
    iam.create_user(UserName="nobody")  # no policy: every S3 action is denied
    nobody = iam.create_access_key(UserName="nobody")["AccessKey"]
    moto_server.enable_auth()  # s3_url resets it for the next test

    def backend(key: str, secret: str) -> S3Backend:
        return S3Backend(s3_url.url, storage_options={**s3_url.storage_options, "key": key,
                                                      "secret": secret}, retry=QUICK)

    ok = backend(good["AccessKeyId"], good["SecretAccessKey"])
    ok.publish("index", b"idx", overwrite=False)
    assert ok.read_small("index") == b"idx"

    cases = [
        (backend(good["AccessKeyId"], "wrong-secret"), "SignatureDoesNotMatch"),
        (backend("AKIAUNKNOWNKEY000000", "whatever"), "InvalidAccessKeyId"),
        (backend(nobody["AccessKeyId"], nobody["SecretAccessKey"]), "AccessDenied"),
    ]
    for denied, code in cases:
        with pytest.raises(StorageAccessDeniedError,
                           match=f"denied.*{code}.*check the credentials"):
            denied.read_small("index")
        with pytest.raises(StorageAccessDeniedError, match=code):
            write(denied, "data", b"x")


# -- concurrency and memory -----------------------------------------------------------------


def test_parts_and_ranged_gets_are_in_flight_together(faulty_s3) -> None:
    proxy = faulty_s3.proxy
    proxy.set_faults(0.0)
    proxy.latency = 0.2  # every request takes 0.2 s: overlap shows as concurrency
    backend = faulty_s3.backend(part_size=PART, max_concurrency=4)
    data = os.urandom(4 * PART)
    write(backend, "data.bin", data, chunk=PART)
    assert 3 <= proxy.max_inflight <= 4  # part uploads overlapped, never more than the limit

    proxy.max_inflight = 0
    ranges = [(i * 1000, 1000) for i in range(12)] + [(PART - 10, 2 * PART + 20)]
    got = backend.read_ranges("data.bin", ranges)
    assert [bytes(g) for g in got] == [data[s:s + n] for s, n in ranges]
    assert 3 <= proxy.max_inflight <= 4


def test_write_memory_is_bounded_by_parts_in_flight(s3_url: S3Location) -> None:
    backend = s3_url.backend(part_size=PART, max_concurrency=2)
    chunk = memoryview(os.urandom(1 << 20))
    backend.exists("warm-up")  # create the client outside the measurement
    tracemalloc.start()
    try:
        with backend.open_writer("big.bin") as w:
            for _ in range(8 * PART // len(chunk)):  # 40 MiB written
                w.write(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert backend.size("big.bin") == 8 * PART
    # 2 parts in flight + the one being filled (+ BytesIO's over-allocation); not the 8 written
    assert peak < 3.5 * PART, f"peak {peak / PART:.1f} parts"


# -- configuration ----------------------------------------------------------------------------


def test_endpoint_and_credentials_from_environment(s3_url: S3Location, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_url.endpoint_url)
    backend = S3Backend(s3_url.url)  # no storage_options at all
    backend.publish("index", b"via env", overwrite=False)
    assert s3_url.keys() == ["ckpt/index"]
    assert backend.read_small("index") == b"via env"


def test_profile_from_config_file(s3_url: S3Location, monkeypatch, tmp_path) -> None:
    config = tmp_path / "aws-config"
    config.write_text(f"[profile shardstore]\nregion = us-east-1\naws_access_key_id = testing\n"
                      f"aws_secret_access_key = testing\nendpoint_url = {s3_url.endpoint_url}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    backend = S3Backend(s3_url.url, storage_options={"profile": "shardstore"})
    backend.publish("index", b"via profile", overwrite=False)
    assert s3_url.keys() == ["ckpt/index"]
    with pytest.raises(StorageError, match="no-such-profile"):
        S3Backend(s3_url.url, storage_options={"profile": "no-such-profile"}).exists("index")


def test_key_prefix_spread(s3_url: S3Location) -> None:
    spread = s3_url.backend(key_prefix_spread=True)
    files = {f"rank{r}/data": f"rank {r}".encode() for r in range(6)}
    for path, data in files.items():
        write(spread, path, data)
    spread.publish("index", b"idx", overwrite=False)
    keys = s3_url.keys()
    assert len(keys) == 7 and len({k[0] for k in keys}) > 1  # scattered over several prefixes
    assert all(k[0] in "0123456789abcdef" and k[1:].startswith("/ckpt/") for k in keys)
    assert spread.list() == sorted([*files, "index"])
    assert spread.child("rank3").list() == ["data"]
    assert bytes(spread.child("rank3").read_ranges("data", [(0, 6)])[0]) == b"rank 3"
    with pytest.raises(CheckpointExistsError):
        spread.publish("index", b"again", overwrite=False)
    assert s3_url.backend().list() == []  # the setting must match between writer and reader
    spread.delete(spread.list())
    assert s3_url.keys() == []


def test_sweep_aborts_uploads_of_killed_writers(s3_url: S3Location) -> None:
    backend = s3_url.backend(part_size=PART)
    client = s3_url.client()
    for key in ("ckpt/rank0/data", "ckpt/step-1/rank1/data", "ckpt2/data", "elsewhere/data"):
        client.create_multipart_upload(Bucket=s3_url.bucket, Key=key)  # writers killed mid-save
    assert backend.child("step-1").abort_incomplete_uploads() == 1
    assert backend.abort_incomplete_uploads() == 1
    assert sorted(u["Key"] for u in s3_url.open_uploads()) == ["ckpt2/data", "elsewhere/data"]


def test_backend_pickles_for_other_processes(s3_url: S3Location) -> None:
    step = s3_url.backend(part_size=PART, key_prefix_spread=True).child("step-7")
    step.publish("index", b"idx", overwrite=False)
    clone = pickle.loads(pickle.dumps(step))
    assert (clone.url, clone.part_size, clone.key_prefix_spread) == (step.url, PART, True)
    assert clone.read_small("index") == b"idx"


@pytest.mark.external_s3
def test_external_endpoint_round_trip(external_s3: S3Location) -> None:
    backend = external_s3.backend(part_size=PART)
    round_trip(backend, {"rank0/data.bin": os.urandom(2 * PART + 5), "rank1/small": b"tiny"})
    with pytest.raises(CheckpointExistsError):
        backend.publish("index", b"second", overwrite=False)
    w = backend.open_writer("aborted")
    w.write(os.urandom(PART + 1))
    w.abort()
    assert not backend.exists("aborted")
    assert [u for u in external_s3.open_uploads() if u["Key"].startswith(external_s3.prefix)] == []


def test_moto_location_is_self_contained(moto_server) -> None:
    """The storage options carry endpoint and credentials, so spawned ranks need nothing else."""
    loc = moto_location(moto_server, "bucket", "run")
    assert loc.url == "s3://bucket/run"
    assert loc.storage_options["endpoint_url"] == moto_server.endpoint_url
    assert {"key", "secret"} <= set(loc.storage_options)
