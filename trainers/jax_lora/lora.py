"""LoRA factors for the JAX Llama: shapes, logical axes and PEFT's initialization.

The adapter is its own pytree ``{proj_name: {"lora_a", "lora_b"}}`` with a leading
``layers`` axis, kept apart from the base weights so that the train step can take
``jax.grad`` with respect to it alone: the base weights enter as a non-differentiated
argument, so XLA never builds (or throws away) a base-weight gradient.

Shapes follow our kernel layout (in..., out...): ``lora_a`` is (layers, *in, r) and
``lora_b`` is (layers, r, *out). PEFT's ``lora_A.weight`` is (r, in_features) and
``lora_B.weight`` is (out_features, r); ``export.py`` does the transposes.

Initialization is PEFT's default (``init_lora_weights=True``): A ~ kaiming-uniform with
a = sqrt(5), i.e. U(-1/sqrt(in_features), 1/sqrt(in_features)); B = 0, so a fresh
adapter leaves the model unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.model import PROJECTIONS, LoraRuntime, Params, projection_shape


def validate_targets(target_modules: Sequence[str]) -> tuple[str, ...]:
    unknown = [t for t in target_modules if t not in PROJECTIONS]
    if unknown or not target_modules:
        raise UserError(
            f"adapter.target_modules {list(target_modules)} must be a non-empty subset of "
            f"{list(PROJECTIONS)}",
            code="invalid_spec",
        )
    # Keep PROJECTIONS order so the pytree layout does not depend on the user's order.
    return tuple(name for name in PROJECTIONS if name in target_modules)


def lora_axes(target_modules: Sequence[str]) -> Params:
    """Logical axes of the LoRA pytree (same structure as ``init_lora``'s result)."""
    return {
        name: {
            "lora_a": ("layers", *PROJECTIONS[name].in_axes, "lora_rank"),
            "lora_b": ("layers", "lora_rank", *PROJECTIONS[name].out_axes),
        }
        for name in validate_targets(target_modules)
    }


def lora_shapes(cfg: DecoderConfig, target_modules: Sequence[str], r: int, dtype: Any) -> Params:
    out: Params = {}
    for name in validate_targets(target_modules):
        in_dims, out_dims = projection_shape(cfg, name)
        out[name] = {
            "lora_a": jax.ShapeDtypeStruct((cfg.num_layers, *in_dims, r), jnp.dtype(dtype)),
            "lora_b": jax.ShapeDtypeStruct((cfg.num_layers, r, *out_dims), jnp.dtype(dtype)),
        }
    return out


def init_lora(
    cfg: DecoderConfig, target_modules: Sequence[str], r: int, key: jax.Array, dtype: Any = jnp.float32
) -> Params:
    """PEFT-default init: A uniform in +-1/sqrt(in_features) per layer, B zeros.

    Pure function of its arguments; ``jax.jit`` it with ``out_shardings`` to create the
    factors directly sharded.
    """
    shapes = lora_shapes(cfg, target_modules, r, dtype)
    out: Params = {}
    for i, (name, pair) in enumerate(shapes.items()):
        a_shape = pair["lora_a"].shape
        fan_in = math.prod(a_shape[1:-1])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
        out[name] = {
            "lora_a": a.astype(dtype),
            "lora_b": jnp.zeros(pair["lora_b"].shape, dtype),
        }
    return out


def lora_runtime(alpha: float, r: int, dropout: float) -> LoraRuntime:
    """PEFT's scaling is ``lora_alpha / r`` (no rsLoRA)."""
    return LoraRuntime(scaling=alpha / r, dropout=dropout)


def count_params(tree: Params) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
