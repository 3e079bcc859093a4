"""The scheduling cycle: order, fair share, backfill with reservations, preemption, lock."""

import itertools
import threading
from dataclasses import replace

import pytest

from scheduling.capacity import CapacitySnapshot
from scheduling.ordering import FairQueue, dominant_shares
from tests.worker.builders import cluster, make_job, mi300x, rtx4090, running
from tests.worker.memory_store import (
    MemoryExecutor,
    MemoryJob,
    MemoryStore,
    TransitionRefused,
    transition,
)
from worker.executors.base import StopReason
from worker.scheduler.cycle import CycleConfig, plan_cycle, run_cycle
from worker.scheduler.lock import FileLock, InProcessLock
from worker.scheduler.loop import Components, run_once


def small(tenant="org-a", **kw):
    b = make_job().qlora("7b").tenant(tenant).tokens(10**6)
    for k, v in kw.items():
        getattr(b, k)(v)
    return b.build()


def test_order_is_priority_then_share_then_age():
    jobs = [make_job().id("old-low").priority("low").created(1).build(),
            make_job().id("new-high").priority("high").created(9).build(),
            make_job().id("a-normal").tenant("org-a").created(2).build(),
            make_job().id("b-normal").tenant("org-b").created(3).build()]
    order = [j.job_id for j in FairQueue(jobs, {"org-a": 0.5, "org-b": 0.1}, {})]
    assert order == ["new-high", "b-normal", "a-normal", "old-low"]


def test_dominant_share_counts_held_and_recent_gpus():
    snap = cluster(mi300x(1), rtx4090(4),
                   running=[running("x", "rtx4090", [("rtx4090-0", 2)], tenant="org-a")])
    shares = dominant_shares(snap, {("org-b", "mi300x"): 4 * 3600.0}, 3600.0, ["org-a", "org-b", "org-c"])
    assert shares == {"org-a": 2 / 8, "org-b": 4 / 8, "org-c": 0.0}


def test_fair_share_interleaves_tenants_within_a_cycle():
    jobs = [small("org-a", created=i) for i in range(10)] + [small("org-b", created=100 + i) for i in range(2)]
    plan = plan_cycle(jobs, cluster(rtx4090(2)), now=0.0)
    assert [a.job.tenant for a in plan.admissions] == ["org-a", "org-b", "org-a", "org-b"]


def test_recent_usage_puts_heavy_tenant_last():
    jobs = [small("org-a", created=1), small("org-b", created=2)]
    plan = plan_cycle(jobs, cluster(rtx4090(1)), now=0.0,
                      recent_gpu_seconds={("org-a", "rtx4090"): 1e6})
    assert plan.admissions[0].job.tenant == "org-b"


def test_waiting_reason_has_position():
    jobs = [small(created=i) for i in range(4)]
    plan = plan_cycle(jobs, cluster(rtx4090(1)), now=0.0)
    assert len(plan.admissions) == 2
    assert [w.position for w in plan.waiting] == [1, 2]
    assert plan.waiting[1].reason == "waiting: rtx4090: needs 1x nvidia-rtx-4090, 0 free; position 2 in queue"


def _starvation_run(backfill: bool, cycles: int = 40) -> tuple[bool, int]:
    """A 405B job waits for a whole MI300X node while a stream of 1-GPU jax jobs arrives.

    Small jobs run 3 cycles each (and the estimator does not know: no token count), so
    without a reservation some small job always holds a GPU of the node.
    """
    pool = mi300x(1)
    store, ex = MemoryStore(), MemoryExecutor([pool])
    config = CycleConfig(backfill=backfill)
    started: dict[str, int] = {}
    for i in range(6):
        store.submit(make_job().lora("7b").trainer("jax_lora").tokens(None).id(f"s{i}").created(i).build())
    run_cycle(store, ex, config=config)
    store.submit(make_job().lora("405b").id("big").created(100).build())
    for c in range(cycles):
        for jid in list(ex.running):
            started.setdefault(jid, c)
            if jid != "big" and c - started[jid] >= 3:
                ex.finish(jid)
        store.submit(make_job().lora("7b").trainer("jax_lora").tokens(None).id(f"n{c}").created(200 + c).build())
        run_cycle(store, ex, config=config)
        if "big" in ex.running:
            return True, c
    return False, cycles


def test_head_job_is_never_starved_by_backfill():
    ran, cycle = _starvation_run(backfill=True)
    assert ran and cycle <= 5
    # Control: without reservations the same stream starves it (the test can fail).
    assert _starvation_run(backfill=False) == (False, 40)


def test_easy_backfill_allows_jobs_that_end_before_the_reservation():
    pool = mi300x(1)
    blocker = running("blk", "mi300x", [("mi300x-0", 4)], expected_end=10_000.0)
    snap = cluster(pool, running=[blocker])
    big = make_job().lora("405b").id("big").created(1).build()
    short = make_job().lora("7b").trainer("jax_lora").id("short").tokens(10**6).created(2).build()
    long = make_job().lora("7b").trainer("jax_lora").id("long").tokens(10**11).created(3).build()
    plan = plan_cycle([big, short, long], snap, now=0.0)
    assert [a.job.job_id for a in plan.admissions] == ["short"]
    assert plan.reservations["mi300x-0"] == ("big", 10_000.0)
    assert {w.job.job_id for w in plan.waiting} == {"big", "long"}


def test_preemption_checkpoints_requeues_and_resumes():
    pool = rtx4090(1)
    store, ex = MemoryStore(), MemoryExecutor([pool], clock=itertools.count().__next__)
    for i in range(2):
        store.submit(small(id=f"low{i}", priority="low", created=i))
    run_cycle(store, ex)
    assert set(ex.running) == {"low0", "low1"}
    store.submit(small(id="hi", priority="high", created=10))
    run_cycle(store, ex)
    assert ex.stopped == [("low1", StopReason.PREEMPT)]  # most recent start, least work lost
    run_cycle(store, ex)  # victim still checkpointing: nobody else is preempted
    assert ex.stopped == [("low1", StopReason.PREEMPT)]
    assert "waiting for stopping job(s)" in store.jobs["hi"].queue_reason
    ex.exit_stopped("low1", checkpoint="/ckpt/low1/step-7")
    run_cycle(store, ex)
    assert store.jobs["low1"].status == "queued" and store.jobs["low1"].resume_from == "/ckpt/low1/step-7"
    assert "hi" in ex.running and store.jobs["hi"].status == "running"
    ex.finish("hi")
    run_cycle(store, ex)
    assert "low1" in ex.running and ex.launched.count("low1") == 2


def test_events_only_when_the_reason_changes():
    store, ex = MemoryStore(), MemoryExecutor([rtx4090(1)])
    for i in range(3):
        store.submit(small(id=f"j{i}", created=i))
    for _ in range(5):
        run_cycle(store, ex)
    assert len(store.jobs["j2"].events) == 1
    ex.finish("j0")
    run_cycle(store, ex)
    assert store.jobs["j2"].status == "running"


def _two_concurrent_cycles(lock_factory, run):
    """Both cycles take their snapshot before either admits (a barrier forces it)."""
    store, ex = MemoryStore(), MemoryExecutor([rtx4090(2)])  # store.refused: admissions of jobs no longer queued
    for i in range(4):
        store.submit(small(id=f"j{i}", created=i))
    barrier = threading.Barrier(2, timeout=0.5)

    def wait():
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass  # the other cycle did not run (it lost the lock, or waits for this one)

    ex.snapshot_hook = wait
    lock = lock_factory()
    errors: list[BaseException] = []

    def cycle():
        try:
            run(store, ex, lock)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=cycle) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    return store, ex


def _cycle(store, ex, lock):
    run_cycle(store, ex, lock=lock)


def test_lock_prevents_double_placement():
    store, ex = _two_concurrent_cycles(InProcessLock, _cycle)
    assert sorted(ex.launched) == ["j0", "j1", "j2", "j3"]
    assert not store.refused
    # Control: without the lock both cycles plan the same jobs; the second admit is refused
    # (as the DB transition would refuse it) -- that is the double placement the lock avoids.
    store, ex = _two_concurrent_cycles(lambda: None, _cycle)
    assert store.refused
    assert sorted(ex.launched) == ["j0", "j1", "j2", "j3"]  # a refusal does not stop the others


def test_threads_of_one_process_take_turns(tmp_path):
    """A process-wide lock (here a file lock) lets every thread of its holder in; run_once does not."""
    components = {}

    def once(store, ex, lock):
        key = id(store)
        if key not in components:
            components[key] = Components(store, ex, lock, CycleConfig())
        run_once(components[key])

    store, ex = _two_concurrent_cycles(lambda: FileLock(tmp_path / "a.lock"), once)
    assert sorted(ex.launched) == ["j0", "j1", "j2", "j3"]
    assert not store.refused
    # Control: the same file lock shared by two threads without run_once lets both plan.
    store, _ = _two_concurrent_cycles(lambda: FileLock(tmp_path / "b.lock"), _cycle)
    assert store.refused


def test_capacity_snapshot_indexes_stay_consistent():
    snap = CapacitySnapshot.from_pools([rtx4090(3)])
    job = running("x", "rtx4090", [("rtx4090-1", 2)])
    snap.allocate(job)
    assert list(snap.nodes_with_free("rtx4090", 0)) == ["rtx4090-1"]
    assert snap.tenant_gpus("org-a", "rtx4090") == 2
    snap.release("x")
    assert list(snap.nodes_with_free("rtx4090", 2)) == ["rtx4090-0", "rtx4090-2", "rtx4090-1"]
    assert snap.pool_free("rtx4090") == 6


def test_the_memory_store_moves_status_only_through_its_transition_rules():
    row = MemoryJob(make_job().build(), "ftjob-x")
    transition(row, "running", "admitted")
    with pytest.raises(TransitionRefused):
        transition(row, "running", "admitted twice")
    transition(row, "succeeded", "the trainer finished")
    with pytest.raises(TransitionRefused):
        transition(row, "queued", "requeued after the end")
    assert row.status == "succeeded" and row.events == ["admitted", "the trainer finished"]


def test_a_job_no_pool_can_hold_fails_and_leaves_the_queue_positions_to_the_others():
    huge = make_job().lora("405b").id("huge").created(0).build()  # no 24 GB pool holds 405B in bf16
    jobs = [huge] + [small(created=i) for i in range(1, 5)]
    plan = plan_cycle(jobs, cluster(rtx4090(1)), now=0.0)
    assert [u.job.job_id for u in plan.unfit] == ["huge"]
    assert [r.code.value for r in plan.unfit[0].reasons] == ["memory_does_not_fit"]
    assert plan.unfit[0].reasons[0].message.startswith("rtx4090: ")
    assert "huge" not in {w.job.job_id for w in plan.waiting}
    assert len(plan.admissions) == 2 and [w.position for w in plan.waiting] == [1, 2]


def test_a_job_that_asked_to_queue_anyway_waits_with_its_reason():
    huge = replace(make_job().lora("405b").id("huge").build(), queue_if_unfit=True)
    plan = plan_cycle([huge], cluster(rtx4090(1)), now=0.0)
    assert plan.unfit == [] and [w.job.job_id for w in plan.waiting] == ["huge"]
    assert "rtx4090: needs" in plan.waiting[0].reason


def test_a_queued_job_whose_pool_left_the_pools_file_fails_with_no_pool_fits():
    """The scheduler restarted on a pools file without the job's pool: the pinned job and
    the one only that pool's family could train fail; a busy pool's jobs still wait."""
    store = MemoryStore()
    pinned = store.submit(small(id="pinned", pool="rtx4090"))
    hqq = store.submit(make_job().qlora("7b", quantization="hqq4").id("hqq").tokens(10**6).build())
    first = store.submit(make_job().lora("7b").trainer("jax_lora").id("first").tokens(10**6).created(1).build())
    waits = store.submit(make_job().lora("405b").id("waits").created(50).build())
    run_cycle(store, MemoryExecutor([mi300x(1)]))
    assert (pinned.status, hqq.status) == ("failed", "failed")
    assert "pool 'rtx4090' does not exist" in pinned.events[-1]
    assert pinned.events[-1].startswith("No node pool can hold this job, even with all its GPUs free")
    assert "mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)" in hqq.events[-1]
    assert first.status == "running"
    assert waits.status == "queued" and waits.queue_reason.startswith("waiting: mi300x")
