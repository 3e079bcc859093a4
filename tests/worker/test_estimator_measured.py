"""The estimator against measured peaks of a real training step on this machine (CPU).

``measure_peak.py`` runs transformers + peft (random Llama, LoRA r=8 on q/k/v/o, fp32,
AdamW, two steps) in a fresh process and reports its peak RSS. The torch trainer runs
exactly this configuration on the CPU ``local`` pool (fp32, no activation
checkpointing: worker/spec_builder.py), so the estimate the scheduler uses there -- the
total including the interpreter and libraries -- must be within 15 % of the measurement.
Run with ``-s`` to see predicted vs measured.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.scheduler.estimator import ModelShape, TrainingShape, memory_per_gpu

MEASURE = Path(__file__).with_name("measure_peak.py")
MIB = 2**20


# One shape here (a fresh torch+transformers+peft process costs ~10 s on 2 shared cores);
# bench/scheduler_estimator_cpu.py measures more shapes.
@pytest.mark.parametrize("hidden, intermediate, seq, batch", [(256, 1024, 256, 4)])
def test_cpu_peak_within_15_percent(hidden, intermediate, seq, batch):
    cfg = dict(hidden=hidden, layers=4, heads=8, kv_heads=4, intermediate=intermediate, vocab=512, r=8,
               targets=["q_proj", "k_proj", "v_proj", "o_proj"], batch=batch, seq=seq, checkpointing=False)
    out = subprocess.run([sys.executable, str(MEASURE), json.dumps(cfg)], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    mem = memory_per_gpu(ModelShape(hidden, 4, 8, 4, intermediate, 512),
                         TrainingShape(seq_len=seq, micro_batch=batch, r=8, compute_bytes=4, checkpointing=False,
                                       cpu_offload="never"), 1, accelerator="cpu")
    err = mem.total / measured["peak"] - 1
    print(f"\nh{hidden} seq {seq} batch {batch}: predicted {mem.total / MIB:.0f} MiB "
          f"(tensors {mem.model_bytes / MIB:.0f}), measured peak RSS {measured['peak'] / MIB:.0f} MiB "
          f"(tensors {measured['delta'] / MIB:.0f}): error {err:+.1%}")
    assert abs(err) <= 0.15
