"""A rank of the multi-process tests: load -> train N steps -> checkpoint/resume -> export.

Run by the tests through ``trainers.fsdp_qlora.distributed.launch_local`` (2 gloo
processes, OMP_NUM_THREADS=1). It drives the real modules of the FSDP trainer (loading,
sharding, train step, DCP checkpoint, PEFT export) on synthetic batches that the test
process regenerates for its single-process reference. Rank 0 writes ``result.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

LR = 1e-2
# The NF4 comparison runs at a smaller learning rate: with LoRA B starting at zero some
# lora_A gradients are ~1e-8, where AdamW's m/sqrt(v) turns float summation-order noise
# (rank partial sums vs one sum) into update noise proportional to the learning rate.
NF4_LR = 1e-3


def synthetic_batches(step: int, n_micro: int, micro_bs: int, seq: int, seed: int = 0) -> list:
    """The step's global micro-batches (same on every rank and in the reference).

    Rows have different amounts of right padding and an unlabelled prompt, so the
    global-token normalization of the loss matters.
    """
    from trainers.common.data import IGNORE_INDEX, Batch

    rng = np.random.default_rng([seed, step])
    out = []
    for _ in range(n_micro):
        ids = rng.integers(0, 256, size=(micro_bs, seq), dtype=np.int64)
        # A learnable pattern: the second half repeats the first half.
        ids[:, seq // 2 :] = ids[:, : seq - seq // 2]
        labels = ids.copy()
        labels[:, : seq // 2] = IGNORE_INDEX
        mask = np.ones_like(ids)
        for r in range(micro_bs):
            pad = int(rng.integers(0, seq // 4))
            if pad:
                mask[r, seq - pad :] = 0
                labels[r, seq - pad :] = IGNORE_INDEX
                ids[r, seq - pad :] = 0
        pos = np.broadcast_to(np.arange(seq), ids.shape).copy()
        out.append(Batch(ids, labels, pos, mask.copy(), mask))
    return out


def run_one(args: argparse.Namespace, ctx, out: Path) -> dict:
    """Load, train ``args.steps`` steps (optionally resuming / checkpointing), export."""
    from trainers.common.checkpointing import load_trainer_state
    from trainers.fsdp_qlora.checkpoint import export_adapter, load_sharded
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import build_optimizer, rank_share, train_step

    opts = ModelOptions(
        model_dir=Path(args.model), quantization=args.quant, compute_dtype=args.compute_dtype,
        base_dtype="float32", lora_r=args.r, lora_alpha=2.0 * args.r,
        target_modules=("q_proj", "v_proj", "down_proj"), activation_checkpointing=args.ac,
    )
    model, report = build_model(opts, ctx)
    tables = _watch_tables_during_layers(model)
    optimizer = build_optimizer(model, learning_rate=args.lr, weight_decay=0.0)
    start = 0
    if args.resume:
        load_sharded(args.resume, model, optimizer, ctx)
        start = load_trainer_state(args.resume).step
    if args.ac_later:
        # The first step's step-down (trainers/fsdp_qlora/step_fit.py): the step taken, the
        # state put back, checkpointing switched on in the sharded model; then the run.
        from trainers.fsdp_qlora.distributed import apply_activation_checkpointing
        from trainers.fsdp_qlora.step_fit import TrainableState

        saved = TrainableState(model, optimizer)
        train_step(model, optimizer, rank_share(synthetic_batches(start, args.micro, args.micro_bs, args.seq), ctx),
                   ctx, step=start, seed=0, learning_rate=args.lr, max_grad_norm=1.0)
        saved.restore()
        apply_activation_checkpointing(model, args.ac_later)
    losses, norms = [], []
    for step in range(start, args.steps):
        batches = rank_share(synthetic_batches(step, args.micro, args.micro_bs, args.seq), ctx)
        stats = train_step(model, optimizer, batches, ctx, step=step, seed=0, learning_rate=args.lr,
                           max_grad_norm=1.0)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        if args.save_at is not None and step + 1 == args.save_at:
            _save(args, model, optimizer, ctx, step + 1, opts)
    export_adapter(out / "adapter", model, ctx, r=args.r, alpha=2.0 * args.r, dropout=0.0,
                   target_modules=opts.target_modules)
    wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    return {"losses": losses, "grad_norms": norms, "world_size": ctx.world_size, "load": report.as_event_data(),
            "tables_whole_during_layers": tables, "checkpointed_layers": wrapped}


def _watch_tables_during_layers(model) -> dict[str, list]:
    """While a decoder layer runs (forward, recomputation or backward): whether the
    embedding and the LM head are gathered whole (a plain tensor, not this rank's DTensor
    shard); in the forward pass proper, how many other decoder layers are whole (in the
    backward pass FSDP prefetches the next layer to compute)."""
    from torch.distributed.tensor import DTensor

    from trainers.fsdp_qlora.distributed import decoder_layers

    layers = decoder_layers(model)
    seen: dict[str, list] = {"embedding": [], "lm_head": [], "forward_other_layers": []}
    in_backward = [False]

    def whole(param) -> bool:
        return not isinstance(param, DTensor)

    def record(current, *_args) -> None:
        seen["embedding"].append(whole(model.get_input_embeddings().weight))
        seen["lm_head"].append(whole(model.get_output_embeddings().weight))
        if not in_backward[0]:
            seen["forward_other_layers"].append(sum(whole(layer.input_layernorm.weight) for layer in layers
                                                    if layer is not current))

    def backward_began(*_args) -> None:
        in_backward[0] = True

    def forward_began(*_args) -> None:
        in_backward[0] = False

    model.register_forward_pre_hook(forward_began)  # each micro-batch's forward
    for layer in layers:
        layer.register_forward_pre_hook(record)
        layer.register_full_backward_pre_hook(record)
        layer.register_full_backward_pre_hook(backward_began)
    return seen


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--suite", action="store_true",
                   help="run the test suite's plan: lora (save at 2), resumed from it, nf4")
    p.add_argument("--quant", default="none")
    p.add_argument("--compute-dtype", default="float32")
    p.add_argument("--ac", default="none")
    p.add_argument("--ac-later", default=None, help="checkpointing switched on after one step taken and undone")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--micro", type=int, default=2, help="global micro-batches per step")
    p.add_argument("--micro-bs", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--ckpt-root", default=None)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--r", type=int, default=4)
    args = p.parse_args(argv)

    import torch

    from trainers.fsdp_qlora.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    ctx = init_distributed()
    out = Path(args.out)
    results = {}
    if args.suite:
        # One launch for several runs: each starts from a freshly built model and
        # optimizer, so "resumed" shares nothing with "lora" but the checkpoint on disk.
        ckpt = out / "ckpt"
        plan = [
            # Activation checkpointing recomputes the same numbers, so the references
            # (without it) still apply: reentrant for lora, non-reentrant for nf4.
            ("lora", {"quant": "none", "steps": 4, "save_at": 2, "ckpt_root": str(ckpt), "resume": None,
                      "ac": "reentrant"}),
            ("resumed", {"quant": "none", "steps": 4, "save_at": None, "resume": str(ckpt / "step-2"),
                         "ac": "reentrant"}),
            ("nf4", {"quant": "nf4", "steps": 3, "save_at": None, "resume": None, "lr": NF4_LR,
                     "ac": "non_reentrant"}),
            ("checkpointed_later", {"quant": "none", "steps": 4, "save_at": None, "resume": None, "ac": "none",
                                    "ac_later": "non_reentrant"}),
        ]
        for name, changes in plan:
            results[name] = run_one(argparse.Namespace(**{**vars(args), **changes}), ctx, out / name)
    else:
        results["run"] = run_one(args, ctx, out)
    if ctx.is_main:
        (out / "result.json").write_text(json.dumps(results))
    destroy_distributed()
    return 0


def _save(args, model, optimizer, ctx, step, opts):
    """Checkpoint: gather the adapter on all ranks first (a collective), then write."""
    from trainers.common.checkpointing import TrainerState
    from trainers.common.data import DataCursor
    from trainers.common.peft_export import write_peft_adapter
    from trainers.fsdp_qlora.checkpoint import (
        gather_adapter_state,
        peft_weights,
        save_checkpoint_distributed,
    )

    adapter = gather_adapter_state(model)

    def write_adapter(d: Path) -> None:
        write_peft_adapter(d, peft_weights(adapter), r=args.r, alpha=2.0 * args.r, dropout=0.0,
                           target_modules=opts.target_modules, dtype="float32")

    return save_checkpoint_distributed(
        args.ckpt_root, TrainerState(step=step, epoch=0, cursor=DataCursor()), model, optimizer, ctx,
        keep_last=2, write_adapter=write_adapter,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
