"""Shared pytest fixtures.

S3 (all against a real HTTP endpoint: moto's server, started once per session):

* ``moto_server`` (session): the :class:`~s3server.MotoServer`.
* ``aws_env`` (function): dummy ``AWS_*`` credentials and region in the environment, with the
  user's ``~/.aws`` and endpoint variables hidden; ``s3_url`` uses it.
* ``s3_url`` (function): an :class:`~s3server.S3Location` with a fresh, empty bucket; moto is
  reset before each test. Use ``s3_url.url`` and ``s3_url.storage_options``; check results with
  ``s3_url.keys()`` and ``s3_url.open_uploads()``.
* ``faulty_s3`` (function): the same location reached through a fault-injecting proxy
  (:class:`FaultyS3`): 5% of requests fail by default; change with ``faulty_s3.proxy.set_faults``.
* ``external_s3`` (function): a unique prefix on the endpoint named by
  ``SHARDSTORE_TEST_S3_ENDPOINT``; tests using it must be marked ``@pytest.mark.external_s3``
  and are skipped when the variable is unset.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # s3server, also under --import-mode=importlib

from s3server import FaultProxy, MotoServer, S3Location, moto_location  # noqa: E402

TEST_BUCKET = "shardstore-test"


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("SHARDSTORE_TEST_S3_ENDPOINT"):
        return
    skip = pytest.mark.skip(reason="set SHARDSTORE_TEST_S3_ENDPOINT to run against a real S3/MinIO")
    for item in items:
        if "external_s3" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def aws_env(monkeypatch, tmp_path) -> None:
    """Dummy AWS credentials in the environment, isolated from the user's ~/.aws and endpoints."""
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config-absent"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials-absent"))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """moto's S3 server in a subprocess on 127.0.0.1, for the whole session."""
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def s3_url(moto_server: MotoServer, aws_env) -> S3Location:
    """A fresh bucket on the moto server (reset before the test); ``.url`` is ``s3://bucket/ckpt``.

    Pass ``s3_url.storage_options`` wherever a URL is opened (it holds the endpoint and the
    credentials, so spawned ranks need nothing else).
    """
    moto_server.reset()
    moto_server.create_bucket(TEST_BUCKET)
    return moto_location(moto_server, TEST_BUCKET, "ckpt")


@dataclass(frozen=True)
class FaultyS3:
    """``s3_url`` reached through a :class:`~s3server.FaultProxy`.

    Attributes:
        url / storage_options: as for ``s3_url``, but requests go through the proxy.
        proxy: the proxy; ``proxy.set_faults(rate, modes, when=...)`` changes the faults,
            ``proxy.faults`` counts the faults injected.
        direct: the same location without the proxy, for checking what is really stored.
    """

    url: str
    storage_options: dict
    proxy: FaultProxy
    direct: S3Location

    def backend(self, **kwargs):
        """An S3Backend through the proxy."""
        return self.direct.through(self.proxy.endpoint_url).backend(**kwargs)


@pytest.fixture
def faulty_s3(s3_url: S3Location) -> Iterator[FaultyS3]:
    """``s3_url`` behind a proxy that fails 5% of requests (503, 500, reset, lost answer)."""
    proxy = FaultProxy(s3_url.endpoint_url, rate=0.05, seed=1)
    through = s3_url.through(proxy.endpoint_url)
    yield FaultyS3(url=through.url, storage_options=through.storage_options, proxy=proxy,
                   direct=s3_url)
    proxy.close()


@pytest.fixture
def external_s3() -> Iterator[S3Location]:
    """A unique prefix on ``SHARDSTORE_TEST_S3_ENDPOINT`` (bucket ``SHARDSTORE_TEST_S3_BUCKET``,
    default ``shardstore-test``; credentials from the usual AWS variables); emptied afterwards."""
    endpoint = os.environ.get("SHARDSTORE_TEST_S3_ENDPOINT")
    if not endpoint:
        pytest.skip("SHARDSTORE_TEST_S3_ENDPOINT is not set")
    bucket = os.environ.get("SHARDSTORE_TEST_S3_BUCKET", TEST_BUCKET)
    prefix = f"shardstore-test-{uuid.uuid4().hex[:12]}"
    options: dict = {"endpoint_url": endpoint}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options.update(key=os.environ["AWS_ACCESS_KEY_ID"],
                       secret=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    if os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"):
        region = os.environ.get("AWS_REGION") or os.environ["AWS_DEFAULT_REGION"]
        options["client_kwargs"] = {"region_name": region}
    location = S3Location(url=f"s3://{bucket}/{prefix}", storage_options=options, bucket=bucket,
                          prefix=prefix, endpoint_url=endpoint)
    yield location
    backend = location.backend()
    backend.delete(backend.list())
    backend.abort_incomplete_uploads()
    backend.close()
