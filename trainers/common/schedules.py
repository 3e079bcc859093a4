"""Learning-rate schedules as pure functions of the optimizer step (both trainers use them).

Step ``s`` is 0-based: the learning rate used by the ``s``-th optimizer update.

- warmup (``s < warmup_steps``): linear from ``base_lr / warmup_steps`` up to ``base_lr``
  at ``s = warmup_steps - 1`` (the first update is never wasted at lr 0);
- then, with ``progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)``
  clamped to ``[0, 1]``: ``cosine`` = ``base_lr * 0.5 * (1 + cos(pi * progress))``,
  ``linear`` = ``base_lr * (1 - progress)``, ``constant`` = ``base_lr``.

The torch recipe sets the lr on its param groups from this function each step; the JAX
trainer can wrap it as an optax schedule (``lambda s: learning_rate_at(int(s), ...)``)
or re-express it with ``jnp`` — the tests compare against this one.
"""

from __future__ import annotations

import math
from typing import Literal

ScheduleKind = Literal["cosine", "linear", "constant"]


def learning_rate_at(
    step: int, *, base_lr: float, total_steps: int, warmup_steps: int = 0, kind: ScheduleKind = "cosine"
) -> float:
    """The learning rate of 0-based optimizer step ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown schedule {kind!r}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return base_lr
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if kind == "linear":
        return base_lr * (1.0 - progress)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
