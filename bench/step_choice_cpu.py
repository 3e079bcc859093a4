"""The scheduler's step choice vs the fixed step it replaced, on both trainers, on CPU.

Before the step choice the worker gave every job on an accelerator pool the same step:
each layer recomputed in the backward (jax_lora ``remat=per_layer``, fsdp_qlora
``activation_checkpointing=non_reentrant``) at the job's micro batch (the largest divisor
of the batch up to 4, ``control.jobs.hyperparameters.micro_batch_for``). Now
``scheduling.step_choice.choose_step`` picks the fastest step whose planned memory fits
the placed device, here the embedded ``local`` CPU pool (``scheduling.pools.local_pool``),
as ``worker.spec_builder.job_step`` asks it, and the trainers confirm it with their first
step. The job is the same on both sides: global batch, data, learning rate; only the
micro batch and the recomputation differ, so step 1's losses agree (checked).

Each run is the trainers' own entry point (``python -m trainers --spec``) in a fresh
process with one thread, for ``--steps`` optimizer steps; its tokens/s is the median of
the metric rows' ``tokens_per_s`` after step 1 (jax_lora compiles in step 1, fsdp_qlora
confirms its step in it). Runs alternate fixed / chosen, ``--rounds`` times per trainer,
so a shared machine's load hits both arms alike; the load average is printed with every
run. The ratio is chosen / fixed of the medians over rounds.

    OMP_NUM_THREADS=1 python bench/step_choice_cpu.py --rounds 3 --steps 6 [--append-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import add_llama_shape_args, build_llama

VOCAB = 1024
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TRAINERS = ("fsdp_qlora", "jax_lora")


def write_data(path: Path, seq: int, rows: int) -> Path:
    """Rows of one short prompt and a completion longer than ``seq`` bytes (byte tokenizer):
    every row is ``seq`` tokens, nearly all of them trained."""
    text = "abcdefghij klmnopqrst " * (seq // 10 + 4)
    path.write_text("".join(json.dumps({"prompt": f"{i}", "completion": text[i:]}) + "\n" for i in range(rows)),
                    encoding="utf-8")
    return path


def chosen_step(model_dir: Path, trainer: str, seq: int, batch: int) -> Any:
    """The step the scheduler gives this job on the local CPU pool (``job_step``'s call)."""
    from control.job_settings import JobSettings
    from control.jobs.hyperparameters import micro_batch_for
    from scheduling.model_files import base_model_shape
    from scheduling.pools import local_pool
    from scheduling.request import training_shape
    from scheduling.step_choice import choose_step

    pool = local_pool()
    shape, _ = base_model_shape(str(model_dir), None, model_id="bench")
    training = training_shape(JobSettings.from_columns(
        adapter={"method": "lora", "r": 8, "target_modules": list(TARGETS)},
        hyperparameters={"batch_size": batch, "micro_batch_size": micro_batch_for(batch)}, max_seq_len=seq))
    return choose_step(shape, training, accelerator=pool.accelerator, device_bytes=pool.gpu_memory_bytes, gpus=1,
                       trainer=trainer, batch_size=batch)


def spec_for(trainer: str, arm: str, model_dir: Path, data: Path, run: Path, args: argparse.Namespace,
             step: Any) -> dict[str, Any]:
    """The trainer spec of one arm: ``fixed`` (per-layer recomputation, micro batch <= 4,
    no memory plan) or ``chosen`` (the step choice, with the pool's memory per device)."""
    from control.jobs.hyperparameters import micro_batch_for

    if arm == "fixed":
        micro, parallelism = micro_batch_for(args.batch), {"activation_checkpointing": "non_reentrant",
                                                           "remat": "per_layer"}
    else:
        micro, parallelism = step.micro_batch, {"activation_checkpointing": step.activation_checkpointing,
                                                "remat": step.remat, "planned_memory_bytes": step.planned_bytes,
                                                "device_memory_bytes": step.device_bytes}
    if trainer == "jax_lora":
        parallelism |= {"host_devices": 1, "mesh": {"data": 1, "fsdp": 1, "tensor": 1}}
    return {
        "job_id": f"ftjob-bench-{run.name}", "trainer": trainer, "model": {"path": str(model_dir)},
        "data": {"train_file": str(data), "format": "prompt_completion", "max_seq_len": args.seq, "shuffle": False},
        "hyperparameters": {"n_epochs": 100, "batch_size": args.batch, "micro_batch_size": micro,
                            "learning_rate": 1e-4, "max_steps": args.steps},
        "adapter": {"r": 8, "alpha": 16.0, "target_modules": list(TARGETS)},
        "parallelism": parallelism,
        "precision": {"base_dtype": "float32", "compute_dtype": "float32", "adapter_dtype": "float32"},
        "output_dir": str(run / "output"),
        "checkpoint": {"dir": str(run / "checkpoints"), "every_n_steps": 1000, "keep_last": 1},
        "termination_log": str(run / "termination-log"),
        "seed": 0,
    }


def run_once(spec: dict[str, Any], run: Path) -> dict[str, Any]:
    """One entry-point run: tokens/s after step 1, step 1's loss, the step event, wall time, load."""
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainers", "--spec", str(run / "spec.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{run.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    reports = [json.loads(line) for line in (run / "checkpoints" / "reports.jsonl").read_text().splitlines()]
    rows = [r for r in reports if r.get("type") == "metric"]
    events = [r["message"] for r in reports if r.get("type") == "event" and r["message"].startswith("step ")]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
            "loss_1": rows[0]["train_loss"], "event": events[0] if events else "",
            "wall_s": time.perf_counter() - started, "load": (load_before + os.getloadavg()[0]) / 2}


def describe(spec: dict[str, Any]) -> str:
    par = spec["parallelism"]
    recompute = par["remat"] if spec["trainer"] == "jax_lora" else par["activation_checkpointing"]
    return f"micro-batch {spec['hyperparameters']['micro_batch_size']}, {recompute}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_shape_args(parser)
    parser.add_argument("--batch", type=int, default=8, help="the job's global batch")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--append-results", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    started = time.time()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    specs: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="step-choice-") as tmp:
        root = Path(tmp)
        model_dir = build_llama(root / "model", args, VOCAB, max_position_embeddings=max(512, args.seq))
        data = write_data(root / "train.jsonl", args.seq, 2 * args.batch)
        for trainer in args.trainers.split(","):
            step = chosen_step(model_dir, trainer, args.seq, args.batch)
            print(f"{trainer}: the step choice on the local pool: {step.describe()}", flush=True)
            results[trainer] = {"fixed": [], "chosen": []}
            for i in range(args.rounds):
                for arm in ("fixed", "chosen"):
                    run = root / f"{trainer}-{arm}-{i}"
                    spec = specs.setdefault((trainer, arm), spec_for(trainer, arm, model_dir, data, run, args, step))
                    out = run_once({**spec, "output_dir": str(run / "output"),
                                    "checkpoint": {**spec["checkpoint"], "dir": str(run / "checkpoints")},
                                    "termination_log": str(run / "termination-log")}, run)
                    results[trainer][arm].append(out)
                    print(f"  {trainer} {arm:6} ({describe(spec)}) round {i + 1}: {out['tokens_per_s']:7.0f} tok/s, "
                          f"step-1 loss {out['loss_1']:.6f}, {out['wall_s']:.1f} s, load {out['load']:.2f}"
                          + (f"; {out['event']}" if out["event"] else ""), flush=True)
    lines = table(results, specs, args)
    load = os.getloadavg()
    footer = (f"{sum(len(a) for r in results.values() for a in r.values())} runs in {time.time() - started:.0f} s; "
              f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min), {os.cpu_count()} CPUs")
    print("\n".join(lines) + "\n\n" + footer)
    if args.append_results:
        append_results(lines, footer, args)
    return 0


def table(results: dict[str, dict[str, list[dict[str, Any]]]], specs: dict[tuple[str, str], dict[str, Any]],
          args: argparse.Namespace) -> list[str]:
    """The markdown table: per trainer, each arm's step, tok/s per round and median, and the ratio."""
    header = ("| trainer | fixed step | chosen step | fixed tok/s (rounds) | chosen tok/s (rounds) | fixed median | "
              "chosen median | chosen / fixed | step-1 loss (fixed, chosen) | load avg |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for trainer, arms in results.items():
        fixed, chosen = (statistics.median(r["tokens_per_s"] for r in arms[a]) for a in ("fixed", "chosen"))
        losses = [arms[a][0]["loss_1"] for a in ("fixed", "chosen")]
        if abs(losses[0] - losses[1]) > 1e-4 * abs(losses[0]):
            raise SystemExit(f"{trainer}: step 1's loss differs between the arms: {losses}")
        loads = [r["load"] for a in arms.values() for r in a]
        lines.append(
            f"| {trainer} | {describe(specs[(trainer, 'fixed')])} | {describe(specs[(trainer, 'chosen')])} | "
            + " | ".join(", ".join(f"{r['tokens_per_s']:.0f}" for r in arms[a]) for a in ("fixed", "chosen"))
            + f" | {fixed:.0f} | {chosen:.0f} | **{chosen / fixed:.2f}x** | {losses[0]:.6f}, {losses[1]:.6f} | "
            f"{min(loads):.1f}-{max(loads):.1f} |")
    return lines


def append_results(lines: list[str], footer: str, args: argparse.Namespace) -> None:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    shape = (f"random Llama h{args.hidden} L{args.layers} ffn {args.ffn}, vocab {VOCAB}, seq {args.seq} x global "
             f"batch {args.batch}, LoRA r8 q/k/v/o, fp32, one thread")
    text = (f"\n## The step choice vs the fixed step it replaced, both trainers on CPU ({when})\n\n"
            f"`OMP_NUM_THREADS=1 python bench/step_choice_cpu.py --rounds {args.rounds} --steps {args.steps}` "
            f"({shape}; each run the entry point in a fresh process, tok/s the median of steps 2-{args.steps}).\n\n"
            + "\n".join(lines) + f"\n\n{footer}.\n")
    with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as results:
        results.write(text)


if __name__ == "__main__":
    raise SystemExit(main())
