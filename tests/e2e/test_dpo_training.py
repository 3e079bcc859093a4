"""A DPO job submitted with the official ``openai`` SDK trains on each trainer and raises
the held-out preference accuracy.

The real processes (API, Celery worker, scheduler loop, trainer subprocess) on the
embedded backend; the base model is the demo's tiny random Llama. The task is generated
(tests/preference_data.py): prefer the correct sum over a longer or a shorter slip. The
exported adapter is loaded with ``peft`` and scored on held-out questions it never saw:
the fraction of pairs whose preferred answer gets the higher log-probability is chance
for the base model (which favours the shorter answer) and clearly higher with the adapter.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.e2e.test_local_training import TERMINAL, all_metrics, download_adapter, wait_status
from tests.preference_data import sum_preference_lines, sum_preference_rows

pytestmark = pytest.mark.slow

N_TRAIN, N_HELD_OUT = 56, 35


def answer_logps(model, tokenizer, rows: list[dict]) -> torch.Tensor:
    """Summed log-probabilities of each row's (preferred, rejected) conversation, shape
    ``(len(rows), 2)``. Both share the prompt, so differences between them (and between
    models on the same text) are differences over the answers alone."""
    def logp(messages: list[dict]) -> float:
        ids = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).sum().item()

    return torch.tensor([[logp(r["input"]["messages"] + r[key]) for key in ("preferred_output", "non_preferred_output")]
                         for r in rows])


@pytest.mark.parametrize("trainer", ["fsdp_qlora", "jax"])
def test_dpo_job_raises_held_out_preference_accuracy(service, tiny_model_dir: Path, tmp_path: Path,
                                                     trainer: str) -> None:
    from openai import OpenAI
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    svc = service("embedded")
    oai = OpenAI(api_key=svc.admin_key, base_url=f"{svc.base_url}/v1", max_retries=0)
    train = oai.files.create(file=("train.jsonl", io.BytesIO(sum_preference_lines(N_TRAIN))),
                             purpose="fine-tune")
    held_out = oai.files.create(
        file=("held_out.jsonl", io.BytesIO(sum_preference_lines(N_HELD_OUT, start=N_TRAIN))), purpose="fine-tune")
    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=train.id, validation_file=held_out.id, seed=5,
        method={"type": "dpo", "dpo": {"hyperparameters": {
            "beta": 0.1, "n_epochs": 6, "batch_size": 8, "learning_rate_multiplier": 50.0}}},
        extra_body={"trainer": trainer, "max_seq_len": 64,
                    "adapter": {"method": "lora", "r": 8, "alpha": 16,
                                "target_modules": ["q_proj", "v_proj", "down_proj"]}},
    )
    assert job.method.type == "dpo"
    with svc.http() as http:
        done = wait_status(http, job.id, TERMINAL, timeout=900)
        assert done["status"] == "succeeded", svc.dump_logs()
        assert done["method"]["dpo"]["hyperparameters"]["beta"] == 0.1
        rows = all_metrics(http, job.id)
        assert [r["step"] for r in rows] == list(range(1, done["total_steps"] + 1))
        assert all(r["rewards/accuracy"] is not None and r["rewards/margin"] is not None for r in rows)
        assert rows[-1]["rewards/margin"] > rows[0]["rewards/margin"]
        valid = [r["valid_rewards/accuracy"] for r in rows if r["valid_rewards/accuracy"] is not None]
        assert valid, "no held-out reward metrics were reported"
        events = oai.fine_tuning.jobs.list_events(job.id, limit=100).data
        assert {e.type for e in events} <= {"message", "metrics"} and any(e.type == "metrics" for e in events)
        checkpoints = oai.fine_tuning.jobs.checkpoints.list(job.id).data
        assert checkpoints and all("rewards/accuracy" in c.metrics.to_dict() for c in checkpoints)
        adapter_dir = tmp_path / "adapter"
        adapter_dir.mkdir()
        download_adapter(http, job.id, adapter_dir)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    held_out_rows = sum_preference_rows(N_HELD_OUT, start=N_TRAIN)
    reference = answer_logps(base, tokenizer, held_out_rows)
    tuned = answer_logps(PeftModel.from_pretrained(base, adapter_dir).eval(), tokenizer, held_out_rows)
    before = (reference[:, 0] > reference[:, 1]).float().mean().item()
    after = (tuned[:, 0] > tuned[:, 1]).float().mean().item()
    # TRL's reward accuracy: the preferred answer's log-ratio to the reference is the larger.
    rewards = tuned - reference
    reward_accuracy = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
    margins = [r["rewards/margin"] for r in rows]
    print(f"{trainer}: held-out preference accuracy {before:.3f} -> {after:.3f}, reward accuracy "
          f"{reward_accuracy:.3f} (trainer's valid_rewards/accuracy {valid[0]:.3f} -> {valid[-1]:.3f}), "
          f"train margin {margins[0]:.3f} -> {margins[-1]:.3f}, "
          f"held-out margin {(rewards[:, 0] - rewards[:, 1]).mean():.3f}")
    assert before <= 0.6, f"the base model already prefers the sums: {before}"
    assert after >= 0.75 and after >= before + 0.4, (before, after)
    assert reward_accuracy >= 0.75
    # The trainer's own held-out figure is the same quantity (at most one pair apart).
    assert abs(valid[-1] - reward_accuracy) <= 1 / N_HELD_OUT + 1e-6, (valid[-1], reward_accuracy)
