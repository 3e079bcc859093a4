"""Benchmark: one scheduling cycle WITH the database, next to the pure planning step.

``bench/scheduler_cycle.py`` times ``plan_cycle`` alone. A real cycle also reads the queue
from the database, admits every placed job (lock the rows, build each trainer spec, the
``queued -> running`` transitions with their events, commit; 500 jobs per transaction)
and hands each to the executor, then writes the waiting jobs' reasons and positions.
This runs ``run_cycle`` with the service's ``DbStore`` on a fresh, Alembic-migrated
PostgreSQL database holding N queued jobs of 50 tenants (the same model mix as
``scheduler_cycle.py``), against an empty cluster of the same two pools (an executor
that only records launches), and reports, in one run: the planning step, the time until
the last admitted job was launched (admissions/s), the whole cycle including the waiting
jobs' reasons, and a second cycle with nothing changed (the steady state).

    OMP_NUM_THREADS=1 .venv/bin/python bench/scheduler_cycle_db.py [--jobs 10000]

Needs PostgreSQL on 127.0.0.1 (trust auth, user postgres).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from api_bench import processed_file
from scheduler_cycle import pools  # the same 1,000 nodes

MODELS = {  # registry id -> (params in billions, method, share of the mix)
    "llama-2-7b": (7, "qlora", 40),
    "llama-3.1-8b": (8, "qlora", 30),
    "llama-3.1-8b-lora": (8, "lora", 10),
    "llama-3.1-70b": (70, "qlora", 10),
    "llama-3.1-70b-lora": (70, "lora", 8),
    "llama-3.1-405b": (405, "lora", 2),
}


class RecordingExecutor:
    """A cluster of the benchmark's pools, empty at first; launches only take capacity."""

    def __init__(self, node_pools):
        self.pools = node_pools
        self.running = []
        self.launched = 0
        self.last_launch = 0.0

    def snapshot(self):
        from scheduling.capacity import CapacitySnapshot

        return CapacitySnapshot.from_pools_and_running(self.pools, self.running)

    def reconcile(self):
        return []

    def launch(self, job, spec, placement):
        from scheduling.capacity import RunningJob

        self.running.append(RunningJob(job.id, job.tenant_id, placement.pool, job.priority, 0.0, placement.nodes))
        self.launched += 1
        self.last_launch = time.perf_counter()

    def stop(self, job, reason):
        pass


def count_events(database: str) -> int:
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={database}") as conn:
        return conn.execute("SELECT count(*) FROM job_events").fetchone()[0]


def seed(settings, n_jobs: int, seed_value: int = 0) -> None:
    from api.jobs.commands import create_job
    from api.jobs.schemas import JobCreate
    from control.auth import create_tenant
    from control.db.models import Tenant
    from control.db.session import session_scope
    from control.models.base_models import load_base_models
    from control.queue import RecordingQueue

    rng = random.Random(seed_value)
    models = load_base_models(settings)
    url = settings.resolved_database_url
    files: dict[str, str] = {}
    with session_scope(url) as session:
        for t in range(50):
            tenant = create_tenant(session, f"org-{t}")
            files[tenant.id] = processed_file(session, tenant).id
    ids, weights = list(MODELS), [m[2] for m in MODELS.values()]
    with session_scope(url) as session:
        tenants = list(session.query(Tenant).filter(Tenant.id.in_(files)))
        for i in range(n_jobs):
            tenant = rng.choice(tenants)
            model = rng.choices(ids, weights)[0]
            body = JobCreate.model_validate({
                "model": model, "training_file": files[tenant.id],
                "adapter": {"method": MODELS[model][1]},
                "priority": rng.choice([25, 50, 50, 50, 75]),
                "hyperparameters": {"max_steps": rng.randrange(100, 5000)},
            })
            create_job(session, tenant, body, raw_body={"i": i}, base_models=models, queue=RecordingQueue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    args = parser.parse_args()

    from control.db.migrate import upgrade
    from control.settings import Settings
    from worker.scheduler import cycle as cycle_module
    from worker.scheduler.cycle import run_cycle
    from worker.scheduler.store import DbStore

    name = f"tunefleet_cycle_bench_{os.getpid()}"
    admin = psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True)
    admin.execute(f"CREATE DATABASE {name}")
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    work = Path(tempfile.mkdtemp(prefix="tf-cycle-bench-"))
    try:
        models_file = work / "models.yaml"
        models_file.write_text(yaml.safe_dump({"models": [
            {"id": mid, "path": f"/models/{mid}", "params_b": float(params)} for mid, (params, _, _) in MODELS.items()
        ]}))
        settings = Settings(_env_file=None, database_url=url, data_dir=work / "data",
                            base_models_file=models_file)
        upgrade(url)
        t0 = time.perf_counter()
        seed(settings, args.jobs)
        print(f"seeded {args.jobs} queued jobs in {time.perf_counter() - t0:.1f} s")

        node_pools = pools()
        executor = RecordingExecutor(node_pools)
        store = DbStore(settings, node_pools)
        planning: list[float] = []
        plan = cycle_module.plan_cycle

        def timed_plan(*a, **kw):
            t = time.perf_counter()
            try:
                return plan(*a, **kw)
            finally:
                planning.append(time.perf_counter() - t)

        cycle_module.plan_cycle = timed_plan
        try:
            t0 = time.perf_counter()
            result = run_cycle(store, executor)
            whole = time.perf_counter() - t0
            to_launch = executor.last_launch - t0
            # The cluster is full now: the next cycle rewrites the waiting reasons ("0 free"),
            # the one after changes nothing (the steady state of a long queue).
            second = run_cycle(store, executor)
            events_before = count_events(name)
            t1 = time.perf_counter()
            third = run_cycle(store, executor)
            steady = time.perf_counter() - t1
            events_third = count_events(name) - events_before
        finally:
            cycle_module.plan_cycle = plan
        admitted = executor.launched
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={name}") as conn:
            running = conn.execute("SELECT count(*) FROM jobs WHERE status = 'running'").fetchone()[0]
            waiting = conn.execute(
                "SELECT count(*) FROM jobs WHERE status = 'queued' AND queue_position IS NOT NULL").fetchone()[0]
        assert running == admitted == len(result.plan.admissions), (running, admitted, len(result.plan.admissions))
        assert not second.plan.admissions and not third.plan.admissions
        print(f"one cycle, {args.jobs} queued jobs, 1000 nodes (3200 GPUs), PostgreSQL, load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"planning: {planning[0]:.2f} s ({admitted / planning[0]:,.0f} admissions/s)")
        print(f"{admitted} admitted and launched {to_launch:.2f} s after the cycle started "
              f"(queue read, planning, admissions): {admitted / to_launch:,.0f} admissions/s end to end")
        print(f"whole cycle, with {waiting} waiting reasons/positions written after the launches: {whole:.2f} s "
              f"({admitted / whole:,.0f} admissions per second of cycle)")
        print(f"a cycle with nothing changed ({len(third.plan.waiting)} waiting, {events_third} events written): "
              f"{steady:.2f} s, planning {planning[2]:.2f} s")
    finally:
        from control.db.session import dispose_engine

        dispose_engine(url)
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


if __name__ == "__main__":
    main()
