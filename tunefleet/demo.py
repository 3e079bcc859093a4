"""The demo that shows a newcomer real learning: a tiny Llama and a small generated task.

`tunefleet serve --demo` builds a tiny random-init Llama (with `transformers`, cached in
the data dir), writes a small chat dataset, uploads it and creates a fine-tuning job over
the public HTTP API, exactly as a user would. The task — name a country's capital — is
learnable by LoRA on a 2-layer random model on 2 CPU cores: the training loss falls
from about ln(vocab) within a minute.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_MODEL_ID = "tunefleet-tiny-llama"

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
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in demo_examples(n, seed=seed):
            f.write(json.dumps(example) + "\n")
    return path


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


def start_demo(settings, base_url: str, admin_key: str) -> str:
    """Build the demo model, upload the dataset and create the demo job over HTTP.

    Returns the job id. Uses plain HTTP, exactly as a user would (README quickstart).
    """
    import httpx

    ensure_demo_model(settings.models_dir)
    dataset = write_demo_dataset(settings.data_path / "demo" / "capitals.jsonl")
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=f"{base_url}/v1", headers=headers, timeout=30.0) as http:
        with dataset.open("rb") as fh:
            upload = http.post("/files", data={"purpose": "fine-tune"},
                               files={"file": (dataset.name, fh, "application/jsonl")})
        upload.raise_for_status()
        file_id = upload.json()["id"]
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
