"""FSDP-QLoRA's memory plan for Llama-3.1-70B NF4 on 2 ranks, from the trainer's own build.

The fsdp_qlora trainer builds its model on the ``meta`` device and shards it with FSDP2
before any weight exists (``trainers.fsdp_qlora.loading``). This bench runs that build
for the real 70B config under a fake process group of ``--ranks`` ranks (PyTorch's
``fake`` backend: collectives are no-ops, the shard layout is the real one), then counts,
exactly, what one rank holds:

- the packed NF4 weights (stored in the bf16 FSDP dtype) and the bf16 embeddings, norms and
  LM head: FSDP2 ``Shard(0)`` slices, padded to equal chunks as FSDP2 allocates them;
- the quantization statistics (absmax per block of 64, the 16-value code): not
  parameters, so FSDP leaves them whole on every rank;
- the LoRA factors (fp32, sharded), their gradients and AdamW's two moments;
- the largest decoder layer all-gathered (FSDP holds it, and prefetches the next).

and compares each with the estimator's term for the same job, asked as the scheduler
asks (``training_shape`` + ``estimate_on_pool`` on the rtx4090 pool, trainer
fsdp_qlora, 2 GPUs pinned), with and without CPU offload.

What it does not count: activations. ``--fake-tensors`` tries PyTorch's memory tracker
for FSDP2 (``FakeTensorMode`` + ``torch.distributed._tools.fsdp2_mem_tracker``), which
would trace a step and count them too; with bitsandbytes 0.50 it fails in the first
forward (``Linear4bit.forward`` re-wraps FSDP's all-gathered weight as a ``Params4bit``
subclass, which a ``FakeTensor`` cannot become), and the bench reports that error.

    python bench/plan_fsdp_qlora.py [--model llama-3.1-70b] [--ranks 2] [--json] [--fake-tensors]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

from control.job_settings import JobSettings
from scheduling.estimator import HEADROOM, estimate_on_pool, memory_per_gpu
from scheduling.model_files import base_model_shape
from scheduling.pools import GIB, load_pools
from scheduling.request import training_shape
from trainers.fsdp_qlora.distributed import DistContext, apply_activation_checkpointing, shard_model
from trainers.fsdp_qlora.loading import (
    ModelOptions,
    build_meta_model,
    is_lora_name,
    read_model_config,
)
from trainers.fsdp_qlora.quantize import is_quantized_linear, quant_state_tensors
from trainers.spec import DEFAULT_TARGET_MODULES
from worker.spec_builder import precision_for

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
POOLS_FILE = ROOT / "deploy" / "pools" / "mixed.yaml"
ADAM_MOMENTS = 2


def fake_process_group(world_size: int) -> Any:
    """Rank 0 of a ``world_size`` job on PyTorch's fake backend, and its 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    return init_device_mesh("cpu", (world_size,))


def model_options(model_dir: Path, r: int) -> ModelOptions:
    """What the worker's spec gives the trainer for a QLoRA job on an NVIDIA pool."""
    p = precision_for("nvidia-rtx-4090")
    return ModelOptions(
        model_dir=model_dir, base_dtype=p.base_dtype, compute_dtype=p.compute_dtype,
        adapter_dtype=p.adapter_dtype, quantization="nf4", lora_r=r, lora_alpha=2.0 * r,
        target_modules=DEFAULT_TARGET_MODULES, activation_checkpointing="non_reentrant",
    )


def _shard_bytes(param: torch.Tensor, world: int) -> int:
    """One rank's storage of a parameter: FSDP2 pads Shard(0) chunks to ceil(dim0 / world) rows."""
    if not hasattr(param, "to_local"):
        return param.numel() * param.element_size()
    rows = math.ceil(param.shape[0] / world)
    return rows * math.prod(param.shape[1:]) * param.element_size()


def _full_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def count_state(model: torch.nn.Module, world: int) -> dict[str, int]:
    """Bytes per rank of the sharded, quantized model state and its training state."""
    quantized = {id(m.weight) for m in model.modules() if is_quantized_linear(m)}
    out = {"packed_nf4_weights": 0, "bf16_weights": 0, "quant_stats": 0, "lora_params": 0}
    for name, param in model.named_parameters():
        nbytes = _shard_bytes(param, world)
        if is_lora_name(name):
            out["lora_params"] += nbytes
        elif id(param) in quantized:
            out["packed_nf4_weights"] += nbytes
        else:
            out["bf16_weights"] += nbytes
    for module in model.modules():
        if is_quantized_linear(module):
            out["quant_stats"] += _full_bytes(quant_state_tensors(module).values())
    # fp32 gradients and AdamW moments exist for the trainable (LoRA) shards only.
    out["lora_grads"] = out["lora_params"]
    out["optimizer"] = ADAM_MOMENTS * out["lora_params"]
    out["total_state"] = sum(out.values())
    return out


def gathered_layer_bytes(model: torch.nn.Module) -> int:
    """The largest decoder layer unsharded: what one FSDP all-gather materializes."""
    from trainers.fsdp_qlora.distributed import decoder_layers

    return max(_full_bytes(layer.parameters()) for layer in decoder_layers(model))


def try_fake_tensor_tracking(model: torch.nn.Module, vocab: int, seq: int) -> dict[str, Any]:
    """One step under FakeTensorMode with FSDP2's memory tracker; the error if it fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from trainers.fsdp_qlora.quantize import replace_quant_state_tensors

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            for m in model.modules():
                if is_quantized_linear(m):
                    stats = quant_state_tensors(m)
                    replace_quant_state_tensors(m, {k: torch.empty(v.shape, dtype=v.dtype) for k, v in stats.items()})
            lora = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(lora, lr=1e-4)
            ids = torch.randint(0, vocab, (1, seq))
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((ids,))
            with tracker:
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            return {"ok": True, "peak_bytes": int(sum(peak.values()))}
    except Exception as exc:  # noqa: BLE001 - the point is to report how the trace fails
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)
                      if "bitsandbytes" in f.filename), f"{Path(frames[-1].filename).name}:{frames[-1].lineno}")
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "where": where}


def estimator_terms(model_dir: Path, ranks: int, seq: int, r: int) -> dict[str, Any]:
    """The estimator's breakdown for this job on the rtx4090 pool, as the scheduler asks it."""
    pool = {p.name: p for p in load_pools(POOLS_FILE)}["rtx4090"]
    shape, _ = base_model_shape(str(model_dir), None, model_id=model_dir.name)
    training = training_shape(JobSettings.from_columns(
        adapter={"method": "qlora", "quantization": "nf4", "r": r}, hyperparameters={"micro_batch_size": 1},
        max_seq_len=seq))
    chosen = estimate_on_pool(shape, training, pool, trainer="fsdp_qlora", gpus=ranks)
    fields = ("weights", "gathered_layer", "lora_params", "lora_grads", "optimizer", "activations", "logits",
              "slack", "framework")
    without = memory_per_gpu(shape, training, ranks, accelerator=pool.accelerator, offload=False, trainer="fsdp_qlora")
    return {
        "pool": pool.name, "gpu_memory_bytes": pool.gpu_memory_bytes,
        "budget_bytes": int(pool.gpu_memory_bytes * HEADROOM),
        "no_offload": {**{k: getattr(without, k) for k in fields}, "total": without.total},
        "scheduler_choice": {"fits": chosen.fits, "cpu_offload": chosen.offload, "gpus": chosen.gpus,
                             "total": chosen.bytes_per_gpu},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048, help="for the estimator's activation terms")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--fake-tensors", action="store_true", help="also try FSDPMemTracker under FakeTensorMode")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model_dir = CONFIG_DIR / args.model if (CONFIG_DIR / args.model).is_dir() else Path(args.model)

    started = time.perf_counter()
    mesh = fake_process_group(args.ranks)
    opts = model_options(model_dir, args.r)
    config = read_model_config(model_dir)
    # The trainer's build order (loading.build_model up to to_empty): meta model, train
    # mode, activation checkpointing, FSDP2 sharding.
    model = build_meta_model(config, opts)
    model.train()
    apply_activation_checkpointing(model, opts.activation_checkpointing)
    shard_model(model, DistContext(0, args.ranks, 0, torch.device("cpu"), mesh), compute_dtype=opts.compute_dtype)
    state = count_state(model, args.ranks)
    result: dict[str, Any] = {
        "model": args.model, "ranks": args.ranks, "per_rank_bytes": state,
        "gathered_layer_bytes": gathered_layer_bytes(model),
        "estimator": estimator_terms(model_dir, args.ranks, args.seq, args.r),
    }
    if args.fake_tensors:
        result["fake_tensor_tracking"] = try_fake_tensor_tracking(model, config.vocab_size, args.seq)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    est = result["estimator"]["no_offload"]
    weights = state["packed_nf4_weights"] + state["bf16_weights"] + state["quant_stats"]
    print(f"{args.model} NF4 QLoRA r {args.r}, FSDP2 over {args.ranks} ranks (fake process group), per rank:")
    rows = [
        ("weights (packed NF4 + bf16 + quant stats)", weights, est["weights"]),
        ("  packed NF4 weights", state["packed_nf4_weights"], None),
        ("  bf16 embeddings, norms, LM head", state["bf16_weights"], None),
        ("  quant stats (replicated)", state["quant_stats"], None),
        ("LoRA params", state["lora_params"], est["lora_params"]),
        ("LoRA grads", state["lora_grads"], est["lora_grads"]),
        ("AdamW moments", state["optimizer"], est["optimizer"]),
        ("one gathered layer (x2 in the estimator: + prefetch)", result["gathered_layer_bytes"], est["gathered_layer"]),
    ]
    for label, got, predicted in rows:
        tail = "" if predicted is None else f"   estimator {predicted / GIB:8.3f} GiB  ratio {predicted / got:.3f}"
        print(f"  {label:54s} {got / GIB:8.3f} GiB{tail}")
    choice = result["estimator"]["scheduler_choice"]
    print(f"  estimator total without offload {est['total'] / GIB:.2f} GiB "
          f"(activations {est['activations'] / GIB:.2f}, "
          f"logits {est['logits'] / GIB:.2f}, slack {est['slack'] / GIB:.2f}, framework {est['framework'] / GIB:.2f}); "
          f"budget {result['estimator']['budget_bytes'] / GIB:.2f} GiB; scheduler: fits {choice['fits']}, "
          f"cpu_offload {choice['cpu_offload']}, {(choice['total'] or 0) / GIB:.2f} GiB per GPU")
    if "fake_tensor_tracking" in result:
        print(f"  FakeTensorMode + FSDPMemTracker: {result['fake_tensor_tracking']}")
    print(f"  ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
