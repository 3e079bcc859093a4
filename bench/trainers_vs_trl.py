"""Both trainers' real step next to TRL's ``SFTTrainer`` (+ peft, + bitsandbytes) on one job.

What a team would otherwise run by hand is TRL: ``SFTTrainer`` with a peft ``LoraConfig``
and, for QLoRA, a base loaded with ``BitsAndBytesConfig(load_in_4bit=True, nf4)``. This
bench runs the same job through it and through each trainer's own step:

- model: a random Llama (default hidden 256, 4 layers, heads 8 / kv 4, ffn 1024) at
  vocab 32,000 and 128,256 (Llama 3's), fp32 weights and compute (the CPU path);
- data: the same token rows on every side, seq 256 x batch 2, no padding, the first half
  of each row prompt (label -100) and the second half completion (completion-only loss).
  TRL gets them pre-tokenized (``input_ids`` + ``completion_mask`` columns, sequential
  sampler) so that its batch k is exactly ours;
- LoRA r 8, alpha 16, dropout 0 on q/k/v/o; AdamW lr 1e-4, no weight decay, constant
  schedule, clipping at 1.0; ``--quantization nf4``: the base in NF4 (fp32 compute).
- TRL's CPU defaults that are not this job are set to it: ``bf16=False`` (our CPU path is
  fp32) and ``gradient_checkpointing=False`` (our trainers' default is none). Everything
  else (its chunked LM head, per-step entropy / token-accuracy metrics, dataloader) is
  TRL's own.

Checked before any figure counts: the step-1 loss of every side on the same batch (LoRA
B starts at zero, so it is the base model's loss on that batch) must agree to
``--loss-rtol``; a mismatch means the jobs differ and the bench stops.

Each (side, vocab, quantization) runs in its own fresh process, so one side's
allocations cannot hide the other's: the child records its RSS after imports, resets
Linux's peak-RSS counter (``VmHWM``) and reports ``peak - baseline`` over loading and
training, plus wall and CPU seconds per step after ``--warmup`` steps. The children run in
rounds (fsdp_qlora, jax_lora, trl, fsdp_qlora, ...) so a shared machine's load hits all
sides alike; the figures are medians over rounds. Each trainer gets the environment the
local executor gives it (``trainer_env``; the JAX trainer also its host-device split),
TRL the plain environment.

    OMP_NUM_THREADS=2 .venv/bin/python bench/trainers_vs_trl.py [--rounds 2] [--steps 6]
        [--vocabs 32000,128256] [--quantization none,nf4]

Prints one JSON line per child and a summary table (markdown) to paste into RESULTS.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    add_llama_shape_args,
    build_llama,
    jax_lora_step,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

SIDES = ("fsdp_qlora", "jax_lora", "trl")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK, ALPHA, LR, CLIP = 8, 16.0, 1e-4, 1.0


def token_rows(n_rows: int, seq: int):
    """Rows of byte-range token ids and their completion-only labels (prompt half -100)."""
    import numpy as np

    ids = np.random.default_rng(0).integers(0, 256, size=(n_rows, seq), dtype=np.int64)
    labels = ids.copy()
    labels[:, : seq // 2] = -100
    return ids, labels


def step_batches(n_steps: int, batch: int, seq: int):
    """One :class:`trainers.common.data.Batch` per step: rows ``k*batch .. (k+1)*batch``."""
    import numpy as np

    from trainers.common.data import Batch

    ids, labels = token_rows(n_steps * batch, seq)
    out = []
    for k in range(n_steps):
        i, lab = ids[k * batch : (k + 1) * batch], labels[k * batch : (k + 1) * batch]
        ones = np.ones_like(i)
        out.append(Batch(i, lab, np.broadcast_to(np.arange(seq), i.shape).copy(), ones, ones.copy()))
    return out


class StepClock:
    """Wall and CPU seconds between consecutive ``tick`` calls."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def start(self) -> None:
        self._last = (time.perf_counter(), time.process_time())

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
        self._last = now


def run_fsdp_qlora(model_dir: Path, quantization: str, batches, clock: StepClock) -> list[float]:
    """The fsdp_qlora trainer: its streamed (optionally NF4) load + LoRA, then ``train_step``."""
    import torch

    from trainers.common.memory import return_freed_tensors_to_the_os
    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import build_optimizer, train_step

    return_freed_tensors_to_the_os()  # as the trainer's recipe does before its load
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    model, _ = build_model(ModelOptions(model_dir=model_dir, quantization=quantization, lora_r=RANK,
                                        lora_alpha=ALPHA, target_modules=TARGETS), ctx)
    opt = build_optimizer(model, learning_rate=LR, weight_decay=0.0)
    losses = []
    clock.start()
    for s, batch in enumerate(batches):
        stats = train_step(model, opt, [batch], ctx, step=s, seed=0, learning_rate=LR, max_grad_norm=CLIP)
        losses.append(stats.loss)
        clock.tick()
    return losses


def run_jax_lora(model_dir: Path, quantization: str, batches, clock: StepClock, host_devices: int) -> list[float]:
    """The jax_lora trainer's jitted step, on the host-device split a local job gets."""
    from trainers.jax_lora.host_devices import use_host_devices

    use_host_devices(host_devices)  # as the trainer does, before anything touches a device
    import jax
    import numpy as np

    from trainers.jax_lora.sharding import make_mesh
    from trainers.jax_lora.step import batch_sharding

    mesh = make_mesh(host_devices, 1, 1, devices=jax.devices()[:host_devices])
    train_step, state, params = jax_lora_step(model_dir, mesh, quantization, targets=TARGETS, rank=RANK, alpha=ALPHA,
                                              learning_rate=LR, max_grad_norm=CLIP)
    losses = []
    clock.start()
    for b in batches:
        host = {"input_ids": b.input_ids, "labels": b.labels, "positions": b.position_ids,
                "segment_ids": b.segment_ids}
        arrays = {k: np.asarray(v, np.int32)[None] for k, v in host.items()}  # (accum 1, rows, seq)
        batch = {k: jax.device_put(v, batch_sharding(mesh, v.shape)) for k, v in arrays.items()}
        state, out = train_step(state, params, batch)
        losses.append(float(out["loss"]))  # waits for the step
        clock.tick()
    return losses


def run_trl(model_dir: Path, quantization: str, batches, clock: StepClock, work: Path) -> list[float]:
    """TRL's SFTTrainer with a peft LoraConfig (and a bitsandbytes NF4 base for QLoRA)."""
    import numpy as np
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    quant = {} if quantization == "none" else {"device_map": "cpu", "quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **quant)
    ids = np.concatenate([b.input_ids for b in batches])
    mask = (np.concatenate([b.labels for b in batches]) != -100).astype(np.int64)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "completion_mask": mask.tolist()})
    args = SFTConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=len(batches[0].input_ids),
        gradient_accumulation_steps=1, max_steps=len(batches), learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch", max_length=ids.shape[1],
        completion_only_loss=True, packing=False, bf16=False, fp16=False, gradient_checkpointing=False,
        use_cpu=True, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )

    class Tick(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.start()

        def on_step_end(self, *a, **k):
            clock.tick()

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=None,
                         peft_config=LoraConfig(r=RANK, lora_alpha=int(ALPHA), lora_dropout=0.0,
                                                target_modules=list(TARGETS), task_type="CAUSAL_LM"),
                         callbacks=[Tick()])
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def child(side: str, model_dir: Path, quantization: str, steps: int, batch: int, seq: int, warmup: int,
          host_devices: int) -> None:
    """One side in this fresh process: imports, baseline RSS, then load + train, one JSON line."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if side == "trl":
        import datasets  # noqa: F401  (imported before the baseline is taken)
        import peft  # noqa: F401
        import trl  # noqa: F401
    if side == "jax_lora":
        from trainers.jax_lora.host_devices import use_host_devices

        use_host_devices(host_devices)
        import jax  # noqa: F401
    if quantization == "nf4" and side != "jax_lora":
        import bitsandbytes as bnb

        # bnb's first 4-bit op pulls in more code (torch._dynamo): load it before the baseline.
        packed, qstate = bnb.functional.quantize_4bit(torch.randn(64, 64), quant_type="nf4")
        bnb.functional.dequantize_4bit(packed, qstate)
    batches = step_batches(steps + warmup, batch, seq)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = rss_bytes()
        reset_peak_rss()
        t0 = time.perf_counter()
        if side == "fsdp_qlora":
            losses = run_fsdp_qlora(model_dir, quantization, batches, clock)
        elif side == "jax_lora":
            losses = run_jax_lora(model_dir, quantization, batches, clock, host_devices)
        else:
            losses = run_trl(model_dir, quantization, batches, clock, Path(tmp))
        total_s = time.perf_counter() - t0
        peak = peak_rss_bytes()
    wall, cpu = clock.wall[warmup:], clock.cpu[warmup:]
    print(json.dumps({
        "side": side, "quantization": quantization, "steps_timed": len(wall),
        "tokens_per_s": batch * seq / statistics.median(wall),
        "cpu_s_per_step": statistics.median(cpu), "wall_s_per_step": statistics.median(wall),
        "peak_rss_delta_mib": (peak - baseline) / 2**20, "baseline_rss_mib": baseline / 2**20,
        "total_s": total_s, "first_loss": losses[0], "losses": losses,
        "load_average": os.getloadavg()[0],
    }), flush=True)


def _child_env(side: str) -> dict[str, str]:
    from worker.executors.local.process import trainer_env

    return {**os.environ, **(trainer_env(side, dict(os.environ)) if side != "trl" else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_shape_args(p)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per child (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocabs", default="32000,128256")
    p.add_argument("--quantization", default="none,nf4", help="none (LoRA), nf4 (QLoRA), or both")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--loss-rtol", type=float, default=1e-4)
    p.add_argument("--child", nargs=3, metavar=("SIDE", "MODEL_DIR", "QUANTIZATION"))
    p.add_argument("--host-devices", type=int, default=1)
    args = p.parse_args()
    if args.child:
        side, model_dir, quantization = args.child
        child(side, Path(model_dir), quantization, args.steps, args.batch, args.seq, args.warmup, args.host_devices)
        return
    from worker.spec_builder import cpu_host_devices, local_trainer_cores

    # What build_spec gives a 1-slot JAX job with this batch on the local pool.
    host_devices = cpu_host_devices(local_trainer_cores(1), args.batch)
    sides = args.sides.split(",")
    quants = args.quantization.split(",")
    rows: dict[tuple[int, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dirs = {vocab: build_llama(Path(tmp) / f"v{vocab}", args, vocab,
                                         max_position_embeddings=max(512, args.seq))
                      for vocab in (int(v) for v in args.vocabs.split(","))}
        # Rounds outermost: every round covers every row, so an interrupted run still has whole rounds.
        for rnd in range(args.rounds):
            for vocab, model_dir in model_dirs.items():
                for q in quants:
                    for side in sides:
                        cmd = [sys.executable, __file__, "--child", side, str(model_dir), q,
                               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                               "--seq", str(args.seq), "--host-devices", str(host_devices)]
                        out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_child_env(side))
                        if out.returncode:
                            sys.exit(f"{side} {q} vocab {vocab} failed:\n{out.stderr[-4000:]}")
                        row = json.loads(out.stdout.strip().splitlines()[-1])
                        row.update(vocab=vocab, round=rnd)
                        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
                        rows.setdefault((vocab, q, side), []).append(row)
                    first = {s: rows[(vocab, q, s)][-1]["first_loss"] for s in sides}
                    ref = first[sides[-1]]
                    if any(abs(v - ref) > args.loss_rtol * abs(ref) for v in first.values()):
                        sys.exit(f"step-1 losses differ (vocab {vocab}, {q}): {first}: the jobs are not the same")
    print(summary(rows, sides, args, host_devices))


def summary(rows, sides, args, host_devices: int) -> str:
    """A markdown table: per vocab and quantization, each trainer's medians and its ratios to TRL."""
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("tokens_per_s", "peak_rss_delta_mib",
                                                                "cpu_s_per_step", "first_loss", "load_average")}
           for k, v in rows.items()}
    head = (f"h{args.hidden} L{args.layers} ffn{args.ffn}, seq {args.seq} x batch {args.batch}, LoRA r{RANK} "
            f"q/k/v/o, fp32, {args.steps} timed steps after {args.warmup}, median of {args.rounds} rounds; "
            f"jax_lora on {host_devices} host device(s); OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")
    columns = ("| vocab | base | side | tok/s | CPU s/step | peak RSS delta MiB | step-1 loss | load avg "
               "| tok/s vs TRL | memory vs TRL |")
    lines = [head, "", columns, "|---|---|---|---|---|---|---|---|---|---|"]
    for (vocab, q, side), m in sorted(med.items(), key=lambda kv: (kv[0][0], kv[0][1], sides.index(kv[0][2]))):
        trl = med.get((vocab, q, "trl"))
        ratios = ("-", "-") if trl is None or side == "trl" else (
            f"**{m['tokens_per_s'] / trl['tokens_per_s']:.2f}x**",
            f"**{m['peak_rss_delta_mib'] / trl['peak_rss_delta_mib']:.2f}x**")
        lines.append(f"| {vocab:,} | {'NF4' if q == 'nf4' else 'fp32'} | {side} | {m['tokens_per_s']:,.0f} | "
                     f"{m['cpu_s_per_step']:.2f} | {m['peak_rss_delta_mib']:,.0f} | {m['first_loss']:.5f} | "
                     f"{m['load_average']:.1f} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
