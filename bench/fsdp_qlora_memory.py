"""Peak host memory of QLoRA (NF4 and HQQ 4-bit) vs bf16 LoRA on the same model, one run.

A random Llama large enough that weights dominate (default hidden 1024 x 8 layers,
ffn 2816, vocab 512: ~110 M parameters, ~210 MiB in bf16) is written once as a sharded
safetensors checkpoint. Each configuration then runs in a FRESH process (so peaks do not
mix): it records its RSS after imports, loads the model through the trainer's own
low-memory loader (``trainers.fsdp_qlora.loading.build_model``), trains 3 LoRA steps
with the trainer's step, and reports ``peak RSS - RSS after imports`` (Linux
``VmHWM``, reset after the baseline and again after loading, so the load's and the
steps' peaks are also reported apart). That delta is the memory the run itself needed:
weights, LoRA + AdamW state, activations, and loading transients.

    OMP_NUM_THREADS=2 .venv/bin/python bench/fsdp_qlora_memory.py [--hidden 1024 --layers 8]
    # weights dominating (~420 M parameters; bf16 steps are slow on an AVX2-only CPU,
    # so fewer, shorter steps keep it to a few minutes):
    OMP_NUM_THREADS=2 .venv/bin/python bench/fsdp_qlora_memory.py --layers 32 --seq 32 --steps 2
    # also: --configs lora_bf16,qlora_nf4_dq (NF4 + double quantization), qlora_hqq4

Prints a JSON line per configuration and the ratios; append them to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import peak_rss_bytes, reset_peak_rss, rss_bytes

CONFIGS = {
    "lora_bf16": {"quantization": "none"},
    "qlora_nf4": {"quantization": "nf4"},
    # QLoRA paper's setting: the fp32 absmax statistics themselves quantized to 8 bit.
    "qlora_nf4_dq": {"quantization": "nf4", "double_quant": True},
    "qlora_hqq4": {"quantization": "hqq4"},
}
# Large allocations get their own mmap and go back to the OS when freed, so RSS tracks
# live tensors instead of glibc's heap high-water mark (set for the child processes).
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def child(model_dir: str, name: str, seq: int, steps: int) -> None:
    import bitsandbytes  # noqa: F401
    import numpy as np
    import peft  # noqa: F401  (imported before the baseline is taken)
    import torch

    from trainers.common.data import Batch
    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import build_optimizer, train_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    # Warm the libraries both configurations load anyway (bnb's first op pulls in
    # torch._dynamo, ~30 MiB), so the baseline holds the same code in every process.
    from trainers.fsdp_qlora.quantize import QuantConfig, dequantized_weight, quantize_linear

    dequantized_weight(quantize_linear(torch.nn.Linear(64, 64, bias=False), QuantConfig("nf4")))
    baseline = rss_bytes()
    reset_peak_rss()
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    opts = ModelOptions(model_dir=Path(model_dir), base_dtype="bfloat16", compute_dtype="bfloat16",
                        adapter_dtype="float32", lora_r=16, lora_alpha=32.0,
                        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), **CONFIGS[name])
    t0 = time.perf_counter()
    model, report = build_model(opts, ctx)
    load_s = time.perf_counter() - t0
    after_load = rss_bytes()
    load_peak = peak_rss_bytes()
    reset_peak_rss()  # from here: the training steps' own peak
    opt = build_optimizer(model, learning_rate=1e-4, weight_decay=0.0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, size=(1, seq), dtype=np.int64)
    batch = Batch(ids, ids.copy(), np.arange(seq)[None].copy(), np.ones_like(ids), np.ones_like(ids))
    t0 = time.perf_counter()
    for s in range(steps):
        stats = train_step(model, opt, [batch], ctx, step=s, seed=0, learning_rate=1e-4, max_grad_norm=1.0)
    step_s = (time.perf_counter() - t0) / steps
    train_peak = peak_rss_bytes()
    peak = max(load_peak, train_peak)  # since the baseline: loading and training
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({
        "config": name, "baseline_rss_mib": baseline / 2**20, "peak_minus_baseline_mib": (peak - baseline) / 2**20,
        "after_load_minus_baseline_mib": (after_load - baseline) / 2**20,
        "load_peak_minus_baseline_mib": (load_peak - baseline) / 2**20,
        "train_peak_minus_baseline_mib": (train_peak - baseline) / 2**20, "param_mib": local / 2**20,
        "load_s": round(load_s, 2), "step_s": round(step_s, 3), "loss": stats.loss,
        "quantized_layers": report.quantized_layers,
    }), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    # HQQ's optimizer is slow on CPU (~9 min for 8 layers here): opt in with --configs.
    p.add_argument("--configs", default="lora_bf16,qlora_nf4")
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "CONFIG"))
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.seq, args.steps)
        return
    from trainers.common.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
                                     intermediate_size=args.ffn, vocab_size=512, dtype="bfloat16",
                                     max_shard_size="64MB")
        results = {}
        for name in args.configs.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", str(model_dir), name, "--seq", str(args.seq),
                                  "--steps", str(args.steps)], capture_output=True, text=True, check=True,
                                 env={**os.environ, **CHILD_ENV})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[name] = row
            print(json.dumps(row), flush=True)
        base = results["lora_bf16"]["peak_minus_baseline_mib"]
        for name in [c for c in results if c != "lora_bf16"]:
            print(f"{name} / lora_bf16 peak memory ratio: {results[name]['peak_minus_baseline_mib'] / base:.3f}")


if __name__ == "__main__":
    main()
