"""Placement: the pure decision of where (and whether) one job can run now.

``place_job(job, snapshot)`` looks at every pool the job may use, asks the estimator
how many GPUs of that pool the job needs, checks the tenant's quota and finds a gang
allocation (all GPUs at once: within one node, or whole free nodes for multi-node
jobs). It returns a ``Placement``:

- ``fit``: the job can start now on ``pool`` with ``nodes``;
- ``fit_after_preemption``: it can start once the ``victims`` (lower-priority jobs
  allowed by the preemption policy) have checkpointed and released their GPUs;
- ``no_fit``: it must wait; ``reasons`` say why, each with a stable code
  (``scheduling.reasons``: ``insufficient_gpus``, ``memory_does_not_fit``, ...) and words a
  user understands ("needs 2x nvidia-rtx-4090, 0 free").

Heterogeneity: among pools where the job fits now, the ``objective`` picks: ``cost``
(default: lowest estimated GPU-hour cost, ties by earliest finish) keeps a 7B QLoRA job
on a free 4090 instead of a slice of the MI300X node a 405B job needs; ``time`` takes
the earliest estimated finish. The trainer family follows the pool, among the families
that can train the job's base (``trainer_can_train``: an NF4 base trains in both, an
HQQ or double-quantized one only in ``fsdp_qlora``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from scheduling.capacity import CapacitySnapshot, NodeCapacity, RunningJob
from scheduling.estimator import PoolEstimate, TrainingShape, estimate_on_pool
from scheduling.pools import NodePool
from scheduling.reasons import Reason, ReasonCode, messages
from scheduling.request import JobRequest
from trainers.spec import auto_runs_method, trains_base

Mode = Literal["fit", "fit_after_preemption", "no_fit"]
Objective = Literal["cost", "time"]


@dataclass(frozen=True)
class PreemptionPolicy:
    """When a waiting job may evict running ones.

    ``min_priority_gap``: the victim's priority must be at least this much lower.
    Victims are taken from the same tenant; another tenant's job is a victim only when
    that tenant is *borrowing* (over its quota in a pool with ``quota_borrowing``) and
    the preemptor stays within its own quota.
    """

    enabled: bool = True
    min_priority_gap: int = 1


@dataclass(frozen=True)
class Placement:
    mode: Mode
    pool: str | None = None
    gpus: int = 0
    nodes: tuple[tuple[str, int], ...] = ()
    trainer: str | None = None
    victims: tuple[str, ...] = ()
    reasons: tuple[Reason, ...] = ()
    estimate: PoolEstimate | None = None
    borrowing: bool = False
    """The tenant exceeds its quota in this pool (its job may be preempted by the owner)."""

    @property
    def offload(self) -> bool:
        return bool(self.estimate and self.estimate.offload)

    @property
    def codes(self) -> tuple[ReasonCode, ...]:
        return tuple(r.code for r in self.reasons)

    def messages(self) -> tuple[str, ...]:
        """The reasons in the user's words (``scheduling.reasons.messages``)."""
        return messages(self.reasons)

    def reason_text(self) -> str:
        return "; ".join(self.messages())


@dataclass(frozen=True)
class _Candidate:
    pool: NodePool
    trainer: str
    estimate: PoolEstimate


_ESTIMATES: dict[tuple, PoolEstimate] = {}  # job shape x pool -> estimate without ETA/cost
_PER_JOB: dict[tuple, PoolEstimate] = {}  # ... -> with the job's ETA/cost


def estimate_for(job: JobRequest, pool: NodePool, trainer: str) -> PoolEstimate:
    """``estimate_on_pool`` memoised: the same job shape on the same pool is asked every
    cycle, and thousands of queued jobs share a few shapes (only their length differs).

    The key is every input the estimate reads: the job's frozen ``ModelShape`` and
    ``TrainingShape``, its pinned GPU count and token count, the trainer, and each pool
    number the estimator uses (not just the pool's name). A hit therefore returns exactly
    what computing would, and ``place_job`` stays a function of (job, snapshot) however
    the pools file changes between cycles.
    """
    key = (job.model, job.training, job.gpus, trainer, pool.name,
           pool.gpu_memory_bytes, pool.gpus_per_node, pool.max_nodes_per_job,
           pool.peak_tflops, pool.price_per_gpu_hour, pool.accelerator)
    est = _PER_JOB.get((key, job.total_tokens))
    if est is not None:
        return est
    if len(_PER_JOB) > 100_000:
        _PER_JOB.clear()
        _ESTIMATES.clear()
    shape = _ESTIMATES.get(key)
    if shape is None:
        shape = _ESTIMATES[key] = estimate_on_pool(job.model, job.training, pool, trainer=trainer, gpus=job.gpus)
    est = _PER_JOB[(key, job.total_tokens)] = shape.for_tokens(job.total_tokens, pool.price_per_gpu_hour)
    return est


def trainer_can_train(trainer: str, training: TrainingShape) -> bool:
    """Whether the ``trainer`` family can train the job's base weights as they are stored
    (``trainers.spec.trains_base``, the trainers' own rule)."""
    return trains_base(trainer, training.quantization, training.double_quant)


def base_text(training: TrainingShape) -> str:
    """How a reason names the job's base: "hqq4 base", "nf4 base with double_quant"."""
    if training.quantization == "none":
        return "unquantized base"
    return f"{training.quantization} base" + (" with double_quant" if training.double_quant else "")


def trainer_for(job: JobRequest, pool: NodePool) -> str | None:
    """The trainer family the job runs on ``pool``, None if the pool cannot run it.

    "auto" takes the first of the pool's families (its preference) that can train the
    job's base and that "auto" may run its method on (``trainers.spec.auto_runs_method``:
    reinforcement on fsdp_qlora), so a pool running both keeps its preferred family
    whenever it can.
    """
    if job.trainer == "auto":
        return next((t for t in pool.trainers if trainer_can_train(t, job.training)
                     and auto_runs_method(t, job.training.objective)), None)
    if job.trainer in pool.trainers and trainer_can_train(job.trainer, job.training):
        return job.trainer
    return None


def trainer_refusal(job: JobRequest, pool: NodePool) -> str:
    """Why ``trainer_for(job, pool)`` is None, in a user's words (no pool name)."""
    runs = f"runs {'/'.join(pool.trainers)}"
    if job.trainer != "auto" and not trainer_can_train(job.trainer, job.training):
        return f"{runs}, job asks for {job.trainer}, which cannot train a {base_text(job.training)}"
    if job.trainer == "auto" and job.training.objective == "reinforcement":
        return f"{runs}, job needs fsdp_qlora (reinforcement fine-tuning with trainer auto; or name jax_lora)"
    if job.trainer == "auto":
        return f"{runs}, job needs fsdp_qlora ({base_text(job.training)})"
    return f"{runs}, job needs {job.trainer}"


def candidate_pools(job: JobRequest, snapshot: CapacitySnapshot) -> tuple[list[_Candidate], list[Reason]]:
    """Pools whose family and memory can hold the job at all, and reasons for the rest."""
    return _pool_candidates(job, snapshot.pools)


def no_pool_fits(job: JobRequest, pools: Mapping[str, NodePool]) -> tuple[Reason, ...]:
    """Why no pool of ``pools`` could hold the job even with all its GPUs free; ``()``
    when one can.

    Only the pools' configuration counts (trainer families, GPU memory, GPUs per job, the
    tenant's quota without borrowing, a pinned pool's existence), never their nodes or
    what runs on them, so the answer does
    not change until the pools file or the job does: such a job would wait forever. Job
    creation refuses it (400 ``no_pool_fits``) and the scheduler fails it when it is
    queued, unless it asked to wait anyway (``JobRequest.queue_if_unfit``).
    """
    candidates, reasons = _pool_candidates(job, pools)
    if candidates:
        return ()
    return tuple(reasons) or (Reason(ReasonCode.NO_POOL, "no node pool is configured"),)


def _pool_candidates(job: JobRequest, pools: Mapping[str, NodePool]) -> tuple[list[_Candidate], list[Reason]]:
    out: list[_Candidate] = []
    reasons: list[Reason] = []
    if job.pool is not None and job.pool not in pools:
        return [], [Reason(ReasonCode.POOL_PINNED_MISSING, f"pool {job.pool!r} does not exist", job.pool)]
    for pool in pools.values():
        if job.pool is not None and pool.name != job.pool:
            continue
        trainer = trainer_for(job, pool)
        if trainer is None:
            reasons.append(Reason(ReasonCode.TRAINER_CANNOT_TRAIN, f"{pool.name}: {trainer_refusal(job, pool)}",
                                  pool.name))
            continue
        if job.gpus is not None and job.gpus > pool.gpus_per_node * pool.max_nodes_per_job:
            reasons.append(Reason(ReasonCode.GPUS_ABOVE_POOL_LIMIT,
                                  f"{pool.name}: at most {pool.gpus_per_node * pool.max_nodes_per_job} GPUs per job",
                                  pool.name))
            continue
        est = estimate_for(job, pool, trainer)
        if not est.fits:
            # Name the row the plan was sized by: the user can shorten it or set max_seq_len.
            row = f"its longest row ({job.longest_row}) " if job.longest_row else ""
            reasons.append(Reason(ReasonCode.MEMORY_DOES_NOT_FIT, f"{pool.name}: {row}{est.reasons[0]}", pool.name))
            continue
        quota = pool.quota_for(job.tenant)
        if quota is not None and not pool.quota_borrowing and est.gpus > quota:
            # Not even with the tenant's other jobs gone: the quota itself is too small.
            reasons.append(Reason(ReasonCode.QUOTA_BELOW_JOB, (
                f"{pool.name}: the tenant's quota is {quota} GPUs and the job needs {est.gpus}"), pool.name))
            continue
        out.append(_Candidate(pool, trainer, est))
    return out, reasons


def gang_nodes(pool: NodePool, snapshot: CapacitySnapshot, gpus: int,
               blocked: frozenset[str] = frozenset()) -> tuple[tuple[str, int], ...] | None:
    """A gang allocation of ``gpus`` on a pool's nodes, or None.

    Within a node: the fullest node that still has room (best fit, keeps whole nodes
    free for multi-node jobs). Across nodes: whole free nodes.
    """
    if gpus <= pool.gpus_per_node:
        for free in range(gpus, pool.gpus_per_node + 1):
            for name in snapshot.nodes_with_free(pool.name, free):
                if name not in blocked:
                    return ((name, gpus),)
        return None
    if gpus % pool.gpus_per_node:
        return None
    need = gpus // pool.gpus_per_node
    chosen: list[str] = []
    for name in snapshot.nodes_with_free(pool.name, pool.gpus_per_node):
        if name not in blocked:
            chosen.append(name)
            if len(chosen) == need:
                return tuple((n, pool.gpus_per_node) for n in chosen)
    return None


def _quota_check(job: JobRequest, pool: NodePool, snapshot: CapacitySnapshot,
                 gpus: int) -> tuple[bool, bool, Reason | None]:
    """(allowed, borrowing, reason) for the tenant taking ``gpus`` more GPUs of the pool."""
    quota = pool.quota_for(job.tenant)
    if quota is None:
        return True, False, None
    used = snapshot.tenant_gpus(job.tenant, pool.name)
    if used + gpus <= quota:
        return True, False, None
    if pool.quota_borrowing:
        return True, True, None
    return False, False, Reason(ReasonCode.QUOTA_EXCEEDED,
                                f"{pool.name}: tenant quota {quota} GPUs, {used} in use, needs {gpus} more", pool.name)


def _free_text(pool: NodePool, snapshot: CapacitySnapshot, gpus: int) -> str:
    free = snapshot.pool_free(pool.name)
    if gpus > pool.gpus_per_node:
        whole = len(snapshot.nodes_with_free(pool.name, pool.gpus_per_node))
        return (f"needs {gpus}x {pool.accelerator} ({gpus // pool.gpus_per_node} whole nodes), "
                f"{whole} whole nodes free")
    return f"needs {gpus}x {pool.accelerator}, {free} free" + (
        f" but not {gpus} on one node" if free >= gpus else "")


def _rank(c: _Candidate, objective: Objective = "cost") -> tuple[float, float, str]:
    # Without a token count, rank by time/cost per token (same order).
    eta = c.estimate.eta_s if c.estimate.eta_s is not None else 1.0 / max(c.estimate.tokens_per_s, 1e-9)
    cost = eta * c.estimate.gpus * c.pool.price_per_gpu_hour
    return (cost, eta, c.pool.name) if objective == "cost" else (eta, cost, c.pool.name)


def place_job(job: JobRequest, snapshot: CapacitySnapshot, *, policy: PreemptionPolicy | None = None,
              blocked_nodes: frozenset[str] = frozenset(), objective: Objective = "cost") -> Placement:
    """Decide where ``job`` runs now, after preemption, or why it waits.

    Args:
        job: the queued job.
        snapshot: pools, node capacity and running jobs (not modified).
        policy: preemption policy; None disables preemption.
        blocked_nodes: nodes reserved for a higher-ordered waiting job (backfill guard).
        objective: how to choose among pools that fit now ("cost" or "time").
    """
    candidates, reasons = candidate_pools(job, snapshot)
    if not candidates:
        return Placement("no_fit", reasons=tuple(reasons) or (Reason(ReasonCode.NO_POOL, "no pool can run this job"),))
    fits: list[tuple[_Candidate, tuple[tuple[str, int], ...], bool]] = []
    waiting: list[Reason] = []
    for cand in candidates:
        ok, borrowing, why = _quota_check(job, cand.pool, snapshot, cand.estimate.gpus)
        if not ok:
            assert why is not None  # refused quotas always say why
            waiting.append(why)
            continue
        nodes = gang_nodes(cand.pool, snapshot, cand.estimate.gpus, blocked_nodes)
        if nodes is None:
            waiting.append(Reason(ReasonCode.INSUFFICIENT_GPUS,
                                  f"{cand.pool.name}: {_free_text(cand.pool, snapshot, cand.estimate.gpus)}",
                                  cand.pool.name))
            continue
        fits.append((cand, nodes, borrowing))
    if fits:
        cand, nodes, borrowing = min(fits, key=lambda f: _rank(f[0], objective))
        return Placement("fit", pool=cand.pool.name, gpus=cand.estimate.gpus, nodes=nodes,
                         trainer=cand.trainer, estimate=cand.estimate,
                         reasons=tuple(Reason(ReasonCode.FITS, r, cand.pool.name) for r in cand.estimate.reasons),
                         borrowing=borrowing)
    if policy is not None and policy.enabled and job.priority > 0:
        options = []
        for cand in candidates:
            plan = _preemption_plan(job, cand, snapshot, policy, blocked_nodes)
            if plan is not None:
                options.append((len(plan[1]), _rank(cand, objective), cand, plan))
        if options:
            _, _, cand, (nodes, victims) = min(options, key=lambda o: (o[0], o[1]))
            return Placement(
                "fit_after_preemption", pool=cand.pool.name, gpus=cand.estimate.gpus, nodes=nodes,
                trainer=cand.trainer, victims=tuple(v.job_id for v in victims),
                reasons=((Reason(ReasonCode.PREEMPTING,
                                 f"preempting {len(victims)} lower-priority job(s) on {cand.pool.name}",
                                 cand.pool.name),)
                         if victims else
                         (Reason(ReasonCode.WAITING_FOR_RELEASE,
                                 f"waiting for stopping job(s) on {cand.pool.name} to release their GPUs",
                                 cand.pool.name),)),
                estimate=cand.estimate,
            )
    return Placement("no_fit", reasons=tuple(waiting + reasons))


def _may_preempt(job: JobRequest, victim: RunningJob, pool: NodePool, snapshot: CapacitySnapshot,
                 policy: PreemptionPolicy, gpus: int) -> bool:
    if not victim.preemptible or victim.stopping or victim.pool != pool.name:
        return False
    if job.priority - victim.priority < policy.min_priority_gap:
        return False
    if victim.tenant == job.tenant:
        return True
    # Across tenants only to take back borrowed GPUs: the victim's tenant is over its
    # quota and the preemptor stays within its own.
    quota_v, quota_j = pool.quota_for(victim.tenant), pool.quota_for(job.tenant)
    if not pool.quota_borrowing or quota_v is None or quota_j is None:
        return False
    return (snapshot.tenant_gpus(victim.tenant, pool.name) > quota_v
            and snapshot.tenant_gpus(job.tenant, pool.name) + gpus <= quota_j)


def _preemption_plan(job: JobRequest, cand: _Candidate, snapshot: CapacitySnapshot, policy: PreemptionPolicy,
                     blocked: frozenset[str]) -> tuple[tuple[tuple[str, int], ...], list[RunningJob]] | None:
    """The fewest, least valuable victims whose GPUs let the job's gang fit."""
    pool, gpus = cand.pool, cand.estimate.gpus
    lowest = snapshot.lowest_victim_priority(pool.name)
    has_victims = lowest is not None and job.priority - lowest >= policy.min_priority_gap
    if not has_victims and not snapshot.stopping_count(pool.name):
        return None  # fast path: nobody to preempt or wait for in this pool
    ok, _, _ = _quota_check(job, pool, snapshot, gpus)
    if not ok:
        return None
    eligible = [v for v in snapshot.running.values() if _may_preempt(job, v, pool, snapshot, policy, gpus)]
    # Jobs already stopping free their GPUs soon: count them first, so a job that
    # preempted last cycle waits for those victims instead of choosing new ones.
    stopping = [v for v in snapshot.running.values() if v.stopping and v.pool == pool.name]
    if not eligible and not stopping:
        return None
    # Lowest priority first; among equals the most recently started (least work lost).
    eligible.sort(key=lambda v: (v.priority, -v.started_at, v.job_id))
    nodes = snapshot.nodes[pool.name]
    freed: dict[str, int] = {}
    for v in stopping:
        for name, n in v.nodes:
            freed[name] = freed.get(name, 0) + n
    if stopping:
        alloc = _gang_after_release(pool, nodes, freed, gpus, blocked)
        if alloc is not None:
            return alloc, []
    chosen: list[RunningJob] = []
    for victim in eligible:
        chosen.append(victim)
        for name, n in victim.nodes:
            freed[name] = freed.get(name, 0) + n
        alloc = _gang_after_release(pool, nodes, freed, gpus, blocked)
        if alloc is not None:
            used = {name for name, _ in alloc}
            # Keep only victims on the nodes the gang uses (earlier picks elsewhere are spared).
            return alloc, [v for v in chosen if any(n in used for n, _ in v.nodes)]
    return None


def _gang_after_release(pool: NodePool, nodes: dict[str, NodeCapacity], freed: dict[str, int], gpus: int,
                        blocked: frozenset[str]) -> tuple[tuple[str, int], ...] | None:
    """gang_nodes over the nodes whose capacity grew by ``freed`` (the victims' GPUs)."""
    names = [n for n in freed if n not in blocked and n in nodes]
    if gpus <= pool.gpus_per_node:
        fitting = [n for n in names if nodes[n].gpus_free + freed[n] >= gpus]
        if not fitting:
            return None
        best = min(fitting, key=lambda n: (nodes[n].gpus_free + freed[n], n))
        return ((best, gpus),)
    need = gpus // pool.gpus_per_node
    whole = [n for n in nodes if n not in blocked
             and nodes[n].gpus_free + freed.get(n, 0) >= nodes[n].gpus_total == pool.gpus_per_node]
    # Prefer nodes that were free already, then those the victims free.
    whole.sort(key=lambda n: (n in freed, n))
    if len(whole) < need:
        return None
    return tuple((n, pool.gpus_per_node) for n in whole[:need])
