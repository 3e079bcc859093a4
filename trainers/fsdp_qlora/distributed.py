"""Data-parallel sharding for the PyTorch trainer: process group, FSDP2, memory options.

One process per GPU (or per CPU "device" in tests). The environment is torchrun's
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), set by
torchrun, by a Kubernetes Indexed Job, or by :func:`launch_local` for N processes on one
machine. NCCL on GPUs, gloo on CPU.

Sharding is FSDP2 (``fully_shard``): each decoder layer is its own FSDP group (its
parameters are all-gathered just before it runs and freed right after), and so are the
input embedding and the LM head when they are not tied; the root takes what is left (the
final norm; a tied embedding). Constraints measured on CPU (gloo,
2 processes): FSDP1 needs ``device_id=cpu`` and cannot flatten integer storage,
``CPUOffloadPolicy`` needs an accelerator; accelerate silently falls back to DDP on CPU.
Hence torch's own FSDP2 API, float quant storage, and offload refused on CPU up front.

Gradient accumulation has ``no_sync`` semantics: on non-final micro-steps FSDP does not
reduce-scatter gradients (``set_requires_gradient_sync(False)``); parameters are still
resharded after each layer's backward, so accumulation never holds more than the layer
being computed (see :func:`set_gradient_sync`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainers.errors import UserError
from trainers.exit_codes import ExitCode

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job.

    Attributes:
        rank / world_size / local_rank: torchrun's numbering.
        device: the device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
        mesh: 1-D device mesh over all ranks (None when ``world_size == 1``).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def accelerator_available() -> bool:
    """True when this process can place tensors on a CUDA (or ROCm) device."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def check_parallelism(
    *,
    world_size: int,
    batch_size: int,
    micro_batch_size: int,
    cpu_offload: bool,
    has_accelerator: bool,
) -> int:
    """Validate the parallel layout before anything heavy happens; return accumulation steps.

    Raises:
        UserError(invalid_parallelism): the global batch is not a multiple of
            ``micro_batch_size * world_size``.
        UserError(offload_requires_accelerator): CPU offload without a GPU (FSDP's
            offload copies host -> device; on a CPU-only host there is nothing to offload to).
    """
    if world_size < 1:
        raise UserError(f"world_size must be >= 1, got {world_size}", code="invalid_parallelism")
    per_step = micro_batch_size * world_size
    if batch_size % per_step:
        raise UserError(
            f"hyperparameters.batch_size ({batch_size}) must be a multiple of "
            f"micro_batch_size x world_size ({micro_batch_size} x {world_size} = {per_step}); "
            f"use a batch size of {max(per_step, batch_size // per_step * per_step)} or change "
            "micro_batch_size / parallelism.world_size",
            code="invalid_parallelism",
        )
    if cpu_offload and not has_accelerator:
        raise UserError(
            "parallelism.cpu_offload needs a GPU: it offloads GPU parameters to host memory, "
            "and this trainer is running on CPU only; set cpu_offload to false",
            code="offload_requires_accelerator",
        )
    return batch_size // per_step


def init_distributed(env: Mapping[str, str] | None = None) -> DistContext:
    """Join the process group described by torchrun-style environment variables.

    With no ``WORLD_SIZE`` (or 1) nothing is initialized and a single-process context is
    returned. Picks NCCL when a GPU is present, gloo otherwise.
    """
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    if accelerator_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistContext(rank=0, world_size=1, local_rank=0, device=device)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in env:
            raise UserError(f"{key} must be set when WORLD_SIZE > 1", code="invalid_parallelism")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            world_size=world_size,
            rank=rank,
        )
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh)


def destroy_distributed() -> None:
    """Leave the process group (no-op when none was joined)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def mixed_precision_policy(compute_dtype: str) -> object | None:
    """FSDP2 mixed precision: low-precision params for compute, fp32 gradient reduction.

    None for fp32 compute (nothing to cast). With bf16/fp16 compute the sharded master
    copies keep their own dtype (fp32 LoRA weights stay fp32 for the optimizer) while the
    all-gathered copies are cast to ``compute_dtype``; gradients are reduced in fp32 so
    summing over ranks does not lose precision.
    """
    if compute_dtype == "float32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_DTYPES[compute_dtype], reduce_dtype=torch.float32)


def decoder_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The model's own transformer block classes (``LlamaDecoderLayer``,
    ``Qwen3DecoderLayer``...): what transformers names in ``_no_split_modules``. On a
    sharded model, FSDP2's subclass of each (``FSDPLlamaDecoderLayer``): the class the
    layer has now.

    Raises:
        RuntimeError: the model names none, or none of them occurs in it.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    classes = tuple({type(m) for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)})
    if not classes:
        raise RuntimeError(f"no decoder layer class found in {type(model).__name__} (looked for {sorted(names)})")
    return classes


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a (possibly peft-wrapped) decoder, in order."""
    classes = decoder_layer_classes(model)
    return [m for m in model.modules() if isinstance(m, classes)]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them.

    ``reentrant`` is the classic autograd.Function implementation (needs an input that
    requires grad: we make the embedding output require it); ``non_reentrant`` is the
    saved-tensor-hooks one (works with frozen inputs, recommended). Call before sharding,
    so that FSDP shards each wrapper (``shard_model``); on a sharded model (the first
    step's step-down, ``step_fit.py``) each wrapper goes around the layer's FSDP unit.
    """
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as _apply,
    )
    impl = {"reentrant": CheckpointImpl.REENTRANT, "non_reentrant": CheckpointImpl.NO_REENTRANT}
    if mode not in impl:
        raise UserError(f"unknown activation_checkpointing {mode!r}", code="invalid_spec")

    def wrapper(module: nn.Module) -> nn.Module:
        return checkpoint_wrapper(module, checkpoint_impl=impl[mode])

    classes = decoder_layer_classes(model)
    _apply(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, classes))
    if mode == "reentrant":
        # Reentrant checkpointing only back-propagates through inputs that require grad;
        # with a frozen embedding nothing would, and LoRA weights inside would get no grad.
        embed = model.get_input_embeddings()
        embed.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))


def shard_model(
    model: nn.Module,
    ctx: DistContext,
    *,
    compute_dtype: str = "float32",
    cpu_offload: bool = False,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root; returns the same module.

    Works on a meta-device model (nothing is allocated until ``to_empty``), which is how
    non-zero ranks avoid ever holding full weights. No-op for a single process.
    """
    if not ctx.distributed:
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs: dict = {"mesh": ctx.mesh}
    mp = mixed_precision_policy(compute_dtype)
    if mp is not None:
        kwargs["mp_policy"] = mp
    kwargs["offload_policy"] = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        # A checkpoint wrapper (if any) is the layer's parent: shard the wrapper so the
        # all-gather happens inside the recomputation too.
        target = _checkpoint_wrapper_of(model, layer) or layer
        fully_shard(target, **kwargs)
    # The embedding table and the LM head are a large-vocabulary model's two largest
    # tensors (Llama 3's 128k rows: 1 GiB each at 8B, 2 GiB each at 70B, in bf16). Left
    # to the root group they are gathered whole together when the forward pass starts and
    # stay whole until the backward pass ends, next to every layer's activations. As
    # groups of their own each is whole only while it runs: the embedding for its lookup
    # (frozen, so its backward gathers nothing unless reentrant checkpointing asks for
    # its output's gradient), the head from its forward through its backward, which
    # follow each other at the end of the step. A tied pair is one tensor: it stays in
    # the root.
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and embed.weight is not head.weight:
        fully_shard(embed, **kwargs, reshard_after_forward=True)
        fully_shard(head, **kwargs, reshard_after_forward=False)
    fully_shard(model, **kwargs)
    return model


def _checkpoint_wrapper_of(model: nn.Module, layer: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if getattr(module, "_checkpoint_wrapped_module", None) is layer:
            return module
    return None


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """``no_sync`` for FSDP2: skip the gradients' reduce-scatter on non-final micro-steps
    (each rank accumulates its LoRA gradients locally); re-enable it for the micro-step
    that precedes the optimizer.

    The weights are still resharded after each layer's backward. Keeping them whole
    between micro-steps (``set_reshard_after_backward(False)``) would save their
    all-gathers, but every layer a micro-step has gathered would then stay whole until
    the last one: the whole model on every rank, which is what sharding a 70B model over
    two 24 GB cards exists to avoid. LoRA's gradients are small, so skipping their sync
    is the only saving that costs no memory."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Clip the global gradient norm (over all ranks' shards); return the norm before clipping.

    ``clip_grad_norm_`` handles DTensor gradients: the norm it returns is a DTensor whose
    full value is the all-reduced global norm. ``max_norm=None`` only measures.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    limit = float("inf") if max_norm is None else max_norm
    total = torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return float(total)


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum a few Python floats over ranks (losses, token counts) in one fp64 collective."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if ctx.distributed:
        import torch.distributed as dist

        if ctx.device.type == "cuda":
            t = t.to(ctx.device)
        dist.all_reduce(t)
    return [float(v) for v in t.cpu()]


def free_port() -> int:
    """A TCP port that is free right now on localhost (for a one-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_local(
    argv: Sequence[str],
    world_size: int,
    *,
    env: Mapping[str, str] | None = None,
    on_cpu: bool | None = None,
    nnodes: int = 1,
    poll_s: float = 0.2,
) -> int:
    """Run ``argv`` as this node's share of ``world_size`` processes, torchrun-style.

    Each child gets ``MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK`` (and
    ``OMP_NUM_THREADS=1`` on CPU so N ranks do not oversubscribe the cores). One node:
    ranks 0..N-1 and a free local port. Several nodes (``nnodes`` > 1, e.g. a Kubernetes
    Indexed Job): ``world_size / nnodes`` ranks here, numbered from
    ``NODE_RANK * that``, with ``MASTER_ADDR/MASTER_PORT`` taken from the environment.
    SIGTERM to this launcher is forwarded to every rank (they checkpoint and exit
    PREEMPTED). If one rank fails, the others are terminated. Returns the exit code of
    the job: the first failing rank's code (user error, OOM, preempted keep their
    meaning), else 0.
    """
    base = dict(os.environ if env is None else env)
    if on_cpu is None:
        on_cpu = not accelerator_available()
    if world_size % nnodes:
        raise UserError(f"world_size {world_size} is not a multiple of nodes {nnodes}", code="invalid_parallelism")
    per_node = world_size // nnodes
    if nnodes == 1:
        base["MASTER_ADDR"] = "127.0.0.1"
        base["MASTER_PORT"] = str(free_port())
        first_rank = 0
    else:
        for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            if key not in base:
                raise UserError(f"{key} must be set for a {nnodes}-node job", code="invalid_parallelism")
        first_rank = int(base["NODE_RANK"]) * per_node
    base["WORLD_SIZE"] = str(world_size)
    procs: list[subprocess.Popen] = []
    for local_rank in range(per_node):
        rank = first_rank + local_rank
        child_env = dict(base, RANK=str(rank), LOCAL_RANK=str(local_rank))
        if on_cpu:
            child_env["OMP_NUM_THREADS"] = "1"
        procs.append(subprocess.Popen(list(argv), env=child_env))

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        first_failure: int | None = None
        while any(p.poll() is None for p in procs):
            for p in procs:
                code = p.poll()
                if code not in (None, 0) and first_failure is None:
                    first_failure = code
                    # A dead rank leaves the others blocked in a collective: stop them.
                    for other in procs:
                        if other.poll() is None:
                            other.terminate()
            time.sleep(poll_s)
        if first_failure is None:
            codes = [p.returncode for p in procs]
            first_failure = next((c for c in codes if c != 0), 0)
        if first_failure < 0:  # killed by a signal: a crash as far as the executor is concerned
            return int(ExitCode.INTERNAL_ERROR)
        return int(first_failure)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main_launch(argv: Sequence[str] | None = None) -> int:
    """``python -m trainers.fsdp_qlora.distributed N cmd ...`` (a tiny torchrun)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m trainers.fsdp_qlora.distributed WORLD_SIZE cmd [args...]", file=sys.stderr)
        return 2
    return launch_local(args[1:], int(args[0]))


if __name__ == "__main__":
    sys.exit(main_launch())
