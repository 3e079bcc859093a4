"""SIGTERM handling: turn the signal into a flag the training loop checks between steps.

Kubernetes (and the local executor's cancel) send SIGTERM, then SIGKILL after a grace
period. Doing work inside a signal handler is unsafe (it runs between two bytecodes of
whatever the loop was doing), so the handler only sets a flag; the loop finishes its
current step, writes a checkpoint, reports, and raises
:class:`trainers.errors.Preempted` (exit code PREEMPTED).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Self


class StopFlag:
    """Set by SIGTERM/SIGINT (once installed); ``requested`` is what the loop polls."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str = "manual") -> None:
        self.signal_name = reason
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> StopFlag:
        """Install the handler (main thread only, as Python requires)."""
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
