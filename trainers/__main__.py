"""Trainer entry point: ``python -m trainers --spec spec.json``.

1. Parse the spec (unreadable or invalid -> exit USER_ERROR, code ``invalid_spec``).
2. Build the reporter (``trainers.common.reporter``), mirror its items to the spec's
   experiment trackers (``trainers.common.integrations``), install the SIGTERM flag.
   s3:// locations (``trainers.common.storage``): the recipe gets a copy of the spec with
   local paths; model and data are downloaded into the cache dir first (and, with
   ``resume_from: latest``, the newest checkpoint in the bucket), and each reported
   checkpoint and the final output dir are uploaded before their report items go out
   with their s3:// locations.
3. Dispatch to the recipe named by ``spec.trainer`` (imported lazily, so a torch image
   without jax, or the reverse, still starts): ``trainers.fsdp_qlora.launch:FsdpQloraLauncher``
   (which starts the ranks, each running ``trainers.fsdp_qlora.recipe.FsdpQloraRecipe``) or
   ``trainers.jax_lora.recipe:JaxLoraRecipe``. A recipe is a
   :class:`trainers.common.recipe.Recipe` (setup, train, save, cleanup; one stop contract
   and one output contract for all), driven by ``run_recipe``; it raises
   :class:`trainers.errors.TrainerError` subclasses for conditions the user can act on, and
   :class:`~trainers.errors.Preempted` after checkpointing on SIGTERM.
4. Map the outcome to the exit code (``trainers.exit_codes``), write ``{"code",
   "message"}`` to ``spec.termination_log`` and report an ``error`` item:

   ===============================================  ===============  =================
   outcome                                          exit code        code
   ===============================================  ===============  =================
   success                                          SUCCESS (0)      -
   TrainerError subclass                            its exit_code    its code
   torch/jax out of memory, MemoryError             OUT_OF_MEMORY    ``out_of_memory``
   OSError ENOSPC / EDQUOT                          USER_ERROR       ``disk_full``
   recipe module/framework missing in this image    USER_ERROR       ``trainer_unavailable``
   anything else                                    INTERNAL_ERROR   ``internal_error``
   ===============================================  ===============  =================

``Preempted`` is an expected outcome, not an error: it is reported as an event.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainers.errors import DiskFull, OutOfMemory, Preempted, TrainerError, UserError
from trainers.exit_codes import ExitCode

if TYPE_CHECKING:
    from trainers.common.recipe import Recipe

log = logging.getLogger("trainers")

RECIPES: dict[str, str] = {
    "fsdp_qlora": "trainers.fsdp_qlora.launch:FsdpQloraLauncher",
    "jax_lora": "trainers.jax_lora.recipe:JaxLoraRecipe",
}
CLOSE_TIMEOUT_S = 15.0


def load_recipe(trainer: str) -> type[Recipe]:
    """Import the recipe class of the named trainer; UserError ``trainer_unavailable`` if
    this image lacks it (or its framework)."""
    from trainers.common.recipe import Recipe

    target = RECIPES.get(trainer)
    if target is None:
        raise UserError(f"unknown trainer {trainer!r}", code="invalid_spec")
    module_name, attr = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UserError(
            f"trainer {trainer!r} is not available in this image ({exc})", code="trainer_unavailable"
        ) from exc
    recipe = getattr(module, attr, None)
    if not (isinstance(recipe, type) and issubclass(recipe, Recipe)):
        raise UserError(f"{module_name} has no {attr} recipe", code="trainer_unavailable")
    return recipe


def classify(exc: BaseException) -> TrainerError:
    """Map any exception to a TrainerError with the right exit code and stable code."""
    if isinstance(exc, TrainerError):
        return exc
    for e in _chain(exc):
        if isinstance(e, MemoryError) or _is_framework_oom(e):
            return OutOfMemory(f"out of memory: {e}")
        if _is_disk_full(e):
            return DiskFull(f"no space left on device ({e}); free disk space where the job writes its "
                            "checkpoints and outputs, then run it again")
    err = TrainerError(f"{type(exc).__name__}: {exc}", code="internal_error")
    return err


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in _DISK_FULL_ERRNOS
    # Writers in Rust (safetensors) raise their own type, the OS error only in the text.
    return any(f"(os error {number})" in str(exc) for number in _DISK_FULL_ERRNOS)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the per-rank errors a wrapper carries:
    torch.distributed.checkpoint raises one ``CheckpointException`` whose ``failures``
    maps each rank to its (exception, traceback), not chained as a cause."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop(0)
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        failures = getattr(cur, "failures", None)
        wrapped = [f[0] if isinstance(f, tuple) and f else f for f in failures.values()] \
            if isinstance(failures, dict) else []
        todo += [cur.__cause__, cur.__context__, *(w for w in wrapped if isinstance(w, BaseException))]
    return seen


def _is_framework_oom(exc: BaseException) -> bool:
    # By name, so the entry point imports neither torch nor jax: torch raises
    # torch.OutOfMemoryError (CUDA/ROCm); XLA raises XlaRuntimeError RESOURCE_EXHAUSTED.
    names = {t.__name__ for t in type(exc).__mro__}
    if "OutOfMemoryError" in names:
        return True
    return "XlaRuntimeError" in names and "RESOURCE_EXHAUSTED" in str(exc)


def write_termination_log(path: str | None, error: TrainerError) -> None:
    if not path:
        return
    try:
        Path(path).write_text(json.dumps(error.to_dict()) + "\n", encoding="utf-8")
    except OSError:
        log.exception("cannot write the termination log %s", path)


def _termination_log_of(spec_path: str) -> str | None:
    """Best effort: the termination_log of a spec that failed validation."""
    try:
        raw = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = raw.get("termination_log") if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def watch_parent(stop: Any, interval_s: float = 1.0) -> threading.Thread:
    """Stop (checkpoint and exit PREEMPTED) once the process that started us is gone.

    The local executor sets ``TUNEFLEET_STOP_WITH_PARENT=1``: a trainer runs in its own
    session, so the death of its Celery worker would otherwise leave it training alone.
    The re-sent supervising task then resumes it from the checkpoint this writes.
    """
    parent = os.getppid()

    def watch() -> None:
        while not stop.requested:
            if os.getppid() != parent:
                stop.request("parent process gone")
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, name="watch-parent", daemon=True)
    thread.start()
    return thread


def configure_logging() -> None:
    """INFO on stderr, which the executor keeps as the job's log, except the HTTP client's.

    httpx logs every request at INFO ("HTTP Request: POST .../reports "HTTP/1.1 200 OK""),
    and the reporter sends one at every flush: those lines would bury the training's own.
    From WARNING they still show; a report that fails is logged by the reporter itself
    (``trainers.common.reporter``, WARNING and ERROR), with its status and what it does next.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="path of the trainer spec JSON")
    args = parser.parse_args(argv)
    configure_logging()

    from pydantic import ValidationError

    from trainers.spec import TrainerSpec

    try:
        spec = TrainerSpec.load(args.spec)
    except (OSError, ValueError, ValidationError) as exc:
        error = UserError(f"cannot read the trainer spec {args.spec}: {exc}", code="invalid_spec")
        print(json.dumps(error.to_dict()), file=sys.stderr)
        write_termination_log(_termination_log_of(args.spec), error)
        return int(error.exit_code)

    from trainers.common.recipe import run_recipe, standalone_reporter
    from trainers.common.signals import StopFlag
    from trainers.common.storage import S3Staging, uses_s3

    # s3:// locations: the recipe gets a copy of the spec with local paths (a cache dir);
    # inputs are downloaded and outputs uploaded around it (trainers.common.storage).
    staging: S3Staging | None = None
    run_spec = spec
    if uses_s3(spec):
        try:
            staging = S3Staging(spec)
        except TrainerError as exc:
            print(json.dumps(exc.to_dict()), file=sys.stderr)
            write_termination_log(spec.termination_log, exc)
            return int(exc.exit_code)
        run_spec = staging.local_spec
    output_dir = Path(run_spec.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # The spool lives next to the checkpoints: both survive a restart of the trainer, so
    # a restarted process re-sends what was not acknowledged and never reuses a seq.
    reporter = standalone_reporter(run_spec)
    if spec.integrations:
        from trainers.common.integrations import mirror_from_spec

        reporter.mirror = mirror_from_spec(spec, warn=lambda msg: reporter.event(msg, level="warning"))
    stop = StopFlag().install()
    if os.environ.get("TUNEFLEET_STOP_WITH_PARENT") == "1":
        watch_parent(stop)
    error: TrainerError | None = None
    try:
        recipe = load_recipe(spec.trainer)()
        recipe_reporter: Any = reporter
        if staging is not None:
            reporter.event("staging s3:// inputs", data={"cache_dir": str(staging.root)})
            reporter.event("s3:// inputs staged", data=staging.stage_inputs())
            recipe_reporter = staging.wrap_reporter(reporter)
        run_recipe(recipe, run_spec, reporter=recipe_reporter, stop=stop)
        if getattr(recipe_reporter, "failure", None) is not None:
            raise recipe_reporter.failure  # an upload that failed outside the recipe's thread
    except BaseException as exc:  # every outcome must become an exit code  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            exc = Preempted("interrupted")
        error = classify(exc)
        if error.exit_code == ExitCode.INTERNAL_ERROR:
            log.error("trainer crashed:\n%s", "".join(traceback.format_exception(exc)))
        else:
            log.error("%s: %s", error.code, error.message)
    finally:
        stop.uninstall()
    if error is not None:
        if isinstance(error, Preempted):
            reporter.event(f"preempted: {error.message}", level="warning")
        else:
            reporter.error(error.code, error.message)
        write_termination_log(spec.termination_log, error)
    if reporter.mirror is not None:
        reporter.mirror.close(failed=error is not None and not isinstance(error, Preempted))
    if not reporter.close(timeout_s=CLOSE_TIMEOUT_S):
        log.warning("some reports were not delivered; they stay spooled for the next attempt")
    return int(error.exit_code) if error is not None else int(ExitCode.SUCCESS)


if __name__ == "__main__":
    # Before anything is written: checkpoints, logs, metrics and the adapter are the
    # tenant's, and most of their writers (torch, safetensors) take no file mode.
    from trainers.common.private_files import restrict_new_files

    restrict_new_files()
    sys.exit(main())
