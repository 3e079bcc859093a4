"""Model FLOP utilisation (MFU) of a training step, from the throughput its trainer reports.

MFU is the share of the gang's peak FLOP/s that the model's own arithmetic used::

    MFU = tokens_per_s x model FLOPs per token / (gpus x peak_tflops x 1e12)

``tokens_per_s`` is what the trainer reports for the step (non-padding tokens of all
ranks over the step's wall time; a DPO step counts its chosen and its rejected rows).
*Model* FLOPs per token are ``scheduling.estimator.flops_per_token`` with checkpointing
off: the FLOPs the model needs, not the hardware FLOPs the step ran. Recomputation under
activation checkpointing (or jax_lora's remat) is work the hardware does to save memory,
so a job that recomputes layers shows a lower MFU for the same work, which is the point:
MFU compares jobs by useful work per peak FLOP, whatever step they chose. The attention
term counts the planned sequence length (the estimator's ``seq_len``), as the estimator
does.

At admission the scheduler stores the basis in the job's estimate
(``job.estimate["throughput"]``, :func:`throughput_basis`), from the job's model and
training shapes and its placement (pool, GPUs); report ingestion computes each metric
row's MFU from it (:func:`mfu`), so the API and the metrics exporter read stored values.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from scheduling.estimator import ModelShape, TrainingShape, flops_per_token


def model_flops_per_token(m: ModelShape, t: TrainingShape, trainer: str | None = None) -> float:
    """Model FLOPs per token the trainer reports: ``flops_per_token`` without checkpointing
    (no recomputation counted: MFU counts the model's FLOPs, not recomputed ones).

    A DPO job's estimator figure is per planned token, a pair's length counted once, but
    its trainers report the tokens of both rows of a pair, so it is divided by the two
    sequences: per reported token, one sequence's training pass plus its reference forward.
    """
    model = replace(t, checkpointing=False, saves_dots=False)
    return flops_per_token(m, model, trainer) / model.sequences_per_example


def throughput_basis(m: ModelShape, t: TrainingShape, *, trainer: str | None, gpus: int,
                     peak_tflops: float) -> dict[str, float]:
    """What :func:`mfu` needs for a placed job, as stored in ``job.estimate["throughput"]``:
    its model FLOPs per token and the gang's peak FLOP/s (``gpus`` x the pool's
    ``peak_tflops`` per device)."""
    return {"model_flops_per_token": model_flops_per_token(m, t, trainer),
            "peak_flops": gpus * peak_tflops * 1e12}


def mfu(tokens_per_s: float | None, model_flops_per_token: float | None, peak_flops: float | None) -> float | None:
    """``tokens_per_s x model_flops_per_token / peak_flops`` (a fraction: 0.42 is 42 %).

    None when any input is missing, not finite or not positive (a step with no
    throughput, a job admitted without a basis), never a made-up 0."""
    values = (tokens_per_s, model_flops_per_token, peak_flops)
    if not all(v is not None and math.isfinite(v) and v > 0 for v in values):
        return None
    return tokens_per_s * model_flops_per_token / peak_flops  # type: ignore[operator]


def row_mfu(tokens_per_s: float | None, estimate: dict[str, Any] | None) -> float | None:
    """A metric row's MFU from the job's stored estimate (None without a throughput basis)."""
    basis = (estimate or {}).get("throughput")
    if not isinstance(basis, dict):
        return None
    try:
        return mfu(tokens_per_s, float(basis.get("model_flops_per_token") or 0),
                   float(basis.get("peak_flops") or 0))
    except (TypeError, ValueError):
        return None
