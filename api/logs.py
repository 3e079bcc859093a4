"""Where a job's trainer log comes from.

The local executor writes ``<data>/jobs/<job_id>/trainer.log``; other executors (the
Kubernetes one reads pod logs) register a reader with ``register_log_reader``. Readers
are tried newest first; the first that returns text wins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

from api.db.models import Job
from api.settings import Settings

LogReader = Callable[[Job, Settings, int], str | None]
_readers: list[LogReader] = []


def register_log_reader(reader: LogReader) -> LogReader:
    """Add ``reader(job, settings, tail_lines) -> text | None`` (usable as a decorator)."""
    if reader not in _readers:
        _readers.append(reader)
    return reader


def tail_file(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a text file, read in one pass without loading it all."""
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        return "".join(deque(handle, maxlen=lines))


def local_log(job: Job, settings: Settings, tail: int) -> str | None:
    path = settings.job_dir(job.id) / "trainer.log"
    return tail_file(path, tail) if path.is_file() else None


def read_job_log(job: Job, settings: Settings, tail: int) -> str:
    for reader in reversed(_readers):
        text = reader(job, settings, tail)
        if text is not None:
            return text
    return local_log(job, settings, tail) or ""
