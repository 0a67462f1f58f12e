"""S3 backend (AWS S3 and S3-compatible stores: MinIO, Ceph RGW...), on s3fs's aiobotocore client.

Commit protocol. S3 has no rename, and copy+delete is neither atomic nor cheap, so nothing here
relies on one. A save writes its data objects first, each rank its own, as multipart uploads;
an object becomes visible only when its upload completes, and a failed writer aborts its upload
so no orphaned parts stay behind. The index is written last, by :meth:`S3Backend.publish`, as
ONE ``PutObject``: S3 makes a single PUT visible all at once, so the index is the commit record
and a checkpoint without it is simply not committed. Without ``overwrite`` the PUT carries
``If-None-Match: *``, so of two racing publishers exactly one wins and the other gets
``CheckpointExistsError``. A store that answers that header with 501 NotImplemented gets an
exists-check followed by a plain PUT instead (logged once); that cannot stop a concurrent
publisher.

Requests run concurrently on fsspec's I/O event-loop thread: a :class:`FileWriter` keeps up to
``max_concurrency`` parts in flight (per backend, so memory stays below ``max_concurrency``
parts plus one filling buffer per open writer); :meth:`S3Backend.read_ranges` issues its ranged
GETs (large ranges split into ``part_size`` pieces) up to ``max_concurrency`` at a time.

Every request goes through :meth:`S3Backend._call`: :func:`retry_async` for transient failures
(503 SlowDown, 5xx, dropped connections; an endpoint that refuses connections gets one retry only),
then :func:`_translate` maps what is left to shardstore errors. Requests that are not idempotent
by themselves are made so by checking the store when a retry meets their own earlier success
(aiohttp also silently re-sends a PUT whose kept-alive connection dropped): a conditional PUT
whose 412 names an object carrying its own one-time token in its metadata, a completion whose
NoSuchUpload finds the object with the expected multipart ETag, a CreateMultipartUpload whose
lost first answer left an upload behind (aborted right away). Botocore's own retries are off, so
this is the only retry loop.

Credentials and endpoint: ``storage_options`` go to :class:`s3fs.S3FileSystem` (``key``,
``secret``, ``token``, ``profile``, ``endpoint_url``, ``client_kwargs``, ``config_kwargs``...);
otherwise botocore's usual chain applies (``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE``,
``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, instance roles). Uploads cut short by a killed
process cannot be aborted by it: give the bucket a lifecycle rule ``AbortIncompleteMultipartUpload``
or call :meth:`S3Backend.abort_incomplete_uploads`.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import functools
import hashlib
import io
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from shardstore.backends.base import Backend, FileWriter, check_relpath
from shardstore.backends.retry import RetryPolicy, retry_async
from shardstore.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    ShardstoreError,
    StorageAccessDeniedError,
    StorageError,
    StorageUnreachableError,
    TruncatedFileError,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

MIB = 1 << 20
DEFAULT_PART_SIZE = 16 * MIB  #: multipart part size, also the size of one ranged GET
DEFAULT_MAX_CONCURRENCY = 8  #: parts in flight per backend; GETs in flight per read_ranges call
MIN_PART_SIZE = 5 * MIB  #: S3's minimum for every part but the last
MAX_PARTS = 10_000  #: S3's limit of parts per upload
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 60.0
DEFAULT_RETRY = RetryPolicy(attempts=6, base_delay=0.1, max_delay=5.0)
CONNECT_ATTEMPTS = 2  #: an endpoint that cannot be connected to at all fails fast
SPREAD_PREFIXES = "0123456789abcdef"  #: with key_prefix_spread, keys start with one of these
_PUBLISH_TOKEN = "shardstore-publish"  # user metadata naming the publish that wrote an object

_ACCESS_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "403",
}
_RETRY_CODES = {
    "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed",
    "Throttling", "ThrottlingException", "RequestLimitExceeded", "XAmzContentSHA256Mismatch",
}


def _error_info(e: BaseException) -> tuple[str, int | None, str]:
    """``(code, HTTP status, message)`` of a botocore ``ClientError``, else ``("", None, "")``."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", None, ""
    err = response.get("Error", {})
    return (str(err.get("Code", "")), response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            str(err.get("Message", "")))


def _cannot_connect(e: BaseException) -> bool:
    """The TCP connection itself failed (refused, DNS, connect timeout): the endpoint is down."""
    import aiohttp
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

    if isinstance(e, ConnectTimeoutError):
        return True
    return isinstance(e, EndpointConnectionError) and isinstance(
        getattr(e, "kwargs", {}).get("error"), aiohttp.ClientConnectorError)


def _retryable(e: BaseException, attempt: int) -> bool:
    """Throttling, server errors and dropped connections are transient; the rest is not."""
    import aiohttp
    from botocore import exceptions as bx

    if isinstance(e, ShardstoreError):
        return False
    if _cannot_connect(e):
        return attempt + 1 < CONNECT_ATTEMPTS
    code, status, _ = _error_info(e)
    if code or status:
        return code in _RETRY_CODES or (status is not None and status >= 500 and status != 501)
    return isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError,
                          bx.ResponseStreamingError, aiohttp.ClientError, ConnectionError,
                          asyncio.TimeoutError))


def _translate(e: BaseException, url: str, bucket: str, endpoint: str) -> BaseException:
    """The one place where S3/botocore errors become shardstore errors with clear messages."""
    from botocore import exceptions as bx

    if isinstance(e, ShardstoreError):
        return e
    tries = getattr(e, "retry_attempts", 1)
    after = f" (after {tries} attempts)" if tries > 1 else ""
    creds = ("check the credentials: storage_options key/secret/token or profile, or "
             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN/AWS_PROFILE")
    code, status, message = _error_info(e)
    if code == "NoSuchBucket":
        return BucketNotFoundError(
            f"bucket {bucket!r} does not exist at {endpoint} (accessing {url})")
    if code in _ACCESS_CODES or status == 403:
        return StorageAccessDeniedError(
            f"access to {url} denied by {endpoint}: {code}: {message or 'Forbidden'}; {creds}")
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return FileNotFoundError(errno.ENOENT, f"{url} does not exist")
    if code == "PreconditionFailed" or status == 412:
        return CheckpointExistsError(f"{url} already exists")
    if code or status:
        return StorageError(f"S3 request for {url} failed at {endpoint}{after}: {code} "
                            f"(HTTP {status}): {message}")
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return StorageAccessDeniedError(f"no usable AWS credentials for {url}: {e}; {creds}")
    if _cannot_connect(e):
        return StorageUnreachableError(
            f"cannot reach the S3 endpoint {endpoint} (accessing {url}){after}: {e}; check "
            "endpoint_url in storage_options or AWS_ENDPOINT_URL")
    return StorageError(f"S3 request for {url} at {endpoint} failed{after}: "
                        f"{type(e).__name__}: {e}")


def _new_session(profile: str | None) -> Any:
    """An aiobotocore session (own credentials and profile) sharing botocore's model loader.

    Loading the S3 service model takes about half a second per session; the loader caches it,
    so backends created one after another (writer, reader, manager) pay that once.
    """
    import aiobotocore.session
    from botocore.exceptions import ProfileNotFound

    session = aiobotocore.session.AioSession(profile=profile)
    try:
        data_path = session.get_config_variable("data_path")
    except ProfileNotFound as e:
        raise StorageAccessDeniedError(
            f"AWS profile {profile!r} not found in the AWS config files "
            "(AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE, ~/.aws)") from e
    session.register_component("data_loader", _loader(data_path))
    return session


@functools.lru_cache(maxsize=None)
def _loader(data_path: str | None) -> Any:
    import botocore.loaders

    return botocore.loaders.create_loader(data_path)


def _restore(args: tuple[str, dict[str, Any]], root: str, url: str) -> S3Backend:
    backend = S3Backend(args[0], **args[1])
    backend._root, backend.url = root, url
    return backend


def _spread(logical: str) -> str:
    """The spread prefix of a key: one hex digit of its MD5, so keys scatter over partitions."""
    return hashlib.md5(logical.encode()).hexdigest()[0] + "/"


def _multipart_etag(etags: Sequence[str]) -> str | None:
    """The ETag S3 gives a completed multipart object (None if the part ETags are not MD5s)."""
    try:
        digests = b"".join(bytes.fromhex(t.strip('"')) for t in etags)
    except ValueError:
        return None
    if len(digests) != 16 * len(etags):
        return None
    return f'"{hashlib.md5(digests).hexdigest()}-{len(etags)}"'


class _S3FileWriter(FileWriter):
    """A multipart upload fed by ``write``; one PUT at ``close`` if under ``part_size``.

    Full parts are uploaded by tasks on the backend's event loop while ``write`` goes on; a
    semaphore shared by the backend bounds the parts in flight (and so the memory they hold),
    blocking ``write`` when the store is slower than the producer.
    """

    def __init__(self, backend: S3Backend, path: str) -> None:
        self._b = backend
        self._key = backend._key(path)
        self._url = f"{backend.url}/{path}"
        self._buf = io.BytesIO()  # the part being filled; handed to the upload without a copy
        self._upload_id: str | None = None
        self._parts: list[asyncio.Task[str]] = []
        self._state = "open"

    def write(self, data: memoryview | bytes) -> None:
        if self._state != "open":
            raise ValueError(f"write to {self._state} writer of {self._url}")
        view = memoryview(data).cast("B")
        size = self._b.part_size
        while view.nbytes:
            room = size - self._buf.tell()
            self._buf.write(view[:room])
            view = view[room:]
            if self._buf.tell() == size:
                self._guard(self._send_part)

    def _send_part(self) -> None:
        b = self._b
        if self._upload_id is None:
            self._upload_id = b._run(b._create_upload(self._key, self._url))
        for task in self._parts:  # surface a failed part now rather than at close
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise StorageError(f"{self._url} needs more than {MAX_PARTS} parts; "
                               f"use a larger part_size than {b.part_size}")
        b._slots.acquire()  # released when the part's task ends, however it ends
        body, self._buf = self._buf, io.BytesIO()
        try:
            self._parts.append(b._run(b._spawn(
                b._upload_part(self._key, self._url, self._upload_id, number, body))))
        except BaseException:
            b._slots.release()
            raise

    def close(self) -> None:
        if self._state == "closed":
            return
        if self._state != "open":
            raise ValueError(f"close of aborted writer of {self._url}")
        self._guard(self._finish)
        self._state = "closed"

    def _finish(self) -> None:
        b = self._b
        if self._upload_id is None:
            body, self._buf = self._buf.getvalue(), io.BytesIO()
            b._run(b._call(self._url, lambda s3, _: s3.put_object(
                Bucket=b.bucket, Key=self._key, Body=body)))
            return
        if self._buf.tell():
            self._send_part()
        etags = b._run(_gather(self._parts))
        b._run(b._complete(self._key, self._url, self._upload_id, etags))
        self._upload_id = None

    def _guard(self, step: Callable[[], None]) -> None:
        """Run ``step``; on any failure abort the upload (no orphaned parts), then re-raise."""
        try:
            step()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._state == "aborted":
            return
        self._state = "aborted"
        self._buf = io.BytesIO()
        b = self._b
        try:
            b._run(_cancel(self._parts))  # no part may land after the abort
            if self._upload_id is not None:
                b._run(b._abort_upload(self._key, self._url, self._upload_id))
                self._upload_id = None
        except ShardstoreError as e:  # keep the caller's original error in charge
            logger.error("could not abort multipart upload %s of %s: %s; its parts stay until "
                         "aborted (see S3Backend.abort_incomplete_uploads)",
                         self._upload_id, self._url, e)


async def _gather(tasks: Sequence[asyncio.Task[T]]) -> list[T]:
    return list(await asyncio.gather(*tasks))


async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class S3Backend(Backend):
    """Objects below ``s3://bucket/prefix``.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        storage_options: passed to :class:`s3fs.S3FileSystem` (credentials, ``endpoint_url``,
            ``client_kwargs``, ``config_kwargs``, ``profile``...). Our defaults for
            ``config_kwargs`` (short connect timeout, no botocore retries, pool size) can be
            overridden there.
        part_size: bytes per multipart part and per ranged GET (at least 5 MiB).
        max_concurrency: parts in flight (shared by all writers of this backend and its
            children) and GETs in flight per ``read_ranges`` call.
        key_prefix_spread: start every key with one hex digit derived from its hash
            (``s3://bucket/<h>/prefix/file``), spreading requests over 16 S3 partitions. Every
            writer and reader of a checkpoint must use the same setting.
        retry: attempts and backoff for transient failures.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 part_size: int = DEFAULT_PART_SIZE,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 key_prefix_spread: bool = False, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        try:
            import fsspec.core
            import s3fs  # noqa: F401
        except ImportError as e:
            raise ImportError("s3:// needs s3fs: pip install 'shardstore[s3]'") from e
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (the S3 minimum)")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        options = dict(storage_options or {})
        options["config_kwargs"] = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"total_max_attempts": 1},  # retry_async is the one retry loop
            "max_pool_connections": max(10, 2 * max_concurrency),
            # Records carry their own checksums; skipping the new default CRC headers keeps
            # older S3-compatible stores working.
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            **options.get("config_kwargs", {}),
        }
        options["skip_instance_cache"] = True  # our own client with our config
        if "session" not in options:
            options["session"] = _new_session(options.pop("profile", None))
        self._fs, root = fsspec.core.url_to_fs(url, **options)
        self.bucket, key, _ = self._fs.split_path(root)
        if not self.bucket:
            raise ValueError(f"S3 URL without a bucket: {url!r}")
        self._root = key.strip("/")
        self.url = f"s3://{self.bucket}/{self._root}".rstrip("/")
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.key_prefix_spread = key_prefix_spread
        self.retry = retry
        self._loop = self._fs.loop
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._conditional_put = True
        self._bucket_checked = False
        self._owner = True
        self._args = (url, {"storage_options": storage_options, "part_size": part_size,
                            "max_concurrency": max_concurrency,
                            "key_prefix_spread": key_prefix_spread, "retry": retry})

    @property
    def read_size(self) -> int:
        """One read call fetches up to ``max_concurrency`` ranged GETs of ``part_size`` at once."""
        return self.part_size * self.max_concurrency

    def __reduce__(self) -> tuple:
        """Pickle as the constructor's arguments (a new process gets its own client)."""
        return _restore, (self._args, self._root, self.url)

    # -- keys -------------------------------------------------------------------------------

    def _logical(self, path: str) -> str:
        rel = check_relpath(path)
        return f"{self._root}/{rel}" if self._root else rel

    def _key(self, path: str) -> str:
        logical = self._logical(path)
        return _spread(logical) + logical if self.key_prefix_spread else logical

    def _starts(self, logical: str) -> list[str]:
        """Key prefixes under which the objects below ``logical`` are stored."""
        return [h + "/" + logical for h in SPREAD_PREFIXES] if self.key_prefix_spread else [logical]

    def __copy__(self) -> S3Backend:
        # A shallow copy shares the client, loop and in-flight limit; __reduce__ (for pickling
        # to other processes) would build a new client instead.
        sub = object.__new__(type(self))
        sub.__dict__.update(self.__dict__)
        return sub

    def child(self, name: str) -> S3Backend:
        rel = check_relpath(name)
        sub = copy.copy(self)  # shares the client, loop and in-flight limit
        sub._root = self._logical(rel)
        sub.url = f"{self.url}/{rel}"
        sub._owner = False
        return sub

    # -- plumbing ---------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the event-loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Start ``coro`` as a task holding one of the in-flight slots until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda _: self._slots.release())
        return task

    async def _call(self, url: str, op: Callable[[Any, int], Awaitable[T]]) -> T:
        """Run ``op(client, attempt)`` with retries; raise failures as shardstore errors."""
        endpoint = "the default AWS endpoint"
        try:
            s3 = await self._fs.set_session()
            endpoint = s3.meta.endpoint_url
            try:
                return await retry_async(lambda attempt: op(s3, attempt), policy=self.retry,
                                         retryable=_retryable, what=f"S3 request for {url}")
            except Exception as e:
                if _error_info(e)[0] == "404" and not self._bucket_checked:
                    await self._check_bucket(s3, endpoint)  # HEAD: is key or bucket missing?
                raise
        except Exception as e:
            raise _translate(e, url, self.bucket, endpoint) from e

    async def _check_bucket(self, s3: Any, endpoint: str) -> None:
        try:
            await s3.head_bucket(Bucket=self.bucket)
        except Exception as e:
            if _error_info(e)[1] == 404:
                raise BucketNotFoundError(
                    f"bucket {self.bucket!r} does not exist at {endpoint} (accessing {self.url})"
                ) from e
            return  # report the original error
        self._bucket_checked = True

    async def _head(self, s3: Any, key: str) -> dict | None:
        try:
            return await s3.head_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if _error_info(e)[1] == 404:
                return None
            raise

    # -- writing ----------------------------------------------------------------------------

    def open_writer(self, path: str) -> FileWriter:
        return _S3FileWriter(self, path)

    async def _create_upload(self, key: str, url: str) -> str:
        retried = False

        async def create(s3: Any, attempt: int) -> str:
            nonlocal retried
            retried = attempt > 0
            return (await s3.create_multipart_upload(Bucket=self.bucket, Key=key))["UploadId"]

        upload_id = await self._call(url, create)
        if retried:  # an earlier attempt may have created an upload whose answer was lost
            await self._abort_uploads(key, url, keep=upload_id)
        return upload_id

    async def _upload_part(self, key: str, url: str, upload_id: str, number: int,
                           body: io.BytesIO) -> str:
        # aiohttp streams a BytesIO in small chunks; a bytes Body would be copied whole on its
        # way to the socket. Each attempt rewinds it (botocore sends from the position).
        async def upload(s3: Any, _: int) -> dict:
            body.seek(0)
            return await s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                        PartNumber=number, Body=body)

        return (await self._call(url, upload))["ETag"]

    async def _complete(self, key: str, url: str, upload_id: str, etags: list[str]) -> None:
        expected = _multipart_etag(etags)
        parts = [{"PartNumber": i + 1, "ETag": t} for i, t in enumerate(etags)]

        async def complete(s3: Any, _: int) -> None:
            try:
                await s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                   MultipartUpload={"Parts": parts})
            except Exception as e:
                if _error_info(e)[0] == "NoSuchUpload" and expected:
                    head = await self._head(s3, key)  # did an earlier, unanswered try succeed?
                    if head is not None and head.get("ETag") == expected:
                        return
                raise

        await self._call(url, complete)

    async def _abort_upload(self, key: str, url: str, upload_id: str) -> None:
        async def abort(s3: Any, _: int) -> None:
            try:
                await s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception as e:
                if _error_info(e)[0] != "NoSuchUpload":
                    raise

        await self._call(url, abort)

    async def _abort_uploads(self, prefix: str, url: str, *, keep: str | None = None,
                             match: Callable[[str], bool] | None = None) -> int:
        """Abort the open uploads of key ``prefix`` (or of the keys below it that ``match``)."""
        uploads = []
        markers: dict[str, str] = {}
        while True:
            page = await self._call(url, lambda s3, _: s3.list_multipart_uploads(
                Bucket=self.bucket, Prefix=prefix, **markers))
            uploads += [u for u in page.get("Uploads", []) if u["UploadId"] != keep
                        and (match(u["Key"]) if match else u["Key"] == prefix)]
            if not page.get("IsTruncated"):
                break
            markers = {"KeyMarker": page["NextKeyMarker"],
                       "UploadIdMarker": page["NextUploadIdMarker"]}
        await asyncio.gather(*(self._abort_upload(u["Key"], url, u["UploadId"]) for u in uploads))
        return len(uploads)

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort every open multipart upload below ``prefix`` (e.g. left by a killed process).

        Only call it when no save is writing below ``prefix``. Returns the number aborted.
        """
        logical = self._logical(prefix) if prefix else self._root
        below = f"{logical}/" if logical else ""

        def ours(key: str) -> bool:
            return not self.key_prefix_spread or _spread(key[2:]) == key[:2]

        async def sweep() -> int:
            counts = await asyncio.gather(*(self._abort_uploads(s, self.url, match=ours)
                                            for s in self._starts(below)))
            return sum(counts)

        return self._run(sweep())

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        self._run(self._publish(self._key(path), f"{self.url}/{path}", bytes(data), overwrite))

    async def _publish(self, key: str, url: str, data: bytes, overwrite: bool) -> None:
        if overwrite or not self._conditional_put:
            if not overwrite and await self._call(url, lambda s3, _: self._head(s3, key)):
                raise CheckpointExistsError(f"{url} already exists")
            await self._call(url, lambda s3, _: s3.put_object(Bucket=self.bucket, Key=key,
                                                              Body=data))
            return

        token = uuid.uuid4().hex  # tells our own earlier PUT from another publisher's

        async def put_if_absent(s3: Any, _: int) -> bool:
            try:
                await s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                                    Metadata={_PUBLISH_TOKEN: token})
                return True
            except Exception as e:
                code, status, _ = _error_info(e)
                if code == "NotImplemented" or status == 501:
                    return False
                if status == 412:  # a retry (ours or aiohttp's) may have met its own success
                    head = await self._head(s3, key)
                    if head is not None and head.get("Metadata", {}).get(_PUBLISH_TOKEN) == token:
                        return True
                raise

        if not await self._call(url, put_if_absent):
            logger.warning("%s does not support conditional PUTs (If-None-Match); publishing "
                           "with an exists-check, which cannot stop a concurrent publisher", url)
            self._conditional_put = False
            await self._publish(key, url, data, overwrite)

    # -- reading ----------------------------------------------------------------------------

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        return self._run(self._read_ranges(self._key(path), f"{self.url}/{path}", ranges))

    async def _read_ranges(self, key: str, url: str,
                           ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        gate = asyncio.Semaphore(self.max_concurrency)

        async def get(start: int, length: int) -> bytes:
            async def ranged_get(s3: Any, _: int) -> bytes:
                try:
                    resp = await s3.get_object(Bucket=self.bucket, Key=key,
                                               Range=f"bytes={start}-{start + length - 1}")
                except Exception as e:
                    if _error_info(e)[0] == "InvalidRange":
                        actual = getattr(e, "response")["Error"].get("ActualObjectSize", "fewer")
                        raise TruncatedFileError(
                            f"{url} is truncated: wanted bytes [{start}, {start + length}), "
                            f"the object has {actual} bytes") from e
                    raise
                async with resp["Body"] as body:
                    return await body.read()

            async with gate:
                data = await self._call(url, ranged_get)
            if len(data) != length:
                raise TruncatedFileError(f"{url} is truncated: wanted bytes [{start}, "
                                         f"{start + length}), got {len(data)}")
            return data

        async def read_one(start: int, length: int) -> bytes | memoryview:
            if length <= self.part_size:
                return await get(start, length) if length else b""
            out = memoryview(bytearray(length))

            async def piece(offset: int) -> None:
                n = min(self.part_size, length - offset)
                out[offset:offset + n] = await get(start + offset, n)

            await asyncio.gather(*(piece(o) for o in range(0, length, self.part_size)))
            return out

        return list(await asyncio.gather(*(read_one(s, n) for s, n in ranges)))

    def read_small(self, path: str) -> bytes:
        key, url = self._key(path), f"{self.url}/{path}"

        async def get(s3: Any, _: int) -> bytes:
            resp = await s3.get_object(Bucket=self.bucket, Key=key)
            async with resp["Body"] as body:
                return await body.read()

        return self._run(self._call(url, get))

    def size(self, path: str) -> int:
        key, url = self._key(path), f"{self.url}/{path}"
        head = self._run(self._call(url, lambda s3, _: s3.head_object(Bucket=self.bucket,
                                                                       Key=key)))
        return int(head["ContentLength"])

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    # -- listing and cleanup ----------------------------------------------------------------

    def list(self, prefix: str = "") -> list[str]:
        base = self._logical(prefix) if prefix else self._root
        cut = len(self._root) + 1 if self._root else 0

        def wanted(logical: str) -> bool:
            if logical.endswith("/"):  # a "directory" marker, not a file
                return False
            return not base or logical.startswith(base + "/") or (bool(prefix) and logical == base)

        async def list_from(start: str) -> list[str]:
            keys, token = [], {}
            while True:
                page = await self._call(self.url, lambda s3, _: s3.list_objects_v2(
                    Bucket=self.bucket, Prefix=start, **token))
                keys += [o["Key"] for o in page.get("Contents", [])]
                if not page.get("IsTruncated"):
                    return keys
                token = {"ContinuationToken": page["NextContinuationToken"]}

        async def list_all() -> list[str]:
            found = await asyncio.gather(*(list_from(s) for s in self._starts(base)))
            keys = [k for ks in found for k in ks]
            if self.key_prefix_spread:  # drop keys that are not where _key would put them
                keys = [k[2:] for k in keys if _spread(k[2:]) == k[:2]]
            return keys

        return sorted(k[cut:] for k in self._run(list_all()) if wanted(k))

    def delete(self, paths: Sequence[str]) -> None:
        keys = [self._key(p) for p in paths]

        async def delete_batch(batch: list[str]) -> None:
            resp = await self._call(self.url, lambda s3, _: s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
            errors = resp.get("Errors", [])
            if errors:
                first = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} objects in {self.url}, e.g. "
                    f"{first.get('Key')}: {first.get('Code')}: {first.get('Message')}")

        async def delete_all() -> None:
            await asyncio.gather(*(delete_batch(keys[i:i + 1000])
                                   for i in range(0, len(keys), 1000)))

        if keys:
            self._run(delete_all())

    def close(self) -> None:
        """Close the HTTP connections (only the backend that created them; children share)."""
        creator = getattr(self._fs, "_s3creator", None)
        if self._owner and creator is not None and getattr(self._fs, "_s3", None) is not None:
            type(self._fs).close_session(self._loop, creator)
            self._fs._s3 = None
