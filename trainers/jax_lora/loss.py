"""Per-token losses of the LM head, computed a chunk of positions at a time.

At a large vocabulary the logits are most of a LoRA step's memory: (rows, seq, vocab) in
float32 is 250 MiB per copy for 512 tokens at Llama 3's 128,256 tokens, and a full-logits
loss keeps several copies alive (the logits, their exponentials, the cotangent of the
backward pass). Only the loss reads them, and only at the positions whose next token is
labelled. ``token_losses`` therefore:

1. moves each row's labelled positions to the front of the row (a stable sort of the
   label mask along the sequence, row by row, so rows stay where they are sharded);
2. applies the head and the log-softmax to ``chunk`` positions at a time in a
   ``lax.scan`` whose body is a ``jax.checkpoint``: the forward pass keeps no logits and
   the backward pass recomputes one chunk's at a time, so one chunk of logits is alive at
   once, forward and backward;
3. skips a chunk in which no row has a labelled position (``lax.cond``): prompt and
   padding positions cost no head matmul, forward or backward;
4. puts every value back at its position, (rows, seq - 1) as the caller indexes them.

Every position's values come from its own hidden state through the same operations a
full-logits loss uses (float32 logits, ``logsumexp`` minus the label's logit, argmax for
accuracy), and the caller sums the per-position array as before: the losses and their
gradients are the full-logits ones up to matmul rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.model import Constrain, Params, lm_head

IGNORE_INDEX = -100
# Positions per chunk of the LM head: (rows, 32, vocab) float32 logits and their
# gradient are alive at once, 16 MiB each per row at a 128,256 vocabulary, instead of
# (rows, seq, vocab). Smaller chunks cost no FLOPs, only more passes over the head's
# weights (one read per chunk, forward and backward): on a GPU with one row per device
# a chunk of 32 positions makes the head's matmuls bound by reading its weights, so
# large-vocabulary GPU jobs may want ``StepConfig.loss_chunk`` larger.
LOSS_CHUNK = 32


class TokenLosses(NamedTuple):
    """Per-position values after the causal shift, each (rows, seq - 1): position t scores
    ``labels[t + 1]``; unlabelled positions have nll 0 and are not correct."""

    nll: jax.Array
    mask: jax.Array
    correct: jax.Array | None  # None unless asked for (``with_accuracy``)


def token_losses(
    params: Params,
    hidden: jax.Array,
    labels: jax.Array,
    *,
    cfg: DecoderConfig,
    constrain: Constrain,
    chunk: int = LOSS_CHUNK,
    with_accuracy: bool = False,
    temperature: float = 1.0,
) -> TokenLosses:
    """NLL (and argmax correctness) of each labelled next token, ``chunk`` positions at a time.

    Args:
        params: the base weights (the LM head, or the tied embedding table, is read).
        hidden: (rows, seq, embed) final-normed hidden states (``model.hidden_states``).
        labels: (rows, seq) aligned with the inputs (HF convention), ``-100`` ignored.
        chunk: positions per chunk; any size, it need not divide the sequence.
        with_accuracy: also return whether the argmax of each labelled position's logits
            is its label (evaluation: the NLL is then not differentiable).
        temperature: the logits are divided by it first: the log-probs of the
            distribution a sampler drew from at that temperature (GRPO, as TRL's).
    """
    rows, seq = labels.shape
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    # Labelled positions first, each row in its own order; ``back`` undoes it.
    order = jnp.argsort(~mask, axis=-1, stable=True)
    back = jnp.argsort(order, axis=-1)
    n_chunks = -(-(seq - 1) // chunk)
    pad = n_chunks * chunk - (seq - 1)

    def chunked(x: jax.Array) -> jax.Array:
        """(rows, seq - 1, ...) in label-first order -> (n_chunks, rows, chunk, ...)."""
        x = jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(rows, n_chunks, chunk, *x.shape[2:]), 0, 1)

    def unchunked(x: jax.Array) -> jax.Array:
        x = jnp.swapaxes(x, 0, 1).reshape(rows, n_chunks * chunk)[:, : seq - 1]
        return jnp.take_along_axis(x, back, axis=1)

    head = _HeadChunks(params, cfg, constrain, temperature)
    chunks = (chunked(hidden[:, :-1]), chunked(jnp.where(mask, targets, 0)), chunked(mask))
    if with_accuracy:
        nll, correct = head.nll_and_accuracy(*chunks)
        return TokenLosses(unchunked(nll), mask, unchunked(correct))
    return TokenLosses(unchunked(head.nll(*chunks)), mask, None)


class _HeadChunks:
    """The head's per-position NLL over (n_chunks, rows, chunk, ...) inputs, a chunk at a time.

    The NLL is differentiable w.r.t. the hidden states with a custom VJP (``nll``): the
    forward pass computes each chunk's NLL and, while that chunk's logits exist, the
    derivative of each position's NLL w.r.t. its hidden state (``jax.vjp`` of the head and
    the log-softmax, with a unit cotangent); the backward pass scales those (rows, chunk,
    embed) rows by the incoming cotangents. No logits are kept or recomputed: the head
    costs its forward and one backward matmul, as with full logits. (Position rows are
    independent, so scaling after the matmul is the same product up to rounding.)
    """

    def __init__(self, params: Params, cfg: DecoderConfig, constrain: Constrain, temperature: float = 1.0) -> None:
        self.params, self.cfg, self.constrain, self.temperature = params, cfg, constrain, temperature
        self.nll = jax.custom_vjp(self._nll)
        self.nll.defvjp(self._nll_forward, self._nll_backward)

    def _logits(self, h: jax.Array) -> jax.Array:
        logits = lm_head(self.params, self.constrain(h, ("batch", "seq", "embed")), cfg=self.cfg,
                         constrain=self.constrain)
        return logits if self.temperature == 1.0 else logits / self.temperature

    @staticmethod
    def _label_nll(logits: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jnp.where(m, logz - picked, 0.0)

    @staticmethod
    def _scan(values, zeros, xs: tuple[jax.Array, ...]):
        """``values(h, t, m)`` per chunk; ``zeros`` where no position of the chunk is labelled."""

        def body(carry: None, chunk: tuple[jax.Array, ...]):
            return carry, jax.lax.cond(jnp.any(chunk[2]), values, zeros, *chunk)

        return jax.lax.scan(body, None, xs)[1]

    def _nll(self, h: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        return self._scan(lambda h, t, m: self._label_nll(self._logits(h), t, m),
                          lambda h, t, m: jnp.zeros(m.shape, jnp.float32), (h, t, m))

    def nll_and_accuracy(self, h: jax.Array, t: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
        def values(h, t, m):
            logits = self._logits(h)
            return self._label_nll(logits, t, m), m & (jnp.argmax(logits, axis=-1) == t)

        return self._scan(values, lambda h, t, m: (jnp.zeros(m.shape, jnp.float32), jnp.zeros_like(m)), (h, t, m))

    def _nll_forward(self, h: jax.Array, t: jax.Array, m: jax.Array):
        def values(h, t, m):
            nll, vjp = jax.vjp(lambda h: self._label_nll(self._logits(h), t, m), h)
            (d_h,) = vjp(jnp.ones_like(nll))
            return nll, d_h

        nll, d_h = self._scan(values, lambda h, t, m: (jnp.zeros(m.shape, jnp.float32), jnp.zeros_like(h)),
                              (h, t, m))
        return nll, d_h

    @staticmethod
    def _nll_backward(d_h: jax.Array, g: jax.Array):
        return (g[..., None] * d_h).astype(d_h.dtype), None, None
