"""Starting the fsdp_qlora ranks: what ``python -m trainers`` runs for ``trainer: fsdp_qlora``.

:class:`FsdpQloraLauncher` is the recipe the entry point drives. It trains in this
process (as :class:`~trainers.fsdp_qlora.recipe.FsdpQloraRecipe`) when the job has one
rank, or when this process already is a rank (``RANK`` set by torchrun or a Kubernetes
pod's launcher). Otherwise it becomes the launcher of this node's ranks:

1. dump the spec into the work dir (``checkpoint.dir``) for the ranks to read;
2. spawn ``python -m trainers.fsdp_qlora.launch --spec ... --work-dir ...`` once per
   local rank (``distributed.launch_local``; on Kubernetes one pod per node does the
   same for its GPUs using ``NNODES``/``NODE_RANK``), forwarding SIGTERM to them;
3. relay the items rank 0 writes to its local report file into the launcher's own
   reporter (:class:`ReportRelay`), so the job keeps ONE reporter and one ``seq`` series;
4. turn the ranks' exit into the launcher's outcome: a failing rank writes its
   ``{code, message}`` to ``.rank<N>-termination.json`` (:func:`rank_main`) and
   :func:`rank_error` raises it again here with the same exit code and code.

The training itself, identical on every rank, is :class:`~trainers.fsdp_qlora.recipe.FsdpQloraRecipe`,
driven by ``trainers.common.recipe.run_recipe`` there as here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from trainers.common.recipe import Recipe, TrainResult, run_recipe
from trainers.errors import OutOfMemory, Preempted, TrainerError, UserError
from trainers.exit_codes import ExitCode

# Imported here, not lazily: an image without torch (or peft, transformers) is then
# refused by the entry point's import as ``trainer_unavailable``.
from trainers.fsdp_qlora.recipe import FsdpQloraRecipe, check_reinforcement_layout

RANK_REPORTS = ".rank0-reports.jsonl"
RANK_SPEC = ".launch-spec.json"
TERMINATION_FILE = ".rank{rank}-termination.json"


class FsdpQloraLauncher(Recipe):
    """The fsdp_qlora recipe of the entry point: this process's rank recipe when it trains
    itself, else the launcher of this node's ranks (module docstring).

    Launching, :meth:`train` spawns the ranks and waits for them; they write every output
    (checkpoints, adapter, manifest), so :meth:`save` has nothing left to do.
    """

    def __init__(self) -> None:
        self._rank: FsdpQloraRecipe | None = None
        self._launch: tuple[Any, Any] | None = None  # (spec, reporter) when launching

    def setup(self, spec: Any, reporter: Any, stop: Any) -> None:
        check_reinforcement_layout(spec)  # before N ranks are started for a job that cannot run
        if spec.parallelism.world_size > 1 and "RANK" not in os.environ:
            # ``stop`` is not polled here: SIGTERM reaches the ranks through
            # ``launch_local``'s forwarding, and they checkpoint and exit PREEMPTED.
            self._launch = (spec, reporter)
            return
        self._rank = FsdpQloraRecipe()
        self._rank.setup(spec, reporter, stop)

    def train(self) -> TrainResult:
        if self._rank is not None:
            return self._rank.train()
        assert self._launch is not None, "setup() first"
        spec, reporter = self._launch
        launch_ranks(spec, reporter=reporter)
        return TrainResult(final_step=None, output_dir=Path(spec.output_dir))

    def save(self) -> None:
        if self._rank is not None:
            self._rank.save()

    def cleanup(self) -> None:
        if self._rank is not None:
            self._rank.cleanup()


def launch_ranks(spec: Any, *, reporter: Any) -> None:
    """Spawn this node's ranks, relay rank 0's reports, and turn their exit into ours.

    SIGTERM reaches the ranks through ``launch_local``'s forwarding, and they checkpoint
    and exit PREEMPTED, which :func:`rank_error` maps.
    """
    from trainers.fsdp_qlora.distributed import (
        accelerator_available,
        check_parallelism,
        launch_local,
    )

    par, hp = spec.parallelism, spec.hyperparameters
    # Refuse bad layouts here too, before N processes pay their imports.
    check_parallelism(world_size=par.world_size, batch_size=hp.batch_size, micro_batch_size=hp.micro_batch_size,
                      cpu_offload=par.cpu_offload, has_accelerator=accelerator_available())
    work = Path(spec.checkpoint.dir)
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / RANK_SPEC
    spec.dump(spec_path)
    reports = work / RANK_REPORTS
    reports.unlink(missing_ok=True)
    for old in work.glob(TERMINATION_FILE.format(rank="*")):
        old.unlink()
    nnodes = int(os.environ.get("NNODES", str(par.nodes)))
    argv = [sys.executable, "-m", "trainers.fsdp_qlora.launch", "--spec", str(spec_path), "--work-dir", str(work)]
    relay = ReportRelay(reports, reporter)
    relay.start()
    try:
        code = launch_local(argv, par.world_size, nnodes=nnodes)
    finally:
        relay.stop()
        spec_path.unlink(missing_ok=True)
    if code == 0:
        return
    raise rank_error(work, code)


def rank_error(work: Path, code: int) -> TrainerError:
    """The error of the first rank that wrote one (rank 0 first), else a generic one."""
    for path in sorted(work.glob(TERMINATION_FILE.format(rank="*"))):
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        cls = {int(ExitCode.USER_ERROR): UserError, int(ExitCode.OUT_OF_MEMORY): OutOfMemory,
               int(ExitCode.PREEMPTED): Preempted}.get(code, TrainerError)
        return cls(info.get("message", "a rank failed"), code=info.get("code"))
    if code == int(ExitCode.PREEMPTED):
        return Preempted("ranks stopped on SIGTERM")
    return TrainerError(f"a rank exited with code {code}", code="internal_error")


class ReportRelay:
    """Tails rank 0's local report file and re-adds each item to the launcher's reporter."""

    def __init__(self, path: Path, reporter: Any, interval_s: float = 0.25) -> None:
        self.path, self.reporter, self.interval_s = path, reporter, interval_s
        self._offset = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="report-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._drain()

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            self._drain()

    def _drain(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):  # a partial line: read it next time
                    break
                self._offset += len(line.encode("utf-8"))
                item = json.loads(line)
                item.pop("seq", None)  # the launcher's reporter numbers its own batches
                if item.get("type") == "checkpoint":  # spooled now, as rank 0 reported it
                    self.reporter.checkpoint(item["step"], item["location"], item.get("metrics", {}))
                else:
                    self.reporter.add(item)


def rank_main(argv: list[str] | None = None) -> int:
    """One rank started by :func:`launch_ranks`: ``--spec`` and the launcher's work dir.

    Rank 0 writes its report items to a local file the launcher relays; every rank turns
    its outcome into an exit code and, on failure, a termination file for the launcher.
    """
    import argparse

    from trainers.__main__ import classify
    from trainers.common.reporter import Reporter
    from trainers.common.signals import StopFlag
    from trainers.spec import TrainerSpec

    parser = argparse.ArgumentParser(prog="python -m trainers.fsdp_qlora.launch")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    spec = TrainerSpec.load(args.spec)
    rank = int(os.environ.get("RANK", "0"))
    work = Path(args.work_dir)
    reporter = Reporter(url=None, local_path=work / RANK_REPORTS if rank == 0 else os.devnull,
                        flush_interval_s=0.2)
    stop = StopFlag().install()
    code = 0
    try:
        run_recipe(FsdpQloraRecipe(), spec, reporter=reporter, stop=stop)
    except BaseException as exc:  # every outcome becomes an exit code  # noqa: BLE001
        error = classify(Preempted("interrupted") if isinstance(exc, KeyboardInterrupt) else exc)
        if error.exit_code == ExitCode.INTERNAL_ERROR:
            import traceback

            traceback.print_exception(exc)
        (work / TERMINATION_FILE.format(rank=rank)).write_text(json.dumps(error.to_dict()), encoding="utf-8")
        code = int(error.exit_code)
    finally:
        stop.uninstall()
        reporter.close()
    return code


if __name__ == "__main__":
    sys.exit(rank_main())
