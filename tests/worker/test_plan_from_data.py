"""The memory plan and the ETA come from the training file's rows, not the model's context.

A SmolLM2-135M-shaped model (8,192 positions) on 1,000 short chat rows, on the default
16 GiB local pool: planned at ``max_seq_len`` per row the SFT job was estimated at
13.0 GiB and 2,048,000 tokens and the DPO job refused (31.4 GiB); planned from the file's
token stats (validation's byte bound) both are admitted, estimated at a fraction of it,
and timed by the file's tokens. A file with one row too long for the pool is refused with
a reason naming that row.
"""

from __future__ import annotations

import json
import random

import pytest

from control.job_settings import JobSettings
from control.jobs.hyperparameters import resolve_settings
from scheduling.capacity import CapacitySnapshot
from scheduling.model_shapes import ModelShape
from scheduling.placement import no_pool_fits, place_job
from scheduling.pools import GIB, local_pool
from scheduling.request import DataStats, request_from_job
from trainers.common.formats import validate_jsonl

SMOL_135M = ModelShape.from_hf_config({
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "head_dim": 64,
    "max_position_embeddings": 8192, "tie_word_embeddings": True})
WORDS = ("the", "of", "and", "to", "a", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with",
         "as", "his", "they", "be", "at", "one", "have", "this")
POOL = local_pool(1, 16 * GIB)


def _text(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def _chat(n: int = 1000, *, long_line: int | None = None, long_words: int = 0) -> bytes:
    rnd = random.Random(0)
    rows = []
    for line in range(1, n + 1):
        answer = long_words if line == long_line else rnd.randint(10, 50)
        rows.append({"messages": [{"role": "user", "content": _text(rnd, rnd.randint(8, 30))},
                                  {"role": "assistant", "content": _text(rnd, answer)}]})
    return "\n".join(json.dumps(r) for r in rows).encode()


def _preference(n: int = 1000) -> bytes:
    rnd = random.Random(1)
    return "\n".join(json.dumps({
        "input": {"messages": [{"role": "user", "content": _text(rnd, rnd.randint(8, 30))}]},
        "preferred_output": [{"role": "assistant", "content": _text(rnd, rnd.randint(10, 50))}],
        "non_preferred_output": [{"role": "assistant", "content": _text(rnd, rnd.randint(10, 50))}],
    }) for _ in range(n)).encode()


def _settings(method: str, max_seq_len: int = 2048) -> JobSettings:
    settings = JobSettings.from_columns(method={"type": method}, max_seq_len=max_seq_len,
                                        hyperparameters={"n_epochs": 1, "batch_size": 8})
    return resolve_settings(settings, 1000)  # micro batch 4, 125 steps


def _place(settings: JobSettings, data: DataStats | None):
    req = request_from_job(job_id="ftjob-1", tenant="org-a", model=SMOL_135M, settings=settings, priority=0,
                           data=data)
    return req, place_job(req, CapacitySnapshot.from_pools([POOL]))


@pytest.mark.parametrize(("method", "data", "before_gib"), [("supervised", _chat, 13.0), ("dpo", _preference, 31.4)])
def test_a_short_row_job_on_a_long_context_model_is_planned_from_its_rows(method, data, before_gib):
    report = validate_jsonl(data()).to_dict()
    stats = DataStats.from_report(report)
    assert stats is not None and stats.rows == 1000 and stats.method == "bytes"
    settings = _settings(method)

    before_req, before = _place(settings, None)
    assert before_req.training.seq_len == 2048 and before_req.total_tokens == 2_048_000
    if method == "dpo":
        assert before.mode == "no_fit"
        reason = no_pool_fits(before_req, {POOL.name: POOL})[0]
        assert f"needs {before_gib} GiB per GPU even on 1x cpu" in reason.message
    else:
        assert round(before.estimate.bytes_per_gpu / GIB, 1) == before_gib

    req, placed = _place(settings, stats)
    assert placed.mode == "fit"
    assert req.training.seq_len == stats.longest_row < 2048
    # memory: a quarter of the max_seq_len plan or less (measured peaks: 1.4 GiB SFT, 1.7 GiB DPO)
    assert placed.estimate.bytes_per_gpu < 0.3 * 13.0 * GIB * (2 if method == "dpo" else 1)
    # time: the file's tokens, not 1,000 x 2,048 (the measured SFT run trained 71,711)
    assert req.total_tokens == stats.total_tokens_estimate
    assert 40_000 < req.total_tokens < 120_000
    assert placed.estimate.eta_s < before_req.total_tokens and placed.estimate.eta_s is not None


def test_the_longest_row_is_capped_by_max_seq_len():
    stats = DataStats.from_report(validate_jsonl(_chat(50, long_line=7, long_words=3000)).to_dict())
    assert stats.longest_row_line == 7 and stats.longest_row > 2048
    req, _ = _place(_settings("supervised", max_seq_len=2048), stats)
    assert req.training.seq_len == 2048
    assert "line 7" in req.longest_row and "truncated to max_seq_len 2,048" in req.longest_row


def test_packing_plans_full_sequences():
    stats = DataStats.from_report(validate_jsonl(_chat(50)).to_dict())
    settings = _settings("supervised").model_copy(update={"packing": True})
    req, _ = _place(settings, stats)
    assert req.training.seq_len == 2048 and req.longest_row is None


def test_a_row_too_long_for_every_pool_is_refused_naming_it():
    # One row of ~30,000 tokens in a file of short ones, max_seq_len the model's 8,192:
    # at 8,192 tokens a DPO micro batch of 4 does not fit 16 GiB.
    stats = DataStats.from_report(validate_jsonl(_chat(200, long_line=17, long_words=8000)).to_dict())
    req, placed = _place(_settings("dpo", max_seq_len=8192), stats)
    assert placed.mode == "no_fit"
    reasons = no_pool_fits(req, {POOL.name: POOL})
    assert reasons, "the job must be refused"
    message = reasons[0].message
    assert "its longest row (line 17, at most" in message and "tokens" in message, message
    assert "needs" in message and "GiB per GPU" in message
    # the same file without that row is admitted
    short = DataStats.from_report(validate_jsonl(_chat(200)).to_dict())
    assert _place(_settings("dpo", max_seq_len=8192), short)[1].mode == "fit"


def test_reports_without_token_stats_plan_at_max_seq_len():
    assert DataStats.from_report({"ok": True, "n_examples": 3}) is None
    assert DataStats.from_report(None) is None
