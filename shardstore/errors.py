"""The exception types shardstore raises. Every one derives from :class:`ShardstoreError`."""

from __future__ import annotations


class ShardstoreError(Exception):
    """Base class of every error raised by shardstore."""


class CheckpointNotFoundError(ShardstoreError, FileNotFoundError):
    """The path does not exist, or holds no committed checkpoint (no index)."""


class CheckpointExistsError(ShardstoreError, FileExistsError):
    """A save targeted a path that already holds a committed checkpoint."""


class InvalidCheckpointError(ShardstoreError, ValueError):
    """The index is malformed: wrong format, unknown version, bad types or paths."""


class CorruptCheckpointError(ShardstoreError):
    """Stored bytes do not match their checksum, or a data file is short or undecodable."""


class TruncatedFileError(CorruptCheckpointError):
    """A data file is shorter than the index says."""


class UnsupportedValueError(ShardstoreError, TypeError):
    """A non-tensor value cannot be stored without pickle."""


class StateMismatchError(ShardstoreError, KeyError):
    """The state to load into does not match the checkpoint (missing keys, shapes)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class StorageError(ShardstoreError, OSError):
    """The storage backend failed (permission, network, missing bucket...)."""


class BucketNotFoundError(StorageError):
    """The bucket named in an object-store URL does not exist (or is not visible at the endpoint)."""


class StorageAccessDeniedError(StorageError, PermissionError):
    """The store refused the credentials or denied the request (missing, wrong or expired keys)."""


class StorageUnreachableError(StorageError, ConnectionError):
    """The storage endpoint cannot be reached (wrong endpoint URL, no network, service down)."""


class AsyncSaveInProgressError(ShardstoreError, RuntimeError):
    """A save was refused because the previous async save is still running (``if_busy="raise"``)."""


class LeaseError(ShardstoreError, RuntimeError):
    """Base class of lease failures."""


class LeaseHeldError(LeaseError):
    """Another live job holds the lease of the root."""


class LeaseLostError(LeaseError):
    """This job held the lease, but another job has taken it over since."""


def unwrap_error(exc: BaseException) -> BaseException:
    """The original error behind DCP's ``CheckpointException``, or ``exc`` itself.

    DCP collects the exception of every failed rank into one ``CheckpointException`` (a
    ``BaseException``) raised on all ranks. This returns the first rank's original exception
    (e.g. a :class:`CorruptCheckpointError`), so callers can handle shardstore errors by type::

        try:
            dcp.load(state, storage_reader=ShardReader(path))
        except BaseException as e:
            if isinstance(unwrap_error(e), CorruptCheckpointError):
                ...
            raise
    """
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return inner
    return exc
