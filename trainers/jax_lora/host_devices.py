"""CPU-only hosts: one XLA host device per core, so the whole step uses every core.

XLA:CPU runs its matmuls on a thread pool but most other fusions of our step (RMSNorm,
RoPE, softmax, residual adds and their backward) as single-threaded loops. On one host
device those loops leave the other cores idle; split into one device per core with a
``data`` mesh over them, each core runs its share of the batch through the whole step
(bench/RESULTS.md, "jax_lora as shipped on a CPU-only local pool").

``parallelism.host_devices`` in the spec asks for it; the worker sets it for local CPU
pools only, so GPU jobs never come here. The device count is fixed when JAX creates its
CPU client, so :func:`use_host_devices` runs before anything touches a device.
"""

from __future__ import annotations


def use_host_devices(count: int | None) -> None:
    """Run on the CPU platform as ``count`` XLA host devices (None: leave JAX as it is).

    Sets ``jax_platforms=cpu`` and ``jax_num_cpu_devices`` (JAX's option for what
    ``XLA_FLAGS=--xla_force_host_platform_device_count`` does, taking precedence over it).
    A caller that initialised JAX already (an in-process test) keeps its devices, as long
    as it has exactly ``count`` of them.

    Raises:
        RuntimeError: JAX was initialised already with a different number of CPU devices.
    """
    if count is None:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # JAX's backends are up already (an in-process caller): checked below
    else:
        jax.config.update("jax_platforms", "cpu")
    found = len(jax.devices("cpu"))
    if found != count:
        raise RuntimeError(
            f"parallelism.host_devices is {count} but JAX was initialised with {found} CPU devices "
            "before the trainer could configure them"
        )
