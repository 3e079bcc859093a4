"""SFT, then DPO from the fine-tuned model, through the service, as OpenAI orders preference
tuning: the DPO job names the SFT job's ``fine_tuned_model`` as its ``model``.

The real processes (API, Celery worker, scheduler loop, trainer subprocesses, the inference
worker) on the embedded backend and the demo's tiny random Llama. The SFT job runs on the
torch trainer (``auto``), the DPO job on the JAX trainer, which takes the torch trainer's
adapter as its frozen parent. The DPO job starts from the SFT model (its first step's
rewards are zero: policy and reference are both that model), its model is served, and its
downloaded adapter (the two folded into one) loads in plain transformers + peft and decodes
what the service answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.test_chat_completions import MAX_TOKENS, MESSAGES, _reference
from tests.e2e.test_local_training import TERMINAL, all_metrics, create_job, download_adapter, upload, wait_status
from tests.preference_data import sum_preference_rows
from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow

BASE = "tunefleet-tiny-llama"


def test_dpo_continues_the_sft_model_and_its_folded_adapter_serves(service, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    svc = service("embedded", TUNEFLEET_INFERENCE_URL=f"http://127.0.0.1:{free_port()}")
    svc.start("inference")
    with svc.http() as http:
        sft = wait_status(http, create_job(http, upload(http, demo_examples(16, seed=1)))["id"], TERMINAL)
        assert sft["status"] == "succeeded", svc.dump_logs()

        created = http.post("/fine_tuning/jobs", json={
            "model": sft["fine_tuned_model"], "training_file": upload(http, sum_preference_rows(16), "pairs.jsonl"),
            "seed": 3,
            "method": {"type": "dpo", "dpo": {"hyperparameters": {
                "beta": 0.1, "n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 20.0}}},
            "trainer": "jax", "max_seq_len": 48,
            "adapter": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"]},
        })
        assert created.status_code == 200, created.text
        assert (created.json()["model"], created.json()["base_model"]) == (sft["fine_tuned_model"], BASE)
        dpo = wait_status(http, created.json()["id"], TERMINAL, timeout=600)
        assert dpo["status"] == "succeeded", svc.dump_logs()
        first = all_metrics(http, dpo["id"])[0]
        assert abs(first["rewards/chosen"]) < 1e-4 and abs(first["rewards/rejected"]) < 1e-4, first
        assert dpo["fine_tuned_model"] == f"ft:{BASE}:{dpo['organization_id']}:{dpo['id']}"
        model = http.get(f"/models/{dpo['fine_tuned_model']}").json()
        assert (model["parent"], model["root"]) == (sft["fine_tuned_model"], BASE)

        body = {"model": dpo["fine_tuned_model"], "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS}
        answer = http.post("/chat/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        adapter_dir = tmp_path / "adapter"
        adapter_dir.mkdir()
        download_adapter(http, dpo["id"], adapter_dir)

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8 + 4, 12)
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    text, _, completion_tokens = _reference(tiny_model_dir, adapter_dir)
    served = answer.json()
    assert (served["choices"][0]["message"]["content"], served["usage"]["completion_tokens"]) == (
        text, completion_tokens)
