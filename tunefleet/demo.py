"""The demo that shows a newcomer real learning, on a real pretrained model.

`tunefleet serve --demo` prepares SmolLM2-135M-Instruct (tunefleet/real_model.py, once,
into the data dir), writes a small generated task whose answers are checkable — write a
date as YYYY-MM-DD — uploads it with held-out dates as the job's validation file and
creates a fine-tuning job over the public HTTP API, exactly as a user would. When the job
has succeeded it asks the service for a held-out evaluation
(``POST /v1/fine_tuning/jobs/{id}/evaluations``): exact match of the base and the
fine-tuned model's greedy answers, which the job page then shows next to the loss and
the terminal prints. The instruct model answers in its own words (about 0 % exact), the
fine-tuned one in the format asked for.

Where the real model cannot be prepared (offline, no ``gguf``), the demo trains the tiny
random-init Llama (cached in the data dir) on the capital-city task instead; the tests
use that tiny model too, because it trains in seconds.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

DEMO_MODEL_ID = "tunefleet-tiny-llama"

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")

# (country, capital): the model learns to answer with the capital. Most bytes of an answer
# follow from its first ones, so a tiny model's loss falls fast once it attends to the country.
CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"),
    ("Turkey", "Ankara"), ("Russia", "Moscow"), ("Vietnam", "Hanoi"), ("Thailand", "Bangkok"),
)


def demo_examples(n: int = 400, *, seed: int = 0) -> list[dict]:
    """Chat examples of the capital-city task, deterministic for a seed."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        country, capital = rng.choice(CAPITALS)
        examples.append(
            {
                "messages": [
                    {"role": "user", "content": f"Capital of {country}?"},
                    {"role": "assistant", "content": capital},
                ]
            }
        )
    return examples


def write_demo_dataset(path: Path, n: int = 400, *, seed: int = 0) -> Path:
    return write_examples(path, demo_examples(n, seed=seed))


def write_examples(path: Path, examples: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example) + "\n")
    return path


def date_examples(n: int, *, seed: int) -> list[dict]:
    """Chat examples of the date-formatting task ("March 5, 2021" -> "2021-03-05").

    Deterministic for a seed; different seeds give (almost always) different dates, so a
    held-out set is another seed. SmolLM2-135M-Instruct answers these in its own words
    ("YYYY-MM-DD: 2021-03", "March 5, 2021: ..."): exact-match is about zero before
    fine-tuning, and the answer is a fixed ten characters after it.
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        year, month, day = rng.randint(1950, 2030), rng.randint(1, 12), rng.randint(1, 28)
        examples.append(
            {
                "messages": [
                    {"role": "user",
                     "content": f"Write this date as YYYY-MM-DD: {MONTHS[month - 1]} {day}, {year}"},
                    {"role": "assistant", "content": f"{year}-{month:02d}-{day:02d}"},
                ]
            }
        )
    return examples


def held_out_evaluation(http, job_id: str, file_id: str, *, max_tokens: int = 16,
                        timeout: float = 1800.0) -> dict:
    """Ask the service to evaluate job ``job_id``'s base and fine-tuned models on ``file_id``
    (through ``http``, an httpx client on ``<api>/v1``; default grader: exact match) and wait
    for the ``fine_tuning.job.evaluation``, succeeded or failed."""
    created = http.post(f"/fine_tuning/jobs/{job_id}/evaluations",
                        json={"file": file_id, "max_tokens": max_tokens})
    created.raise_for_status()
    evaluation = created.json()
    deadline = time.monotonic() + timeout
    while evaluation["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(2.0)
        evaluation = http.get(f"/fine_tuning/jobs/{job_id}/evaluations/{evaluation['id']}").json()
    return evaluation


def ensure_demo_model(models_dir: Path) -> Path:
    """Build (once) and return the tiny demo Llama checkpoint directory."""
    from trainers.common.tiny_model import build_tiny_llama, refresh_tiny_tokenizer

    out = models_dir / "tiny-llama"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        refresh_tiny_tokenizer(out)  # one built by an older release: today's chat template
        return out
    return build_tiny_llama(
        out, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, seed=0
    )


# The real-model demo's job: sized to finish in a few minutes on 2 CPU cores (tests/e2e/
# test_real_model.py trains the same task and measures the rise).
DATES_TRAIN, DATES_HELD_OUT = 160, 40
DATES_JOB = {
    "hyperparameters": {"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 10.0},
    "adapter": {"method": "lora", "r": 8, "alpha": 16,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                   "gate_proj", "up_proj", "down_proj"]},
    "max_seq_len": 96,
}


def start_demo(settings, base_url: str, admin_key: str) -> str:
    """Submit the demo job over HTTP: the real model's when it is prepared, else the tiny one's.

    Returns the job id. Uses plain HTTP, exactly as a user would (README quickstart). With
    the real model it then waits for the job, has the service evaluate it on the held-out
    dates and prints exact-match accuracy before and after fine-tuning.
    """
    from control.models.base_models import REAL_MODEL_ID
    from tunefleet.real_model import is_prepared, real_model_dir

    if is_prepared(real_model_dir(settings.models_dir)):
        return _real_model_demo(settings, base_url, admin_key, REAL_MODEL_ID)
    return _tiny_model_demo(settings, base_url, admin_key)


def _client(base_url: str, admin_key: str):
    import httpx

    return httpx.Client(base_url=f"{base_url}/v1", headers={"Authorization": f"Bearer {admin_key}"},
                        timeout=30.0)


def _upload(http, path: Path) -> str:
    with path.open("rb") as fh:
        upload = http.post("/files", data={"purpose": "fine-tune"},
                           files={"file": (path.name, fh, "application/jsonl")})
    upload.raise_for_status()
    return upload.json()["id"]


def _real_model_demo(settings, base_url: str, admin_key: str, model: str) -> str:
    demo = settings.data_path / "demo"
    dataset = write_examples(demo / "dates.jsonl", date_examples(DATES_TRAIN, seed=0))
    held_out = write_examples(demo / "dates-held-out.jsonl", date_examples(DATES_HELD_OUT, seed=1))
    with _client(base_url, admin_key) as http:
        file_id, held_out_id = _upload(http, dataset), _upload(http, held_out)
        job = http.post(
            "/fine_tuning/jobs",
            headers={"Idempotency-Key": f"demo-{file_id}"},
            json={"model": model, "training_file": file_id, "validation_file": held_out_id, "suffix": "demo",
                  "seed": 0, "metadata": {"demo": "dates"}, **DATES_JOB},
        )
        job.raise_for_status()
        job_id = job.json()["id"]
        print(f"demo job {job_id} submitted: watch it at {base_url}/ui/jobs/{job_id}", flush=True)
        while (state := http.get(f"/fine_tuning/jobs/{job_id}").json())["status"] not in (
                "succeeded", "failed", "cancelled"):
            time.sleep(2.0)
        if state["status"] != "succeeded":
            print(f"demo job {job_id} {state['status']}: {state.get('error')}", flush=True)
            return job_id
        print(f"demo: evaluating {model} and {state['fine_tuned_model']} on {DATES_HELD_OUT} held-out dates "
              "(the job page shows the result)", flush=True)
        evaluation = held_out_evaluation(http, job_id, held_out_id)
    if evaluation["status"] != "succeeded":
        print(f"demo: the held-out evaluation {evaluation['id']} {evaluation['status']}: {evaluation['error']}",
              flush=True)
        return job_id
    before, after = evaluation["results"]["base"], evaluation["results"]["fine_tuned"]
    print(f"demo: held-out exact match (YYYY-MM-DD) on {after['count']} dates: {model} {before['score']:.0%} "
          f"before fine-tuning -> {after['model']} {after['score']:.0%} after", flush=True)
    return job_id


def _tiny_model_demo(settings, base_url: str, admin_key: str) -> str:
    ensure_demo_model(settings.models_dir)
    dataset = write_demo_dataset(settings.data_path / "demo" / "capitals.jsonl")
    with _client(base_url, admin_key) as http:
        file_id = _upload(http, dataset)
        job = http.post(
            "/fine_tuning/jobs",
            headers={"Idempotency-Key": f"demo-{file_id}"},
            json={
                "model": DEMO_MODEL_ID,
                "training_file": file_id,
                "suffix": "demo",
                "seed": 0,
                "hyperparameters": {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 25.0},
                "adapter": {"method": "lora", "r": 16, "alpha": 32,
                            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"]},
                "max_seq_len": 64,
                "metadata": {"demo": "capitals"},
            },
        )
        job.raise_for_status()
        job_id = job.json()["id"]
    print(f"demo job {job_id} submitted: watch it at {base_url}/ui/jobs/{job_id}", flush=True)
    return job_id
