"""The cycle on the real database: jobs created through the API, placed by DbStore.

Admission goes through ``control.jobs.lifecycle.transition`` (queued -> running, an event, pool,
gpus, usage); waiting jobs show ``queue_reason`` on ``GET /v1/fine_tuning/jobs/{id}``
with one event per change; executor observations requeue (preemption, lost runs) or end
jobs; usage accounting sums GPU-seconds per tenant and pool.
"""

import json

from sqlalchemy import func, select

from api.fleet.usage import tenant_usage
from control.db.models import Job, JobEvent
from control.db.session import session_scope
from scheduling.capacity import CapacitySnapshot, RunningJob
from scheduling.pools import local_pool
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from worker.executors.base import ObservedChange, ObservedKind, StopReason
from worker.scheduler.cycle import run_cycle
from worker.scheduler.store import DbStore

JOBS = "/v1/fine_tuning/jobs"


class Clock:
    def __init__(self, t=1_764_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


class RecordingExecutor:
    """Holds 'GPUs' of the local pool for launched jobs; records launches and stops."""

    def __init__(self, pools):
        self.pools = pools
        self.running: dict[str, RunningJob] = {}
        self.launches: list[tuple[str, dict]] = []
        self.stops: list[tuple[str, StopReason]] = []
        self.changes: list[ObservedChange] = []

    def launch(self, job, spec, placement):
        self.launches.append((job.id, json.loads(spec.model_dump_json())))
        self.running[job.id] = RunningJob(job.id, job.tenant_id, placement.pool, job.priority, 0.0, placement.nodes)

    def stop(self, job, reason):
        self.stops.append((job.id, reason))

    def snapshot(self):
        return CapacitySnapshot.from_pools_and_running(self.pools, list(self.running.values()))

    def reconcile(self):
        out, self.changes = self.changes, []
        return out


def _tiny_config(settings):
    d = settings.models_dir / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "config.json").exists():
        (d / "config.json").write_text(json.dumps({
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 256}))


def test_cycle_on_the_database(settings, client, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    a, b = tenant_key(), tenant_key()
    j1 = make_job(a.headers)["id"]
    j2 = make_job(b.headers)["id"]
    j3 = make_job(a.headers, priority="low")["id"]
    pools = [local_pool(slots=2)]
    clock = Clock()
    # A lost run restarts at once here (its backoff has a test of its own, in test_outcomes).
    store = DbStore(settings.model_copy(update={"restart_backoff_s": 0.0}), pools, clock=clock)
    ex = RecordingExecutor(pools)

    run_cycle(store, ex, clock=clock)
    assert sorted(j for j, _ in ex.launches) == sorted([j1, j2])
    spec = dict(ex.launches)[j1]
    assert spec["job_id"] == j1 and spec["report"]["token"].startswith("tfjob_")
    got = client.get(f"{JOBS}/{j1}", headers=a.headers).json()
    assert (got["status"], got["pool"], got["gpus"]) == ("running", "local", 1)
    assert got["usage"]["segments"][0]["start"] == clock.t and got["estimate"]["admitted"]["pool"] == "local"
    waiting = client.get(f"{JOBS}/{j3}", headers=a.headers).json()
    assert waiting["status"] == "queued"
    assert waiting["queue_reason"] == "waiting: local: needs 1x cpu, 0 free; position 1 in queue"
    assert waiting["queue_position"] == 1
    assert got["queue_position"] is None  # admitted: no place in the queue

    def reason_events(job_id):
        with session_scope(settings.resolved_database_url) as s:
            return s.scalar(select(func.count()).select_from(JobEvent).where(
                JobEvent.job_id == job_id, JobEvent.message.like("Waiting:%")))

    run_cycle(store, ex, clock=clock)
    run_cycle(store, ex, clock=clock)
    assert reason_events(j3) == 1  # the reason did not change: no event spam

    # j1 preempted (checkpointed) -> requeued with resume_from; j2 lost its pod -> restart 1
    clock.t += 3600
    ex.running.pop(j1), ex.running.pop(j2)
    ex.changes = [ObservedChange(j1, ObservedKind.STOPPED, stop_reason=StopReason.PREEMPT, checkpoint="/ck/step-5"),
                  ObservedChange(j2, ObservedKind.REQUEUE, error_code="evicted", message="pod evicted")]
    run_cycle(store, ex, clock=clock)
    with session_scope(settings.resolved_database_url) as s:
        r1, r2 = s.get(Job, j1), s.get(Job, j2)
        assert r1.resume_from == "/ck/step-5" and r2.restarts == 1
        assert r1.usage["segments"][0]["end"] == clock.t and r1.usage["gpu_seconds"] == 3600.0
        # both were requeued and (normal priority first) placed again in the same cycle
        assert {r1.status, r2.status} == {"running"} and len(r1.usage["segments"]) == 2
        usage_a = tenant_usage(s, a.tenant_id, clock.t - 7200, clock.t + 1, now=clock.t)
    assert usage_a["by_pool"]["local"]["gpu_seconds"] == 3600.0 and usage_a["jobs"] == 1
    # j3 still waits, and its place in the queue is the scheduler's: behind the requeued j1.
    assert client.get(f"{JOBS}/{j3}", headers=a.headers).json()["queue_position"] == 1
    assert client.post(f"{JOBS}/{j3}/cancel", headers=a.headers).json()["queue_position"] is None


class ObservingExecutor(RecordingExecutor):
    """A cluster executor: its snapshot is what it observed, not the pools file."""

    def __init__(self, pools, nodes):
        super().__init__(pools)
        self.nodes = nodes  # [(pool, node, gpus_total, gpus_free)]

    def snapshot(self):
        from scheduling.capacity import NodeCapacity

        snap = CapacitySnapshot(pools={p.name: p for p in self.pools}, observed=True)
        for pool, node, total, free in self.nodes:
            snap.add_node(NodeCapacity(node, pool, total, free))
        return snap


def test_node_pools_show_what_the_scheduler_observed_in_the_cluster(settings, client, tenant_key):
    """Kubernetes mode: GET /v1/node_pools shows the scheduler's fresh observation of the
    Nodes (names, allocatable, free), and the pools file's view once it is stale."""
    import datetime as dt

    from control.db.models import PoolCapacity

    a = tenant_key()
    pools = [local_pool(slots=2)]
    store = DbStore(settings, pools)

    def view():
        data = client.get("/v1/node_pools", headers=a.headers).json()["data"]
        return {p["name"]: p for p in data}["local"]

    configured = view()
    assert configured["capacity_source"] == "config" and configured["observed_at"] is None
    run_cycle(store, RecordingExecutor(pools))  # the local executor publishes nothing
    assert view()["capacity_source"] == "config"

    ex = ObservingExecutor(pools, [("local", "gpu-node-a", 8, 3), ("local", "gpu-node-b", 8, 8)])
    run_cycle(store, ex)
    seen = view()
    assert seen["capacity_source"] == "cluster" and seen["observed_at"] is not None
    assert (seen["nodes"], seen["gpus_total"], seen["gpus_used"], seen["gpus_free"]) == (2, 16, 5, 11)
    assert seen["node_list"] == [
        {"name": "gpu-node-a", "gpus_total": 8, "gpus_used": 5, "gpus_free": 3},
        {"name": "gpu-node-b", "gpus_total": 8, "gpus_used": 0, "gpus_free": 8},
    ]
    with session_scope(settings.resolved_database_url) as s:
        s.get(PoolCapacity, "local").observed_at -= dt.timedelta(minutes=5)
    assert view() == configured


def test_run_forever_runs_cycles_and_stops(settings):
    """The `tunefleet scheduler` entry point: builds executor/store/lock from settings."""
    import threading

    from worker.scheduler.loop import run_forever

    stop = threading.Event()
    s = settings.model_copy(update={"schedule_interval_s": 0.05})
    run_forever(s, stop=stop, max_cycles=3)  # returns after 3 cycles, nothing queued
    assert (settings.data_path / "scheduler.lock").exists()  # SQLite mode: the file lock


def _first(store, method, request):
    """Make ``store.<method>`` send ``request`` (an API call that must succeed) first: a
    user acting between the cycle's plan and its writes."""
    real = getattr(store, method)

    def wrapped(items):
        assert request().status_code == 200
        return real(items)

    setattr(store, method, wrapped)


def test_admissions_are_batched_and_one_bad_job_keeps_no_one_out(settings, client, tenant_key, make_job,  # noqa: F811
                                                                  monkeypatch):
    """Admissions go in transactions of ADMIT_CHUNK jobs. Inside a chunk, a job cancelled
    since the plan is skipped and a job whose spec fails is failed, the rest admitted; a
    chunk that fails as a whole (an unexpected error) is retried one job at a time."""
    import worker.scheduler.store as store_module
    from control.db.models import File
    from worker import spec_builder

    _tiny_config(settings)
    monkeypatch.setattr(store_module, "ADMIT_CHUNK", 3)
    a = tenant_key()
    ids = [make_job(a.headers)["id"] for _ in range(7)]
    cancelled, bad_file, crashing = ids[1], ids[2], ids[4]
    pools = [local_pool(slots=7)]
    store, ex = DbStore(settings, pools), RecordingExecutor(pools)

    with session_scope(settings.resolved_database_url) as s:  # j2's training file: its own, deleted
        job = s.get(Job, bad_file)
        original = s.get(File, job.training_file)
        copy = File(**{c.key: getattr(original, c.key) for c in File.__table__.columns})
        copy.id, copy.deleted_at = "file-deleted-for-test", original.created_at
        s.add(copy)
        s.flush()
        job.training_file = copy.id

    real_build = spec_builder.build_spec

    def build(session, job, *args, **kwargs):
        if job.id == crashing:
            raise RuntimeError("unexpected")
        return real_build(session, job, *args, **kwargs)

    monkeypatch.setattr(spec_builder, "build_spec", build)
    _first(store, "admit", lambda: client.post(f"{JOBS}/{cancelled}/cancel", headers=a.headers))
    run_cycle(store, ex)

    launched = [j for j, _ in ex.launches]
    assert sorted(launched) == sorted(set(ids) - {cancelled, bad_file, crashing})
    status = {j: client.get(f"{JOBS}/{j}", headers=a.headers).json() for j in ids}
    assert status[cancelled]["status"] == "cancelled"
    assert status[bad_file]["status"] == "failed" and status[bad_file]["error"]["code"] == "file_not_found"
    assert status[crashing]["status"] == "queued"  # its chunk-mates were admitted one by one
    assert all(status[j]["status"] == "running" for j in launched)
    with session_scope(settings.resolved_database_url) as s:
        admitted_events = s.scalars(select(JobEvent.job_id).where(JobEvent.message.like("Admitted on pool%"))).all()
    assert sorted(admitted_events) == sorted(launched)  # one event each, none for the refused


def test_waiting_reasons_skip_jobs_that_left_the_queue(settings, client, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    a = tenant_key()
    running, waits, leaves = (make_job(a.headers)["id"] for _ in range(3))
    pools = [local_pool(slots=1)]
    store, ex = DbStore(settings, pools), RecordingExecutor(pools)
    _first(store, "set_waiting", lambda: client.post(f"{JOBS}/{leaves}/cancel", headers=a.headers))
    run_cycle(store, ex)
    assert [j for j, _ in ex.launches] == [running]
    got = {j: client.get(f"{JOBS}/{j}", headers=a.headers).json() for j in (waits, leaves)}
    assert got[waits]["queue_reason"].startswith("waiting: local: needs 1x cpu, 0 free; position 1")
    assert got[waits]["queue_position"] == 1
    assert got[leaves]["status"] == "cancelled"
    assert got[leaves]["queue_reason"] is None and got[leaves]["queue_position"] is None
    with session_scope(settings.resolved_database_url) as s:
        def waiting_events(job_id):
            return s.scalar(select(func.count()).select_from(JobEvent).where(
                JobEvent.job_id == job_id, JobEvent.message.like("Waiting:%")))
        assert (waiting_events(waits), waiting_events(leaves)) == (1, 0)


def test_the_adapter_decides_whether_a_jax_pool_takes_a_qlora_job(settings, client, tenant_key, make_job):  # noqa: F811
    """The store maps the stored adapter (double_quant included) onto the job's training
    shape; a JAX-only pool then trains an NF4 base and refuses a double-quantized one,
    which no pool can ever hold: it fails with no_pool_fits instead of waiting."""
    _tiny_config(settings)
    a = tenant_key()
    nf4, double_quant = (make_job(a.headers, adapter={"method": "qlora"})["id"] for _ in range(2))
    with session_scope(settings.resolved_database_url) as s:
        row = s.get(Job, double_quant)
        row.adapter = {**row.adapter, "double_quant": True}  # the trainer spec's field; not in the API
    jax_only = local_pool(slots=2).model_copy(update={"trainers": ("jax_lora",)})
    store, ex = DbStore(settings, [jax_only]), RecordingExecutor([jax_only])
    run_cycle(store, ex)
    assert [j for j, _ in ex.launches] == [nf4]
    spec = dict(ex.launches)[nf4]
    assert (spec["trainer"], spec["adapter"]["quantization"], spec["adapter"]["double_quant"]) == (
        "jax_lora", "nf4", False)
    refused = client.get(f"{JOBS}/{double_quant}", headers=a.headers).json()
    assert refused["status"] == "failed" and refused["error"]["code"] == "no_pool_fits"
    assert "(local: runs jax_lora, job needs fsdp_qlora (nf4 base with double_quant))" in (
        refused["error"]["message"])


def test_a_queued_dpo_job_is_placed_with_its_dpo_shape_and_spec(settings, client, tenant_key, make_job):  # noqa: F811
    """The store reads the job's method: a DPO job's request counts two sequences per
    example, and the spec it launches with trains DPO on its preference file."""
    from tests.preference_data import sum_preference_lines

    _tiny_config(settings)
    a = tenant_key()
    file_id = client.post("/v1/files", headers=a.headers, data={"purpose": "fine-tune"},
                          files={"file": ("p.jsonl", sum_preference_lines(12), "application/jsonl")}).json()["id"]
    dpo = make_job(a.headers, training_file=file_id, method={"type": "dpo"})["id"]
    sft = make_job(a.headers)["id"]
    pool = local_pool(slots=2)
    store, ex = DbStore(settings, [pool]), RecordingExecutor([pool])
    shapes = {r.job_id: r.training for r in store.queued()}
    assert (shapes[dpo].objective, shapes[sft].objective) == ("dpo", "supervised")
    run_cycle(store, ex)
    spec = dict(ex.launches)[dpo]
    assert (spec["method"]["type"], spec["method"]["beta"], spec["data"]["format"]) == ("dpo", 0.1, "preference")


def test_an_admitted_job_runs_the_chosen_step_and_a_resumed_run_keeps_it(settings, client, tenant_key,
                                                                         make_job):  # noqa: F811
    """Admission writes the step choice into the spec (micro batch, remat and activation
    checkpointing, planned bytes), an event in words, and the job; a resumed run keeps it."""
    from scheduling.step_choice import StepChoice
    from scheduling.throughput import model_flops_per_token

    _tiny_config(settings)
    a = tenant_key()
    jid = make_job(a.headers, hyperparameters={"batch_size": 4, "n_epochs": 1})["id"]
    pool = local_pool(slots=1)
    store, ex = DbStore(settings, [pool]), RecordingExecutor([pool])
    request = {r.job_id: r for r in store.queued()}[jid]
    run_cycle(store, ex)
    spec = dict(ex.launches)[jid]
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, jid)
        stored = StepChoice.from_dict(job.estimate["step"])
        throughput = job.estimate["throughput"]
        events = s.scalars(select(JobEvent.message).where(JobEvent.job_id == jid,
                                                          JobEvent.message.like("Step:%"))).all()
    # a tiny model on a 16 GiB CPU slot: the whole batch in one micro batch, no recomputation
    assert (stored.micro_batch, stored.remat, stored.fits) == (4, "none", True)
    assert spec["hyperparameters"]["micro_batch_size"] == 4 and spec["hyperparameters"]["batch_size"] == 4
    assert (spec["parallelism"]["remat"], spec["parallelism"]["activation_checkpointing"]) == ("none", "none")
    assert spec["parallelism"]["planned_memory_bytes"] == stored.planned_bytes > 0
    assert events == [f"Step: {stored.describe()}."]
    assert events[0].startswith("Step: micro-batch 4, no remat: ")
    # Beside it, what each step's MFU needs: the model's FLOPs per token and the gang's peak.
    assert throughput == {"model_flops_per_token": model_flops_per_token(request.model, request.training),
                          "peak_flops": 1 * pool.peak_tflops * 1e12}
    assert throughput["model_flops_per_token"] > 0

    # The run is lost and requeued to resume: its earlier choice (made smaller here, as if a
    # smaller device had chosen it) is kept, not chosen again.
    kept = StepChoice(2, "none", False, stored.planned_bytes, stored.device_bytes)
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, jid)
        job.status, job.resume_from = "queued", "latest"
        job.estimate = {**job.estimate, "step": kept.to_dict()}
    ex.running.clear()
    ex.launches.clear()
    run_cycle(store, ex)
    spec = dict(ex.launches)[jid]
    assert spec["hyperparameters"]["micro_batch_size"] == 2 and spec["hyperparameters"]["batch_size"] == 4
