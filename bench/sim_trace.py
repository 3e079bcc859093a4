"""Trace simulation: our scheduling policy vs FIFO first-fit on the same simulated clock.

Cluster: 4 nodes of 8x MI300X (jax_lora) + 32 nodes of 2x RTX 4090 (fsdp_qlora).
Trace: 2,000 jobs (seeded) mixing 7B/8B QLoRA and LoRA, 70B QLoRA and LoRA, 405B LoRA,
from 8 tenants, 10 % high priority, Poisson arrivals ~3x faster than the cluster could serve them at best (a
queue builds up, as on a busy shared cluster).

Ground truth per job (the same for both policies): the true peak memory is the
estimator's figure times an error factor, and the true speed is the estimator's
tokens/s times a log-normal factor (sigma 0.25). A job placed where its true memory
exceeds the GPU's OOMs after 5 minutes (the GPUs are held meanwhile) and is requeued.
Two error models for memory (third argument):

- ``fitted`` (default): log-normal, fitted to the published peak / estimate ratio of
  every published GPU anchor (``measured_over_predicted``: the 10 rows of
  tests/worker/test_estimator_anchors.py, computed from the estimator as it is). It has
  tails: a job the estimator sized near the 84 % headroom limit can still OOM, so
  "0 OOM placements" is a result here, not a given.
- ``uniform``: a factor in [0.88, 1.18], the anchors' spread only. With the estimator's
  84 % headroom (0.84 x 1.18 < 1) our policy cannot OOM by construction under it.

``--four-bit-share`` rescales the mix so 4-bit jobs are that fraction of the trace (MIX
as written: 60 %). Which pools a job may use follows the scheduler's ``trainer_for``: the
mix's 4-bit jobs are NF4 without double quantization, which both trainers train (jax_lora
on MI300X, fsdp_qlora on RTX 4090); an HQQ or double-quantized base would be 4090-only.

- ours: ``plan_cycle`` every simulated minute (priority, fair share, estimator-sized
  gangs, cost-aware pool choice, backfill with a reservation, preemption with a 60 s
  checkpoint); after an OOM the job is pinned to the next larger GPU count of its pool,
  as the service does (``worker.outcomes.requeue_after_oom``).
- FIFO first-fit: strict arrival order, the head blocks the queue; the first pool (in
  config order) with a trainer that can run the job (``trainer_for``, as for ours) and a
  free gang of the *naive* size (weights only: parameters x bytes per parameter / GPU
  memory); after an OOM the job retries with twice the GPUs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sim_trace.py [jobs] [seed] [fitted|uniform]
        [--four-bit-share F] [--no-plot]            # writes bench/sim_trace.png
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

# scheduler_cycle is bench/scheduler_cycle.py (a script's own folder is on sys.path).
from scheduler_cycle import pools

from scheduling.capacity import CapacitySnapshot, RunningJob
from scheduling.estimator import (
    TrainingShape,
    candidate_gpu_counts,
    estimate_on_pool,
    memory_per_gpu,
)
from scheduling.model_shapes import KNOWN_MODELS
from scheduling.placement import estimate_for, trainer_for
from scheduling.pools import GIB, NodePool
from scheduling.request import JobRequest
from worker.scheduler.cycle import CycleConfig, plan_cycle

TICK_S = 60.0
OBJECTIVE = "cost"
OOM_AFTER_S = 300.0
CHECKPOINT_S = 60.0

def measured_over_predicted() -> list[float]:
    """Published peak / the estimator's figure for every published GPU anchor
    (``tests/worker/test_estimator_anchors.py``: Answer.AI 7B QLoRA/LoRA at several batch
    sizes, 70B QLoRA+offload, torchtune 8B QLoRA/LoRA), computed from the estimator as it
    is now. Only GPU figures: the simulated pools are GPUs, and our CPU peaks measure the
    CPU accounting (own constants, bench/scheduler_estimator_cpu.py)."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)  # the tests package, outside the installed ones
    from tests.worker.test_estimator_anchors import MEMORY_ANCHORS

    return [published * GIB / memory_per_gpu(KNOWN_MODELS[model], training, gpus,
                                             accelerator="nvidia-rtx-4090", offload=offload).model_bytes
            for _source, model, training, gpus, offload, published in MEMORY_ANCHORS]


def memory_error(rng: random.Random, model: str, log_fit: tuple[float, float]) -> float:
    """The true / estimated memory factor of one job; ``log_fit``: (mean, sigma) of the
    fitted log-normal."""
    if model == "uniform":
        return rng.uniform(0.88, 1.18)
    return math.exp(rng.gauss(*log_fit))


MIX = [  # weight, model, method, quantization (nf4: no double quant), seq, tokens range (millions)
    (30, "llama-2-7b", "qlora", "nf4", 2048, (2, 20)),
    (20, "llama-3.1-8b", "qlora", "nf4", 2048, (2, 20)),
    (15, "llama-3.1-8b", "lora", "none", 2048, (2, 20)),
    (15, "llama-2-7b", "lora", "none", 4096, (2, 10)),
    (10, "llama-3.1-70b", "qlora", "nf4", 2048, (1, 5)),
    (7, "llama-3.1-70b", "lora", "none", 2048, (1, 5)),
    (3, "llama-3.1-405b", "lora", "none", 2048, (0.5, 2)),
]


@dataclass
class SimJob:
    req: JobRequest
    arrival: float
    tokens: float
    mem_factor: float
    speed_factor: float
    done_tokens: float = 0.0
    start: float | None = None
    end: float | None = None  # when the current run ends (finish, OOM or checkpoint done)
    finish: float | None = None
    first_start: float | None = None
    run_tps: float = 0.0
    oom: bool = False
    stopping: bool = False
    ooms: int = 0
    preemptions: int = 0
    pool: str = ""
    gpus: int = 0
    nodes: tuple = ()


def mix_weights(four_bit_share: float | None) -> list[float]:
    """``MIX``'s weights, or rescaled so that 4-bit jobs are ``four_bit_share`` of the trace
    (each kind keeps its weight within its group)."""
    weights = [float(m[0]) for m in MIX]
    if four_bit_share is None:
        return weights
    four_bit = [m[3] != "none" for m in MIX]
    total_4, total_16 = (sum(w for w, q in zip(weights, four_bit, strict=True) if q == want) for want in (True, False))
    return [w * (four_bit_share / total_4 if q else (1 - four_bit_share) / total_16)
            for w, q in zip(weights, four_bit, strict=True)]


def make_trace(n: int, seed: int, cluster: list[NodePool], load: float = 3.0,
               memory_model: str = "fitted", four_bit_share: float | None = None) -> list[SimJob]:
    rng = random.Random(seed)
    # Memory errors from their own stream: both error models get the same jobs and arrivals.
    mem_rng = random.Random(f"memory-{seed}")
    logs = [math.log(r) for r in measured_over_predicted()]
    log_fit = (statistics.fmean(logs), statistics.stdev(logs))  # once per trace, not per job
    jobs: list[SimJob] = []
    weights = mix_weights(four_bit_share)
    for i in range(n):
        _, model, method, quant, seq, (lo, hi) = rng.choices(MIX, weights)[0]
        tokens = rng.uniform(lo, hi) * 1e6
        req = JobRequest(job_id=f"j{i:05d}", tenant=f"org-{rng.randrange(8)}", model=KNOWN_MODELS[model],
                         training=TrainingShape(method=method, quantization=quant, seq_len=seq),
                         priority=75 if rng.random() < 0.1 else 50, created_at=0.0)
        jobs.append(SimJob(req, 0.0, tokens, memory_error(mem_rng, memory_model, log_fit),
                           math.exp(rng.gauss(0, 0.25))))
    # Offered load ~100 %: spread arrivals so total work / capacity ~= the arrival span.
    work = 0.0
    for j in jobs:
        ests = [estimate_on_pool(j.req.model, j.req.training, p, trainer=trainer)
                for p in cluster if (trainer := trainer_for(j.req, p)) is not None]
        best = max(e.tokens_per_s / max(1, e.gpus) for e in ests if e.fits)
        work += j.tokens / best  # GPU-seconds on its best pool
    total_gpus = sum(p.nodes * p.gpus_per_node for p in cluster)
    span = work / total_gpus / load  # arrivals faster than the cluster drains: a queue builds up
    t = 0.0
    for j in jobs:
        t += rng.expovariate(n / span)
        j.arrival = t
        j.req = replace(j.req, created_at=t)
    return jobs


def true_memory(j: SimJob, pool: NodePool, gpus: int, offload: bool, trainer: str) -> float:
    return memory_per_gpu(j.req.model, j.req.training, gpus, accelerator=pool.accelerator,
                          offload=offload, trainer=trainer).total * j.mem_factor


class Sim:
    def __init__(self, jobs: list[SimJob], cluster: list[NodePool], policy: str) -> None:
        self.jobs = [replace(j) for j in jobs]
        self.pools = {p.name: p for p in cluster}
        self.snap = CapacitySnapshot.from_pools(cluster)
        self.policy = policy
        self.queue: list[SimJob] = []
        self.running: dict[str, SimJob] = {}
        self.total_gpus = sum(p.nodes * p.gpus_per_node for p in cluster)
        self.busy_gpu_s = 0.0
        self.useful_gpu_s = 0.0
        self.waiting_busy = [0.0, 0.0]  # (allocated GPU-s, capacity GPU-s) while jobs wait
        self.waiting_unusable_idle = 0.0  # idle GPU-s of pools no waiting job can run on
        self.oom_placements = 0
        self.timeline: list[tuple[float, float]] = []
        self.config = CycleConfig(objective=OBJECTIVE)

    # --- events ------------------------------------------------------------------------
    def _release(self, j: SimJob, t: float) -> None:
        self.snap.release(j.req.job_id)
        del self.running[j.req.job_id]

    def _progress(self, j: SimJob, t: float) -> None:
        if j.start is not None and not j.oom:
            j.done_tokens = min(j.tokens, j.done_tokens + (t - j.start) * j.run_tps)

    def step_ends(self, t: float) -> None:
        for j in list(self.running.values()):
            if j.end is not None and j.end <= t:
                if j.oom:
                    j.ooms += 1
                    self._requeue_after_oom(j)
                elif j.stopping:
                    j.preemptions += 1
                    j.stopping = False
                else:
                    j.done_tokens = j.tokens
                    j.finish = j.end
                self._release(j, j.end)
                if j.finish is None:
                    j.start = j.end = None
                    j.oom = False
                    self.queue.append(j)

    def _requeue_after_oom(self, j: SimJob) -> None:
        pool = self.pools[j.pool]
        if self.policy == "ours":  # learn: the next larger gang on that pool
            counts = candidate_gpu_counts(pool)
            bigger = [c for c in counts if c > j.gpus]
            j.req = replace(j.req, gpus=bigger[0] if bigger else None, pool=j.pool if bigger else None)
        else:  # what a user of a naive scheduler does: ask for twice the GPUs
            j.req = replace(j.req, gpus=j.gpus * 2)
            if all(j.gpus * 2 > p.gpus_per_node * p.max_nodes_per_job for p in self.pools.values()):
                j.req = replace(j.req, gpus=None)  # cannot grow: start over with the naive size

    def start(self, j: SimJob, pool: NodePool, trainer: str, gpus: int, nodes: tuple, t: float, offload: bool,
              est_tps: float, est_eta: float | None) -> None:
        j.pool, j.gpus, j.nodes, j.start = pool.name, gpus, nodes, t
        j.first_start = j.first_start if j.first_start is not None else t
        if true_memory(j, pool, gpus, offload, trainer) > pool.gpu_memory_bytes:
            self.oom_placements += 1
            j.oom, j.end, j.run_tps = True, t + OOM_AFTER_S, 0.0
        else:
            j.run_tps = est_tps * j.speed_factor
            j.end = t + (j.tokens - j.done_tokens) / j.run_tps
        self.running[j.req.job_id] = j
        self.snap.allocate(RunningJob(j.req.job_id, j.req.tenant, pool.name, j.req.priority, t, nodes,
                                      expected_end=(t + est_eta) if est_eta else None))

    # --- policies ----------------------------------------------------------------------
    def schedule_ours(self, t: float) -> None:
        reqs = []
        by_id = {}
        for j in self.queue:
            remaining = max(1, int(j.tokens - j.done_tokens))
            r = replace(j.req, total_tokens=remaining)
            reqs.append(r)
            by_id[r.job_id] = j
        plan = plan_cycle(reqs, self.snap, now=t, config=self.config)
        for pre in plan.preemptions:
            v = self.running[pre.victim_id]
            if not v.stopping and not v.oom:
                self._progress(v, t)
                v.stopping, v.end, v.run_tps = True, t + CHECKPOINT_S, 0.0
                v.start = t
                self.snap.mark_stopping(v.req.job_id)
        for adm in plan.admissions:
            j = by_id[adm.job.job_id]
            self.queue.remove(j)
            est = adm.placement.estimate
            self.start(j, self.pools[adm.placement.pool], adm.placement.trainer, adm.placement.gpus,
                       adm.placement.nodes, t, adm.placement.offload, est.tokens_per_s, est.eta_s)

    def naive_gpus(self, j: SimJob, pool: NodePool) -> int | None:
        if j.req.gpus:  # after an OOM: the smallest valid gang with at least that many GPUs
            return next((c for c in candidate_gpu_counts(pool) if c >= j.req.gpus), None)
        bpp = 2.0 if j.req.training.quantization == "none" else 0.5
        need = j.req.model.params * bpp
        for n in candidate_gpu_counts(pool):
            if need / n <= pool.gpu_memory_bytes:
                return n
        return None

    def schedule_fifo(self, t: float) -> None:
        from scheduling.placement import gang_nodes

        self.queue.sort(key=lambda j: j.arrival)
        while self.queue:
            j = self.queue[0]
            placed = False
            for pool in self.pools.values():
                trainer = trainer_for(j.req, pool)
                if trainer is None:  # e.g. an HQQ base on a JAX-only pool: no scheduler can
                    continue
                n = self.naive_gpus(j, pool)
                if n is None:
                    continue
                nodes = gang_nodes(pool, self.snap, n)
                if nodes is None:
                    continue
                est = estimate_for(replace(j.req, gpus=n, pool=pool.name), pool, trainer)
                tps = est.tokens_per_s if est.fits else (estimate_on_pool(
                    j.req.model, j.req.training, pool, gpus=n, trainer=trainer).tokens_per_s or
                    n * pool.peak_tflops * 1e12 * 0.4 / (6 * j.req.model.params))
                if tps <= 0:
                    from scheduling.estimator import flops_per_token
                    tps = n * pool.peak_tflops * 1e12 * 0.4 / flops_per_token(j.req.model, j.req.training)
                self.queue.pop(0)
                self.start(j, pool, trainer, n, nodes, t, False, tps, None)
                placed = True
                break
            if not placed:
                return  # head-of-line blocking

    # --- run ---------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        pending = sorted(self.jobs, key=lambda j: j.arrival)
        i, t = 0, 0.0
        while i < len(pending) or self.queue or self.running:
            t += TICK_S
            while i < len(pending) and pending[i].arrival <= t:
                self.queue.append(pending[i])
                i += 1
            self.step_ends(t)
            if self.queue:
                (self.schedule_ours if self.policy == "ours" else self.schedule_fifo)(t)
            allocated = sum(j.gpus for j in self.running.values())
            useful = sum(j.gpus for j in self.running.values() if not j.oom and not j.stopping)
            self.busy_gpu_s += allocated * TICK_S
            self.useful_gpu_s += useful * TICK_S
            if self.queue:
                self.waiting_busy[0] += useful * TICK_S
                self.waiting_busy[1] += self.total_gpus * TICK_S
                # Idle GPUs of pools that no waiting job's trainer can run on: no policy
                # could use them at this moment (e.g. only HQQ jobs wait, MI300X is free).
                unusable = [p for p in self.pools.values()
                            if not any(trainer_for(j.req, p) for j in self.queue)]
                for pool in unusable:
                    held = sum(j.gpus for j in self.running.values() if j.pool == pool.name)
                    self.waiting_unusable_idle += (pool.nodes * pool.gpus_per_node - held) * TICK_S
            self.timeline.append((t, useful / self.total_gpus))
            if t > 400 * 24 * 3600:
                raise RuntimeError("simulation did not converge")
        jct = [j.finish - j.arrival for j in self.jobs]
        waits = [j.first_start - j.arrival for j in self.jobs]
        makespan = max(j.finish for j in self.jobs)
        return {
            "mean_jct_h": statistics.mean(jct) / 3600, "p95_jct_h": sorted(jct)[int(0.95 * len(jct))] / 3600,
            "max_wait_h": max(waits) / 3600, "makespan_h": makespan / 3600,
            "util_overall": self.useful_gpu_s / (self.total_gpus * makespan),
            "util_while_waiting": self.waiting_busy[0] / max(1.0, self.waiting_busy[1]),
            "util_usable_while_waiting": self.waiting_busy[0]
            / max(1.0, self.waiting_busy[1] - self.waiting_unusable_idle),
            "oom_placements": self.oom_placements,
            "preemptions": sum(j.preemptions for j in self.jobs),
            "jct": jct,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jobs", nargs="?", type=int, default=2000)
    parser.add_argument("seed", nargs="?", type=int, default=7)
    parser.add_argument("memory_model", nargs="?", choices=("fitted", "uniform"), default="fitted")
    parser.add_argument("--four-bit-share", type=float, default=None,
                        help="fraction of 4-bit (QLoRA) jobs in the trace; default: MIX as written (0.6)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    n, seed, memory_model = args.jobs, args.seed, args.memory_model
    cluster = pools(mi300x_nodes=4, rtx4090_nodes=32)
    t0 = time.perf_counter()
    trace = make_trace(n, seed, cluster, memory_model=memory_model, four_bit_share=args.four_bit_share)
    results = {}
    for policy in ("ours", "fifo"):
        sim = Sim(trace, cluster, policy)
        results[policy] = (sim.run(), sim.timeline)
    ours, fifo = results["ours"][0], results["fifo"][0]
    share = sum(j.req.training.quantization != "none" for j in trace) / n  # as mix_weights counts 4-bit
    print(f"trace: {n} jobs ({share:.0%} 4-bit), seed {seed}, memory error model {memory_model}, "
          f"cluster 4x8 MI300X + 32x2 RTX 4090 "
          f"(simulated in {time.perf_counter() - t0:.0f} s)")
    print(f"{'metric':28s} {'ours':>10s} {'FIFO first-fit':>15s}")
    for key, label in [("mean_jct_h", "mean JCT (h)"), ("p95_jct_h", "p95 JCT (h)"), ("max_wait_h", "max wait (h)"),
                       ("makespan_h", "makespan (h)"), ("util_overall", "GPU utilization (makespan)"),
                       ("util_while_waiting", "GPU utilization (jobs wait)"),
                       ("util_usable_while_waiting", "  of GPUs a waiting job can use"),
                       ("oom_placements", "OOM placements"),
                       ("preemptions", "preemptions")]:
        a, b = ours[key], fifo[key]
        fmt = "{:>10.3f} {:>15.3f}" if isinstance(a, float) else "{:>10d} {:>15d}"
        print(f"{label:28s} " + fmt.format(a, b))
    print(f"mean JCT speedup (FIFO / ours): {fifo['mean_jct_h'] / ours['mean_jct_h']:.2f}x")
    if args.no_plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy, color in (("ours", "tab:blue"), ("fifo", "tab:red")):
        res, timeline = results[policy]
        jct = sorted(x / 3600 for x in res["jct"])
        ax1.plot(jct, [k / len(jct) for k in range(1, len(jct) + 1)], color=color,
                 label=f"{'ours' if policy == 'ours' else 'FIFO first-fit'} (mean {res['mean_jct_h']:.1f} h)")
        ax2.plot([x / 3600 for x, _ in timeline], [u for _, u in timeline], color=color, lw=0.8,
                 label=f"{'ours' if policy == 'ours' else 'FIFO first-fit'}")
    ax1.set_xscale("log")
    ax1.set_xlabel("job completion time (h)")
    ax1.set_ylabel("fraction of jobs")
    ax1.legend()
    ax1.set_title(f"JCT CDF, {n} jobs")
    ax2.set_xlabel("simulated time (h)")
    ax2.set_ylabel("useful GPU utilization")
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    ax2.set_title("4x8 MI300X + 32x2 RTX 4090")
    fig.tight_layout()
    name = "sim_trace" + ("" if memory_model == "fitted" else f"_{memory_model}")
    if args.four_bit_share is not None:
        name += f"_4bit{round(args.four_bit_share * 100)}"
    out = Path(__file__).with_name(name + ".png")
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
