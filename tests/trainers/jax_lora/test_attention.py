"""The trainer's attention (``model.attention``) against ``jax.nn.dot_product_attention``.

The model parity tests compare logits with transformers; this one pins the attention
function itself, values AND gradients (its probabilities are recomputed in the backward
pass), on a packed batch with padding and on plain causal rows, with GQA, with the
queries in one block, in blocks that divide the sequence and in blocks that do not; and
that no backend's backward pass keeps (seq x seq) probabilities per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers.jax_lora.model import attention, attention_mask

TOL = 1e-5
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 24, 8, 4, 16


def _qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(keys[1], (BATCH, SEQ, KV_HEADS, HEAD_DIM), jnp.float32)
    v = jax.random.normal(keys[2], (BATCH, SEQ, KV_HEADS, HEAD_DIM), jnp.float32)
    return q, k, v


def _packed_mask():
    # Row 0: segments 1 (10 tokens), 2 (8), padding (6). Row 1: one segment, no padding.
    row0 = [1] * 10 + [2] * 8 + [0] * 6
    segment_ids = jnp.asarray([row0, [1] * SEQ], jnp.int32)
    return attention_mask(segment_ids)


def _reference(q, k, v, mask):
    scale = 1.0 / np.sqrt(HEAD_DIM)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=mask is None, scale=scale, implementation="xla"
    )


@pytest.mark.parametrize("query_block", [64, 8, 7])  # SEQ 24: 1 block, 3 blocks, 7+7+7+3
@pytest.mark.parametrize("packed", [True, False])
def test_blockwise_attention_matches_jax_reference(packed, query_block):
    q, k, v = _qkv()
    mask = _packed_mask() if packed else None
    cotangent = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

    ours_out = attention(q, k, v, mask, HEAD_DIM, query_block)
    ref_out = _reference(q, k, v, mask)
    assert np.abs(np.asarray(ref_out)).max() > 0.1
    assert np.abs(np.asarray(ours_out - ref_out)).max() <= TOL

    ours_grads = jax.grad(loss(lambda q, k, v: attention(q, k, v, mask, HEAD_DIM, query_block)),
                          argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(lambda q, k, v: _reference(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    for ours, ref in zip(ours_grads, ref_grads, strict=True):
        assert np.abs(np.asarray(ref)).max() > 0.1
        assert np.abs(np.asarray(ours - ref)).max() <= TOL


def _lora_grad_temp_bytes(layers: int, heads: int, seq: int) -> int:
    """XLA's temporaries for the LoRA gradients of a ``layers``-deep model on one packed row."""
    from trainers.jax_lora.config import DecoderConfig
    from trainers.jax_lora.lora import init_lora
    from trainers.jax_lora.model import hidden_states, init_params

    cfg = DecoderConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 2,
        "max_position_embeddings": seq, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    })
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    lora = init_lora(cfg, ("q_proj", "v_proj"), 4, jax.random.key(1))
    tokens = jnp.zeros((1, seq), jnp.int32)
    segment_ids = jnp.asarray([[1] * (seq // 2) + [2] * (seq // 2)], jnp.int32)

    def loss(lora):
        return jnp.sum(hidden_states(params, lora, tokens, cfg=cfg, segment_ids=segment_ids) ** 2)

    return jax.jit(jax.grad(loss)).lower(lora).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_the_backward_pass_keeps_no_seq_squared_probabilities_per_layer(monkeypatch, backend):
    """What a layer keeps for the backward pass grows with seq, not seq^2: each layer past
    the second adds less to XLA's temporaries than half of one layer's float32
    probabilities (heads x seq^2 x 4 B; what it does add is its activations, the
    attention's residuals and a boolean mask: 0.6 MiB here), whichever backend the
    attention is traced for. Traced as "gpu" (compiled on this CPU), the old accelerator
    path - ``jax.nn.dot_product_attention`` with the packing mask - kept every layer's
    probabilities (4.6 MiB per layer here): an 8B Llama at batch 4 x 2048 ran out of an
    H200's memory on them. (Within one layer, the blocks' transient scores may all be live
    at once: XLA orders the independent blocks freely.)"""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    heads, seq = 8, 256
    one_layer_probs = heads * seq * seq * 4  # 2 MiB
    per_layer = (_lora_grad_temp_bytes(4, heads, seq) - _lora_grad_temp_bytes(2, heads, seq)) / 2
    assert per_layer < one_layer_probs / 2, f"{per_layer / 2**20:.2f} MiB more temporaries per layer"
