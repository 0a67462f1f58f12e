"""Retry with bounded exponential backoff and full jitter: the one retry loop of the backends.

A backend wraps each request that is safe to repeat in :func:`retry_async` and decides, with its
own ``retryable`` predicate, which failures are transient (throttling, 5xx, dropped connections).
Every attempt is bounded (``RetryPolicy.attempts``) and so is every pause, so a broken store
fails a save in seconds instead of hanging it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry.

    Attributes:
        attempts: total tries of one request (the first one included).
        base_delay: pause before the first retry is drawn from ``[0, base_delay]`` seconds; each
            further retry doubles the upper bound ("full jitter"), so many ranks that are
            throttled together do not retry in lockstep.
        max_delay: cap of that upper bound, in seconds.
    """

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"invalid retry policy {self}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first retry)."""
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2**retry))


async def retry_async(
    op: Callable[[int], Awaitable[T]],
    *,
    policy: RetryPolicy,
    retryable: Callable[[BaseException, int], bool],
    what: str,
) -> T:
    """Await ``op(attempt)`` until it succeeds, retrying failures that ``retryable`` accepts.

    Args:
        op: makes one attempt; gets the attempt number (0 first), so an operation that is made
            idempotent by checking the store after an ambiguous failure knows it is a retry.
        policy: attempts and backoff.
        retryable: ``retryable(error, attempt)`` says whether ``error`` is worth another attempt.
        what: the request, for log messages.

    Returns:
        What ``op`` returned.

    Raises:
        The last error, with ``retry_attempts`` set to the number of attempts made.
    """
    for attempt in range(policy.attempts):
        try:
            return await op(attempt)
        except Exception as e:
            if attempt + 1 >= policy.attempts or not retryable(e, attempt):
                e.retry_attempts = attempt + 1  # type: ignore[attr-defined]
                raise
            pause = policy.delay(attempt)
            logger.debug("%s failed (%s: %s); retry %d in %.2fs", what, type(e).__name__, e,
                         attempt + 1, pause)
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")
