"""The Kubernetes executor: one batch/v1 Job per fine-tuning job, on the job's node pool.

``launch`` renders the job's objects (``worker.executors.manifests``) and creates them
with the official ``kubernetes`` client: the Job first, then the ConfigMap (spec),
Secret (report token) and, for multi-node jobs, the headless Service, each owned by the
Job so that deleting the Job (or its TTL) removes them. Pods wait for their volumes
like any pod does.

Two informers (list + watch with resourceVersion resumption; a 410 Gone means "relist")
keep a cache of our Jobs and Pods; ``reconcile`` turns what changed into
``ObservedChange`` values with reasons a user can act on, through the pure
``worker.executors.pod_outcomes.observe`` (its table lists every pod state), and deletes
the Job of a run that ended other than by success. Every object carries the job's run
attempt (label ``tunefleet.io/run``), which each change names.

``stop`` first records *why* on the Job (annotation ``tunefleet.io/stop-reason``), then
deletes it with foreground propagation: Kubernetes sends SIGTERM to the pods, the trainer
checkpoints and exits PREEMPTED within the grace period. The annotation lets a process
that did not issue the stop (a restarted scheduler) tell a preemption, cancel or pause
from a SIGTERM the cluster sent (a node drain).

Matching against the database (``running_jobs``, given by the scheduler): what this
process tracks is only what it launched, so every ``reconcile`` also (a) *adopts* each
job the database has ``running`` that it does not track -- after a scheduler restart or a
410 relist -- from the newest of the job's labelled Jobs (pool, tenant, priority, attempt
from its labels, the stop reason from its annotation, the launch time from its creation);
a running job without any Job is tracked from its admission time and reported
``job_lost``; and (b) stops live Jobs whose job is no longer ``running`` there (cancelled
or paused through the API, which does not talk to the cluster) once they have been for
``orphan_grace_s`` (a trainer that reported its own end gets to exit by itself). Nothing
is adopted or stopped before both informers have listed once.

API verbs used (the Helm chart's Role grants exactly these): namespaced jobs create/
list/watch/patch/delete; pods list/watch; pods/log get; services, configmaps, secrets
create; cluster-scoped nodes list. Free GPUs are node allocatable
minus the GPU requests of *our* pods (we may not list other namespaces' pods): give
the pools dedicated nodes (taints) so nothing else takes their GPUs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from kube.labels import (
    ANNOTATION_STOP_REASON,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_POOL,
    LABEL_PRIORITY,
    LABEL_RUN,
    LABEL_TENANT,
    MANAGED,
)
from kube.labels import attempt_of as _attempt
from kube.pod_logs import read_pod_log
from scheduling.capacity import CapacitySnapshot, NodeCapacity, RunningJob
from scheduling.pools import NodePool
from trainers.spec import TrainerSpec
from worker.executors.base import JobRef, ObservedChange, ObservedKind, RunningRow, StopReason
from worker.executors.manifests import ManifestOptions, launch_manifests, owner_reference
from worker.executors.pod_outcomes import TrackedRun, job_condition, observe

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}  # client 37 sends bodies without a media type otherwise

# A live Job whose job the API moved to one of these statuses is stopped at once, for
# this reason: cancelled ends it, paused lets the trainer write its checkpoint first.
STOPPED_BY_THE_API = {"cancelled": StopReason.CANCEL, "paused": StopReason.PAUSE}


class Informer:
    """A cache of one resource kept current by list + watch (resourceVersion resumption).

    ``run_once`` lists when it has no resourceVersion (first time, or after a 410) and
    otherwise watches from the last one it saw (BOOKMARKs advance it too).
    """

    def __init__(self, list_fn: Callable[..., Any], namespace: str, label_selector: str,
                 on_change: Callable[[], None] | None = None) -> None:
        self.list_fn = list_fn
        self.namespace = namespace
        self.label_selector = label_selector
        self.items: dict[str, Any] = {}
        self.resource_version: str | None = None
        self.relists = 0
        self.lock = threading.Lock()
        self.on_change = on_change

    @property
    def synced(self) -> bool:
        """Whether the cache has been listed at least once (before that it is empty, not
        "nothing exists")."""
        return self.relists > 0

    def relist(self) -> None:
        result = self.list_fn(self.namespace, label_selector=self.label_selector)
        with self.lock:
            self.items = {o.metadata.name: o for o in result.items}
            self.resource_version = result.metadata.resource_version
            self.relists += 1

    def run_once(self, timeout_s: int = 5) -> None:
        if self.resource_version is None:
            self.relist()
            if self.on_change:
                self.on_change()
        w = watch.Watch()
        try:
            for event in w.stream(self.list_fn, self.namespace, label_selector=self.label_selector,
                                  resource_version=self.resource_version, timeout_seconds=timeout_s,
                                  allow_watch_bookmarks=True):
                obj = event["object"]
                with self.lock:
                    if event["type"] == "DELETED":
                        self.items.pop(obj.metadata.name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self.items[obj.metadata.name] = obj
                if event["type"] != "BOOKMARK" and self.on_change:
                    self.on_change()
            if w.resource_version:
                self.resource_version = w.resource_version
        except ApiException as exc:
            if exc.status == 410:
                log.info("watch of %s expired (410): relisting", self.list_fn.__name__)
                self.resource_version = None
            else:
                raise

    def snapshot(self) -> list[Any]:
        with self.lock:
            return list(self.items.values())


class KubernetesExecutor:
    """Runs trainers as Kubernetes Jobs; implements ``worker.executors.base.Executor``."""

    def __init__(self, api_client: client.ApiClient, pools: list[NodePool], *,
                 options: ManifestOptions | None = None, max_pending_s: float = 900.0,
                 clock: Callable[[], float] = time.time, watch_timeout_s: int = 5,
                 command: list[str] | None = None, extra_env: dict[str, str] | None = None,
                 running_jobs: Callable[[], Iterable[RunningRow]] | None = None,
                 job_statuses: Callable[[Collection[str]], Mapping[str, str]] | None = None,
                 orphan_grace_s: float = 30.0) -> None:
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.pools = {p.name: p for p in pools}
        self.options = options = options or ManifestOptions()
        self.ns = options.namespace
        self.max_pending_s = max_pending_s
        self.clock = clock
        self.watch_timeout_s = watch_timeout_s
        self.command = command  # None: the image's `python -m trainers --spec ...`
        self.extra_env = extra_env
        # The database's running jobs, to adopt and to stop orphans by (None: only what
        # this process launched is observed, as in tests of the executor alone).
        self.running_jobs = running_jobs
        # The database status of jobs that are not running (``DbStore.job_statuses``):
        # which of their live Jobs to stop at once (``STOPPED_BY_THE_API``).
        self.job_statuses = job_statuses
        # A trainer that reported its own end has a moment to exit before its Job counts
        # as an orphan (its log stays readable until the Job's TTL).
        self.orphan_grace_s = orphan_grace_s
        self._orphan_since: dict[str, float] = {}
        self.jobs = Informer(self.batch.list_namespaced_job, self.ns, MANAGED)
        self.pods = Informer(self.core.list_namespaced_pod, self.ns, MANAGED)
        self.tracked: dict[str, TrackedRun] = {}
        self._lock = threading.Lock()
        self._stop_watching = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- informers ---------------------------------------------------------------------
    def start(self) -> None:
        """Run both informers in background threads (the service does; tests may poll)."""
        for inf in (self.jobs, self.pods):
            t = threading.Thread(target=self._watch_loop, args=(inf,), daemon=True, name=f"k8s-watch-{id(inf)}")
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self._stop_watching.set()
        for t in self._threads:
            t.join(timeout=self.watch_timeout_s + 2)

    def _watch_loop(self, inf: Informer) -> None:
        while not self._stop_watching.is_set():
            try:
                inf.run_once(self.watch_timeout_s)
            except Exception:
                log.exception("watch failed; retrying")
                self._stop_watching.wait(1.0)

    def sync(self) -> None:
        """Bring both caches up to date now (used when no background informers run)."""
        for inf in (self.jobs, self.pods):
            inf.run_once(timeout_s=1)

    # --- Executor protocol -------------------------------------------------------------
    def launch(self, job: JobRef, spec: TrainerSpec, placement: Any) -> None:
        pool = self.pools[placement.pool]
        nodes = max(1, len(placement.nodes))
        gpus_per_node = placement.gpus // nodes if placement.gpus else 0
        tenant = str(getattr(job, "tenant_id", None) or getattr(job, "tenant", "") or "")
        priority = int(getattr(job, "priority", 0) or 0)
        existing = self.batch.list_namespaced_job(self.ns, label_selector=f"{MANAGED},{LABEL_JOB}={job.id}").items
        live = [j for j in existing if not j.metadata.deletion_timestamp and not _job_finished(j)]
        if live:
            log.info("job %s already has Kubernetes Job %s: launch is a no-op", job.id, live[0].metadata.name)
            return
        attempt = 1 + max((int((j.metadata.labels or {}).get(LABEL_ATTEMPT, "0")) for j in existing), default=0)
        m = launch_manifests(spec, tenant=tenant, priority=priority, pool=pool,
                             trainer=placement.trainer or pool.preferred_trainer(), nodes=nodes,
                             gpus_per_node=gpus_per_node, opts=self.options, attempt=attempt,
                             run=getattr(job, "attempt", None), command=self.command, extra_env=self.extra_env)
        created = self.batch.create_namespaced_job(self.ns, client.V1Job.from_dict(m.job), _headers=JSON)
        owner = owner_reference({"metadata": {"name": created.metadata.name, "uid": created.metadata.uid}})
        for doc, create, model in (
            (m.configmap, self.core.create_namespaced_config_map, client.V1ConfigMap),
            (m.secret, self.core.create_namespaced_secret, client.V1Secret),
            (m.service, self.core.create_namespaced_service, client.V1Service),
        ):
            if doc is None:
                continue
            doc["metadata"]["ownerReferences"] = [owner]
            try:
                create(self.ns, model.from_dict(doc), _headers=JSON)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        with self._lock:
            self.tracked[job.id] = TrackedRun(job.id, pool.name, tenant, priority, tuple(placement.nodes), self.clock(),
                                            attempt=attempt, run=getattr(job, "attempt", None))

    def stop(self, job: JobRef, reason: StopReason) -> None:
        with self._lock:
            tracked = self.tracked.get(job.id)
            if tracked is not None:
                tracked.stop_reason = reason
        for j in self._jobs_of(job.id):
            if not j.metadata.deletion_timestamp:
                self._annotate_stop(j.metadata.name, reason)
            self._delete_job(j.metadata.name)

    def snapshot(self) -> CapacitySnapshot:
        snap = CapacitySnapshot(pools=dict(self.pools), observed=True)
        used: dict[str, int] = {}
        holders: dict[str, dict[str, Any]] = {}
        pods = self.core.list_namespaced_pod(self.ns, label_selector=MANAGED).items
        unbound: list[tuple[str, int]] = []
        for pod in pods:
            if pod.status is None or pod.status.phase not in ("Pending", "Running"):
                continue
            pool = self.pools.get((pod.metadata.labels or {}).get(LABEL_POOL, ""))
            gpus = _gpu_request(pod, pool.resource_name if pool else None)
            jid = (pod.metadata.labels or {}).get(LABEL_JOB, "")
            info = holders.setdefault(jid, {"pod": pod, "nodes": []})
            if pod.spec.node_name:
                used[pod.spec.node_name] = used.get(pod.spec.node_name, 0) + gpus
                info["nodes"].append((pod.spec.node_name, gpus))
            elif pool is not None:
                unbound.append((pool.name, gpus))
                info["nodes"].append(("", gpus))
        for pool in self.pools.values():
            sel = ",".join(f"{k}={v}" for k, v in pool.node_selector.items()) or None
            for node in self.core.list_node(label_selector=sel).items:
                if node.spec and node.spec.unschedulable:
                    continue
                if not _ready(node):
                    continue
                alloc = (node.status.allocatable or {}) if node.status else {}
                total = int(alloc.get(pool.resource_name, 0)) if pool.resource_name else pool.gpus_per_node
                free = max(0, total - used.get(node.metadata.name, 0))
                snap.add_node(NodeCapacity(node.metadata.name, pool.name, total, free))
        # Pods not bound to a node yet (and jobs launched whose pods do not exist yet)
        # still hold their GPUs in our books: take them off the fullest-free nodes.
        with self._lock:
            tracked = dict(self.tracked)
        for jid, t in tracked.items():
            if not t.done and jid not in holders:
                unbound.extend((t.pool, n) for _, n in t.nodes)
        for pool_name, gpus in unbound:
            self._take_free(snap, pool_name, gpus)
        for jid, info in holders.items():
            t = tracked.get(jid)
            labels = info["pod"].metadata.labels or {}
            snap.add_running(RunningJob(
                job_id=jid, tenant=labels.get(LABEL_TENANT, ""), pool=labels.get(LABEL_POOL, ""),
                priority=int(labels.get(LABEL_PRIORITY, "0")),
                started_at=t.launched_at if t else 0.0,
                nodes=tuple((n, g) for n, g in info["nodes"] if n) or tuple(t.nodes if t else ()),
                stopping=bool((t and t.stop_reason) or info["pod"].metadata.deletion_timestamp)))
        return snap

    @staticmethod
    def _take_free(snap: CapacitySnapshot, pool: str, gpus: int) -> None:
        for free in range(max(gpus, 1), 65):
            names = list(snap.nodes_with_free(pool, free))
            if names:
                node = snap.nodes[pool][names[0]]
                snap._set_free(pool, node.name, node.gpus_free - gpus)
                return

    def reconcile(self) -> list[ObservedChange]:
        if not self._threads:
            self.sync()
        if not (self.jobs.synced and self.pods.synced):
            return []  # empty caches would read as "every Job is gone"
        if self.running_jobs is not None:
            self._match_database()
        changes: list[ObservedChange] = []
        pods_by_job: dict[str, list[Any]] = {}
        for pod in self.pods.snapshot():
            pods_by_job.setdefault((pod.metadata.labels or {}).get(LABEL_JOB, ""), []).append(pod)
        jobs_by_id: dict[str, list[Any]] = {}
        for j in self.jobs.snapshot():
            jobs_by_id.setdefault((j.metadata.labels or {}).get(LABEL_JOB, ""), []).append(j)
        with self._lock:
            tracked = list(self.tracked.values())
        for t in tracked:
            if t.done:
                continue
            job = _of_attempt(jobs_by_id.get(t.job_id, []), t.attempt)
            if t.stop_reason is None and job is not None:
                t.stop_reason = _stop_reason_of(job)  # stopped by another process
            change = observe(t, job, _all_of_attempt(pods_by_job.get(t.job_id, []), t.attempt), self.clock(),
                             max_pending_s=self.max_pending_s)
            for ch in change:
                key = f"{ch.kind.value}:{ch.message}"
                if key in t.reported:
                    continue
                t.reported.add(key)
                changes.append(ch)
                if ch.kind in (ObservedKind.SUCCEEDED, ObservedKind.FAILED, ObservedKind.STOPPED, ObservedKind.REQUEUE):
                    t.done = True
                    if ch.kind != ObservedKind.SUCCEEDED:
                        for j in self._jobs_of(t.job_id):
                            if not j.metadata.deletion_timestamp:
                                self._delete_job(j.metadata.name)
                    break
        with self._lock:
            for t in tracked:
                if t.done:
                    self.tracked.pop(t.job_id, None)
        return changes

    def _match_database(self) -> None:
        """Adopt the database's running jobs this process does not track; stop live Jobs
        whose job is no longer running (see the module docstring)."""
        running = {row.id: row for row in self.running_jobs()}  # type: ignore[misc]
        newest: dict[str, Any] = {}
        live: dict[str, list[Any]] = {}
        for j in self.jobs.snapshot():
            jid = (j.metadata.labels or {}).get(LABEL_JOB, "")
            if jid not in newest or _attempt(j) > _attempt(newest[jid]):
                newest[jid] = j
            if not j.metadata.deletion_timestamp and not _job_finished(j):
                live.setdefault(jid, []).append(j)
        with self._lock:
            for jid, row in running.items():
                if jid in self.tracked:
                    continue
                self.tracked[jid] = self._adopted(row, newest.get(jid))
                log.info("adopted running job %s (Kubernetes Job %s)", jid,
                         newest[jid].metadata.name if jid in newest else "missing")
            # (cancelled or paused through the API; skipped when a stop is under way)
            candidates = [jid for jid in live if jid and jid not in running
                          and (jid not in self.tracked or self.tracked[jid].stop_reason is None)]
        statuses = self.job_statuses(candidates) if self.job_statuses is not None and candidates else {}
        now = self.clock()
        self._orphan_since = {jid: self._orphan_since.get(jid, now) for jid in candidates}
        for jid, since in list(self._orphan_since.items()):
            reason = STOPPED_BY_THE_API.get(statuses.get(jid, ""))
            if reason is None and now - since < self.orphan_grace_s:
                continue
            self._orphan_since.pop(jid)
            log.info("job %s is %s in the database: stopping its Kubernetes Job", jid,
                     statuses.get(jid, "no longer running"))
            with self._lock:
                if jid not in self.tracked:
                    self.tracked[jid] = self._adopted(None, newest[jid], job_id=jid)
            self.stop(_Ref(jid), reason or StopReason.CANCEL)

    def _adopted(self, row: RunningRow | None, job: Any, job_id: str = "") -> TrackedRun:
        """What to track for a job launched by another process (or before a restart)."""
        if job is None:  # running, but its Job is gone: ``observe`` reports it lost
            assert row is not None
            return TrackedRun(row.id, row.pool or "", row.tenant_id, int(row.priority or 0),
                            (("", int(row.gpus or 0)),),
                            self.clock() if row.started_at is None else float(row.started_at))
        labels = job.metadata.labels or {}
        created = job.metadata.creation_timestamp
        return TrackedRun(
            row.id if row is not None else job_id, labels.get(LABEL_POOL, ""), labels.get(LABEL_TENANT, ""),
            int(labels.get(LABEL_PRIORITY, "0")), (("", int(row.gpus or 0) if row is not None else 0),),
            created.timestamp() if created is not None else self.clock(),
            stop_reason=_stop_reason_of(job), attempt=_attempt(job) if LABEL_ATTEMPT in labels else None,
            run=int(labels[LABEL_RUN]) if labels.get(LABEL_RUN, "").isdigit() else None)

    def logs(self, job_id: str, tail_lines: int | None = 200) -> str:
        """The trainer log of the job's newest launch, rank 0."""
        return read_pod_log(self.core, self.ns, job_id, tail_lines) or ""

    # --- helpers -----------------------------------------------------------------------
    def _annotate_stop(self, name: str, reason: StopReason) -> None:
        """Record the stop reason on the Job (a merge of one annotation) before deleting it."""
        try:
            self.batch.patch_namespaced_job(name, self.ns, {"metadata": {"annotations": {
                ANNOTATION_STOP_REASON: reason.value}}})
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _jobs_of(self, job_id: str) -> list[Any]:
        return self.batch.list_namespaced_job(self.ns, label_selector=f"{MANAGED},{LABEL_JOB}={job_id}").items

    def _delete_job(self, name: str) -> None:
        try:
            self.batch.delete_namespaced_job(name, self.ns, propagation_policy="Foreground", _headers=JSON)
        except ApiException as exc:
            if exc.status != 404:
                raise


@dataclass(frozen=True)
class _Ref:
    id: str


def _of_attempt(jobs: list[Any], attempt: int | None) -> Any:
    """The Job of one launch (None: the newest), or None."""
    matching = _all_of_attempt(jobs, attempt)
    return max(matching, key=_attempt) if matching else None


def _all_of_attempt(objs: list[Any], attempt: int | None) -> list[Any]:
    """Objects of one launch; those without the label (older launches) always match."""
    if attempt is None:
        return objs
    return [o for o in objs if LABEL_ATTEMPT not in (o.metadata.labels or {}) or _attempt(o) == attempt]


def _stop_reason_of(job: Any) -> StopReason | None:
    value = (job.metadata.annotations or {}).get(ANNOTATION_STOP_REASON)
    try:
        return StopReason(value) if value else None
    except ValueError:
        return None




def _job_finished(job: Any) -> bool:
    return job_condition(job) is not None


def _ready(node: Any) -> bool:
    conds = (node.status.conditions or []) if node.status else []
    return not conds or any(c.type == "Ready" and c.status == "True" for c in conds)


def _gpu_request(pod: Any, resource_name: str | None) -> int:
    if not resource_name:
        return 1
    total = 0
    for c in pod.spec.containers:
        res = c.resources
        req = (res.requests or res.limits or {}) if res else {}
        total += int(req.get(resource_name, 0))
    return total






