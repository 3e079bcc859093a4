"""Estimator vs measured peak RSS of a real transformers+peft LoRA step on CPU (fp32).

Each shape runs in a fresh process (bench/measure_peak.py, peak = VmHWM), with and without
activation checkpointing (the CPU trainer runs without it). Goal: within +-15 %.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scheduler_estimator_cpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from worker.scheduler.estimator import ModelShape, TrainingShape, memory_per_gpu

MEASURE = Path(__file__).resolve().parent / "measure_peak.py"
MIB = 2**20


def main() -> None:
    print(f"{'shape':34s} {'ckpt':>5s} {'predicted':>10s} {'measured':>10s} {'error':>7s}")
    for hidden, inter, seq, batch in [(256, 1024, 256, 4), (512, 1408, 512, 4)]:
        for ckpt in (False, True):
            cfg = dict(hidden=hidden, layers=4, heads=8, kv_heads=4, intermediate=inter, vocab=512, r=8,
                       targets=["q_proj", "k_proj", "v_proj", "o_proj"], batch=batch, seq=seq, checkpointing=ckpt)
            out = subprocess.run([sys.executable, str(MEASURE), json.dumps(cfg)], capture_output=True, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
            mem = memory_per_gpu(ModelShape(hidden, 4, 8, 4, inter, 512),
                                 TrainingShape(seq_len=seq, micro_batch=batch, r=8, compute_bytes=4,
                                               checkpointing=ckpt, cpu_offload="never"), 1, accelerator="cpu")
            shape = f"h{hidden} L4 ffn{inter} seq{seq} batch{batch}"
            print(f"{shape:34s} {ckpt!s:>5s} {mem.total / MIB:>7.0f} MiB {peak / MIB:>7.0f} MiB "
                  f"{mem.total / peak - 1:>+7.1%}")


if __name__ == "__main__":
    main()
