"""place_job: table-driven cases over a two-pool cluster (MI300X + RTX 4090)."""

import pytest

from scheduling.placement import PreemptionPolicy, place_job, trainer_for
from scheduling.pools import GIB
from tests.worker.builders import cluster, make_job, mi300x, rtx4090, running

POLICY = PreemptionPolicy()


def full_4090s(nodes=4, **kw):
    pool = rtx4090(nodes=nodes, **kw)
    jobs = [running(f"r{i}", "rtx4090", [(f"rtx4090-{i}", 2)], priority="low", started_at=i) for i in range(nodes)]
    return pool, jobs


CASES = [
    # name, job, pools, running, expected (mode, pool, gpus), reason fragment
    ("7b qlora takes one 4090", make_job().qlora("7b").tokens(10**6), [mi300x(1), rtx4090(2)], [],
     ("fit", "rtx4090", 1), "1x nvidia-rtx-4090"),
    ("405b lora needs a whole mi300x node", make_job().lora("405b"), [mi300x(1), rtx4090(2)], [],
     ("fit", "mi300x", 8), "8x amd-mi300x"),
    ("pinned pool is honoured", make_job().lora("7b").pool("mi300x"), [mi300x(1), rtx4090(2)], [],
     ("fit", "mi300x", 1), ""),
    ("pinned trainer family restricts pools", make_job().lora("7b").trainer("jax_lora"), [mi300x(1), rtx4090(2)], [],
     ("fit", "mi300x", 1), ""),
    ("nf4 qlora pinned to a jax pool trains there", make_job().qlora("7b").pool("mi300x"), [mi300x(1), rtx4090(2)],
     [], ("fit", "mi300x", 1), "1x amd-mi300x"),
    ("nf4 qlora takes the mi300x when the 4090s are full", make_job().qlora("7b"), [mi300x(1), full_4090s()[0]],
     full_4090s()[1], ("fit", "mi300x", 1), "1x amd-mi300x"),
    ("nf4 qlora on a jax-only fleet", make_job().qlora("70b"), [mi300x(1)], [], ("fit", "mi300x", 1), ""),
    ("nf4 qlora pinned to jax_lora", make_job().qlora("7b").trainer("jax_lora"), [mi300x(1), rtx4090(2)], [],
     ("fit", "mi300x", 1), ""),
    ("hqq4 never goes to a jax-only pool", make_job().qlora("7b", "hqq4").pool("mi300x"), [mi300x(1), rtx4090(2)],
     [], ("no_fit", None, 0), "mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)"),
    ("hqq4 waits for the full 4090s, not the free mi300x", make_job().qlora("7b", "hqq4").priority("low"),
     [mi300x(1), full_4090s()[0]], full_4090s()[1], ("no_fit", None, 0),
     "mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)"),
    ("double-quantized nf4 never goes to a jax-only pool", make_job().qlora("7b").double_quant(), [mi300x(1)], [],
     ("no_fit", None, 0), "mi300x: runs jax_lora, job needs fsdp_qlora (nf4 base with double_quant)"),
    ("double-quantized nf4 still takes a 4090", make_job().qlora("7b").double_quant(), [mi300x(1), rtx4090(2)], [],
     ("fit", "rtx4090", 1), ""),
    ("jax_lora pinned with an hqq4 base", make_job().qlora("7b", "hqq4").trainer("jax_lora"),
     [mi300x(1), rtx4090(2)], [], ("no_fit", None, 0), "job asks for jax_lora, which cannot train a hqq4 base"),
    ("unknown pool", make_job().qlora("7b").pool("tpu"), [rtx4090(2)], [], ("no_fit", None, 0),
     "pool 'tpu' does not exist"),
    ("405b never fits 4090s", make_job().lora("405b"), [rtx4090(4)], [], ("no_fit", None, 0),
     "per GPU even on 8x nvidia-rtx-4090"),
    ("405b waits for a whole node", make_job().lora("405b"), [mi300x(1)],
     [running("x", "mi300x", [("mi300x-0", 1)])], ("no_fit", None, 0), "needs 8x amd-mi300x, 7 free"),
    ("multi-node gang needs whole free nodes", make_job().qlora("70b").gpus(4), [rtx4090(3)],
     [running("x", "rtx4090", [("rtx4090-0", 1)]), running("y", "rtx4090", [("rtx4090-1", 1)])],
     ("no_fit", None, 0), "needs 4x nvidia-rtx-4090 (2 whole nodes), 1 whole nodes free"),
    ("multi-node gang fits on whole nodes", make_job().qlora("70b").gpus(4), [rtx4090(3)],
     [running("x", "rtx4090", [("rtx4090-0", 1)])], ("fit", "rtx4090", 4), ""),
    ("jax-only job cannot use 4090s", make_job().lora("7b").trainer("jax_lora"), [rtx4090(2)], [],
     ("no_fit", None, 0), "rtx4090: runs fsdp_qlora, job needs jax_lora"),
]


@pytest.mark.parametrize("name, builder, pools, jobs, expected, fragment", CASES, ids=[c[0] for c in CASES])
def test_place_job(name, builder, pools, jobs, expected, fragment):
    placement = place_job(builder.build(), cluster(*pools, running=jobs), policy=POLICY)
    assert (placement.mode, placement.pool, placement.gpus) == expected
    assert fragment in placement.reason_text()
    if placement.mode == "fit":
        assert sum(n for _, n in placement.nodes) == placement.gpus
        assert placement.trainer in {"jax_lora", "fsdp_qlora"}


def test_trainer_follows_pool():
    snap = cluster(mi300x(1), rtx4090(1))
    assert place_job(make_job().lora("405b").build(), snap).trainer == "jax_lora"
    assert place_job(make_job().qlora("7b").tokens(10**6).build(), snap).trainer == "fsdp_qlora"
    assert place_job(make_job().qlora("7b").pool("mi300x").build(), snap).trainer == "jax_lora"


BOTH = ("fsdp_qlora", "jax_lora")
TRAINERS = [
    # name, job, the pool's families (first = preferred), expected trainer
    ("auto lora takes the preferred family", make_job().lora("7b"), ("jax_lora", "fsdp_qlora"), "jax_lora"),
    ("auto nf4 keeps a preferred jax_lora", make_job().qlora("7b"), ("jax_lora", "fsdp_qlora"), "jax_lora"),
    ("auto nf4 keeps a preferred fsdp_qlora", make_job().qlora("7b"), BOTH, "fsdp_qlora"),
    ("auto hqq4 skips a preferred jax_lora", make_job().qlora("7b", "hqq4"), ("jax_lora", "fsdp_qlora"), "fsdp_qlora"),
    ("auto double-quant skips a preferred jax_lora", make_job().qlora("7b").double_quant(),
     ("jax_lora", "fsdp_qlora"), "fsdp_qlora"),
    ("auto nf4 on jax only", make_job().qlora("7b"), ("jax_lora",), "jax_lora"),
    ("auto hqq4 on jax only", make_job().qlora("7b", "hqq4"), ("jax_lora",), None),
    ("auto double-quant on jax only", make_job().qlora("7b").double_quant(), ("jax_lora",), None),
    ("pinned jax_lora nf4", make_job().qlora("7b").trainer("jax_lora"), BOTH, "jax_lora"),
    ("pinned jax_lora hqq4", make_job().qlora("7b", "hqq4").trainer("jax_lora"), BOTH, None),
    ("pinned jax_lora double-quant", make_job().qlora("7b").double_quant().trainer("jax_lora"), BOTH, None),
    ("pinned fsdp_qlora hqq4", make_job().qlora("7b", "hqq4").trainer("fsdp_qlora"), BOTH, "fsdp_qlora"),
    ("pinned fsdp_qlora on jax only", make_job().qlora("7b").trainer("fsdp_qlora"), ("jax_lora",), None),
    ("auto reinforcement skips a preferred jax_lora", make_job().lora("7b")._t(objective="reinforcement", group_size=4),
     ("jax_lora", "fsdp_qlora"), "fsdp_qlora"),
    ("auto reinforcement on jax only", make_job().lora("7b")._t(objective="reinforcement", group_size=4),
     ("jax_lora",), None),
    ("pinned jax_lora reinforcement", make_job().lora("7b")._t(objective="reinforcement").trainer("jax_lora"),
     BOTH, "jax_lora"),
    ("pinned jax_lora reinforcement on jax only",
     make_job().lora("7b")._t(objective="reinforcement").trainer("jax_lora"), ("jax_lora",), "jax_lora"),
]


@pytest.mark.parametrize("name, builder, families, expected", TRAINERS, ids=[c[0] for c in TRAINERS])
def test_trainer_for(name, builder, families, expected):
    assert trainer_for(builder.build(), mi300x(1).model_copy(update={"trainers": families})) == expected


def test_single_node_gang_uses_best_fit_node():
    # node 0 has 1 free, node 1 has 2 free: a 1-GPU job goes to node 0 and keeps node 1 whole.
    snap = cluster(rtx4090(2), running=[running("x", "rtx4090", [("rtx4090-0", 1)])])
    p = place_job(make_job().qlora("7b").build(), snap)
    assert p.nodes == (("rtx4090-0", 1),)


def test_quota_blocks_without_borrowing():
    pool = rtx4090(4, max_gpus_per_tenant={"org-a": 2})
    snap = cluster(pool, running=[running("x", "rtx4090", [("rtx4090-0", 2)], tenant="org-a")])
    p = place_job(make_job().qlora("7b").tenant("org-a").build(), snap)
    assert p.mode == "no_fit" and "tenant quota 2 GPUs, 2 in use, needs 1 more" in p.reason_text()
    assert place_job(make_job().qlora("7b").tenant("org-b").build(), snap).mode == "fit"


def test_quota_borrowing_admits_and_flags():
    pool = rtx4090(4, max_gpus_per_tenant={"*": 2}, quota_borrowing=True)
    snap = cluster(pool, running=[running("x", "rtx4090", [("rtx4090-0", 2)], tenant="org-a")])
    p = place_job(make_job().qlora("7b").tenant("org-a").build(), snap)
    assert p.mode == "fit" and p.borrowing


def test_preemption_same_tenant_lower_priority():
    pool, jobs = full_4090s(2)
    p = place_job(make_job().qlora("7b").priority("high").build(), cluster(pool, running=jobs), policy=POLICY)
    assert p.mode == "fit_after_preemption"
    assert p.victims == ("r1",)  # the most recently started low-priority job: least work lost


def test_no_preemption_of_equal_priority_or_when_disabled():
    pool, jobs = full_4090s(2)
    snap = cluster(pool, running=jobs)
    assert place_job(make_job().qlora("7b").priority("low").build(), snap, policy=POLICY).mode == "no_fit"
    assert place_job(make_job().qlora("7b").priority("high").build(), snap,
                     policy=PreemptionPolicy(enabled=False)).mode == "no_fit"
    assert place_job(make_job().qlora("7b").priority("high").build(), snap, policy=None).mode == "no_fit"


def test_never_preempt_another_tenant_without_borrowing():
    pool = rtx4090(2)
    jobs = [running(f"r{i}", "rtx4090", [(f"rtx4090-{i}", 2)], tenant="org-b", priority="low") for i in range(2)]
    p = place_job(make_job().qlora("7b").priority(100).tenant("org-a").build(), cluster(pool, running=jobs),
                  policy=POLICY)
    assert p.mode == "no_fit"


def test_preempt_another_tenants_borrowed_gpus():
    pool = rtx4090(2, max_gpus_per_tenant={"*": 2}, quota_borrowing=True)
    jobs = [running(f"r{i}", "rtx4090", [(f"rtx4090-{i}", 2)], tenant="org-b", priority="low") for i in range(2)]
    p = place_job(make_job().qlora("7b").priority("high").tenant("org-a").build(), cluster(pool, running=jobs),
                  policy=POLICY)
    assert p.mode == "fit_after_preemption" and len(p.victims) == 1


def test_stopping_jobs_are_waited_for_not_re_preempted():
    pool, jobs = full_4090s(2)
    jobs[1] = running("r1", "rtx4090", [("rtx4090-1", 2)], priority="low", started_at=1, stopping=True)
    p = place_job(make_job().qlora("7b").priority("high").build(), cluster(pool, running=jobs), policy=POLICY)
    assert p.mode == "fit_after_preemption" and p.victims == ()
    assert "waiting for stopping job(s)" in p.reason_text()


def test_multi_node_preemption_frees_whole_nodes():
    pool, jobs = full_4090s(3)
    p = place_job(make_job().qlora("70b").gpus(4).priority("high").build(), cluster(pool, running=jobs), policy=POLICY)
    assert p.mode == "fit_after_preemption" and len(p.victims) == 2
    assert {n for n, _ in p.nodes} == {n for v in p.victims for n, _ in jobs[int(v[1:])].nodes}


CODE_CASES = [
    # name, job, pools, running, expected codes (in order), full text users see
    ("unknown pool", make_job().qlora("7b").pool("tpu"), [rtx4090(2)], [],
     ["pool_pinned_missing"], "pool 'tpu' does not exist"),
    ("no family for the base", make_job().qlora("7b", "hqq4"), [mi300x(1)], [],
     ["trainer_cannot_train"], "mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)"),
    ("too many pinned GPUs", make_job().qlora("7b").gpus(16), [rtx4090(4)], [],
     ["gpus_above_pool_limit"], "rtx4090: at most 8 GPUs per job"),
    ("memory never fits", make_job().lora("405b"), [rtx4090(4)], [], ["memory_does_not_fit"], None),
    ("busy pool, other pool refuses", make_job().qlora("7b", "hqq4").priority("low"),
     [mi300x(1), rtx4090(1)], [running("x", "rtx4090", [("rtx4090-0", 2)])],
     ["insufficient_gpus", "trainer_cannot_train"],
     "waiting: rtx4090: needs 1x nvidia-rtx-4090, 0 free; mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)"),
    ("quota used up", make_job().qlora("7b").tenant("org-b"), [rtx4090(2, max_gpus_per_tenant={"org-b": 1})],
     [running("x", "rtx4090", [("rtx4090-0", 1)], tenant="org-b")],
     ["quota_exceeded"], "waiting: rtx4090: tenant quota 1 GPUs, 1 in use, needs 1 more"),
    ("quota smaller than the job", make_job().qlora("7b").gpus(2).tenant("org-b"),
     [rtx4090(2, max_gpus_per_tenant={"org-b": 1})], [],
     ["quota_below_job"], "rtx4090: the tenant's quota is 1 GPUs and the job needs 2"),
    ("preempts a lower-priority job", make_job().qlora("7b").priority("high"), [rtx4090(1)],
     [running("x", "rtx4090", [("rtx4090-0", 2)], priority="low")],
     ["preempting"], "preempting 1 lower-priority job(s) on rtx4090"),
]


@pytest.mark.parametrize("name, builder, pools, jobs, codes, text", CODE_CASES, ids=[c[0] for c in CODE_CASES])
def test_reasons_carry_stable_codes_next_to_the_words_users_read(name, builder, pools, jobs, codes, text):
    p = place_job(builder.build(), cluster(*pools, running=jobs), policy=POLICY)
    assert [c.value for c in p.codes] == codes
    if text is not None:
        assert p.reason_text() == text
    assert all(r.message for r in p.reasons)


def test_the_estimate_memo_answers_for_the_pool_it_is_given():
    """The memo behind place_job is keyed on every pool number the estimate reads, so a
    pool of the same name with other numbers (a changed pools file) gets its own answer."""
    job = make_job().qlora("70b").build()
    small = place_job(job, cluster(rtx4090(4)))
    big = place_job(job, cluster(rtx4090(4).model_copy(update={"gpu_memory_bytes": 48 * GIB})))
    again = place_job(job, cluster(rtx4090(4)))
    assert "of 24 GiB per GPU" in small.reason_text() and "of 48 GiB per GPU" in big.reason_text()
    assert again == small
