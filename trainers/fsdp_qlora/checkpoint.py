"""Sharded checkpoints (torch.distributed.checkpoint) and PEFT export of the gathered adapter.

A checkpoint directory (layout from ``trainers.common.checkpointing``) holds::

    step-<N>/
        trainer_state.json     step, epoch, data cursor, host RNG, metrics (common module)
        dcp/                   LoRA weights + AdamW state, one file per rank (DCP)
        adapter/               the PEFT adapter at this step (gathered on rank 0)

Only trainable tensors are saved: the frozen (quantized) base is the user's checkpoint
and is re-read on resume. We build the state dict by hand from ``named_parameters`` and
``optimizer.state`` rather than ``get_model_state_dict`` because the latter walks
``HQQLinear.state_dict``, which fails under FSDP2 on HQQ's view-as-float weights; the
tensors are FSDP2 DTensors, so DCP writes each rank's shard and can reload into any world size.

The common module writes into a temporary directory and renames it atomically; rank 0
owns that directory and broadcasts its path so every rank writes its DCP shard there
before the rename.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainers.fsdp_qlora.distributed import DistContext, barrier
from trainers.fsdp_qlora.loading import canonical_name, is_trained_lora_name

DCP_DIR = "dcp"
ADAPTER_DIR = "adapter"


def trainable_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"adapter": {name: tensor}, "optim": {name: {exp_avg, exp_avg_sq, step}}}`` with
    live tensors (DTensor shards under FSDP): the object DCP saves and loads in place."""
    adapter: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = canonical_name(name)
        adapter[key] = param
        state = optimizer.state.get(param)
        if state:
            optim[key] = {k: v for k, v in state.items() if torch.is_tensor(v)}
    return {"adapter": adapter, "optim": optim}


def _dcp_path(directory: str | Path) -> str:
    return str(Path(directory) / DCP_DIR)


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
    """Every rank writes its shards of the adapter and optimizer state under ``directory``."""
    import torch.distributed.checkpoint as dcp

    # A single process has no process group: DCP reads and writes without collectives.
    dcp.save(trainable_state(model, optimizer), checkpoint_id=_dcp_path(directory), no_dist=not ctx.distributed)


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
    """Load adapter + optimizer state saved by :func:`save_sharded`, in place.

    The optimizer state must exist first (see ``train_step.init_optimizer_state``); DCP
    reshards if the world size changed.
    """
    import torch.distributed.checkpoint as dcp

    from trainers.fsdp_qlora.train_step import init_optimizer_state

    init_optimizer_state(optimizer)
    dcp.load(trainable_state(model, optimizer), checkpoint_id=_dcp_path(directory), no_dist=not ctx.distributed)


def gather_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of the trained LoRA (not a frozen parent's) keyed by canonical name, on
    every rank (a collective under FSDP).

    ``DTensor.full_tensor()`` all-gathers each shard; plain tensors are returned as is.
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not is_trained_lora_name(name):
            continue
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[canonical_name(name)] = full.detach().to("cpu", torch.float32).clone()
    return out


def peft_weights(adapter: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Canonical names (``model.layers.0.self_attn.q_proj.lora_A.default.weight``) to
    PEFT's saved keys (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    from trainers.common.peft_export import lora_key

    out: dict[str, np.ndarray] = {}
    for name, tensor in adapter.items():
        parts = name.split(".")
        # model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.<adapter>.weight
        if len(parts) != 8 or parts[:2] != ["model", "layers"] or not parts[5].startswith("lora_"):
            raise ValueError(f"unexpected LoRA parameter name {name!r}")
        out[lora_key(int(parts[2]), parts[4], parts[5][-1])] = tensor.numpy()
    return out


def export_adapter(
    out_dir: str | Path,
    model: nn.Module,
    ctx: DistContext,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: tuple[str, ...],
    base_model_name_or_path: str | None = None,
) -> Path | None:
    """Gather the adapter (all ranks) and write it in PEFT format (rank 0). Returns the
    adapter directory on rank 0, None elsewhere."""
    from trainers.common.peft_export import write_peft_adapter

    adapter = gather_adapter_state(model)
    result = None
    if ctx.is_main:
        result = write_peft_adapter(
            out_dir,
            peft_weights(adapter),
            r=r,
            alpha=alpha,
            dropout=dropout,
            target_modules=target_modules,
            base_model_name_or_path=base_model_name_or_path,
            dtype="float32",
        )
    barrier(ctx)
    return result


def shared_path(path: Path | None, ctx: DistContext) -> Path:
    """Rank 0's ``path`` on every rank (e.g. the temporary checkpoint directory)."""
    if not ctx.distributed:
        assert path is not None
        return path
    import torch.distributed as dist

    box = [str(path) if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def save_checkpoint_distributed(
    root: str | Path,
    state: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
    *,
    keep_last: int,
    write_adapter: Callable[[Path], None],
    reporter: Any | None = None,
) -> Path:
    """Write ``step-<state.step>`` atomically with every rank's DCP shard in it.

    ``state`` is a ``trainers.common.checkpointing.TrainerState``; ``write_adapter(dir)``
    writes the gathered PEFT adapter (rank 0; the gather must already have happened on
    all ranks); ``reporter`` (rank 0) reports it as ``save_checkpoint`` does. Returns the
    final directory (on every rank).
    """
    from trainers.common.checkpointing import checkpoint_path, save_checkpoint

    if ctx.is_main:

        def write_tensors(tmp: Path) -> None:
            shared_path(tmp, ctx)
            save_sharded(tmp, model, optimizer, ctx)
            write_adapter(tmp / ADAPTER_DIR)

        final = save_checkpoint(root, state, write_tensors, keep_last=keep_last, reporter=reporter)
    else:
        tmp = shared_path(None, ctx)
        save_sharded(tmp, model, optimizer, ctx)
        final = checkpoint_path(root, state.step)
    barrier(ctx)  # nobody reads or prunes before the rename is done
    return final
