"""Save and restore the JAX train state inside the shared checkpoint layout.

``trainers.common.checkpointing`` owns the directory (``step-<N>/``, atomic rename,
keep-last-K, ``trainer_state.json`` with step, epoch, data cursor and host RNG); this
module writes the framework part into it:

- ``train_state.safetensors``: every array of the state (LoRA factors, AdamW moments and
  counters, the step, the raw PRNG key data), keyed by its pytree path
  (``lora/q_proj/lora_a``, ``opt_state/1/0/mu/q_proj/lora_a``...), in its own dtype;
- ``adapter/``: the adapter at that step in PEFT format, usable on its own.

Restore builds every array directly with its sharding (``jax.make_array_from_callback``
handing each device its slice of the host array), and checks that the saved keys, shapes and
dtypes are exactly the ones the current run expects, so resuming with a different
adapter config fails clearly instead of silently.

Multi-host: arrays are gathered to every process (``process_allgather``); only process
0 writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import load_file

from trainers.errors import UserError

STATE_FILE = "train_state.safetensors"


def _path_key(path: Any) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def state_to_host(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Flat ``{path: numpy array}`` of the state (PRNG keys as their uint32 key data)."""
    state = dict(state)
    state["rng"] = jax.random.key_data(state["rng"])
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        flat[_path_key(path)] = np.ascontiguousarray(_to_host(leaf))
    return flat


def restore_state(directory: str | Path, abstract_state: dict[str, Any], shardings: dict[str, Any]) -> dict[str, Any]:
    """Load a state saved by ``write_state`` onto ``shardings``.

    Args:
        abstract_state: the state of the current run (arrays or ShapeDtypeStructs),
            defining the expected keys, shapes and dtypes.

    Raises:
        UserError: ``incompatible_checkpoint`` if the saved state does not match.
    """
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise UserError(f"{directory} has no {STATE_FILE}; not a JAX trainer checkpoint",
                        code="incompatible_checkpoint")
    saved = load_file(str(path))
    abstract = dict(abstract_state)
    key_shape = jax.eval_shape(jax.random.key_data, abstract["rng"])
    abstract["rng"] = key_shape
    shard_tree = dict(shardings)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shard_leaves = jax.tree.leaves(shard_tree)
    expected = {_path_key(p) for p, _ in leaves_with_path}
    if set(saved) != expected:
        missing, extra = sorted(expected - set(saved)), sorted(set(saved) - expected)
        raise UserError(
            f"checkpoint {directory} does not match this run's adapter/optimizer: "
            f"missing {missing[:5]}, unexpected {extra[:5]}",
            code="incompatible_checkpoint",
        )
    out = []
    for (p, leaf), sharding in zip(leaves_with_path, shard_leaves, strict=True):
        value = saved[_path_key(p)]
        if leaf.shape == () and value.shape == (1,):  # safetensors stores 0-d tensors as (1,)
            value = value.reshape(())
        if tuple(value.shape) != tuple(leaf.shape) or value.dtype != np.dtype(leaf.dtype):
            raise UserError(
                f"checkpoint tensor {_path_key(p)} is {value.shape} {value.dtype}, this run needs "
                f"{tuple(leaf.shape)} {np.dtype(leaf.dtype)}",
                code="incompatible_checkpoint",
            )
        # from_callback works for shardings spanning other processes' devices too.
        out.append(jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx]))
    state = jax.tree_util.tree_unflatten(treedef, out)
    state["rng"] = jax.random.wrap_key_data(state["rng"])
    return state
