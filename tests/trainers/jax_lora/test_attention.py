"""The CPU attention path (``model.attention``) against ``jax.nn.dot_product_attention``.

The model parity tests compare logits with transformers; this one pins the attention
function itself, values AND gradients (its probabilities are recomputed in the backward
pass), on a packed batch with padding and on plain causal rows, with GQA, with the
queries in one block, in blocks that divide the sequence and in blocks that do not.
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
def test_cpu_attention_matches_jax_reference(packed, query_block):
    assert jax.default_backend() == "cpu"  # the path under test is the CPU one
    q, k, v = _qkv()
    mask = _packed_mask() if packed else None
    cotangent = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

    ours_out = attention(q, k, v, mask, HEAD_DIM, query_block)
    ref_out = _reference(q, k, v, mask)
    assert np.abs(np.asarray(ref_out)).max() > 0.1
    assert np.abs(np.asarray(ours_out - ref_out)).max() <= TOL

    ours_grads = jax.grad(loss(lambda q, k, v: attention(q, k, v, mask, HEAD_DIM, query_block)), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(lambda q, k, v: _reference(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    for ours, ref in zip(ours_grads, ref_grads, strict=True):
        assert np.abs(np.asarray(ref)).max() > 0.1
        assert np.abs(np.asarray(ours - ref)).max() <= TOL
