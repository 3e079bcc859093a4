"""Tokens/s of the trainer's QLoRA step vs a plain transformers + peft + bitsandbytes loop.

Same model (random Llama, default h256 x 4 layers, ffn 1024, vocab 32000 as Llama 2's:
``--vocab 512`` for a toy vocabulary), same NF4 quantization, same LoRA (r 8 on q/k/v/o),
same batch (4 x 256 tokens, completion-only labels: the first half of each row is
prompt, label -100), same AdamW, on the same CPU threads. Both sides live in ONE process
and their steps are interleaved (A, B, A, B, ...), so the load of a shared machine hits
both alike; best and median step times are reported, and the median CPU seconds the
process spent per step (steadier than wall time when other processes compete for the
cores, most of all with 1 thread). The plain loop is what a user writes from the
libraries' docs: ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``,
``prepare``-free ``get_peft_model``, ``model(input_ids, labels=...)``, ``loss.backward()``,
``clip_grad_norm_``, ``AdamW.step()``. With completion-only labels the trainer's step
projects only label positions onto the vocabulary; the plain loop projects every one.

    OMP_NUM_THREADS=2 .venv/bin/python bench/fsdp_qlora_throughput.py [--steps 8] [--vocab 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import add_llama_shape_args, build_llama

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _batch(seq: int, bs: int):
    import numpy as np

    from trainers.common.data import Batch

    ids = np.random.default_rng(0).integers(0, 256, size=(bs, seq), dtype=np.int64)
    labels = ids.copy()
    labels[:, : seq // 2] = -100  # SFT: the prompt half is not trained on (completion-only loss)
    return Batch(ids, labels, np.broadcast_to(np.arange(seq), ids.shape).copy(), np.ones_like(ids),
                 np.ones_like(ids))


def build_ours(model_dir: str, seq: int, bs: int):
    """The trainer's path: streamed NF4 load + LoRA, and one ``train_step`` per call."""
    import torch

    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import build_optimizer, train_step

    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    model, _ = build_model(ModelOptions(model_dir=Path(model_dir), quantization="nf4", lora_r=8, lora_alpha=16.0,
                                        target_modules=TARGETS), ctx)
    opt = build_optimizer(model, learning_rate=1e-4, weight_decay=0.0)
    batch = _batch(seq, bs)

    def step(s: int) -> float:
        return train_step(model, opt, [batch], ctx, step=s, seed=0, learning_rate=1e-4, max_grad_norm=1.0).loss

    return step


def build_plain(model_dir: str, seq: int, bs: int):
    """What a user writes from the libraries' docs."""
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

    def step(s: int) -> float:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    add_llama_shape_args(p)
    p.add_argument("--vocab", type=int, default=32000, help="32000 = Llama 2's vocabulary")
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per side (after 1 warm-up step)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "m", args, args.vocab)
        sides = {"ours": build_ours(str(model_dir), args.seq, args.bs),
                 "plain": build_plain(str(model_dir), args.seq, args.bs)}
        times: dict[str, list[float]] = {k: [] for k in sides}
        cpu_times: dict[str, list[float]] = {k: [] for k in sides}
        losses: dict[str, list[float]] = {k: [] for k in sides}
        # Interleave single steps of the two sides in ONE process: on a shared machine the
        # load changes by the second, and alternating exposes both sides to it alike.
        for s in range(args.steps + 1):
            for name, step in sides.items():
                t0, c0 = time.perf_counter(), time.process_time()
                losses[name].append(step(s))
                if s > 0:
                    times[name].append(time.perf_counter() - t0)
                    cpu_times[name].append(time.process_time() - c0)
        tokens = args.seq * args.bs
        row = {"shape": f"h{args.hidden} L{args.layers} ffn{args.ffn} vocab{args.vocab} seq{args.seq} batch{args.bs}"}
        for name in sides:
            row[name] = {"tokens_per_s_best": tokens / min(times[name]),
                         "tokens_per_s_median": tokens / statistics.median(times[name]),
                         # CPU seconds this process spent per step: less disturbed than wall time
                         # by other processes on a shared box (both sides use the same threads).
                         "cpu_s_per_step_median": statistics.median(cpu_times[name]),
                         "first_loss": losses[name][0], "last_loss": losses[name][-1]}
        row["ratio_best"] = row["ours"]["tokens_per_s_best"] / row["plain"]["tokens_per_s_best"]
        row["ratio_median"] = row["ours"]["tokens_per_s_median"] / row["plain"]["tokens_per_s_median"]
        row["ratio_cpu_time_median"] = row["plain"]["cpu_s_per_step_median"] / row["ours"]["cpu_s_per_step_median"]
        print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
