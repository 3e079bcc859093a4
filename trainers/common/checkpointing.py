"""Checkpoint layout, atomic writes, keep-last-K, and the framework-neutral trainer state.

Layout (docs/internals.md)::

    <checkpoint.dir>/step-<N>/
        trainer_state.json      step, epoch, data cursor, RNG states, metrics, extra
        ...                     tensors written by the recipe (adapter, optimizer state)

A checkpoint is written into a hidden temporary directory next to its final place and
renamed into place once every file is fsynced, so a crash (or SIGKILL) mid-write never
leaves a half checkpoint that :func:`latest_checkpoint` would pick; a write that fails
(``ENOSPC``) removes its temporary directory. Framework tensors
are the recipe's business: it passes a ``write_tensors(dir)`` callback.

Reports: given the run's reporter, :func:`save_checkpoint` spools every report item
queued so far before the rename (the next run resumes from a visible checkpoint and never
produces its steps again, so their metrics must be on disk first), reports the checkpoint
right after it, and prunes only checkpoints whose listing the API has acknowledged. A
kill between the rename and that report loses only the listing, which the resumed run
sends again (:func:`report_resumed`) with the metric rows since the checkpoint before it.

Resuming: :func:`resolve_resume` is the one rule both recipes follow for
``checkpoint.resume_from`` (what counts as a checkpoint to resume from).

RNG: :func:`capture_host_rng` / :func:`restore_host_rng` cover Python's ``random`` and
numpy's global generator; the recipe adds its framework's generator state (e.g. torch's
CPU generator, base64-encoded) under ``rng["framework"]``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainers.common.data import DataCursor
from trainers.errors import UserError

TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """What a resumed run needs besides tensors. JSON-serializable."""

    step: int
    epoch: int
    cursor: DataCursor
    rng: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cursor"] = self.cursor.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainerState:
        return cls(
            step=int(d["step"]),
            epoch=int(d["epoch"]),
            cursor=DataCursor.from_dict(d["cursor"]),
            rng=d.get("rng", {}),
            metrics=d.get("metrics", {}),
            extra=d.get("extra", {}),
        )


def capture_host_rng() -> dict[str, Any]:
    """Python ``random`` and numpy global RNG states as JSON values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore_host_rng(rng: dict[str, Any]) -> None:
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for p in base.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointReporter(Protocol):
    """What :func:`save_checkpoint` needs of the run's reporter (``trainers.common.reporter``)."""

    def persist(self) -> None: ...

    def checkpoint(self, step: int, location: str, metrics: dict[str, Any]) -> None: ...

    def unacknowledged_checkpoints(self) -> set[int]: ...


def save_checkpoint(
    root: str | Path,
    state: TrainerState,
    write_tensors: Callable[[Path], None],
    *,
    keep_last: int,
    reporter: CheckpointReporter | None = None,
) -> Path:
    """Atomically write ``step-<state.step>`` under ``root`` and prune to ``keep_last``.

    Args:
        write_tensors: called with the (temporary) directory to put framework files in.
        reporter: the run's reporter: what it holds is spooled before the rename, the
            checkpoint reported after it, and a checkpoint whose listing the API has not
            acknowledged is never pruned (module docstring). None: no reports.

    Returns:
        The final checkpoint directory.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(base, state.step)
    tmp = base / f".tmp-step-{state.step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_tensors(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps(state.to_dict(), indent=1), encoding="utf-8")
        _fsync_tree(tmp)
        if reporter is not None:
            reporter.persist()
    except BaseException:
        # A save that failed (a full disk, most often) leaves nothing behind: its partial
        # files would keep the disk full for the error report that comes next.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # the same step again (e.g. SIGTERM right after a periodic save)
        old = base / f".old-step-{state.step}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(base)
    keep: set[int] = set()
    if reporter is not None:
        reporter.checkpoint(state.step, str(final), dict(state.metrics))
        keep = reporter.unacknowledged_checkpoints()
    prune_checkpoints(base, keep_last, keep=keep)
    return final


def prune_checkpoints(root: str | Path, keep_last: int, *, keep: Iterable[int] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints, sparing the steps in ``keep``;
    returns the deleted paths."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    spared = set(keep)
    doomed = [p for step, p in list_checkpoints(root)[:-keep_last] if step not in spared]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def report_resumed(reporter: Any, root: str | Path, checkpoint_dir: str | Path, state: TrainerState,
                   metric_rows: Iterable[dict[str, Any]], *, every_n_steps: int) -> None:
    """Report again the checkpoint a run resumes from, and the metric rows since the
    periodic checkpoint before it (``metrics.jsonl``, kept up to the resumed step).

    The run that wrote it may have died between its rename and its report, or with a
    spool that died with its pod; the API applies both idempotently (a step's metrics and a
    checkpoint's listing are replaced, not added). A checkpoint from outside ``root`` (an
    explicit ``resume_from`` of another run) is not this job's to list.
    """
    if Path(checkpoint_dir).resolve().parent != Path(root).resolve():
        return
    since = state.step - (state.step - 1) % every_n_steps - 1  # the periodic checkpoint's step
    for row in metric_rows:
        if since < int(row.get("step", 0)) <= state.step:
            reporter.metric(**row)
    reporter.checkpoint(state.step, str(checkpoint_dir), dict(state.metrics))


def load_trainer_state(checkpoint_dir: str | Path) -> TrainerState:
    return TrainerState.from_dict(
        json.loads((Path(checkpoint_dir) / TRAINER_STATE).read_text(encoding="utf-8"))
    )


def resolve_resume(checkpoint: Any) -> Path | None:
    """The checkpoint directory a run resumes from, given the spec's ``checkpoint`` section.

    - ``resume_from`` None: a fresh start (None);
    - ``"latest"``: the newest complete checkpoint in ``checkpoint.dir``, or None when
      there is none yet (the first attempt of a job that may be restarted);
    - a directory: it must be a complete checkpoint (it holds ``trainer_state.json``, the
      file written last), else UserError ``checkpoint_not_found``; a half-written or
      unrelated directory is refused before any model is loaded.
    """
    wanted = checkpoint.resume_from
    if wanted is None:
        return None
    if wanted == "latest":
        return latest_checkpoint(checkpoint.dir)
    path = Path(wanted)
    if not (path / TRAINER_STATE).is_file():
        raise UserError(
            f"checkpoint.resume_from {wanted} is not a checkpoint (no {TRAINER_STATE} in it); "
            "give a step-<N> directory of checkpoint.dir, or 'latest'",
            code="checkpoint_not_found",
        )
    return path
