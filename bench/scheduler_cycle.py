"""Benchmark: one scheduling cycle with 10,000 queued jobs over 1,000 nodes in two pools.

The pure in-memory cycle (``plan_cycle``: ordering with fair share, estimator,
placement with gang allocation, reservations) on an empty cluster of 200 nodes of
8x MI300X and 800 nodes of 2x RTX 4090 (3,200 GPUs), with a job mix of 7B/8B QLoRA,
70B QLoRA/LoRA and 405B LoRA from 50 tenants. Prints cycle time and admissions/s
(Kueue's own performance test admits ~43 workloads/s; our goal is >= 1,000/s).

    OMP_NUM_THREADS=1 .venv/bin/python bench/scheduler_cycle.py
"""

from __future__ import annotations

import random
import statistics
import time

from scheduling.capacity import CapacitySnapshot
from scheduling.estimator import TrainingShape
from scheduling.model_shapes import KNOWN_MODELS
from scheduling.pools import GIB, NodePool
from scheduling.request import JobRequest
from worker.scheduler.cycle import plan_cycle

MIX = [  # (weight, model, method, quantization, seq)
    (40, "llama-2-7b", "qlora", "nf4", 2048),
    (30, "llama-3.1-8b", "qlora", "nf4", 2048),
    (10, "llama-3.1-8b", "lora", "none", 2048),
    (10, "llama-3.1-70b", "qlora", "nf4", 2048),
    (8, "llama-3.1-70b", "lora", "none", 2048),
    (2, "llama-3.1-405b", "lora", "none", 2048),
]


def pools(mi300x_nodes: int = 200, rtx4090_nodes: int = 800) -> list[NodePool]:
    """The scheduler benches' two pools (this one's 1,000 nodes by default): nodes of
    8x MI300X for jax_lora and of 2x RTX 4090 for fsdp_qlora, in that config order."""
    return [
        NodePool(name="mi300x", accelerator="amd-mi300x", gpu_memory_bytes=192 * GIB, gpus_per_node=8,
                 resource_name="amd.com/gpu", trainers=("jax_lora",), price_per_gpu_hour=3.0,
                 max_nodes_per_job=4, peak_tflops=1307, nodes=mi300x_nodes),
        NodePool(name="rtx4090", accelerator="nvidia-rtx-4090", gpu_memory_bytes=24 * GIB, gpus_per_node=2,
                 resource_name="nvidia.com/gpu", trainers=("fsdp_qlora",), price_per_gpu_hour=0.4,
                 max_nodes_per_job=4, peak_tflops=165, nodes=rtx4090_nodes),
    ]


def jobs(n: int, seed: int = 0) -> list[JobRequest]:
    rng = random.Random(seed)
    weights = [m[0] for m in MIX]
    out = []
    for i in range(n):
        _, model, method, quant, seq = rng.choices(MIX, weights)[0]
        out.append(JobRequest(
            job_id=f"ftjob-{i:06d}", tenant=f"org-{rng.randrange(50)}", model=KNOWN_MODELS[model],
            training=TrainingShape(method=method, quantization=quant, seq_len=seq),
            priority=rng.choice([25, 50, 50, 50, 75]), created_at=float(i),
            total_tokens=rng.randrange(1, 50) * 1_000_000))
    return out


def main(repeats: int = 3) -> None:
    queued = jobs(10_000)
    snap = CapacitySnapshot.from_pools(pools())
    times, admitted = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_cycle(queued, snap, now=0.0)
        times.append(time.perf_counter() - t0)
        admitted = len(plan.admissions)
    t = statistics.median(times)
    used = sum(a.placement.gpus for a in plan.admissions)
    print("queued 10000 jobs, 1000 nodes (200x 8 MI300X + 800x 2 RTX 4090 = 3200 GPUs)")
    print(f"cycle time: median {t:.3f} s over {repeats} runs (min {min(times):.3f}, max {max(times):.3f})")
    print(f"admitted {admitted} jobs using {used} GPUs; waiting {len(plan.waiting)}; "
          f"reservations on {len(plan.reservations)} nodes")
    print(f"admissions/s: {admitted / t:,.0f}   (jobs considered/s: {10_000 / t:,.0f})")


if __name__ == "__main__":
    main()
