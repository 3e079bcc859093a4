"""The LM-head loss a chunk of positions at a time (``trainers/jax_lora/loss.py``).

Loss, LoRA gradients and the eval step's sums/accuracy at chunk sizes that do not divide
the sequence equal transformers + peft on the same weights and adapter; and the compiled
step's temporaries shrink with the chunk (no (rows, seq, vocab) logits are planned).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import PeftModel

from tests.trainers.jax_lora.batches import IGNORE, random_lora
from tests.trainers.jax_lora.hf_tiny import load_hf
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import export_adapter, to_peft_weights
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import lora_runtime, lora_shapes
from trainers.jax_lora.model import param_shapes
from trainers.jax_lora.sharding import make_mesh
from trainers.jax_lora.step import StepConfig, make_eval_step, make_loss_and_grads

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
R, ALPHA = 4, 8.0
ROWS, SEQ = 3, 23


def _rows(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows and labels with every layout the sort must handle: a prompt prefix, holes
    of -100 inside the answer, a row labelled from its second token, one with no label."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, vocab, (ROWS, SEQ)).astype(np.int32)
    labels = tokens.copy()
    labels[0, :12] = IGNORE
    labels[0, [15, 16, 20]] = IGNORE
    labels[1, 0] = IGNORE
    labels[2, :] = IGNORE
    return tokens, labels


def _peft_reference(model_dir, adapter_dir, tokens, labels):
    model = PeftModel.from_pretrained(load_hf(model_dir), str(adapter_dir), is_trainable=True)
    logits = model(input_ids=torch.tensor(tokens, dtype=torch.long), use_cache=False).logits
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    targets = torch.tensor(labels[:, 1:], dtype=torch.long).reshape(-1)
    loss = torch.nn.functional.cross_entropy(shifted, targets, ignore_index=IGNORE)
    loss.backward()
    labelled = targets != IGNORE
    nll_sum = torch.nn.functional.cross_entropy(shifted, targets, ignore_index=IGNORE, reduction="sum")
    correct = int((shifted.argmax(-1)[labelled] == targets[labelled]).sum())
    grads = {name.replace(".default.", "."): p.grad.numpy()
             for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.item(), grads, nll_sum.item(), int(labelled.sum()), correct


# 22 scored positions: neither chunk size divides them; the tied head is the embedding table
@pytest.mark.parametrize(("fixture", "chunk"), [("tiny_untied", 4), ("tiny_tied", 9)])
def test_chunked_loss_grads_and_eval_match_peft(fixture, chunk, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32)
    lora = random_lora(lora_shapes(cfg, TARGETS, R, jnp.float32), seed=2, scale=0.2)
    adapter = export_adapter(tmp_path / "a", lora, r=R, alpha=ALPHA, dropout=0.0, target_modules=TARGETS)
    tokens, labels = _rows(cfg.vocab_size)
    micro = {"input_ids": tokens, "labels": labels, "positions": np.broadcast_to(np.arange(SEQ), tokens.shape),
             "segment_ids": np.ones_like(tokens)}
    micro = {k: jnp.asarray(v, jnp.int32) for k, v in micro.items()}
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(ALPHA, R, 0.0), packed=False, loss_chunk=chunk)
    lora = jax.tree.map(jnp.asarray, lora)

    loss, grads, n_tokens = jax.jit(make_loss_and_grads(sc, None))(
        lora, params, {k: v[None] for k, v in micro.items()}, None)
    sums = jax.jit(make_eval_step(sc, None))(lora, params, micro)
    ref_loss, ref_grads, ref_nll_sum, ref_tokens, ref_correct = _peft_reference(model_dir, adapter, tokens, labels)

    assert int(n_tokens) == int(sums["n_tokens"]) == ref_tokens == 8 + 22
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert float(sums["nll_sum"]) == pytest.approx(ref_nll_sum, rel=1e-5, abs=1e-6)
    assert int(sums["n_correct"]) == ref_correct
    ours = to_peft_weights(jax.tree.map(np.asarray, grads))
    assert ours.keys() == ref_grads.keys()
    for key, ref in ref_grads.items():
        assert np.abs(ref).max() > 1e-4, key
        np.testing.assert_allclose(ours[key], ref, rtol=1e-5, atol=1e-6, err_msg=key)


def _train_temps(chunk: int, vocab: int, rows: int, seq: int) -> int:
    """Temporary bytes XLA plans for the train step's loss and grads (abstract inputs, nothing runs)."""
    cfg = DecoderConfig.from_hf_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": seq, "rope_theta": 10000.0, "tie_word_embeddings": False,
    })
    params = param_shapes(cfg, jnp.float32)
    lora = lora_shapes(cfg, TARGETS, R, jnp.float32)
    batch = {k: jax.ShapeDtypeStruct((1, rows, seq), jnp.int32)
             for k in ("input_ids", "labels", "positions", "segment_ids")}
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(ALPHA, R, 0.0), packed=False, loss_chunk=chunk)
    compiled = jax.jit(make_loss_and_grads(sc, None)).lower(lora, params, batch, None).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_only_a_chunk_of_logits_is_planned():
    vocab, rows, seq = 65536, 2, 256
    logits_bytes = rows * seq * vocab * 4  # one float32 copy of the full logits: 128 MiB
    whole = _train_temps(seq, vocab, rows, seq)  # one chunk: the full logits exist
    chunked = _train_temps(16, vocab, rows, seq)
    assert whole >= logits_bytes
    assert chunked < logits_bytes / 4
