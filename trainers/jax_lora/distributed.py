"""Multi-host setup: ``jax.distributed`` from the environment of an Indexed Job.

The Kubernetes executor sets ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0 through
a headless Service), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. With them set we join
the cluster before anything touches a device; without them we are a single process.
After ``initialize``, ``jax.devices()`` lists every process's devices and the mesh spans
all of them; each process feeds only its own devices (see ``recipe.py``) and only
process 0 writes reports, checkpoints and the adapter.
"""

from __future__ import annotations

import os

from trainers.errors import UserError

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_from_env(environ: dict[str, str] | None = None) -> bool:
    """Call ``jax.distributed.initialize`` if the multi-host variables are set.

    Returns:
        True if this process joined a multi-process cluster.

    Raises:
        UserError: ``invalid_parallelism`` if only some variables are set or are malformed.
    """
    env = os.environ if environ is None else environ
    present = [v for v in ENV_VARS if env.get(v)]
    if not present:
        return False
    if len(present) != len(ENV_VARS):
        missing = sorted(set(ENV_VARS) - set(present))
        raise UserError(f"multi-host run needs all of {ENV_VARS}; missing {missing}", code="invalid_parallelism")
    try:
        num, pid = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
    except ValueError as exc:
        raise UserError(f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers: {exc}",
                        code="invalid_parallelism") from exc
    if not 0 <= pid < num:
        raise UserError(f"JAX_PROCESS_ID {pid} is not in [0, {num})", code="invalid_parallelism")

    import jax

    # CPU clusters (our tests) need a cross-process collectives implementation; GPUs
    # use NCCL/RCCL and ignore this option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=num, process_id=pid
    )
    return True

