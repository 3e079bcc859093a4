"""Estimator vs the measured peak host memory of OUR trainers on CPU (goal: within +-15 %).

Each configuration runs the real trainer entry point, ``python -m trainers --spec``, in a
fresh process for 2 optimizer steps on a random Llama of the given shape. The trainers
report ``memory_bytes`` with every metric: on CPU that is the process's peak RSS
(``VmHWM``, ``trainers.common.memory.peak_rss_bytes``), which covers the interpreter and
libraries, loading, and both steps. It is compared with
``scheduling.estimator.memory_per_gpu(..., accelerator="cpu")`` for the same shape
and the settings the trainer runs with: fp32 base/compute/adapter (what
``worker.spec_builder`` gives CPU pools), NF4 for QLoRA, activation checkpointing off
(the CPU setting) and on.

Every row of the training data is longer than ``seq`` (truncated to it) and all but a few
prompt tokens are labels, so each micro batch is ``batch x seq`` tokens, as the estimator
assumes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scheduler_estimator_cpu.py [--trainers fsdp_qlora,jax_lora]
        [--shapes 0,1,2,3] [--return-freed]

``jax_lora`` runs on one host device, remat per layer or none, with an fp32 or NF4 base.
``--return-freed`` runs the trainers with ``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor its
own mmap, unmapped when freed), so the peak is the live tensors' plus the framework's; the
difference to a default run is what glibc's heap retains (the estimator's CPU slack). The
torch trainer fixes the threshold itself (``trainers.common.memory``), so for it the flag
changes little; the ``slack`` column is the estimator's slack term.
The CPU-only constants of the estimator (fp32 activations, heap retention, framework)
were fitted on shapes 0-2; shape 3 was not used to fit them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from scheduling.estimator import ModelShape, TrainingShape, memory_per_gpu

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
VOCAB = 512
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
R = 8


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    seq: int
    batch: int
    heads: int = 8
    kv_heads: int = 4

    @property
    def model(self) -> ModelShape:
        return ModelShape(self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate, VOCAB)

    @property
    def label(self) -> str:
        return f"h{self.hidden} L{self.layers} ffn{self.intermediate} seq{self.seq} b{self.batch}"


# Activation-dominated shapes (the earlier benchmark's), a weight-dominated one (~110 M
# parameters: 420 MiB in fp32, where NF4 matters), and a held-out one between them.
SHAPES = (Shape(256, 4, 1024, 256, 4), Shape(512, 4, 1408, 512, 4), Shape(1024, 8, 2816, 128, 1, 16, 16),
          Shape(768, 6, 2048, 256, 2, 12, 4))


def write_model(shape: Shape, root: Path) -> Path:
    from trainers.common.tiny_model import build_tiny_llama

    out = root / f"model-{shape.hidden}-{shape.layers}"
    if not out.exists():
        # bf16 on disk like a published checkpoint; the CPU trainers load it as fp32.
        build_tiny_llama(out, hidden_size=shape.hidden, num_layers=shape.layers, num_heads=shape.heads,
                         num_kv_heads=shape.kv_heads, intermediate_size=shape.intermediate, vocab_size=VOCAB,
                         max_position_embeddings=max(512, shape.seq), dtype="bfloat16", max_shard_size="64MB")
    return out


def write_data(shape: Shape, root: Path) -> Path:
    """Rows of one short prompt and a completion longer than ``seq`` bytes (byte tokenizer)."""
    path = root / f"train-{shape.seq}.jsonl"
    text = "abcdefghij klmnopqrst " * (shape.seq // 10 + 4)
    rows = [{"prompt": f"{i}", "completion": text[i:]} for i in range(4 * shape.batch)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_trainer(trainer: str, shape: Shape, quantization: str, checkpointing: bool, root: Path,
                env: dict[str, str] | None = None) -> int:
    """Peak RSS (bytes) our trainer reports at its second step, from a fresh process."""
    run = root / f"{trainer}-{shape.hidden}-{quantization}-{int(checkpointing)}"
    parallelism: dict = {"activation_checkpointing": "non_reentrant" if checkpointing else "none"}
    if trainer == "jax_lora":
        parallelism = {"remat": "per_layer" if checkpointing else "none", "host_devices": 1,
                       "mesh": {"data": 1, "fsdp": 1, "tensor": 1}}
    spec = {
        "job_id": f"ftjob-mem-{run.name}", "trainer": trainer,
        "model": {"path": str(write_model(shape, root))},
        "data": {"train_file": str(write_data(shape, root)), "format": "prompt_completion",
                 "max_seq_len": shape.seq, "shuffle": False},
        "hyperparameters": {"n_epochs": 1, "batch_size": shape.batch, "micro_batch_size": shape.batch,
                            "learning_rate": 1e-4, "max_steps": 2},
        "adapter": {"method": "qlora" if quantization != "none" else "lora", "quantization": quantization,
                    "r": R, "alpha": 16.0, "target_modules": list(TARGETS)},
        "parallelism": parallelism,
        "precision": {"base_dtype": "float32", "compute_dtype": "float32", "adapter_dtype": "float32"},
        "output_dir": str(run / "output"),
        "checkpoint": {"dir": str(run / "checkpoints"), "every_n_steps": 1000, "keep_last": 1},
        "seed": 0,
    }
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    subprocess.run([sys.executable, "-m", "trainers", "--spec", str(run / "spec.json")], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    reports = [json.loads(line) for line in (run / "checkpoints" / "reports.jsonl").read_text().splitlines()]
    metrics = [r for r in reports if r.get("type") == "metric" and r.get("step") == 2]
    return int(metrics[-1]["memory_bytes"])


def predicted(trainer: str, shape: Shape, quantization: str, checkpointing: bool) -> tuple[int, int]:
    """The estimator's total for one process, and the part of it that is allocator slack."""
    training = TrainingShape(method="qlora" if quantization != "none" else "lora", quantization=quantization,
                             r=R, target_modules=TARGETS, seq_len=shape.seq, micro_batch=shape.batch,
                             checkpointing=checkpointing, cpu_offload="never", compute_bytes=4)
    mem = memory_per_gpu(shape.model, training, 1, accelerator="cpu", trainer=trainer)
    return mem.total, mem.slack


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainers", default="fsdp_qlora", help="fsdp_qlora and/or jax_lora, comma-separated")
    p.add_argument("--return-freed", action="store_true", help="malloc returns freed tensors (live peak)")
    p.add_argument("--shapes", default="0,1,2,3", help="indices into SHAPES")
    args = p.parse_args()
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"} if args.return_freed else None
    trainers = args.trainers.split(",")
    runs = [("fsdp_qlora", q, c) for q in ("none", "nf4") for c in (False, True)] if "fsdp_qlora" in trainers else []
    if "jax_lora" in trainers:
        runs += [("jax_lora", q, c) for q in ("none", "nf4") for c in (False, True)]
    print(f"{'trainer':11s} {'shape':32s} {'quant':5s} {'ckpt':>5s} {'predicted':>10s} {'measured':>10s} "
          f"{'error':>7s} {'slack':>8s} {'error without slack':>20s}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            for trainer, quant, ckpt in runs:
                peak = run_trainer(trainer, shape, quant, ckpt, Path(tmp), env)
                pred, slack = predicted(trainer, shape, quant, ckpt)
                print(f"{trainer:11s} {shape.label:32s} {quant:5s} {ckpt!s:>5s} {pred / MIB:>6.0f} MiB "
                      f"{peak / MIB:>6.0f} MiB {pred / peak - 1:>+7.1%} {slack / MIB:>4.0f} MiB "
                      f"{(pred - slack) / peak - 1:>+20.1%}",
                      flush=True)


if __name__ == "__main__":
    main()
