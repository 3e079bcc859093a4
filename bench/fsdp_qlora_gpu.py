"""One-GPU QLoRA benchmark: the trainer's NF4 path vs plain transformers+peft+bitsandbytes.

Run by ``bench/gpu_fsdp_qlora.sh`` on one H200-class GPU, offline. Steps:

1. ``make``: write an 8B-shaped Llama (hidden 4096, 32 layers, 32/8 heads, ffn 14336,
   vocab 128256; 8.03 B parameters) with random bf16 weights as a sharded safetensors
   checkpoint, one shard per decoder layer, generated on the GPU (seconds, not the
   minutes a CPU ``LlamaForCausalLM`` init takes).
2. ``ours`` (fresh process): ``trainers.fsdp_qlora.loading.build_model`` (stream +
   quantize NF4 on the GPU, LoRA, non-reentrant activation checkpointing) and the
   trainer's ``train_step``; bf16 autocast, fp32 LoRA weights and AdamW.
3. ``plain`` (fresh process): ``from_pretrained(quantization_config=BitsAndBytesConfig(
   nf4, bf16 compute))`` + ``gradient_checkpointing_enable(use_reentrant=False)`` +
   ``get_peft_model`` + the usual ``loss.backward(); clip; AdamW.step()`` loop, same
   autocast, same LoRA (r 8, alpha 16, all 7 projections), same batch.

Reports tokens/s, MFU = 4 * N * tokens/s / peak bf16 FLOP/s (LoRA: forward 2N + input
gradients 2N per token; recomputation not counted), peak allocated/reserved GPU memory,
and load time, as JSON lines; the shell script collects them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "4090": 165e12, "3090": 71e12}


SMOKE_SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 512}


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke logic check only


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_checkpoint(out: Path, layers: int, smoke: bool = False) -> None:
    """Random bf16 Llama in HF layout, one safetensors shard per decoder layer."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = dict(SMOKE_SHAPE if smoke else SHAPE)
    if not smoke:
        shape["num_hidden_layers"] = layers
    layers = shape["num_hidden_layers"]
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(out)
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    g = torch.Generator(device=_device()).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=g, device=_device(), dtype=torch.bfloat16) * 0.02).cpu()

    shards: list[dict] = [{"model.embed_tokens.weight": rnd(v, h)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append({
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
            p + "mlp.down_proj.weight": rnd(h, f),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    shards.append({"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rnd(v, h)})
    weight_map, total = {}, 0
    for n, tensors in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _n_params(model_dir: Path) -> int:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return index["metadata"]["total_size"] // 2  # bf16


def _peak_flops() -> float:
    import torch

    name = torch.cuda.get_device_name()
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return PEAK_BF16_FLOPS["H100"]


def _timed_steps(step: Callable[[int], Any], steps: int, warmup: int) -> tuple[float, Any]:
    """Run ``step(0)``, ``step(1)``, ... for ``warmup + steps`` steps from a fresh memory
    peak; the seconds the last ``steps`` took (device synchronized) and the last result."""
    _reset_peak()
    t0 = time.perf_counter()
    for s in range(warmup + steps):
        if s == warmup:
            _sync()
            t0 = time.perf_counter()
        out = step(s)
    _sync()
    return time.perf_counter() - t0, out


def _profile_step(step: Callable[[int], Any], label: str) -> None:
    """One more step under torch.profiler: the 15 ops with the most GPU time (printed)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step(10_000)
        _sync()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"--- {label}: one step, top ops by {key}", file=sys.stderr)  # stdout: the JSON row only
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60), file=sys.stderr, flush=True)


def _profiled(fn: Callable[[], Any], label: str, enabled: bool) -> Any:
    """``fn()``; with ``enabled``, under cProfile, printing its 15 costliest functions."""
    if not enabled:
        return fn()
    import cProfile
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    print(f"--- {label}: top functions by own time", file=sys.stderr)
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    return out


def _ids(seq: int, bs: int):
    import torch

    return torch.randint(0, 1000, (bs, seq), generator=torch.Generator().manual_seed(0))


def bench_ours(model_dir: Path, seq: int, bs: int, steps: int, warmup: int, profile: bool = False) -> dict:
    import numpy as np
    import torch

    from trainers.common.data import Batch
    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import build_optimizer, train_step

    ctx = DistContext(0, 1, 0, torch.device(_device(), 0) if _device() == "cuda" else torch.device("cpu"))
    t0 = time.perf_counter()
    model, report = _profiled(lambda: build_model(ModelOptions(
        model_dir=model_dir, base_dtype="bfloat16", compute_dtype="bfloat16", adapter_dtype="float32",
        quantization="nf4", lora_r=8, lora_alpha=16.0, target_modules=TARGETS,
        activation_checkpointing="non_reentrant"), ctx), "ours: load", profile)
    _sync()
    load_s = time.perf_counter() - t0
    opt = build_optimizer(model, learning_rate=1e-4, weight_decay=0.0)
    ids = _ids(seq, bs).numpy()
    batch = Batch(ids, ids.copy(), np.broadcast_to(np.arange(seq), ids.shape).copy(), np.ones_like(ids),
                  np.ones_like(ids))

    def step(s: int) -> Any:
        with torch.autocast(_device(), dtype=torch.bfloat16):
            return train_step(model, opt, [batch], ctx, step=s, seed=0, learning_rate=1e-4, max_grad_norm=1.0)

    dt, stats = _timed_steps(step, steps, warmup)
    if profile:
        _profile_step(step, "ours")
    return {"load_s": load_s, "tokens_per_s": steps * seq * bs / dt, "loss": stats.loss,
            "load_peak_rss_gib": report.peak_rss_bytes / 2**30}


def bench_plain(model_dir: Path, seq: int, bs: int, steps: int, warmup: int, profile: bool = False) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, device_map="cuda:0" if _device() == "cuda" else "cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.bfloat16),
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS),
                                             task_type="CAUSAL_LM"))
    model.train()
    _sync()
    load_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = _ids(seq, bs).to(_device())

    def step(s: int) -> Any:
        with torch.autocast(_device(), dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    dt, loss = _timed_steps(step, steps, warmup)
    if profile:
        _profile_step(step, "plain")
    return {"load_s": load_s, "tokens_per_s": steps * seq * bs / dt, "loss": float(loss)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["make", "ours", "plain"])
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU allowed: checks the script's logic")
    p.add_argument("--profile", action="store_true",
                   help="after timing: print one step's top GPU ops (and, for ours, the load's top functions)")
    args = p.parse_args()
    if args.what == "make":
        t0 = time.perf_counter()
        make_checkpoint(args.model_dir, args.layers, smoke=args.smoke)
        print(json.dumps({"what": "make", "seconds": time.perf_counter() - t0}), flush=True)
        return
    import torch

    fn = bench_ours if args.what == "ours" else bench_plain
    row = fn(args.model_dir, args.seq, args.bs, args.steps, args.warmup, profile=args.profile)
    n = _n_params(args.model_dir)
    cuda = torch.cuda.is_available()
    row.update({
        "what": args.what, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "params": n, "seq": args.seq,
        "batch": args.bs, "mfu": 4 * n * row["tokens_per_s"] / _peak_flops() if cuda else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "torch": torch.__version__, "omp": os.environ.get("OMP_NUM_THREADS"),
    })
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
