"""A scripted stand-in for ``inference.engine.Engine`` behind the real worker server (and so
the real client): what API-side tests put where a model would generate.

A subclass's ``generate(request)`` yields the request's events, or raises an
``InferenceError`` to refuse it. Each request plays on a thread of its own, as the real
engine's generations do; a caller's cancel is recorded and wakes the request's waits
(:meth:`ScriptedEngine.wait_until`), so a test can hold a request at any point and see
whether the API cancelled it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from inference.engine import InferenceError
from inference.protocol import GenerationRequest, ModelRef, StreamEvent


class ScriptedEngine:
    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[GenerationRequest] = []
        self.preloaded: list[ModelRef] = []
        self._changed = threading.Condition()
        self._current = threading.local()

    def generate(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        raise NotImplementedError

    # -- what the worker server calls ------------------------------------------------------

    def start(self, request: GenerationRequest, sink: Callable[[Any], None]) -> ScriptedRun:
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
        run = ScriptedRun(self, request, sink)
        threading.Thread(target=run.play, daemon=True).start()
        return run

    def status(self) -> dict[str, Any]:
        return {}

    def stalled_s(self) -> float:
        return 0.0

    def cancel_all(self, reason: InferenceError | None = None) -> None:
        pass

    def preload(self, ref: ModelRef) -> str:
        with self._changed:
            self.preloaded.append(ref)
            self._changed.notify_all()
        return "loading"

    # -- for the script and the test -------------------------------------------------------

    def wait_until(self, ready: Callable[[], bool], timeout: float = 60) -> bool:
        """In ``generate``: wait until ``ready()`` (see :meth:`changed`); False if the request
        was cancelled meanwhile."""
        run: ScriptedRun = self._current.run
        with self._changed:
            self._changed.wait_for(lambda: run.stopped or ready(), timeout)
            return not run.stopped

    def changed(self) -> None:
        """What ``wait_until`` waits on has changed."""
        with self._changed:
            self._changed.notify_all()

    def wait_requests(self, count: int, timeout: float = 30) -> bool:
        return self._wait_for(lambda: len(self.requests) >= count, timeout)

    def wait_cancelled(self, count: int = 1, timeout: float = 10) -> bool:
        return self._wait_for(lambda: len(self.cancelled) >= count, timeout)

    def wait_preloaded(self, count: int, timeout: float = 10) -> bool:
        return self._wait_for(lambda: len(self.preloaded) >= count, timeout)

    def _wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)


class ScriptedRun:
    """One request's play; the server cancels it when its caller goes away."""

    def __init__(self, engine: ScriptedEngine, request: GenerationRequest, sink: Callable[[Any], None]) -> None:
        self.engine, self.request, self.sink = engine, request, sink
        self.stopped = False

    def cancel(self, reason: InferenceError | None = None) -> None:
        with self.engine._changed:
            if not self.stopped:
                self.stopped = True
                self.engine.cancelled.append(self.request)
            self.engine._changed.notify_all()

    def play(self) -> None:
        self.engine._current.run = self
        try:
            for event in self.engine.generate(self.request):
                if self.stopped:
                    return
                self.sink(event)
        except InferenceError as exc:
            self.sink(exc)
        finally:
            self.sink(None)
