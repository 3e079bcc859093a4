"""The order in which both trainers step down from a planned step that does not fit.

The scheduler chose a job's micro batch and recomputation (``scheduling.step_choice``)
from its memory estimate and wrote them into the spec, with the pool's memory per device
(``parallelism.device_memory_bytes``). Each trainer checks that choice on its own devices
-- jax_lora with XLA's plan of the compiled step before its first step
(``trainers/jax_lora/step_fit.py``), fsdp_qlora with its first step's measured peak
(``trainers/fsdp_qlora/step_fit.py``) -- and, when it does not fit, takes the next choice
in the scheduler's speed order. What both share lives here: that order, and the share
of the pool's declared memory a step may use.

The global batch never changes: a smaller micro batch is made up by gradient
accumulation, and both trainers normalize a step's loss over the whole batch, so the
loss curve is the one the job asked for whichever choice runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# What a step's own buffers may take of the pool's declared memory per device: the rest is
# the runtime around them (the CUDA context, the allocator's fragmentation, collectives'
# scratch), which neither XLA's plan nor torch's allocated peak counts.
USABLE = 0.9
# As the scheduler's step choice: beyond this a step's matmuls are already large.
MAX_MICRO_BATCH = 64


def declared_limit_bytes(spec: Any) -> int | None:
    """``USABLE`` of the pool's memory per device (``parallelism.device_memory_bytes``);
    None where the spec declares none (a spec written by hand, or before the step choice)."""
    declared = spec.parallelism.device_memory_bytes
    return int(declared * USABLE) if declared else None


def fallback_steps(rows_per_rank: int, micro_batch: int, level: str,
                   order: Sequence[str]) -> list[tuple[int, str]]:
    """The choices after (``micro_batch``, ``level``) in the speed order: smaller micro
    batches at the same recomputation, then every micro batch (largest first) of each
    level in ``order`` (least recomputation first) that recomputes more. Micro batches
    divide ``rows_per_rank``; a level outside ``order`` has no level after it."""
    micros = [m for m in range(min(rows_per_rank, MAX_MICRO_BATCH), 0, -1) if rows_per_rank % m == 0]
    later = order[order.index(level) + 1:] if level in order else ()
    return [(m, level) for m in micros if m < micro_batch] + [(m, r) for r in later for m in micros]
