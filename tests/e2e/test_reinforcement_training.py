"""A reinforcement fine-tuning job submitted with the official ``openai`` SDK trains on each
trainer and raises the grader's reward on held-out prompts.

The real processes (API, Celery worker, scheduler loop, trainer subprocess) on the embedded
backend; the base model is the demo's tiny random Llama. The task is trivially learnable:
a python grader (run in the trainer's sandbox) rewards the fraction of an answer's
characters that are lowercase letters, which the random base writes about one time in ten
(its answers are mostly arbitrary bytes). The held-out reward is the mean over greedy
answers (``eval_samples`` 1) to prompts the job never trains on.
"""

from __future__ import annotations

import io
import json

import pytest

from tests.e2e.test_local_training import TERMINAL, all_metrics, wait_status

pytestmark = pytest.mark.slow

GRADER = {"type": "python", "name": "lowercase",
          "source": "def grade(sample, item):\n    text = sample['output_text']\n"
                    "    return sum(c.islower() for c in text) / max(len(text), 1)\n"}
# Measured on this job (seed 5, 2 CPU cores): held-out reward 0.0 at the first evaluation
# (step 4), then 0.41, 0.41, 0.62, 1.0, 1.0 (step 24) on fsdp_qlora, and 0.5, 1.0, 1.0, 1.0,
# 1.0 on jax_lora (its own draws: the trainers share the seed rule, not the random streams).
# The sampled training reward stays near 0.1 (fsdp_qlora: 0.10 over the first 6 steps, 0.13
# over the last 6): the frozen head of a random model this small barely sharpens its
# near-uniform distribution, but its most likely answer moves.
HELD_OUT_FLOOR = 0.5


def prompt_lines(n: int, start: int = 0) -> bytes:
    return b"".join(json.dumps({"messages": [{"role": "user", "content": f"Write something, {i}."}],
                                "id": i}).encode() + b"\n" for i in range(start, start + n))


@pytest.mark.parametrize("trainer", ["fsdp_qlora", "jax"])
def test_reinforcement_job_raises_the_held_out_reward(service, trainer: str) -> None:
    from openai import OpenAI

    svc = service("embedded")
    oai = OpenAI(api_key=svc.admin_key, base_url=f"{svc.base_url}/v1", max_retries=0)
    train = oai.files.create(file=("train.jsonl", io.BytesIO(prompt_lines(16))), purpose="fine-tune")
    held_out = oai.files.create(file=("held_out.jsonl", io.BytesIO(prompt_lines(4, start=16))), purpose="fine-tune")
    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=train.id, validation_file=held_out.id, seed=5,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {
            "n_epochs": 6, "batch_size": 4, "compute_multiplier": 1, "eval_interval": 4, "eval_samples": 1,
            "learning_rate": 0.05, "max_completion_tokens": 8}}},
        extra_body={"trainer": trainer, "max_seq_len": 64,
                    "adapter": {"method": "lora", "r": 8, "alpha": 16,
                                "target_modules": ["q_proj", "v_proj", "down_proj"]}},
    )
    assert job.method.type == "reinforcement"
    with svc.http() as http:
        done = wait_status(http, job.id, TERMINAL, timeout=900)
        assert done["status"] == "succeeded", svc.dump_logs()
        rows = all_metrics(http, job.id)
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert all(r["reward_mean"] is not None and r["completion_length"] is not None for r in rows)
    held = [(r["step"], r["valid_reward_mean"]) for r in rows if r["valid_reward_mean"] is not None]
    print("held-out reward by step:", held, "train reward:", [round(r["reward_mean"], 3) for r in rows])
    assert [s for s, _ in held] == [4, 8, 12, 16, 20, 24]
    assert held[-1][1] >= HELD_OUT_FLOOR and held[-1][1] > held[0][1], held
    checkpoints = oai.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints and all("reward_mean" in c.metrics.to_dict() for c in checkpoints)
