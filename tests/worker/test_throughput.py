"""MFU's definition (``scheduling.throughput``), checked against values computed by hand."""

from __future__ import annotations

import math

import pytest

from scheduling.estimator import ModelShape, TrainingShape, flops_per_token
from scheduling.throughput import mfu, model_flops_per_token, row_mfu, throughput_basis

# A tiny Llama-layout shape whose FLOPs are easy to count by hand:
#   linear params per layer: q, k, v, o 64x64 = 4 x 4,096; gate, up, down 64x128 = 3 x 8,192
#     -> 40,960; 2 layers -> P = 81,920
#   LM head: 100 x 64 = 6,400
#   LoRA r=8 on q, k, v, o: 4 x 8 x (64 + 64) = 4,096 per layer -> 8,192
#   attention (QK^T and AV) per token at seq 32: 2 x 2 x 2 layers x 32 x 4 heads x 16 = 16,384
TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=100)
SHAPE = TrainingShape(seq_len=32, r=8)

# Forward 2P + input-grad backward 2P, the head's forward and backward, attention three
# times (forward, backward's two), LoRA's 6 x its params:
#   4 x 81,920 + 4 x 6,400 + 3 x 16,384 + 6 x 8,192 = 327,680 + 25,600 + 49,152 + 49,152
MODEL_FLOPS = 451_584.0
# With whole-layer checkpointing (the torch trainer) the layers' 2P and the attention
# are recomputed once more: 6 x 81,920 + 25,600 + 4 x 16,384 + 49,152.
HARDWARE_FLOPS_CHECKPOINTED = 631_808.0
# DPO, per reported token (both rows of a pair are counted): one sequence's training
# pass plus its reference forward (2P + the head's 2 x 6,400 + attention once):
#   451,584 + 2 x (81,920 + 6,400) + 16,384
DPO_MODEL_FLOPS = 644_608.0


@pytest.mark.parametrize(("shape", "trainer", "expected"), [
    (SHAPE, "fsdp_qlora", MODEL_FLOPS),
    (TrainingShape(seq_len=32, r=8, checkpointing=False), "fsdp_qlora", MODEL_FLOPS),
    # jax_lora's remat policies change what the hardware recomputes, not the model's FLOPs.
    (SHAPE, "jax_lora", MODEL_FLOPS),
    (TrainingShape(seq_len=32, r=8, saves_dots=True), "jax_lora", MODEL_FLOPS),
    (TrainingShape(seq_len=32, r=8, objective="dpo"), "fsdp_qlora", DPO_MODEL_FLOPS),
])
def test_model_flops_per_token_leave_recomputation_out(shape: TrainingShape, trainer: str, expected: float) -> None:
    assert model_flops_per_token(TINY, shape, trainer) == expected


def test_the_estimators_hardware_flops_count_the_recomputation_model_flops_do_not() -> None:
    assert flops_per_token(TINY, SHAPE, "fsdp_qlora") == HARDWARE_FLOPS_CHECKPOINTED
    assert model_flops_per_token(TINY, SHAPE, "fsdp_qlora") < HARDWARE_FLOPS_CHECKPOINTED


@pytest.mark.parametrize(("tokens_per_s", "flops", "peak", "expected"), [
    # 1,000 tok/s x 451,584 FLOPs on 2 devices of 0.5 TFLOP/s: 4.51584e8 / 1e12
    (1000.0, MODEL_FLOPS, 2 * 0.5e12, 4.51584e-4),
    # an 8B-class model (6e9 FLOPs/token) at 50k tok/s on 8 x 989 TFLOP/s: 3e14 / 7.912e15
    (50_000.0, 6e9, 8 * 989e12, 3e14 / 7.912e15),
    # half the peak exactly
    (2_000.0, 1e9, 4e12, 0.5),
    (None, MODEL_FLOPS, 1e12, None),  # a step with no throughput
    (0.0, MODEL_FLOPS, 1e12, None),
    (1000.0, None, 1e12, None),  # no basis
    (1000.0, MODEL_FLOPS, 0.0, None),
    (math.inf, MODEL_FLOPS, 1e12, None),
    (math.nan, MODEL_FLOPS, 1e12, None),
    (-5.0, MODEL_FLOPS, 1e12, None),
])
def test_mfu(tokens_per_s: float | None, flops: float | None, peak: float | None, expected: float | None) -> None:
    got = mfu(tokens_per_s, flops, peak)
    assert got == expected if expected is None else got == pytest.approx(expected, rel=1e-12)


def test_the_stored_basis_gives_each_row_its_mfu() -> None:
    basis = throughput_basis(TINY, SHAPE, trainer="fsdp_qlora", gpus=2, peak_tflops=0.5)
    assert basis == {"model_flops_per_token": MODEL_FLOPS, "peak_flops": 1e12}
    estimate = {"step": {"micro_batch_size": 1}, "throughput": basis}
    assert row_mfu(1000.0, estimate) == pytest.approx(4.51584e-4)
    assert row_mfu(None, estimate) is None
    assert row_mfu(1000.0, {"step": {}}) is None  # admitted before the basis existed
    assert row_mfu(1000.0, None) is None
    assert row_mfu(1000.0, {"throughput": {"model_flops_per_token": "x", "peak_flops": 1}}) is None
