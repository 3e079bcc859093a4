"""Tokens/s of the fsdp_qlora recipe's train loop next to a plain transformers+peft loop.

Same model (random Llama: hidden 256, 4 layers, heads 8/4, ffn 1024, vocab 1024), same
shape (batch 4 x seq 256, every row full: no padding), same LoRA (r 8 on q/k/v/o, AdamW),
same process, alternating rounds so machine load affects both alike. The recipe's number
is its own ``tokens_per_s`` metric (whole step: batch collation, forward/backward,
clipping, AdamW, metrics), the plain loop's is forward(labels=...)/backward/AdamW.

Run:  OMP_NUM_THREADS=2 .venv/bin/python bench/trainer_torch_vs_peft.py [--steps 12] [--rounds 2]
Appends a line to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainers.common.reporter import Reporter
from trainers.common.signals import StopFlag
from trainers.common.tiny_model import build_tiny_llama
from trainers.fsdp_qlora.recipe import run
from trainers.spec import TrainerSpec

SEQ, BATCH, R = 256, 4, 8
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def recipe_tokens_per_s(model_dir: Path, data: Path, work: Path, steps: int) -> float:
    spec = TrainerSpec.model_validate({
        "job_id": "ftjob-bench", "trainer": "fsdp_qlora", "model": {"path": str(model_dir)},
        "data": {"train_file": str(data), "format": "prompt_completion", "max_seq_len": SEQ, "shuffle": True},
        "hyperparameters": {"n_epochs": 1, "batch_size": BATCH, "micro_batch_size": BATCH,
                            "learning_rate": 1e-4, "max_steps": steps + 2, "max_grad_norm": 1.0},
        "adapter": {"r": R, "alpha": 16.0, "target_modules": MODULES},
        "output_dir": str(work / "out"), "checkpoint": {"dir": str(work / "ck"), "every_n_steps": 100_000},
    })
    reporter = Reporter(url=None, local_path=work / "reports.jsonl", flush_interval_s=5.0)
    try:
        run(spec, reporter=reporter, stop=StopFlag())
    finally:
        reporter.close()
    rows = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_seen"] % (BATCH * SEQ) == 0 for r in rows), "rows must be full (no padding)"
    per_step = [r["tokens_per_s"] for r in rows[2:]]  # the first two steps warm up allocators
    return statistics.median(per_step)


def plain_tokens_per_s(model_dir: Path, steps: int) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=16, target_modules=MODULES, task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 256, (BATCH, SEQ))
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return BATCH * SEQ / statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    model_dir = build_tiny_llama(work / "model", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                 intermediate_size=1024, vocab_size=1024)
    data = work / "train.jsonl"
    with open(data, "w") as f:  # every example is longer than SEQ: truncated to exactly SEQ tokens
        f.writelines(json.dumps({"prompt": f"q{i} " + "x" * 60, "completion": ("abc " * 100)}) + "\n"
                     for i in range(BATCH * (args.steps + 2)))
    recipe, plain = [], []
    for k in range(args.rounds):
        recipe.append(recipe_tokens_per_s(model_dir, data, work / f"r{k}", args.steps))
        plain.append(plain_tokens_per_s(model_dir, args.steps))
    r, p = statistics.median(recipe), statistics.median(plain)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    section = (
        f"\n## fsdp_qlora recipe vs plain transformers+peft ({stamp} UTC)\n\n"
        f"`OMP_NUM_THREADS=2 python bench/trainer_torch_vs_peft.py --steps {args.steps} --rounds {args.rounds}`; "
        f"h256 L4 heads 8/4 ffn 1024 vocab 1024, seq {SEQ} x batch {BATCH}, LoRA r{R} q/k/v/o, fp32, CPU "
        f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}); "
        f"median of per-step tokens/s over {args.rounds} alternating rounds.\n\n"
        f"recipe **{r:,.0f} tok/s**, plain peft loop **{p:,.0f} tok/s**, ratio recipe/plain = **{r / p:.2f}** "
        f"(rounds: recipe {[round(x) for x in recipe]}, plain {[round(x) for x in plain]}).\n"
    )
    print(section)
    results = Path(__file__).with_name("RESULTS.md")
    with open(results, "a") as f:
        f.write(section)


if __name__ == "__main__":
    main()
