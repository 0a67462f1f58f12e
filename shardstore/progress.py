"""Progress bars for long command-line work (export, import, cp, diff), on stderr.

Part of the command line, not of the data flows: library functions take an optional
:class:`Progress` and call :meth:`Progress.update` with bytes done; they never print. A bar
appears only once the work has run for a moment (tqdm's ``delay``), so quick commands stay
quiet, and never with ``--json`` (scripts read stdout, and stderr stays free for the one-line
error).
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType

#: Seconds of work before a bar is shown at all.
SHOW_AFTER_S = 1.0


class Progress:
    """A byte counter shown as a tqdm bar on stderr; a no-op when disabled.

    Thread-safe: parallel copy threads may call :meth:`update` at once.

    Args:
        total: bytes expected (``None`` if unknown).
        desc: a short label (``"export"``, ``"cp"``).
        enabled: ``False`` for ``--json`` output or when called as a library.
    """

    def __init__(self, total: int | None, desc: str, *, enabled: bool = True) -> None:
        self._lock = threading.Lock()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, delay=SHOW_AFTER_S, leave=False, dynamic_ncols=True,
            )

    def set_total(self, total: int | None) -> None:
        """Set the bytes expected, once known."""
        if self._bar is not None:
            with self._lock:
                self._bar.total = total

    def update(self, n: int) -> None:
        """Count ``n`` more bytes done."""
        if self._bar is not None and n:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def silent() -> Progress:
    """A :class:`Progress` that shows nothing."""
    return Progress(None, "", enabled=False)
