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

A parent fine-tuned model's adapter (``parent_lora``) has the same layout, its scale folded
into ``lora_b``; it rides among the frozen base weights (``model.PARENT_LORA``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainers.common.lineage import LoraWeights
from trainers.common.peft_export import lora_key
from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.model import PARENT_LORA, PROJECTIONS, LoraRuntime, Params, projection_shape


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


def parent_lora(cfg: DecoderConfig, parent: LoraWeights, dtype: Any = np.float32) -> Params:
    """The frozen parent adapter (PEFT orientation, scale 1) as host arrays in our layout:
    ``lora_a`` (layers, *in, R), ``lora_b`` (layers, R, *out); the inverse of
    ``export.to_peft_weights``.

    Raises:
        UserError(parent_adapter_mismatch): a layer it lacks, or a factor whose shape is not
            this model's (an adapter of another model).
    """
    out: Params = {}
    for name in validate_targets(parent.target_modules):
        in_dims, out_dims = projection_shape(cfg, name)
        a_layers, b_layers = [], []
        for layer in range(cfg.num_layers):
            a = parent.weights.get(lora_key(layer, name, "A"))
            b = parent.weights.get(lora_key(layer, name, "B"))
            expected = ((parent.r, math.prod(in_dims)), (math.prod(out_dims), parent.r))
            if a is None or b is None or (a.shape, b.shape) != expected:
                raise UserError(
                    f"the parent adapter's layer {layer} {name} is {None if a is None else a.shape} / "
                    f"{None if b is None else b.shape}; this model needs lora_A {expected[0]}, lora_B {expected[1]}",
                    code="parent_adapter_mismatch")
            a_layers.append(np.asarray(a).T.reshape(*in_dims, parent.r))
            b_layers.append(np.asarray(b).T.reshape(parent.r, *out_dims))
        out[name] = {"lora_a": np.stack(a_layers).astype(dtype), "lora_b": np.stack(b_layers).astype(dtype)}
    return out


def with_parent_lora(params: Params, parent: Params) -> Params:
    """The base weights' pytree (or its shapes, or its axes) with the parent adapter's added
    as ``layers[PARENT_LORA]``: frozen, it is never differentiated."""
    return {**params, "layers": {**params["layers"], PARENT_LORA: parent}}
