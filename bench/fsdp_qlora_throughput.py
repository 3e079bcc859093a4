"""Tokens/s of the trainer's QLoRA step vs a plain transformers + peft + bitsandbytes loop.

Same model (random Llama, default h256 x 4 layers, ffn 1024, vocab 512), same NF4
quantization, same LoRA (r 8 on q/k/v/o), same batch (4 x 256 tokens, completion-only labels: the
first half of each row is prompt, label -100), same AdamW, on
the same CPU threads; each side runs in its own process, alternating A/B/A/B so load
from other processes hits both alike. The plain loop is what a user writes from the
libraries' docs: ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``,
``prepare``-free ``get_peft_model``, ``model(input_ids, labels=...)``, ``loss.backward()``,
``clip_grad_norm_``, ``AdamW.step()``.

    OMP_NUM_THREADS=2 .venv/bin/python bench/fsdp_qlora_throughput.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _batch(seq: int, bs: int):
    import numpy as np

    from trainers.common.data import Batch

    ids = np.random.default_rng(0).integers(0, 256, size=(bs, seq), dtype=np.int64)
    labels = ids.copy()
    labels[:, : seq // 2] = -100  # SFT: the prompt half is not trained on (completion-only loss)
    return Batch(ids, labels, np.broadcast_to(np.arange(seq), ids.shape).copy(), np.ones_like(ids),
                 np.ones_like(ids))


def ours(model_dir: str, seq: int, bs: int, steps: int, warmup: int) -> float:
    import torch

    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import build_optimizer, train_step

    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    model, _ = build_model(ModelOptions(model_dir=Path(model_dir), quantization="nf4", lora_r=8, lora_alpha=16.0,
                                        target_modules=TARGETS), ctx)
    opt = build_optimizer(model, learning_rate=1e-4, weight_decay=0.0)
    batch = _batch(seq, bs)
    for s in range(warmup + steps):
        if s == warmup:
            t0 = time.perf_counter()
        train_step(model, opt, [batch], ctx, step=s, seed=0, learning_rate=1e-4, max_grad_norm=1.0)
    return steps * seq * bs / (time.perf_counter() - t0)


def plain(model_dir: str, seq: int, bs: int, steps: int, warmup: int) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32),
    )
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS), task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = _batch(seq, bs)
    ids, labels = torch.as_tensor(batch.input_ids), torch.as_tensor(batch.labels)
    for s in range(warmup + steps):
        if s == warmup:
            t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * seq * bs / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "WHICH"))
    args = p.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
        fn = ours if args.child[1] == "ours" else plain
        print(json.dumps({"which": args.child[1], "tokens_per_s": fn(args.child[0], args.seq, args.bs, args.steps,
                                                                    args.warmup)}), flush=True)
        return
    from trainers.common.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 32, num_kv_heads=args.hidden // 64,
                                     intermediate_size=args.ffn, vocab_size=512)
        got: dict[str, list[float]] = {"ours": [], "plain": []}
        for _ in range(args.rounds):
            for which in ("ours", "plain"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(model_dir), which, "--seq", str(args.seq),
                     "--bs", str(args.bs), "--steps", str(args.steps), "--warmup", str(args.warmup)],
                    capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                got[which].append(row["tokens_per_s"])
                print(json.dumps(row), flush=True)
        o, q = statistics.median(got["ours"]), statistics.median(got["plain"])
        print(f"median tokens/s: ours {o:.0f}, plain transformers+peft+bnb {q:.0f}, ratio {o / q:.2f}x")


if __name__ == "__main__":
    main()
