"""The step a placed job runs: micro batch, rematerialization and CPU offload.

``choose_step`` is a pure function of the job's shapes (model, training), the device it
was placed on and its gang. Among every combination the trainer supports it returns the
fastest whose planned memory (``scheduling.estimator.memory_per_gpu``) fits the device
under ``HEADROOM``. The global batch stays what the job asked for: a micro batch divides
the batch per data-parallel rank, and gradient accumulation makes up the rest, so the
optimizer sees the same steps whatever the choice.

The options:

- micro batch: every divisor of the rows per data-parallel rank, up to ``MAX_MICRO_BATCH``;
- rematerialization: jax_lora ``none``, ``dots_saveable`` (matmul outputs kept, the
  elementwise work recomputed) or ``per_layer`` (each layer's input kept, the layer
  recomputed); fsdp_qlora activation checkpointing ``none`` or ``non_reentrant`` (shown
  as ``per_layer``). CPU pools run without either (the estimator plans them so);
- CPU offload of the sharded weights: fsdp_qlora on an accelerator, only where the
  placement allowed it (it sized the host for it).

Speed order, a heuristic (no step is timed here), lexicographic:

1. less recomputation: ``none``, then ``dots_saveable`` (no matmul recomputed, only the
   elementwise work), then ``per_layer`` (the layer's forward again: about a third more
   FLOPs, ``flops_per_token``);
2. no offload before offload (``scheduling.estimator.OFFLOAD_SLOWDOWN``: slower, and only a placement that
   sized the host for it allows it);
3. the larger micro batch (fewer, larger matmuls per step; fewer of FSDP's per-step
   all-gathers and of the kernel launches each forward/backward pays).

So a job that fits without recomputation runs without it at the largest micro batch
that fits; one that does not gets the least recomputation that fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from scheduling.estimator import (
    HEADROOM,
    MemoryBreakdown,
    ModelShape,
    TrainingShape,
    memory_per_gpu,
)
from scheduling.pools import GIB

Remat = Literal["none", "dots_saveable", "per_layer"]
REMAT_ORDER: tuple[Remat, ...] = ("none", "dots_saveable", "per_layer")
"""Least recomputation first (the speed order's tie-break)."""
# The largest micro batch tried: beyond it a step's matmuls are already large, and a
# longer compile (jax_lora) or a larger allocator peak buys nothing.
MAX_MICRO_BATCH = 64
_FP32 = 4


@dataclass(frozen=True)
class StepChoice:
    """A placed job's step: what the trainer spec says and what the plan holds per device."""

    micro_batch: int
    remat: Remat
    cpu_offload: bool
    planned_bytes: int
    """The estimator's bytes per device for this choice."""
    device_bytes: int
    fits: bool = True
    """False only when not even the smallest choice fits (then it is that one)."""

    @property
    def activation_checkpointing(self) -> Literal["none", "non_reentrant"]:
        """The torch trainer's spelling: it checkpoints whole layers or nothing."""
        return "none" if self.remat == "none" else "non_reentrant"

    def describe(self) -> str:
        """"micro-batch 8, no remat: 61.0 GiB of 80 planned" (the job event's words)."""
        remat = {"none": "no remat", "dots_saveable": "remat dots_saveable",
                 "per_layer": "remat per_layer"}[self.remat]
        offload = ", CPU offload" if self.cpu_offload else ""
        return (f"micro-batch {self.micro_batch}, {remat}{offload}: {self.planned_bytes / GIB:.1f} GiB of "
                f"{self.device_bytes / GIB:.3g} planned ({HEADROOM:.0%} usable)")

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch, "remat": self.remat, "cpu_offload": self.cpu_offload,
                "planned_bytes": self.planned_bytes, "device_bytes": self.device_bytes, "fits": self.fits}

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> StepChoice:
        return cls(micro_batch=int(stored["micro_batch_size"]), remat=stored["remat"],
                   cpu_offload=bool(stored.get("cpu_offload")), planned_bytes=int(stored.get("planned_bytes") or 0),
                   device_bytes=int(stored.get("device_bytes") or 0), fits=bool(stored.get("fits", True)))


def micro_batch_options(batch_size: int, data_parallel: int = 1, limit: int = MAX_MICRO_BATCH) -> list[int]:
    """Micro batches that split ``batch_size`` evenly over the data-parallel ranks and
    their accumulation steps (1 always: a batch the ranks cannot split evenly runs one
    row at a time, as the spec builder lowers it)."""
    per_rank = max(1, batch_size // max(1, data_parallel))
    return sorted({1} | {d for d in range(1, min(per_rank, limit) + 1)
                         if batch_size % (d * max(1, data_parallel)) == 0})


def remat_options(trainer: str, accelerator: str) -> tuple[Remat, ...]:
    """What the trainer can recompute: jax_lora three policies, fsdp_qlora whole layers or
    nothing; CPU pools nothing (fp32 runs without checkpointing)."""
    if accelerator == "cpu":
        return ("none",)
    return REMAT_ORDER if trainer == "jax_lora" else ("none", "per_layer")


def shape_for(t: TrainingShape, *, micro_batch: int, remat: Remat, accelerator: str) -> TrainingShape:
    """The training shape the estimator plans for one choice (a CPU pool's in fp32)."""
    if accelerator == "cpu":
        return replace(t, micro_batch=micro_batch, compute_bytes=_FP32, checkpointing=False, saves_dots=False)
    return replace(t, micro_batch=micro_batch, checkpointing=remat != "none", saves_dots=remat == "dots_saveable")


def planned_memory(m: ModelShape, t: TrainingShape, *, gpus: int, accelerator: str, trainer: str,
                   micro_batch: int, remat: Remat, offload: bool) -> MemoryBreakdown:
    """The estimator's bytes per device for one choice."""
    shape = shape_for(t, micro_batch=micro_batch, remat=remat, accelerator=accelerator)
    return memory_per_gpu(m, shape, gpus, accelerator=accelerator, offload=offload, trainer=trainer)


def step_candidates(m: ModelShape, t: TrainingShape, *, accelerator: str, device_bytes: int, gpus: int,
                    trainer: str, batch_size: int, data_parallel: int = 1, offload_allowed: bool = False,
                    max_micro_batch: int = MAX_MICRO_BATCH, devices_per_process: int = 1) -> list[StepChoice]:
    """Every step the trainer can run for this job, in the speed order (module docstring),
    each with its planned bytes and whether they fit ``device_bytes`` under ``HEADROOM``.
    Arguments as :func:`choose_step`."""
    budget = int(device_bytes * HEADROOM)
    offloads = [False, True] if offload_allowed and trainer == "fsdp_qlora" and accelerator != "cpu" else [False]
    keyed: list[tuple[tuple[int, int, int], StepChoice]] = []
    for micro in micro_batch_options(batch_size, data_parallel, max_micro_batch):
        for level, remat in enumerate(remat_options(trainer, accelerator)):
            for offload in offloads:
                shape = shape_for(t, micro_batch=micro * devices_per_process, remat=remat, accelerator=accelerator)
                planned = memory_per_gpu(m, shape, gpus, accelerator=accelerator, offload=offload,
                                         trainer=trainer).total
                choice = StepChoice(micro, remat, offload, planned, device_bytes, fits=planned <= budget)
                keyed.append(((level, int(offload), -micro), choice))  # the speed order (module docstring)
    return [choice for _, choice in sorted(keyed, key=lambda kc: kc[0])]


def choose_step(m: ModelShape, t: TrainingShape, *, accelerator: str, device_bytes: int, gpus: int,
                trainer: str, batch_size: int, data_parallel: int = 1, offload_allowed: bool = False,
                max_micro_batch: int = MAX_MICRO_BATCH, devices_per_process: int = 1) -> StepChoice:
    """The fastest step whose planned memory fits ``device_bytes`` under ``HEADROOM``.

    Args:
        m: the base model's shape.
        t: the job's training shape (its sequence length the longest row it trains).
        accelerator: the pool's accelerator (``cpu``: fp32, no rematerialization).
        device_bytes: memory of one device (``NodePool.gpu_memory_bytes``).
        gpus: devices the job's gang shards over.
        trainer: ``jax_lora`` or ``fsdp_qlora``.
        batch_size: the job's global batch (kept: accumulation makes up the rest).
        data_parallel: ranks that each take whole rows of a batch.
        offload_allowed: the placement sized the host for fsdp_qlora's CPU offload.
        max_micro_batch: the largest micro batch tried.
        devices_per_process: data-parallel devices one process holds (a jax_lora CPU host
            mesh: each XLA host device takes ``micro`` rows, all in the one process's
            memory, so the plan counts ``micro x devices_per_process`` rows).

    Returns:
        The fastest fitting choice; when none fits, the smallest one with ``fits=False``.
    """
    candidates = step_candidates(m, t, accelerator=accelerator, device_bytes=device_bytes, gpus=gpus,
                                 trainer=trainer, batch_size=batch_size, data_parallel=data_parallel,
                                 offload_allowed=offload_allowed, max_micro_batch=max_micro_batch,
                                 devices_per_process=devices_per_process)
    for choice in candidates:
        if choice.fits:
            return choice
    # At least one micro batch and one policy are always tried; among equal plans the
    # smallest micro batch, then the least recomputation, then no offload.
    smallest = min(candidates, key=lambda c: (c.planned_bytes, c.micro_batch, REMAT_ORDER.index(c.remat),
                                              c.cpu_offload))
    return replace(smallest, fits=False)


def kept_step(stored: dict[str, Any] | None, m: ModelShape, t: TrainingShape, *, accelerator: str,
              device_bytes: int, gpus: int, trainer: str, devices_per_process: int = 1) -> StepChoice | None:
    """A resumed job's earlier choice, re-planned on its new gang (None: none stored, or
    one the new device cannot run: another accelerator kind's remat, or offload where
    the trainer has none)."""
    if not stored:
        return None
    try:
        kept = StepChoice.from_dict(stored)
    except (KeyError, TypeError, ValueError):
        return None
    if kept.remat not in remat_options(trainer, accelerator):
        return None
    offload = kept.cpu_offload and trainer == "fsdp_qlora" and accelerator != "cpu"
    planned = planned_memory(m, t, gpus=gpus, accelerator=accelerator, trainer=trainer,
                             micro_batch=kept.micro_batch * devices_per_process, remat=kept.remat,
                             offload=offload).total
    return StepChoice(kept.micro_batch, kept.remat, offload, planned, device_bytes,
                      fits=planned <= int(device_bytes * HEADROOM))
