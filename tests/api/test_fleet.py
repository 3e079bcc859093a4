"""Fleet routes: ``GET /v1/node_pools``, ``POST /v1/fine_tuning/estimate``, ``GET /v1/usage``,
and the estimate stored at job creation.

A two-pool fleet (one 8x MI300X 192 GiB node running ``jax_lora``, one 2x RTX 4090 24 GiB
node running ``fsdp_qlora``) and a base-model registry with Llama 7B/8B/70B/405B entries:
the 8B one has a real ``config.json`` (the exact shape), the others only ``params_b`` (the
scheduler's nearest-known-model rule). Estimates are checked against the scheduler's
estimator called directly on the shapes the request implies (the route must map the
body to exactly those), and against the published anchors the estimator was calibrated
on: 8B QLoRA on one 24 GB GPU, 70B QLoRA on 2x24 GB, 405B LoRA bf16 on 8x MI300X.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from control.db.models import Job
from control.jobs.lifecycle import transition
from scheduling.estimator import ModelShape, TrainingShape, estimate_on_pool
from scheduling.model_shapes import KNOWN_MODELS
from scheduling.pools import parse_pools
from tests.conftest import make_settings

GIB = 2**30

POOLS_YAML = """
pools:
  - name: mi300x
    accelerator: amd-mi300x
    gpu_memory_gib: 192
    gpus_per_node: 8
    resource_name: amd.com/gpu
    trainer: jax_lora
    price_per_gpu_hour: 3.0
    peak_tflops: 1307
    nodes: 1
  - name: rtx4090
    accelerator: nvidia-rtx-4090
    gpu_memory_gib: 24
    gpus_per_node: 2
    resource_name: nvidia.com/gpu
    trainer: fsdp_qlora
    price_per_gpu_hour: 0.4
    peak_tflops: 165
    nodes: 1
"""
POOLS = {p.name: p for p in parse_pools(POOLS_YAML)}

# Llama-3.1-8B's config.json values (the 8B entry reads them from disk).
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}


@pytest.fixture
def settings(settings, tmp_path: Path):
    """The suite's settings (SQLite or PostgreSQL) plus the fleet and the model registry."""
    llama8 = tmp_path / "models" / "llama-8b"
    llama8.mkdir(parents=True)
    (llama8 / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    broken = tmp_path / "models" / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("[]")  # valid JSON, not a config
    pools = tmp_path / "node_pools.yaml"
    pools.write_text(POOLS_YAML)
    models = tmp_path / "base_models.yaml"
    models.write_text(
        "models:\n"
        "  - {id: llama-7b, path: 's3://models/llama-2-7b', params_b: 6.7, max_seq_len: 4096}\n"
        f"  - {{id: llama-8b, path: '{llama8}', params_b: 8.0, max_seq_len: 8192}}\n"
        "  - {id: llama-70b, path: 's3://models/llama-3.1-70b', params_b: 70.6, max_seq_len: 8192}\n"
        "  - {id: llama-405b, path: 's3://models/llama-3.1-405b', params_b: 405, max_seq_len: 8192}\n"
        "  - {id: mystery, path: 's3://models/mystery', max_seq_len: 2048}\n"
        f"  - {{id: broken, path: '{broken}', params_b: 8.0, max_seq_len: 2048}}\n"
    )
    return make_settings(
        settings.data_path,
        database_url=settings.resolved_database_url,
        node_pools_file=pools,
        base_models_file=models,
    )


@pytest.fixture(autouse=True)
def idle_fleet(db_session) -> None:
    """Capacity is fleet-wide, and on PostgreSQL the suite shares one database: end the
    running/queued jobs earlier tests left there so each test starts on an idle fleet."""
    db_session.execute(
        update(Job).where(Job.status.in_(("running", "queued"))).values(status="cancelled")
    )
    db_session.commit()


def _estimate(client, headers, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/fine_tuning/estimate", headers=headers, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _row(result: dict[str, Any], pool: str) -> dict[str, Any]:
    return next(r for r in result["pools"] if r["pool"] == pool)


def _create(client, headers, file_id: str, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/fine_tuning/jobs",
        headers=headers,
        json={
            "model": "llama-8b",
            "training_file": file_id,
            "adapter": {"method": "qlora"},
            **body,
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def _run(
    db_session, job_id: str, pool: str, gpus: int, usage: dict[str, Any] | None = None
) -> None:
    row = db_session.get_one(Job, job_id)
    transition(db_session, row, "running", actor="scheduler", pool=pool, gpus=gpus, usage=usage)
    db_session.commit()


# ---- estimate ---------------------------------------------------------------------------


def test_8b_qlora_goes_to_one_4090_with_the_estimators_numbers(client, tenant_key) -> None:
    a = tenant_key()
    result = _estimate(
        client, a.headers, model="llama-8b", adapter={"method": "qlora"}, n_examples=1000
    )
    assert result["object"] == "fine_tuning.estimate"
    assert result["model"] == {
        "id": "llama-8b",
        "params": ModelShape.from_hf_config(LLAMA_8B_CONFIG).params,
        "shape_source": "config.json",
    }
    assert result["mode"] == "fit"
    chosen = result["chosen"]
    assert (chosen["pool"], chosen["gpus"], chosen["trainer"], chosen["mode"]) == (
        "rtx4090",
        1,
        "fsdp_qlora",
        "fit",
    )

    # Reference: the scheduler's estimator on the shapes the body implies. 1000 examples
    # resolve to batch 2 (0.2 %), micro batch 2, 3 epochs -> 1500 steps of 2 x 2048 tokens.
    training = TrainingShape(method="qlora", quantization="nf4", seq_len=2048, micro_batch=2)
    tokens = 1500 * 2 * 2048
    def ref_on(pool: str, trainer: str):
        return estimate_on_pool(ModelShape.from_hf_config(LLAMA_8B_CONFIG), training, POOLS[pool],
                                trainer=trainer, total_tokens=tokens)

    ref = ref_on("rtx4090", "fsdp_qlora")
    row = _row(result, "rtx4090")
    assert result["total_tokens"] == tokens
    assert row["fits"] and row["gpus"] == 1 and not row["cpu_offload"]
    assert row["memory_per_gpu_bytes"] == ref.bytes_per_gpu == chosen["memory_per_gpu_bytes"]
    assert sum(row["breakdown"].values()) == row["memory_per_gpu_bytes"]
    assert row["memory_per_gpu_bytes"] <= row["usable_bytes"] < row["capacity_bytes"] == 24 * GIB
    assert row["eta_s"] == pytest.approx(ref.eta_s, abs=0.05)  # reported to 0.1 s
    assert row["cost"] == pytest.approx(ref.eta_s / 3600 * 0.4, abs=1e-4)
    # Published: torchtune's Llama-3.1-8B QLoRA peaks at 7.4 GiB (seq 512, batch 2); at
    # 2048 tokens it must still sit well inside one 24 GB card.
    assert 7.4 * GIB < row["memory_per_gpu_bytes"] < 20 * GIB
    # The MI300X pool's JAX trainer trains an NF4 base too (one layer dequantized at a
    # time); the 4090 is cheaper per token, so it only lists the pool as an option.
    ref_jax = ref_on("mi300x", "jax_lora")
    mi = _row(result, "mi300x")
    assert (mi["fits"], mi["gpus"], mi["trainer"]) == (True, 1, "jax_lora")
    assert mi["memory_per_gpu_bytes"] == ref_jax.bytes_per_gpu == sum(mi["breakdown"].values())
    assert ref_jax.memory.dequantized_layer > 0
    assert chosen["cost"] < mi["cost"]


def test_hqq4_qlora_is_refused_by_the_jax_pool_with_the_reason(client, tenant_key) -> None:
    a = tenant_key()
    result = _estimate(
        client, a.headers, model="llama-8b", adapter={"method": "qlora", "quantization": "hqq4"}
    )
    assert result["chosen"]["pool"] == "rtx4090"
    mi = _row(result, "mi300x")
    assert not mi["fits"] and mi["trainer"] is None
    assert mi["reasons"] == ["mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)"]

    # Pinned to the JAX pool it can never run: no pool is chosen, and the reason says why.
    pinned = _estimate(
        client,
        a.headers,
        model="llama-8b",
        adapter={"method": "qlora", "quantization": "hqq4"},
        placement={"pool": "mi300x"},
    )
    assert pinned["mode"] == "no_fit" and pinned["chosen"] is None
    assert pinned["reasons"] == ["mi300x: runs jax_lora, job needs fsdp_qlora (hqq4 base)"]


def test_nf4_qlora_takes_the_mi300x_when_the_4090s_are_busy(
    client, tenant_key, processed_file, db_session
) -> None:
    a, b = tenant_key(), tenant_key()
    other = _create(client, b.headers, processed_file(b.headers), placement={"pool": "rtx4090"})
    _run(db_session, other["id"], "rtx4090", 2)
    busy = _estimate(client, a.headers, model="llama-8b", adapter={"method": "qlora"})
    assert busy["mode"] == "fit"
    assert (busy["chosen"]["pool"], busy["chosen"]["gpus"], busy["chosen"]["trainer"]) == (
        "mi300x",
        1,
        "jax_lora",
    )


@pytest.mark.parametrize(
    ("quantization", "double_quant"), [("nf4", False), ("nf4", True), ("hqq4", False)]
)
@pytest.mark.parametrize("trainer", ["jax", "fsdp_qlora", "auto"])
def test_the_apis_trainer_check_agrees_with_the_scheduler(
    client, tenant_key, trainer, quantization, double_quant
) -> None:
    from scheduling.placement import trainer_can_train

    adapter = {"method": "qlora", "quantization": quantization, "double_quant": double_quant}
    response = client.post(
        "/v1/fine_tuning/estimate",
        headers=tenant_key().headers,
        json={"model": "llama-8b", "trainer": trainer, "adapter": adapter},
    )
    family = {"jax": "jax_lora"}.get(trainer, trainer)
    can = family == "auto" or trainer_can_train(
        family, TrainingShape(method="qlora", quantization=quantization, double_quant=double_quant)
    )
    assert response.status_code == (200 if can else 400), response.text


def test_70b_qlora_fits_two_4090s_and_405b_lora_takes_a_whole_mi300x_node(
    client, tenant_key
) -> None:
    a = tenant_key()
    # Answer.AI: 70B QLoRA trains on 2x 24 GB (FSDP + CPU offload of the sharded weights).
    pinned = _estimate(
        client,
        a.headers,
        model="llama-70b",
        adapter={"method": "qlora"},
        placement={"pool": "rtx4090", "gpus": 2},
        max_seq_len=2048,
    )
    assert pinned["model"]["shape_source"].startswith("nearest known model llama-3.1-70b")
    assert pinned["chosen"]["pool"] == "rtx4090" and pinned["chosen"]["gpus"] == 2
    row = _row(pinned, "rtx4090")
    assert row["fits"] and row["cpu_offload"]
    ref = estimate_on_pool(
        KNOWN_MODELS["llama-3.1-70b"],
        TrainingShape(method="qlora", quantization="nf4"),
        POOLS["rtx4090"],
        gpus=2,
    )
    assert row["memory_per_gpu_bytes"] == ref.bytes_per_gpu <= 24 * GIB
    # Unpinned, the 70B QLoRA job lands on the pool that is cheaper per token; the two are
    # within 6 % (one 4090 with offload; one MI300X, whose jax_lora step recomputes less).
    free = _estimate(
        client, a.headers, model="llama-70b", adapter={"method": "qlora"}, max_seq_len=2048
    )
    nf4 = TrainingShape(method="qlora", quantization="nf4")
    costs = {
        name: estimate_on_pool(KNOWN_MODELS["llama-3.1-70b"], nf4, pool, total_tokens=10**7)
        for name, pool in POOLS.items()
    }
    cheapest = min(costs, key=lambda name: costs[name].cost)
    assert (free["chosen"]["pool"], free["chosen"]["gpus"]) == (cheapest, costs[cheapest].gpus)

    # Felafax: Llama-3.1-405B LoRA in bf16 on 8x MI300X.
    big = _estimate(
        client, a.headers, model="llama-405b", adapter={"method": "lora"}, max_seq_len=2048
    )
    assert (big["chosen"]["pool"], big["chosen"]["gpus"], big["chosen"]["trainer"]) == (
        "mi300x",
        8,
        "jax_lora",
    )
    mi = _row(big, "mi300x")
    assert 0.81e12 <= mi["memory_per_gpu_bytes"] * 8 <= 1.3e12
    rtx = _row(big, "rtx4090")
    assert not rtx["fits"] and "GiB per GPU even on" in rtx["reasons"][0]


def test_no_fit_reasons_are_human_readable(client, tenant_key, processed_file, db_session) -> None:
    a, b = tenant_key(), tenant_key()
    never = _estimate(
        client, a.headers, model="llama-405b", placement={"pool": "rtx4090"}, max_seq_len=2048
    )
    assert never["mode"] == "no_fit" and never["chosen"] is None
    assert any(
        "needs" in r and "GiB per GPU" in r and "nvidia-rtx-4090" in r for r in never["reasons"]
    ), never

    # The 4090 node is full (another tenant's job): a pinned 8B QLoRA job waits for it.
    other = _create(client, b.headers, processed_file(b.headers), placement={"pool": "rtx4090"})
    _run(db_session, other["id"], "rtx4090", 2)
    busy = _estimate(
        client,
        a.headers,
        model="llama-8b",
        adapter={"method": "qlora"},
        placement={"pool": "rtx4090"},
    )
    assert busy["mode"] == "no_fit"
    assert busy["reasons"] == ["waiting: rtx4090: needs 1x nvidia-rtx-4090, 0 free"]
    assert busy["chosen"]["pool"] == "rtx4090" and busy["chosen"]["mode"] == "no_fit"
    assert _row(busy, "rtx4090")["gpus_free"] == 0


def test_bad_input_is_400_with_the_param(client, tenant_key, processed_file) -> None:
    a, b = tenant_key(), tenant_key()
    cases = [
        ({"model": "nope"}, "invalid_model", "model"),
        ({"model": "mystery"}, "model_config_unavailable", "model"),
        ({"model": "broken"}, "model_config_unavailable", "model"),
        ({"model": "llama-8b", "adapter": {"r": 0}}, "invalid_request", "adapter.r"),
        ({"model": "llama-8b", "n_examples": 0}, "invalid_request", "n_examples"),
        ({"model": "llama-8b", "max_seq_len": 9000}, "invalid_request", "max_seq_len"),
        ({"model": "llama-8b", "placement": {"pool": "h100"}}, "invalid_request", "placement.pool"),
        ({"model": "llama-8b", "placement": {"gpus": 0}}, "invalid_request", "placement.gpus"),
        (
            {
                "model": "llama-8b",
                "trainer": "jax",
                "adapter": {"method": "qlora", "quantization": "hqq4"},
            },
            "invalid_request",
            "trainer",
        ),
        (
            {"model": "llama-8b", "training_file": processed_file(b.headers)},
            "invalid_file",
            "training_file",
        ),
        ({"model": "llama-8b", "gpus": 2}, "invalid_request", "gpus"),
    ]
    for body, code, param in cases:
        response = client.post("/v1/fine_tuning/estimate", headers=a.headers, json=body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert (error["code"], error["param"]) == (code, param), (body, error)


# ---- job creation stores the estimate ----------------------------------------------------


def test_job_creation_stores_the_estimate(client, tenant_key, processed_file) -> None:
    a = tenant_key()
    job = _create(client, a.headers, processed_file(a.headers))
    shown = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=a.headers).json()
    est = shown["estimate"]
    assert est["object"] == "fine_tuning.estimate" and est["chosen"]["pool"] == "rtx4090"
    hp = shown["hyperparameters"]
    # total_steps x batch_size x the file's mean row (its validation's token stats), as
    # the scheduler counts: far below max_seq_len (2048) per row for these short rows.
    assert 0 < est["total_tokens"] < shown["total_steps"] * hp["batch_size"] * 2048 // 4
    assert est["chosen"]["eta_s"] > 0 and est["chosen"]["cost"] >= 0

    # A model whose shape cannot be known: the job is still created, the reason is stored.
    response = client.post(
        "/v1/fine_tuning/jobs",
        headers=a.headers,
        json={"model": "mystery", "training_file": processed_file(a.headers)},
    )
    assert response.status_code == 200, response.text
    assert response.json()["estimate"]["error"]["code"] == "model_config_unavailable"


# ---- node pools ----------------------------------------------------------------------------


def test_node_pools_show_capacity_and_only_own_running_jobs(
    client, tenant_key, admin_key, processed_file, db_session
) -> None:
    a, b = tenant_key(), tenant_key()
    job_a = _create(client, a.headers, processed_file(a.headers))
    job_b = _create(client, b.headers, processed_file(b.headers))
    _run(db_session, job_a["id"], "rtx4090", 1)
    _run(db_session, job_b["id"], "mi300x", 4)
    waiting = _create(client, a.headers, processed_file(a.headers), placement={"pool": "rtx4090"})
    assert waiting["status"] == "queued"

    def pools(headers: dict[str, str]) -> dict[str, dict[str, Any]]:
        response = client.get("/v1/node_pools", headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "list"
        return {p["name"]: p for p in response.json()["data"]}

    seen_a = pools(a.headers)
    assert list(seen_a) == ["mi300x", "rtx4090"]
    rtx, mi = seen_a["rtx4090"], seen_a["mi300x"]
    assert (rtx["gpus_total"], rtx["gpus_used"], rtx["gpus_free"]) == (2, 1, 1)
    assert (mi["gpus_total"], mi["gpus_used"], mi["gpus_free"]) == (8, 4, 4)
    assert rtx["node_list"] == [
        {"name": "rtx4090-0", "gpus_total": 2, "gpus_used": 1, "gpus_free": 1}
    ]
    assert rtx["trainers"] == ["fsdp_qlora"] and rtx["gpu_memory_bytes"] == 24 * GIB
    assert rtx["price_per_gpu_hour"] == 0.4 and rtx["queued_jobs"] == 1
    assert rtx["running_jobs"] == [job_a["id"]] and mi["running_jobs"] == []
    seen_b = pools(b.headers)
    assert seen_b["rtx4090"]["running_jobs"] == [] and seen_b["mi300x"]["running_jobs"] == [
        job_b["id"]
    ]
    seen_admin = pools({"Authorization": f"Bearer {admin_key}"})
    assert seen_admin["rtx4090"]["running_jobs"] == [job_a["id"]]
    assert seen_admin["mi300x"]["running_jobs"] == [job_b["id"]]


def test_prometheus_gets_the_pool_totals(
    client, tenant_key, processed_file, db_session, backend
) -> None:
    a = tenant_key()
    _run(db_session, _create(client, a.headers, processed_file(a.headers))["id"], "mi300x", 4)
    metrics = client.get("/metrics").text
    assert 'tunefleet_gpus_total{pool="mi300x"} 8.0' in metrics
    assert 'tunefleet_gpus_free{pool="mi300x"} 4.0' in metrics
    # The DB gauges are there on both databases (PostgreSQL cannot GROUP BY json).
    assert 'tunefleet_jobs{pool="mi300x",status="running"} 1.0' in metrics


# ---- usage -----------------------------------------------------------------------------------


def test_usage_sums_a_jobs_segments_per_pool(
    client, tenant_key, admin_key, processed_file, db_session
) -> None:
    a, b = tenant_key(), tenant_key()
    job = _create(client, a.headers, processed_file(a.headers))
    usage = {
        "segments": [
            {
                "pool": "rtx4090",
                "gpus": 2,
                "start": 1000.0,
                "end": 4600.0,
                "price_per_gpu_hour": 0.4,
            },
            {
                "pool": "mi300x",
                "gpus": 8,
                "start": 5000.0,
                "end": 5900.0,
                "price_per_gpu_hour": 3.0,
            },
        ]
    }
    _run(db_session, job["id"], "mi300x", 8, usage=usage)

    whole = client.get("/v1/usage", params={"start": 0, "end": 10000}, headers=a.headers).json()
    assert whole["object"] == "usage" and whole["tenant_id"] == a.tenant_id and whole["jobs"] == 1
    assert whole["by_pool"] == {
        "mi300x": {"gpu_seconds": 7200.0, "cost": 6.0},
        "rtx4090": {"gpu_seconds": 7200.0, "cost": 0.8},
    }
    assert whole["gpu_seconds"] == 14400.0 and whole["cost"] == pytest.approx(6.8)
    # Clipped to the range: from 2800 s (ISO 8601 form) only half of the 4090 segment counts.
    clipped = client.get(
        "/v1/usage", params={"start": "1970-01-01T00:46:40+00:00", "end": 10000}, headers=a.headers
    ).json()
    assert clipped["by_pool"]["rtx4090"] == {"gpu_seconds": 3600.0, "cost": 0.4}

    assert client.get("/v1/usage", headers=b.headers).json()["gpu_seconds"] == 0
    admin = {"Authorization": f"Bearer {admin_key}"}
    everyone = client.get("/v1/usage", params={"start": 0, "end": 10000}, headers=admin).json()
    assert {t["tenant_id"]: t["gpu_seconds"] for t in everyone["tenants"]}[a.tenant_id] == 14400.0
    assert everyone["gpu_seconds"] >= 14400.0  # other tests' tenants may share the PostgreSQL DB
    one = client.get(
        "/v1/usage", params={"tenant": a.tenant_id, "start": 0, "end": 10000}, headers=admin
    ).json()
    assert one["gpu_seconds"] == 14400.0 and one["tenants"] is None

    for params, status, param in [
        ({"start": "yesterday"}, 400, "start"),
        ({"start": 10, "end": 5}, 400, "end"),
        ({"end": "nan"}, 400, "end"),
        ({"tenant": b.tenant_id}, 403, "tenant"),
    ]:
        response = client.get("/v1/usage", params=params, headers=a.headers)
        assert response.status_code == status and response.json()["error"]["param"] == param, (
            response.text
        )
    assert (
        client.get("/v1/usage", params={"tenant": "org-nobody"}, headers=admin).status_code == 404
    )


def test_a_dpo_estimate_counts_its_pairs_and_reference_forward(client, tenant_key) -> None:
    a = tenant_key()
    body = {"model": "llama-8b", "adapter": {"method": "qlora"}, "n_examples": 1000}
    sft = _row(_estimate(client, a.headers, **body), "rtx4090")
    dpo_result = _estimate(client, a.headers, **body, method={"type": "dpo"})
    dpo = _row(dpo_result, "rtx4090")
    # The same resolved run (batch 2, 1500 steps), trained as DPO: the estimator's DPO shape.
    training = TrainingShape(method="qlora", quantization="nf4", seq_len=2048, micro_batch=2, objective="dpo")
    ref = estimate_on_pool(ModelShape.from_hf_config(LLAMA_8B_CONFIG), training, POOLS["rtx4090"],
                           trainer="fsdp_qlora", total_tokens=1500 * 2 * 2048)
    assert dpo_result["total_tokens"] == 1500 * 2 * 2048
    assert dpo["memory_per_gpu_bytes"] == ref.bytes_per_gpu > sft["memory_per_gpu_bytes"]
    # Four 2048-token sequences of a 128k vocabulary per micro batch (and the reference's
    # logits) do not fit the 4090s the SFT job fits on one of: the MI300X pool takes it.
    assert sft["fits"] and sft["gpus"] == 1
    assert not dpo["fits"] and not ref.fits and dpo["reasons"] == list(ref.reasons)
    assert dpo_result["chosen"]["pool"] == "mi300x"
