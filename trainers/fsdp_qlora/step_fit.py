"""Confirm the planned step with the run's first step, and step down if it does not fit.

The scheduler chose the job's micro batch and activation checkpointing from its memory
estimate (the spec's ``hyperparameters.micro_batch_size`` and
``parallelism.activation_checkpointing``). torch has no plan of a step before it runs,
so the recipe takes the run's first step with the planned choice and measures its peak
(:class:`PeakMemory`): on a GPU the allocator's peak of live tensors
(``torch.cuda.max_memory_allocated``, what each metric row's ``memory_bytes`` reports),
on CPU the process's resident set (``VmHWM``, everything the CPU plan counts), each
reset just before the step. If the peak is over the device's memory (:func:`device_limit_bytes`)
or the step ran out of memory (``torch.OutOfMemoryError``, one process only: a rank
that fails alone leaves the others waiting in a collective), the recipe puts the
trainable state back as it was before the step (:class:`TrainableState`), takes the
next choice in the scheduler's speed order (``trainers.common.step_fit``: a smaller
micro batch, then checkpointing every layer from the largest micro batch down) and runs
the step again, until one fits. The step that counts is the one that fit: the global
batch, the data and the update rule are the same whatever the choice, so its loss is
the loss any choice gives. If none fits, the job fails with ``out_of_memory`` before
any step is reported, which the scheduler answers with a larger gang.

The device's memory is ``USABLE`` of the smaller of the pool's memory per device
(``parallelism.device_memory_bytes``, what the step was planned against) and, on a GPU,
the device's own total memory: the allocator's peak leaves out the runtime around the
tensors (the CUDA context, the allocator's fragmentation), as XLA's plan does on the
JAX side. A CPU process has no limit of its own: on a CPU pool only the pool's figure
counts, and without it (or where the kernel cannot reset ``VmHWM``) the step is taken
as planned and only out-of-memory errors step down.

Checkpointing that was off is switched on in place: each decoder layer gets the
checkpoint wrapper ``build_model`` would have given it. On several ranks that wrapper
then sits around the layer's FSDP unit instead of inside it; FSDP2 re-gathers a layer
for a recomputation that runs inside its backward either way. CPU offload stays what
the placement chose (it sized the host for it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainers.common.memory import peak_rss_bytes, reset_peak_rss
from trainers.common.step_fit import USABLE, declared_limit_bytes

CHECKPOINTING_ORDER = ("none", "non_reentrant")
"""Least recomputation first: the scheduler's ``none`` and ``per_layer`` in torch's words."""
GIB = 2**30


@dataclass(frozen=True)
class MeasuredStep:
    """One choice the first step ran with, and its measured peak on one device."""

    micro_batch: int
    activation_checkpointing: str
    peak_bytes: int | None
    """The highest of every rank's peak; None: the step ran out of memory."""
    limit_bytes: int | None

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None and (self.limit_bytes is None or self.peak_bytes <= self.limit_bytes)

    def describe(self) -> str:
        """"micro-batch 4, no checkpointing: the first step peaked at 0.612 GiB of 0.9 GiB"."""
        checkpointing = ("no checkpointing" if self.activation_checkpointing == "none"
                         else f"{self.activation_checkpointing} checkpointing")
        if self.peak_bytes is None:
            return f"micro-batch {self.micro_batch}, {checkpointing}: out of memory"
        limit = "" if self.limit_bytes is None else f" of {self.limit_bytes / GIB:.3g} GiB"
        return f"micro-batch {self.micro_batch}, {checkpointing}: the first step peaked at " \
               f"{self.peak_bytes / GIB:.3g} GiB{limit}"


def device_limit_bytes(spec: Any, device: torch.device) -> int | None:
    """The memory the step must fit on ``device`` (module docstring); None: no limit known."""
    limits = []
    declared = declared_limit_bytes(spec)
    if declared is not None:
        limits.append(declared)
    if device.type == "cuda":
        limits.append(int(torch.cuda.get_device_properties(device).total_memory * USABLE))
    return min(limits) if limits else None


class PeakMemory:
    """The peak memory of this rank's device since :meth:`reset`, and since the start.

    A GPU's is the caching allocator's peak of allocated tensors; a CPU's the process's
    resident-set high-water mark. :meth:`since_start` keeps what every metric row reports
    (the peak of the whole run, loading included) across the resets.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before_reset = 0

    def read(self) -> int:
        """The peak since the last reset (the process's start before any)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return peak_rss_bytes()

    def reset(self) -> bool:
        """Start measuring a new peak; False where the peak cannot be reset (the kernel
        offers no reset of ``VmHWM``), and then :meth:`read` stays the process's peak."""
        self._before_reset = max(self._before_reset, self.read())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        return reset_peak_rss()

    def since_start(self) -> int:
        return max(self._before_reset, self.read())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its storage: writes reach the DTensor), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


class TrainableState:
    """What an optimizer step changes -- the trainable parameters and the optimizer's
    state -- copied to host memory, so that a step can be taken again from the same state.

    The LoRA parameters and their AdamW moments are small next to the base weights; a
    fresh run's optimizer has no state yet (AdamW creates it in its first step), and
    :meth:`restore` drops what a step created.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        with torch.no_grad():
            self.params = [(p, _local(p).detach().to("cpu", copy=True)) for p in model.parameters()
                           if p.requires_grad]
            self.state = {p: {k: _local(v).detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
                              for k, v in state.items()}
                          for p, state in optimizer.state.items()}

    def restore(self) -> None:
        """Write the saved values back in place (every rank its own shards), gradients cleared."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, saved in self.params:
                _local(p).copy_(saved)
            for p in [p for p in self.optimizer.state if p not in self.state]:
                del self.optimizer.state[p]
            for p, saved_state in self.state.items():
                live = self.optimizer.state[p]
                for k, v in saved_state.items():
                    if torch.is_tensor(v) and torch.is_tensor(live.get(k)):
                        _local(live[k]).copy_(v)
                    else:
                        live[k] = v


def with_step(spec: Any, micro_batch: int, activation_checkpointing: str) -> Any:
    """``spec`` running (``micro_batch``, ``activation_checkpointing``); everything else as it was."""
    return spec.model_copy(update={
        "hyperparameters": spec.hyperparameters.model_copy(update={"micro_batch_size": micro_batch}),
        "parallelism": spec.parallelism.model_copy(update={"activation_checkpointing": activation_checkpointing}),
    })
