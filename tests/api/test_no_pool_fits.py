"""Jobs that no node pool can hold never wait forever.

Creation refuses them (400 ``no_pool_fits``, each pool's reason from the estimate) unless
the body asks to queue anyway (``placement.queue_if_unfit``); a queued job whose pool
leaves the pools file fails with that code at the scheduler's next cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scheduling.pools import GIB, NodePool
from tests.conftest import make_settings
from tests.worker.memory_store import MemoryExecutor
from worker.scheduler.cycle import run_cycle
from worker.scheduler.store import DbStore

JOBS = "/v1/fine_tuning/jobs"

# "tiny" is too small for any job; "jaxonly" holds the tiny model but trains no HQQ base.
POOLS_YAML = """\
pools:
  - {name: tiny, accelerator: cpu, gpu_memory_gib: 0.01, gpus_per_node: 1, trainer: fsdp_qlora, peak_tflops: 0.5}
  - {name: jaxonly, accelerator: cpu, gpu_memory_gib: 16, gpus_per_node: 1, trainer: jax_lora, peak_tflops: 0.5}
"""
HQQ = {"method": "qlora", "quantization": "hqq4"}


@pytest.fixture
def settings(settings, tmp_path: Path):
    """The suite's settings (with the demo model's files) on the two pools above."""
    pools = tmp_path / "node_pools.yaml"
    pools.write_text(POOLS_YAML)
    return make_settings(settings.data_path, database_url=settings.resolved_database_url,
                         node_pools_file=pools)


def _create(client, headers, processed_file, key: str | None = None, **body: Any):
    payload = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers), **body}
    extra = {"Idempotency-Key": key} if key else {}
    return client.post(JOBS, headers={**headers, **extra}, json=payload)


def test_a_job_no_pool_can_hold_is_refused_with_each_pools_reason(
        client, tenant_key, processed_file) -> None:
    headers = tenant_key().headers
    response = _create(client, headers, processed_file, key="k-1", adapter=HQQ)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("no_pool_fits", "placement", "invalid_request_error")
    pools = error["details"]["pools"]
    assert [(p["pool"], p["code"]) for p in pools] == [
        ("tiny", "memory_does_not_fit"), ("jaxonly", "trainer_cannot_train")]
    # the plan was sized by the file's longest row, which the reason names
    assert pools[0]["message"].startswith("tiny: its longest row (line ")
    assert " tokens) needs " in pools[0]["message"]
    assert pools[1]["message"] == "jaxonly: runs jax_lora, job needs fsdp_qlora (hqq4 base)"
    for p in pools:
        assert p["message"] in error["message"]
    assert "placement.queue_if_unfit" in error["message"]
    # Nothing of the refused job stays: no job, and its Idempotency-Key is still free.
    assert client.get(JOBS, headers=headers).json()["data"] == []
    fits = _create(client, headers, processed_file, key="k-1")
    assert fits.status_code == 200, fits.text
    assert fits.json()["status"] == "queued" and fits.json()["estimate"]["unfit"] == []
    assert fits.json()["estimate"]["chosen"]["pool"] == "jaxonly"


def test_a_pinned_pool_that_does_not_exist_is_refused(client, tenant_key, processed_file) -> None:
    response = _create(client, tenant_key().headers, processed_file, placement={"pool": "gone"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["details"]["pools"] == [
        {"pool": "gone", "code": "pool_pinned_missing", "message": "pool 'gone' does not exist"}]


def test_queue_if_unfit_queues_it_with_the_reasons_in_its_estimate(client, tenant_key, processed_file) -> None:
    response = _create(client, tenant_key().headers, processed_file, adapter=HQQ,
                       placement={"queue_if_unfit": True})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "queued" and job["placement"] == {"queue_if_unfit": True}
    assert [u["code"] for u in job["estimate"]["unfit"]] == ["memory_does_not_fit", "trainer_cannot_train"]
    assert job["estimate"]["chosen"] is None


def test_queue_if_unfit_must_be_a_boolean(client, tenant_key, processed_file) -> None:
    response = _create(client, tenant_key().headers, processed_file, placement={"queue_if_unfit": "yes"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "placement.queue_if_unfit"


def test_the_estimate_lists_why_no_pool_fits(client, tenant_key) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "n_examples": 10}
    unfit = client.post("/v1/fine_tuning/estimate", headers=headers, json={**body, "adapter": HQQ}).json()
    assert [(u["pool"], u["code"]) for u in unfit["unfit"]] == [
        ("tiny", "memory_does_not_fit"), ("jaxonly", "trainer_cannot_train")]
    assert unfit["chosen"] is None
    fits = client.post("/v1/fine_tuning/estimate", headers=headers, json=body).json()
    assert fits["unfit"] == [] and fits["chosen"]["pool"] == "jaxonly"


def test_a_queued_job_whose_pool_left_the_pools_file_fails_at_the_next_cycle(
        client, tenant_key, processed_file, settings) -> None:
    headers = tenant_key().headers
    pinned = _create(client, headers, processed_file, placement={"pool": "jaxonly"}).json()
    patient = _create(client, headers, processed_file,
                      placement={"pool": "jaxonly", "queue_if_unfit": True}).json()
    assert (pinned["status"], patient["status"]) == ("queued", "queued")
    # The scheduler restarts on a pools file without "jaxonly".
    tiny = NodePool(name="tiny", accelerator="cpu", gpu_memory_bytes=GIB // 100, gpus_per_node=1,
                    trainers=("fsdp_qlora",), peak_tflops=0.5)
    run_cycle(DbStore(settings, [tiny]), MemoryExecutor([tiny]))
    failed = client.get(f"{JOBS}/{pinned['id']}", headers=headers).json()
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "no_pool_fits" and failed["error"]["param"] == "placement"
    assert "pool 'jaxonly' does not exist" in failed["error"]["message"]
    events = client.get(f"{JOBS}/{pinned['id']}/events", headers=headers).json()["data"]
    assert events[0]["level"] == "error" and "pool 'jaxonly' does not exist" in events[0]["message"]
    waiting = client.get(f"{JOBS}/{patient['id']}", headers=headers).json()
    assert waiting["status"] == "queued"
    assert waiting["queue_reason"].startswith("pool 'jaxonly' does not exist; position ")


def test_a_job_larger_than_the_tenants_quota_is_refused(client, tenant_key, processed_file, settings,
                                                       tmp_path: Path) -> None:
    """A quota without borrowing that is smaller than the job never lets it run, however
    idle the pool: refused at creation, like a pool that is too small."""
    quota = tmp_path / "quota_pools.yaml"
    quota.write_text(POOLS_YAML.replace("peak_tflops: 0.5}\n", "peak_tflops: 0.5, max_gpus_per_tenant: {'*': 0}}\n"))
    from fastapi.testclient import TestClient

    from api.main import create_app

    app = create_app(make_settings(settings.data_path, database_url=settings.resolved_database_url,
                                   node_pools_file=quota))
    with TestClient(app) as quota_client:
        response = _create(quota_client, tenant_key().headers, processed_file)
    assert response.status_code == 400, response.text
    pools = response.json()["error"]["details"]["pools"]
    assert ("jaxonly", "quota_below_job") in [(p["pool"], p["code"]) for p in pools]
    assert "jaxonly: the tenant's quota is 0 GPUs and the job needs 1" in response.json()["error"]["message"]
