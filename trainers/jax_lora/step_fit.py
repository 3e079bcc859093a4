"""Confirm the planned step on the devices before the first step, and step down if it does not fit.

The scheduler chose the job's micro batch and rematerialization from its memory
estimate (the spec's ``hyperparameters.micro_batch_size`` and ``parallelism.remat``).
An estimate can be wrong; XLA's is not an estimate: the compiled train step's
``memory_analysis()`` gives the bytes of every buffer the step's program holds on one
device -- its arguments (weights, adapter, optimizer state, batch), outputs and
temporaries, minus what donation lets the outputs reuse. The recipe compiles the step
for the planned choice (the executable it then runs: nothing is compiled twice) and
compares that total with the device's memory. If it does not fit, it tries the next
choices in the scheduler's speed order -- a smaller micro batch at the same
rematerialization, then more rematerialization from the largest micro batch down --
and runs the first that fits. The global batch never changes (gradient accumulation
makes up the rest), so the loss curve is the one the job asked for. If nothing fits,
the job fails with ``out_of_memory`` before its first step, which the scheduler answers
with a larger gang.

The device's memory is the smaller of what the device reports (``bytes_limit`` of its
allocator, on GPUs) and ``parallelism.device_memory_bytes`` (the pool's memory per
device, which the step was planned against) times ``USABLE``. A CPU device reports
none: on a CPU pool only the pool's figure counts. That share (``USABLE``) and the
order are the torch trainer's too (``trainers.common.step_fit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.common import step_fit
from trainers.common.step_fit import declared_limit_bytes
from trainers.spec import TrainerSpec

REMAT_ORDER = ("none", "dots_saveable", "per_layer")
"""Least recomputation first: the scheduler's speed order (scheduling/step_choice.py)."""


@dataclass(frozen=True)
class StepFit:
    """One candidate step and what XLA plans for it on one device."""

    micro_batch: int
    remat: str
    xla_bytes: int
    limit_bytes: int | None

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.xla_bytes <= self.limit_bytes

    def describe(self) -> str:
        remat = "no remat" if self.remat == "none" else f"remat {self.remat}"
        limit = "" if self.limit_bytes is None else f" of {self.limit_bytes / 2**30:.3g} GiB"
        return f"micro-batch {self.micro_batch}, {remat}: XLA plans {self.xla_bytes / 2**30:.3g} GiB{limit}"


def xla_step_bytes(compiled: Any) -> int:
    """The bytes one device holds while the compiled step runs: arguments + outputs -
    aliased (donated inputs the outputs reuse) + temporaries + generated code."""
    mem = compiled.memory_analysis()
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
               + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)


def device_limit_bytes(spec: TrainerSpec, device: Any) -> int | None:
    """The memory the step must fit on ``device`` (module docstring); None: no limit known.
    A device's own allocator limit already leaves room for the runtime and is used whole."""
    declared = declared_limit_bytes(spec)
    limits = [declared] if declared is not None else []
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends raise or return None: no limit reported
        stats = None
    if stats and stats.get("bytes_limit"):
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def fallback_steps(rows_per_rank: int, micro_batch: int, remat: str) -> list[tuple[int, str]]:
    """The choices after (``micro_batch``, ``remat``) in the speed order: smaller micro
    batches at the same rematerialization, then every micro batch (largest first) of each
    rematerialization that recomputes more. Micro batches divide ``rows_per_rank``."""
    return step_fit.fallback_steps(rows_per_rank, micro_batch, remat, REMAT_ORDER)


def with_step(spec: TrainerSpec, micro_batch: int, remat: str) -> TrainerSpec:
    """``spec`` running (``micro_batch``, ``remat``); everything else as it was."""
    return spec.model_copy(update={
        "hyperparameters": spec.hyperparameters.model_copy(update={"micro_batch_size": micro_batch}),
        "parallelism": spec.parallelism.model_copy(update={"remat": remat}),
    })
