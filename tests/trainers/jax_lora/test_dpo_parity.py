"""The JAX trainer's DPO objective = the torch trainer's on the same batch and adapter.

The torch trainer's DPO objective is itself checked against TRL's ``DPOTrainer``
(``tests/trainers/fsdp_qlora/test_dpo_trl_parity.py``); here the JAX step's loss, LoRA
gradients and reward sums match it to fp32 rounding on an fp32 and an NF4 base, and the
JAX step's own layouts (accumulation, data-parallel blocks, all-padding pairs) change
nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.trainers.dpo_pairs import pair_data
from tests.trainers.jax_lora.batches import lora_grads, random_lora, torch_model_with_lora
from trainers.common.preference import pad_pairs
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import to_peft_weights
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import lora_runtime, lora_shapes
from trainers.jax_lora.loss import LOSS_CHUNK
from trainers.jax_lora.sharding import make_mesh
from trainers.jax_lora.step import PreferenceLoss, StepConfig, make_preference_loss_and_grads

TARGETS = ("q_proj", "v_proj", "down_proj")
BETA, SFT, R, ALPHA = 0.3, 0.2, 4, 8.0
SEQ = 32


def _jax_batch(batches, blocks: int = 1) -> dict[str, jnp.ndarray]:
    """(accum, rows, seq) arrays; each micro-batch = ``blocks`` preference micro-batches."""
    def arrays(b):
        return {"input_ids": b.input_ids, "labels": b.labels, "positions": b.position_ids,
                "segment_ids": b.segment_ids}

    groups = [batches[i : i + blocks] for i in range(0, len(batches), blocks)]
    stacked = [{k: np.concatenate([arrays(b)[k] for b in g]) for k in arrays(g[0])} for g in groups]
    return {k: jnp.asarray(np.stack([s[k] for s in stacked]), jnp.int32) for k in stacked[0]}


def _jax_objective(model_dir, quant, lora, batch, blocks=1, chunk=LOSS_CHUNK):
    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32, quant)
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(ALPHA, R, 0.0), packed=False, loss_chunk=chunk,
                    preference=PreferenceLoss(beta=BETA, sft_weight=SFT, blocks=blocks))
    value, grads, sums = jax.jit(make_preference_loss_and_grads(sc, None))(lora, params, batch, None)
    return float(value), jax.tree.map(np.asarray, grads), {k: float(v) for k, v in sums.items()}


def _torch_objective(model_dir, quant, peft_lora, batch):
    from trainers.fsdp_qlora.train_step import PreferenceObjective, preference_backward

    model, cpu = torch_model_with_lora(model_dir, quant, peft_lora, r=R, alpha=ALPHA, targets=TARGETS)
    value, sums, _, _ = preference_backward(model, [batch], cpu, PreferenceObjective(BETA, SFT))
    grads = lora_grads(model)
    return value, grads, sums


# chunk 5: the answers' log-probs summed over LM-head chunks that do not divide the rows
@pytest.mark.parametrize(("quant", "chunk"), [("none", LOSS_CHUNK), ("nf4", LOSS_CHUNK), ("none", 5)])
def test_jax_dpo_loss_grads_and_rewards_equal_the_torch_trainer(tiny_untied, tiny_tokenizer, quant, chunk):
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    lora = random_lora(lora_shapes(cfg, TARGETS, R, jnp.float32), seed=5, scale=0.2)
    micro = next(pair_data(tiny_tokenizer, 3, micro_batch_size=3, pad_to=SEQ).micro_batches())

    value, grads, sums = _jax_objective(tiny_untied, quant, lora, _jax_batch([micro]), chunk=chunk)
    t_value, t_grads, t_sums = _torch_objective(tiny_untied, quant, to_peft_weights(lora), micro)

    assert value == pytest.approx(t_value, rel=1e-5, abs=1e-6)
    assert abs(value - np.log(2)) > 1e-2  # the adapter moved the policy off the reference
    ours = to_peft_weights(grads)  # the same reshapes/transposes as the factors'
    assert ours.keys() == t_grads.keys()
    for k in ours:
        np.testing.assert_allclose(ours[k], t_grads[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert sums["pairs"] == t_sums.pairs == 3
    assert sums["correct"] == t_sums.correct
    for key, expected in (("loss_sum", t_sums.loss), ("chosen_sum", t_sums.chosen), ("rejected_sum", t_sums.rejected)):
        assert sums[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key


def test_accumulation_blocks_and_padding_pairs_do_not_change_the_objective(tiny_untied, tiny_tokenizer):
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    lora = random_lora(lora_shapes(cfg, TARGETS, R, jnp.float32), seed=6, scale=0.2)

    def micro_batches(pairs_per_batch: int) -> list:
        stream = pair_data(tiny_tokenizer, 4, micro_batch_size=pairs_per_batch, pad_to=SEQ).micro_batches()
        return [next(stream) for _ in range(4 // pairs_per_batch)]

    # 2 micro-batches x 2 blocks, each block one pair and one all-padding pair (as the
    # recipe pads a short micro-batch): accumulation, blocks and padding at once
    singles = [pad_pairs(b, 2, tiny_tokenizer.pad_token_id) for b in micro_batches(1)]
    value, grads, sums = _jax_objective(tiny_untied, "none", lora, _jax_batch(micro_batches(4)))
    v, g, s = _jax_objective(tiny_untied, "none", lora, _jax_batch(singles, blocks=2), blocks=2)
    assert v == pytest.approx(value, rel=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert s["pairs"] == 4 and s["correct"] == sums["correct"]
    assert s["chosen_sum"] == pytest.approx(sums["chosen_sum"], rel=1e-5, abs=1e-6)
