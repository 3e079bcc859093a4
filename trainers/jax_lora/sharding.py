"""Device mesh and the ONE table that maps logical axes to mesh axes.

Model code names logical axes only (``batch``, ``seq``, ``embed``, ``heads``, ...); this
module decides where each lands on the ``(data, fsdp, tensor)`` mesh, separately for
parameters (weights, LoRA factors and the optimizer state that mirrors them) and for
activations (levanter / maxtext style). Changing the parallel layout means changing
``PARAM_RULES`` / ``ACTIVATION_RULES``, never the model.

Parameters are sharded ZeRO-3 style over ``fsdp`` on their ``embed`` dimension and
Megatron style over ``tensor`` on heads / MLP / vocab; XLA inserts the all-gathers and
reduce-scatters. A projection's bias (Qwen2) carries its output axes, so it splits like
the kernel's outputs; RMSNorm weights (``embed``, and Qwen3's per-head ``head_dim``
norms) are small and split over ``fsdp`` or not at all. Activations are split over
``data`` x ``fsdp`` on the batch dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from trainers.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

LogicalAxes = tuple[str | None, ...]
MeshAxes = str | tuple[str, ...] | None

PARAM_RULES: dict[str, MeshAxes] = {
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "lora_rank": None,
    # NF4 kernels flatten (heads, head_dim) into one dim (model.param_axes): it shards
    # like heads, but a dim that does not divide is replicated rather than refused.
    "heads_flat": "tensor",
    "kv_heads_flat": "tensor",
    # NF4 block scales: their outputs over both parameter axes (see model.param_axes).
    "nf4_scales": ("fsdp", "tensor"),
}

ACTIVATION_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "kv_seq": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "lora_rank": None,
}

# Logical axes that MUST divide their mesh axes: splitting a head across devices is
# not something we silently fall back from (it changes what each device computes).
STRICT_AXES = frozenset({"heads", "kv_heads"})


def make_mesh(data: int, fsdp: int, tensor: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the (data, fsdp, tensor) mesh over all devices of all processes.

    Raises:
        UserError: ``invalid_parallelism`` when the product differs from the device count.
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = (data, fsdp, tensor)
    if math.prod(shape) != len(devices):
        raise UserError(
            f"parallelism.mesh data={data} x fsdp={fsdp} x tensor={tensor} = {math.prod(shape)} "
            f"does not equal the number of devices ({len(devices)})",
            code="invalid_parallelism",
        )
    # Auto axes: we annotate shardings and XLA's partitioner propagates the rest.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _mesh_axis_size(mesh: Mesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[n] for n in names)


def logical_to_spec(
    axes: LogicalAxes, mesh: Mesh, rules: dict[str, MeshAxes], shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec through ``rules``.

    With ``shape``, a dimension that its mesh axes do not divide is replicated instead
    (e.g. a vocab of 32001 on tensor=2); for ``STRICT_AXES`` that is a ``UserError``.
    A mesh axis is used at most once per array (the first dimension claiming it wins).
    """
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        names = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        names = tuple(n for n in names if n not in used and mesh.shape[n] > 1)
        if names and shape is not None and shape[i] % _mesh_axis_size(mesh, names):
            if name in STRICT_AXES:
                raise UserError(
                    f"{name} ({shape[i]}) is not divisible by the mesh axes {names} "
                    f"(size {_mesh_axis_size(mesh, names)}); choose parallelism.mesh.tensor "
                    f"that divides the model's {name}",
                    code="invalid_parallelism",
                )
            names = ()
        used.update(names)
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*spec)


def tree_shardings(params: Any, axes: Any, mesh: Mesh, rules: dict[str, MeshAxes] = PARAM_RULES) -> Any:
    """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) and its logical axes."""
    return jax.tree.map(
        lambda p, a: NamedSharding(mesh, logical_to_spec(a, mesh, rules, p.shape)), params, axes
    )


def make_activation_constraint(mesh: Mesh | None) -> Callable[[jax.Array, LogicalAxes], jax.Array]:
    """The ``constrain(x, logical_axes)`` the model calls on activations (identity without a mesh)."""
    if mesh is None or mesh.size == 1:
        return lambda x, axes: x

    def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
        spec = logical_to_spec(axes, mesh, ACTIVATION_RULES, x.shape)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain


def check_divisible_heads(num_heads: int, num_kv_heads: int, mesh: Mesh) -> None:
    """Fail early (before any allocation or compile) if heads cannot split over ``tensor``."""
    for name, size in (("heads", num_heads), ("kv_heads", num_kv_heads)):
        logical_to_spec((name,), mesh, PARAM_RULES, (size,))


@dataclass(frozen=True)
class ShardingReport:
    total_bytes: int
    bytes_per_device: int
    ideal_bytes_per_device: int
    replicated_bytes: int

    @property
    def excess_fraction(self) -> float:
        return self.bytes_per_device / max(self.ideal_bytes_per_device, 1) - 1.0


def sharding_report(shapes: Any, shardings: Any, mesh: Mesh) -> ShardingReport:
    """Bytes per device of a pytree under ``shardings`` vs. the ideal split over fsdp x tensor.

    Only ``fsdp`` and ``tensor`` are meant to split parameters (``data`` replicates them
    by design), so the ideal per-device share is ``total / (fsdp * tensor)``.
    """
    total = per_device = replicated = 0
    for leaf, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        split = math.prod(
            _mesh_axis_size(mesh, entry) for entry in sharding.spec if entry is not None
        )
        total += nbytes
        per_device += nbytes // split
        if split == 1:
            replicated += nbytes
    ideal = total // (mesh.shape["fsdp"] * mesh.shape["tensor"])
    return ShardingReport(total, per_device, ideal, replicated)


def check_replication(report: ShardingReport, *, max_excess_fraction: float = 0.05, what: str = "parameters") -> None:
    """Raise if the per-device share exceeds the ideal split by more than ``max_excess_fraction``.

    Raises:
        UserError: ``invalid_parallelism``; the message reports bytes per device.
    """
    if report.excess_fraction > max_excess_fraction:
        raise UserError(
            f"{what}: {report.bytes_per_device:,} bytes per device vs. an ideal "
            f"{report.ideal_bytes_per_device:,} ({report.replicated_bytes:,} bytes fully replicated); "
            f"the mesh does not divide the model's dimensions - choose fsdp/tensor sizes that "
            f"divide hidden size, heads and vocab",
            code="invalid_parallelism",
        )
