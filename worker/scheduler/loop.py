"""The scheduler process: a scheduling cycle every few seconds, one active replica at a time.

``tunefleet scheduler`` (and ``tunefleet serve``) call ``run_forever(settings)``; the
Celery task ``tunefleet.schedule`` runs a single cycle with the same components
(``build_components``) with the local executor. Both take the scheduler lock first
(``worker.scheduler.lock``), so any number of replicas and tasks never place a job twice.
In Kubernetes mode only this loop runs cycles: its executor is the one process that
launches, stops and reconciles trainer Jobs (``worker/tasks/scheduling.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from control.settings import Settings
from kube.kueue import parse_priority_classes
from scheduling.placement import PreemptionPolicy
from scheduling.pools import load_pools
from worker.executors.base import Executor
from worker.executors.manifests import ManifestOptions
from worker.metrics import scheduler_cycled
from worker.scheduler.cycle import CycleConfig, CycleResult, run_cycle
from worker.scheduler.lock import SchedulerLock, make_lock
from worker.scheduler.store import DbStore

log = logging.getLogger(__name__)

WEBHOOK_SWEEP_INTERVAL_S = 60.0


@dataclass
class Components:
    store: DbStore
    executor: Executor
    lock: SchedulerLock
    config: CycleConfig
    # The scheduler lock keeps other processes out, but its holder is the process: the
    # worker's threads share one Components, so two ``tunefleet.schedule`` tasks would
    # both "hold" it. Cycles of one process take turns on this mutex instead.
    mutex: threading.Lock = field(default_factory=threading.Lock)


def make_executor(settings: Settings, pools: list[Any], *,
                  running_jobs: Callable[[], Iterable[Any]] | None = None,
                  job_statuses: Callable[[Collection[str]], Mapping[str, str]] | None = None) -> Executor:
    """The executor the settings ask for (``TUNEFLEET_EXECUTOR``).

    ``running_jobs`` and ``job_statuses`` (the store's) let the Kubernetes executor adopt
    the running jobs of a previous scheduler process and stop the Jobs of jobs cancelled
    or paused through the API.
    """
    if settings.executor == "kubernetes":
        from kubernetes import client, config

        from worker.executors.kubernetes import KubernetesExecutor

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        extra_env = trainer_env(settings, os.environ) or None
        options = manifest_options(settings)
        ex = KubernetesExecutor(client.ApiClient(), pools, extra_env=extra_env, options=options,
                                running_jobs=running_jobs, job_statuses=job_statuses)
        ex.start()
        return ex
    from control.queue import CeleryQueue
    from worker.executors.local.executor import LocalExecutor

    return LocalExecutor(settings, pools, CeleryQueue(settings))


# The control plane's environment that trainer pods get as values: the artifact store's
# region (boto3 reads it) besides the settings named in ``trainer_env``.
TRAINER_ENV_PASSED = ("AWS_DEFAULT_REGION", "AWS_REGION")


def trainer_env(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """Plain environment values every trainer pod gets (``KubernetesExecutor.extra_env``).

    Trainers reach the artifact bucket themselves: its endpoint and region as values, its
    credentials from ``TUNEFLEET_K8S_TRAINER_SECRET`` or the trainer service account
    (``manifest_options``); and they check tracking servers against the same allow-list
    as the API.
    """
    env = {name: environ[name] for name in TRAINER_ENV_PASSED if environ.get(name)}
    if settings.s3_endpoint_url:
        env["TUNEFLEET_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    if settings.tracker_allowed_hosts:
        env["TUNEFLEET_TRACKER_ALLOWED_HOSTS"] = settings.tracker_allowed_hosts
    return env


def manifest_options(settings: Settings) -> ManifestOptions:
    """The trainer Jobs' deployment-wide knobs from the settings (``TUNEFLEET_K8S_*``,
    ``TUNEFLEET_KUEUE_*``): what the Helm chart's values turn into."""
    return ManifestOptions(
        namespace=settings.k8s_namespace, kueue_queue=settings.kueue_queue,
        kueue_priority_classes=parse_priority_classes(settings.kueue_priority_classes),
        env_from_secret=settings.k8s_trainer_secret, service_account=settings.k8s_trainer_service_account,
        automount_service_account_token=settings.k8s_trainer_automount_token,
        priority_class_name=settings.k8s_trainer_priority_class,
        active_deadline_seconds=settings.k8s_trainer_max_runtime_s)


def cycle_config(settings: Settings) -> CycleConfig:
    """The cycle's policy knobs from the settings (``TUNEFLEET_PREEMPTION_*``,
    ``TUNEFLEET_PLACEMENT_OBJECTIVE``)."""
    return CycleConfig(
        preemption=PreemptionPolicy(enabled=settings.preemption_enabled,
                                    min_priority_gap=settings.preemption_min_priority_gap),
        objective=settings.placement_objective)


def build_components(settings: Settings) -> Components:
    from control.db.session import get_engine

    pools = load_pools(settings.node_pools_file)
    store = DbStore(settings, pools, in_cluster=settings.executor == "kubernetes")
    executor = make_executor(settings, pools, running_jobs=store.running_jobs, job_statuses=store.job_statuses)
    engine = get_engine(settings.resolved_database_url)
    return Components(store, executor, make_lock(settings, engine), cycle_config(settings))


def _holds(lease: SchedulerLock | None) -> bool | None:
    """Take or renew ``lease`` (None: no lease to hold); a broken lock store holds nothing."""
    if lease is None:
        return None
    try:
        return lease.acquire()
    except Exception:
        log.exception("the gauge exporter lease could not be taken")
        return False


def run_once(components: Components) -> CycleResult:
    """One cycle; waits for a cycle running in another thread of this process to end first."""
    with components.mutex:
        return run_cycle(components.store, components.executor, lock=components.lock, config=components.config)


def run_forever(settings: Settings, *, stop: threading.Event | None = None, max_cycles: int | None = None) -> None:
    """Run cycles every ``settings.schedule_interval_s`` until SIGTERM/SIGINT (or ``stop``)."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    from control.inference_preload import install as install_preload
    from control.webhooks import install_hooks

    install_hooks()  # status changes made in this process notify webhooks too
    install_preload(settings)  # and a job that succeeds hints the inference worker to load its base
    components = build_components(settings)
    log.info("scheduler started (executor %s, every %.1f s)", settings.executor, settings.schedule_interval_s)
    cycles = 0
    from control.queue import CeleryQueue

    queue = CeleryQueue(settings)
    exporter = None
    if settings.metrics_database_gauges == "scheduler" and settings.metrics_port:
        from control.db.session import get_engine

        exporter = make_lock(settings, get_engine(settings.resolved_database_url), exporter=True)
    last_sweep = 0.0
    while not stop.is_set():
        started = time.monotonic()
        if started - last_sweep >= WEBHOOK_SWEEP_INTERVAL_S:
            # Re-send webhook deliveries left pending by a lost task (at-least-once delivery).
            queue.send("tunefleet.sweep_webhooks")
            # Fail uploads whose validation never finished, and the jobs waiting for them.
            queue.send("tunefleet.sweep_stale_validations")
            # Delete uploads past their expires_after that no unfinished job uses.
            queue.send("tunefleet.delete_expired_files")
            # End uploads left pending past their hour, and delete their parts.
            queue.send("tunefleet.expire_uploads")
            last_sweep = started
        try:
            result = run_once(components)
            if result.ran and result.plan and (result.plan.admissions or result.plan.preemptions):
                log.info("cycle: %d admitted, %d preempted, %d waiting (%.3f s)", len(result.plan.admissions),
                         len(result.plan.preemptions), len(result.plan.waiting), result.seconds)
        except Exception:
            log.exception("scheduling cycle failed")
        # The loop is not stuck (the pod's liveness, a Prometheus gauge); whether this
        # replica exports the database gauges (it holds, or just took, their lease).
        scheduler_cycled(exporting=_holds(exporter))
        cycles += 1
        if max_cycles is not None and cycles >= max_cycles:
            break
        stop.wait(max(0.0, settings.schedule_interval_s - (time.monotonic() - started)))
    close = getattr(components.executor, "close", None)
    if close:
        close()
    if exporter is not None:
        exporter.release()
