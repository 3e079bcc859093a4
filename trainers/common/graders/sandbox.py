"""Where tenant ``python`` graders run: a separate, locked-in interpreter with limits.

A tenant's grader source is untrusted code. It never runs in the API, the worker or the
trainer: :class:`PythonGraderProcess` starts ``sandbox_child.py`` in a fresh interpreter
(``python -I -S -B``, empty environment, its own session, ``/`` as its folder), which locks
itself in before it reads the source (see that module: no root, rlimits, Landlock,
seccomp). This side enforces what the child cannot enforce on itself:

- a wall-clock deadline per answer (``seconds_per_sample``; the source's load has
  ``startup_seconds``): past it the process group is killed (``timeout``);
- bounded output: an answer line, and everything the grader prints (stderr), each at most
  ``output_bytes``; more kills it (``output_limit``);
- how it ended: SIGSYS is a forbidden system call (``forbidden_syscall``), SIGXCPU the CPU
  limit (``timeout``), a ``MemoryError`` the address-space limit (``memory_limit``), any
  other death ``crashed``; a kernel without Landlock ``sandbox_unavailable``.

One process grades many samples of ONE grader for ONE job (a training batch): another
tenant's samples never reach it. :func:`grade_in_sandbox` runs a batch, starting a fresh
process for the rest of the batch when one dies.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

CHILD = Path(__file__).with_name("sandbox_child.py")
MAX_SOURCE_BYTES = 256 * 1024  # OpenAI's limit on a python grader's source
_CHILD_ENV = {"LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "MALLOC_ARENA_MAX": "2"}

# Stable codes of a sandbox that stopped the grader (``python_grader_server_error_type``).
TIMEOUT = "timeout"
MEMORY_LIMIT = "memory_limit"
OUTPUT_LIMIT = "output_limit"
FORBIDDEN_SYSCALL = "forbidden_syscall"
CRASHED = "crashed"
UNAVAILABLE = "sandbox_unavailable"
# The grader itself failed (``python_grader_runtime_error``): it raised, returned a
# non-number, or its source did not load.
EXCEPTION = "exception"
LOAD_FAILED = "load_failed"
SANDBOX_CODES = (TIMEOUT, MEMORY_LIMIT, OUTPUT_LIMIT, FORBIDDEN_SYSCALL, CRASHED, UNAVAILABLE)


@dataclass(frozen=True)
class SandboxLimits:
    """What one grader process may use (the trainer and the API pass their settings)."""

    memory_bytes: int = 1 << 30
    seconds_per_sample: float = 10.0
    seconds_per_call: float = 120.0
    startup_seconds: float = 10.0
    output_bytes: int = 64 * 1024
    open_files: int = 64

    def cpu_seconds(self, samples: int) -> int:
        """The process's RLIMIT_CPU: the wall budget of its batch (a backstop for threads
        burning CPU in parallel)."""
        return math.ceil(self.startup_seconds + min(self.seconds_per_sample * max(samples, 1),
                                                    self.seconds_per_call))


@dataclass(frozen=True)
class SandboxResult:
    """One sample's outcome: a reward, or an error ``code`` (see the module doc)."""

    reward: float | None = None
    code: str | None = None
    details: str | None = None

    @property
    def sandbox_error(self) -> bool:
        return self.code in SANDBOX_CODES


class SandboxStopped(Exception):
    """The process stopped (or was stopped) before answering: ``code`` says why."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def library_paths() -> list[str]:
    """The folders the grader may read: this interpreter's standard library and packages."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")))


class PythonGraderProcess:
    """One sandboxed grader process: ``start`` it on a source, ``grade`` samples, ``close``."""

    def __init__(self, source: str, limits: SandboxLimits, *, batch_size: int = 1) -> None:
        self.limits = limits
        self._source = source
        self._batch_size = batch_size
        self._process: subprocess.Popen[bytes] | None = None
        self._selector = selectors.DefaultSelector()
        self._pending = bytearray()
        self._stdout = bytearray()
        self._stderr_bytes = 0
        self._killed_for: SandboxStopped | None = None

    def start(self) -> None:
        """Start the process and load the source; ``SandboxStopped`` if it does not load."""
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(CHILD)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_CHILD_ENV, cwd="/",
            start_new_session=True, close_fds=True,
        )
        for stream in (self._process.stdin, self._process.stdout, self._process.stderr):
            os.set_blocking(stream.fileno(), False)
        self._selector.register(self._process.stdout, selectors.EVENT_READ)
        self._selector.register(self._process.stderr, selectors.EVENT_READ)
        config = {"library_paths": library_paths(), "limits": {
            "memory_bytes": self.limits.memory_bytes, "cpu_seconds": self.limits.cpu_seconds(self._batch_size),
            "open_files": self.limits.open_files}}
        self._send(config)
        reply = self._exchange(self._source, self.limits.startup_seconds)
        if "error" in reply:
            raise SandboxStopped(reply["error"].get("kind", LOAD_FAILED), str(reply["error"].get("details", "")))

    def grade(self, sample: dict[str, Any], item: dict[str, Any], *, seconds: float | None = None) -> SandboxResult:
        """One sample's reward (within ``seconds``, default ``seconds_per_sample``); a
        ``SandboxStopped`` when the process died on it."""
        reply = self._exchange({"sample": sample, "item": item}, seconds or self.limits.seconds_per_sample)
        if "error" in reply:
            error = reply["error"]
            return SandboxResult(code=str(error.get("kind", EXCEPTION)), details=str(error.get("details", "")))
        reward = reply.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return SandboxResult(code=EXCEPTION, details="the grader's answer is not a number")
        return SandboxResult(reward=float(reward))

    def close(self) -> None:
        """Kill the process (and anything it could have left) and reap it."""
        if self._process is None:
            return
        self._kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout, self._process.stderr):
            stream.close()
        self._selector.close()
        self._process = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, message: Any) -> None:
        self._pending += (json.dumps(message) + "\n").encode()
        if not self._is_writing():
            self._selector.register(self._process.stdin, selectors.EVENT_WRITE)

    def _is_writing(self) -> bool:
        try:
            self._selector.get_key(self._process.stdin)
            return True
        except KeyError:
            return False

    def _exchange(self, message: Any, seconds: float) -> dict[str, Any]:
        """Send ``message`` and wait up to ``seconds`` for the answer line."""
        self._send(message)
        deadline = time.monotonic() + seconds
        while (line := self._answer_line()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop(SandboxStopped(TIMEOUT, f"the grader took longer than {seconds:g} s"))
            for key, _events in self._selector.select(left):
                self._on_ready(key.fileobj)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):
            self._stop(SandboxStopped(CRASHED, "the grader process wrote something other than an answer"))
        return reply

    def _answer_line(self) -> bytes | None:
        end = self._stdout.find(b"\n")
        if end < 0:
            if len(self._stdout) > self.limits.output_bytes:
                self._stop(SandboxStopped(OUTPUT_LIMIT, f"the grader wrote over {self.limits.output_bytes} bytes"))
            return None
        line = bytes(self._stdout[:end])
        del self._stdout[:end + 1]
        return line

    def _on_ready(self, stream: Any) -> None:
        process = self._process
        if stream is process.stdin:
            try:
                written = os.write(stream.fileno(), self._pending)
            except BlockingIOError:
                return
            except BrokenPipeError:
                self._selector.unregister(stream)
                self._pending.clear()
                return
            del self._pending[:written]
            if not self._pending:
                self._selector.unregister(stream)
            return
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:  # the process closed its end: it is gone
            self._stop(self._death())
        if stream is process.stdout:
            self._stdout += chunk
        else:
            self._stderr_bytes += len(chunk)
            if self._stderr_bytes > self.limits.output_bytes:
                self._stop(SandboxStopped(OUTPUT_LIMIT, f"the grader printed over {self.limits.output_bytes} bytes"))

    def _death(self) -> SandboxStopped:
        """Why the process ended (it closed its output; a grader may close it and go on)."""
        try:
            status = self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self._kill()
            self._process.wait()
            return SandboxStopped(CRASHED, "the grader closed its output")
        if status == -signal.SIGSYS:
            return SandboxStopped(FORBIDDEN_SYSCALL, "the grader made a system call the sandbox forbids "
                                                     "(network, processes, programs, other processes)")
        if status == -signal.SIGXCPU:
            return SandboxStopped(TIMEOUT, "the grader used up its CPU time")
        answer = self._answer_line() if b"\n" in self._stdout else None
        if answer:
            try:
                error = json.loads(answer).get("error", {})
                return SandboxStopped(str(error.get("kind", CRASHED)), str(error.get("details", "")))
            except (json.JSONDecodeError, AttributeError):
                pass
        return SandboxStopped(CRASHED, f"the grader process ended (status {status})")

    def _stop(self, reason: SandboxStopped) -> None:
        self._kill()
        raise reason

    def _kill(self) -> None:
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def grade_in_sandbox(source: str, pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]],
                     limits: SandboxLimits) -> list[SandboxResult]:
    """Grade each ``(sample, item)`` with ``source``'s ``grade``, in as few processes as
    possible: a process that dies answers for the sample it died on, and a fresh one takes
    the rest. A source that does not load answers every sample with that error. The whole
    call has ``seconds_per_call``: samples left when it is spent are ``timeout``."""
    deadline = time.monotonic() + limits.seconds_per_call
    results: list[SandboxResult] = []
    while len(results) < len(pairs):
        if time.monotonic() >= deadline:
            spent = SandboxResult(code=TIMEOUT, details=f"the call took longer than {limits.seconds_per_call:g} s")
            return results + [spent] * (len(pairs) - len(results))
        process = PythonGraderProcess(source, limits, batch_size=len(pairs) - len(results))
        try:
            process.start()
        except SandboxStopped as stopped:
            process.close()
            failed = SandboxResult(code=stopped.code, details=stopped.details)
            return results + [failed] * (len(pairs) - len(results))
        try:
            for sample, item in pairs[len(results):]:
                seconds = min(limits.seconds_per_sample, max(deadline - time.monotonic(), 0.001))
                results.append(process.grade(sample, item, seconds=seconds))
        except SandboxStopped as stopped:
            results.append(SandboxResult(code=stopped.code, details=stopped.details))
        finally:
            process.close()
    return results
