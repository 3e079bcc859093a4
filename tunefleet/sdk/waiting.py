"""When a ``wait`` gives up: shared by the sync and async ``files.wait`` and ``jobs.wait``."""

from __future__ import annotations

import time
from typing import Any

from tunefleet.sdk.errors import WaitTimeoutError


class WaitDeadline:
    """``timeout`` seconds from now (on the monotonic clock), or never when it is None."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._at = None if timeout is None else time.monotonic() + timeout

    def check(self, what: str, last: Any) -> None:
        """Raise ``WaitTimeoutError`` (carrying ``last``, the latest object seen) once it passed."""
        if self._at is not None and time.monotonic() >= self._at:
            raise WaitTimeoutError(f"{what} still {last.status} after {self.timeout}s", last=last)
