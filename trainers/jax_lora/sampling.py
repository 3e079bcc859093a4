"""Sampling completions from the policy: a jitted decode loop with a KV cache, on the job's mesh.

A reinforcement step samples ``samples_per_prompt`` completions of each of its prompts
from the current policy (base + adapter, no dropout); an evaluation samples the
validation prompts' (greedy with ``eval_samples`` 1). :class:`Sampler` runs one compiled
program for both, whatever the step: its shapes are fixed when the job starts,

- ``rows``: completions per call (a step's ``batch_size x samples_per_prompt``; an
  evaluation's rows are cut into calls of that many, the last one padded);
- ``prompt_len``: the longest prompt of the job's files; prompts are LEFT-padded to it,
  so every row's next token goes to the same cache slot (``model.cached_hidden_states``);
- ``new_tokens``: the largest token budget of the job's prompts
  (``min(max_completion_tokens, max_seq_len - prompt)``); each row also stops at its own.

and greedy decoding and the temperature are arguments of the program, not constants of
it. The program prefills the prompts into a KV cache of ``prompt_len + new_tokens``
slots, then draws one token per row per iteration of a ``lax.while_loop``: at the
temperature (``jax.random.categorical`` of the logits divided by it; no top-p/top-k cut,
as the torch trainer) or the argmax, until every row has drawn a stop token
(``trainers.common.reinforcement.stop_token_ids``) or reached its budget; a finished row
draws padding. The draws are a function of the key alone (JAX's partitionable threefry):
the same on one device or a mesh, and a step's key comes from (seed, step), so a
resumed run samples what the uninterrupted one did.

Sharding: the base and adapter as the train step holds them, the rows (and the cache's
rows) over ``data x fsdp``, the cache's KV heads over ``tensor`` (``sharding.py``'s
activation rules). The drawn tokens come back replicated: every process reads them whole.

Cost: each drawn token is a forward of one token per row through every layer, attending
over all ``prompt_len + new_tokens`` slots (masked, not skipped), so a call costs about
``new_tokens`` forwards of ``rows`` single tokens: compute-light and bound by reading the
weights and the cache; ``rows`` amortizes the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainers.common.reinforcement import Prompt, cut_at_stop
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.model import CACHE_AXES, LoraRuntime, Params, cache_shapes, cached_hidden_states, lm_head
from trainers.jax_lora.sharding import ACTIVATION_RULES, logical_to_spec, make_activation_constraint


@dataclass(frozen=True)
class SamplingShape:
    """The fixed shapes of the compiled decode loop (module doc)."""

    rows: int
    prompt_len: int
    new_tokens: int

    @classmethod
    def for_prompts(cls, rows: int, prompts: Sequence[Prompt]) -> SamplingShape:
        """The shape that holds every one of ``prompts`` (the job's train and validation)."""
        return cls(rows=rows, prompt_len=max(len(p.input_ids) for p in prompts),
                   new_tokens=max(p.max_new_tokens for p in prompts))


@dataclass(frozen=True)
class DecodeConfig:
    """Static settings of the decode loop (hashable)."""

    cfg: DecoderConfig
    runtime: LoraRuntime
    shape: SamplingShape
    stop_ids: tuple[int, ...]
    pad_id: int
    compute_dtype: str = "float32"


def sampling_key(seed: int) -> jax.Array:
    """A threefry key from a 64-bit seed (``trainers.common.reinforcement.sampling_seed``):
    ``jax.random.key`` keeps only the low 32 bits of an int without x64."""
    return jax.random.wrap_key_data(np.array([seed >> 32 & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32))


def make_generate(dc: DecodeConfig, mesh: Mesh | None):
    """The decode loop ``(params, lora, prompt_ids, starts, budgets, key, temperature,
    greedy) -> tokens`` (not yet jitted).

    ``prompt_ids`` (rows, prompt_len) left-padded, ``starts`` each row's first real slot,
    ``budgets`` each row's most tokens; ``tokens`` (rows, new_tokens), padding after a
    row's stop token or budget.
    """
    cfg, shape = dc.cfg, dc.shape
    constrain = make_activation_constraint(mesh)
    compute_dtype = jnp.dtype(dc.compute_dtype)
    stop = jnp.asarray(dc.stop_ids, jnp.int32)

    def forward(params: Params, lora: Params, tokens: jax.Array, cache: Params, index: Any, starts: jax.Array):
        h, cache = cached_hidden_states(params, lora, tokens, cache, index=index, starts=starts, cfg=cfg,
                                        runtime=dc.runtime, compute_dtype=compute_dtype, constrain=constrain)
        return lm_head(params, h[:, -1:], cfg=cfg, constrain=constrain)[:, 0], cache

    def generate(params, lora, prompt_ids, starts, budgets, key, temperature, greedy):
        rows, prompt_len = prompt_ids.shape
        empty = cache_shapes(cfg, rows, prompt_len + shape.new_tokens, compute_dtype)
        cache = {k: constrain(jnp.zeros(s.shape, s.dtype), CACHE_AXES) for k, s in empty.items()}
        logits, cache = forward(params, lora, prompt_ids, cache, 0, starts)

        def unfinished(carry) -> jax.Array:
            t, _, _, done, _ = carry
            return (t < shape.new_tokens) & ~jnp.all(done)

        def draw(carry):
            t, logits, cache, done, tokens = carry
            drawn = jax.random.categorical(jax.random.fold_in(key, t), logits / temperature, axis=-1)
            token = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
            token = jnp.where(done, dc.pad_id, token)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, t))
            done = done | jnp.isin(token, stop) | (t + 1 >= budgets)
            logits, cache = forward(params, lora, token[:, None], cache, prompt_len + t, starts)
            return t + 1, logits, cache, done, tokens

        tokens = jnp.full((rows, shape.new_tokens), dc.pad_id, jnp.int32)
        carry = (jnp.zeros((), jnp.int32), logits, cache, jnp.zeros(rows, bool), tokens)
        return jax.lax.while_loop(unfinished, draw, carry)[4]

    return generate


class Sampler:
    """The jitted decode loop with its shardings, and the host's side of it: left-padding
    the prompts, cutting the rows into calls, each completion cut at its stop token.

    Args:
        dc: the loop's static settings.
        mesh: the job's mesh.
        param_shardings, lora_shardings: the base's and the adapter's, as the train step
            holds them (no resharding between sampling and training).
    """

    def __init__(self, dc: DecodeConfig, mesh: Mesh, param_shardings: Params, lora_shardings: Params) -> None:
        self.dc = dc
        rows, prompt_len = dc.shape.rows, dc.shape.prompt_len

        def batch(*axes: str | None, shape: tuple[int, ...]) -> NamedSharding:
            return NamedSharding(mesh, logical_to_spec(axes, mesh, ACTIVATION_RULES, shape))

        self.input_shardings = (batch("batch", "seq", shape=(rows, prompt_len)), batch("batch", shape=(rows,)),
                                batch("batch", shape=(rows,)))
        replicated = NamedSharding(mesh, PartitionSpec())
        self._generate = jax.jit(
            make_generate(dc, mesh),
            in_shardings=(param_shardings, lora_shardings, *self.input_shardings, replicated, replicated, replicated),
            out_shardings=replicated,
        )

    def sample(self, params: Params, lora: Params, prompts: Sequence[Prompt], n: int, *, seed: int,
               greedy: bool = False, temperature: float = 1.0) -> list[list[int]]:
        """``n`` completions of each prompt (a prompt's contiguous), each ending at its stop
        token or its budget; ``seed`` (``sampling_seed``) keys every draw."""
        shape, pad_id, stop_ids = self.dc.shape, self.dc.pad_id, frozenset(self.dc.stop_ids)
        wanted = [p for p in prompts for _ in range(n)]
        key = sampling_key(seed)
        out: list[list[int]] = []
        for call, first in enumerate(range(0, len(wanted), shape.rows)):
            chunk = wanted[first : first + shape.rows]
            # Rows past the chunk are padding: one pad token, a budget of 1 (done at once).
            ids = np.full((shape.rows, shape.prompt_len), pad_id, dtype=np.int32)
            starts = np.full(shape.rows, shape.prompt_len - 1, dtype=np.int32)
            budgets = np.ones(shape.rows, dtype=np.int32)
            for r, prompt in enumerate(chunk):
                length = len(prompt.input_ids)
                if length > shape.prompt_len or prompt.max_new_tokens > shape.new_tokens:
                    raise ValueError(f"a prompt of {length} tokens and {prompt.max_new_tokens} new ones does not fit "
                                     f"the sampler's {shape}")
                ids[r, shape.prompt_len - length :] = prompt.input_ids
                starts[r] = shape.prompt_len - length
                budgets[r] = prompt.max_new_tokens
            inputs = [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])
                      for a, s in zip((ids, starts, budgets), self.input_shardings, strict=True)]
            tokens = np.asarray(self._generate(params, lora, *inputs, jax.random.fold_in(key, call),
                                               np.float32(temperature), np.bool_(greedy)))
            out.extend(cut_at_stop(tokens[r, : p.max_new_tokens], stop_ids) for r, p in enumerate(chunk))
        return out
