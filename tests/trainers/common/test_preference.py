"""Preference batching (chosen rows first, pairs kept together), the resume cursor, the
reward metrics and the loading of a preference file."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tests.trainers.dpo_pairs import pair_data, sum_pairs, write_preference_file
from trainers.common.data import DataCursor, PreferenceDataset
from trainers.common.preference import (
    PreferenceData,
    RewardSums,
    load_preference_data,
    pair_halves,
)
from trainers.errors import UserError


def _row(batch, r):
    n = int(batch.attention_mask[r].sum())
    return tuple(batch.input_ids[r, :n]), tuple(batch.labels[r, :n])


def test_a_micro_batch_holds_the_chosen_then_the_rejected_rows_of_the_same_pairs(tiny_tokenizer):
    pairs = sum_pairs(tiny_tokenizer, 5)
    data = PreferenceData(PreferenceDataset(pairs), max_seq_len=64, micro_batch_size=2, seed=1,
                          pad_id=tiny_tokenizer.pad_token_id)
    order = [row[0] for row in data.rows(0)]
    assert sorted(order) == list(range(5)) and order != list(range(5))  # pairs shuffled, none lost
    batches = list(itertools.islice(data.micro_batches(), 3))
    assert [b.input_ids.shape[0] for b in batches] == [4, 4, 2]  # 2 pairs, 2 pairs, the epoch's last pair
    seen = []
    for b in batches:
        chosen, _ = pair_halves(b)
        for i in range(chosen.input_ids.shape[0]):
            p = order[len(seen)]
            seen.append(p)
            assert _row(b, i)[0] == pairs[p][0].input_ids
            # labels: the trained answer tokens; the first token never is (causal shift)
            assert _row(b, i)[1][1:] == pairs[p][0].labels[1:]
            assert _row(b, chosen.input_ids.shape[0] + i)[0] == pairs[p][1].input_ids
    assert seen == order
    assert batches[-1].cursor_after == DataCursor(1, 0)
    assert data.micro_batches_per_epoch(0) == 3 and data.n_pairs == 5


def test_resuming_at_a_cursor_yields_the_batches_the_uninterrupted_run_reads_next(tiny_tokenizer):
    data = pair_data(tiny_tokenizer, 6, micro_batch_size=2)
    data.shuffle = True
    full = list(itertools.islice(data.micro_batches(), 7))  # crosses into epoch 2
    resumed = list(itertools.islice(data.micro_batches(full[3].cursor_after), 3))
    for a, b in zip(full[4:], resumed, strict=True):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.labels, b.labels)
        assert a.cursor_after == b.cursor_after


def test_padded_batches_have_fixed_shapes(tiny_tokenizer):
    batch = next(pair_data(tiny_tokenizer, 3, pad_to=48).micro_batches())
    assert batch.input_ids.shape == (6, 48)
    assert (batch.labels[batch.attention_mask == 0] == -100).all()


def test_reward_metrics_are_means_over_pairs():
    sums = RewardSums(pairs=2, loss=1.2, chosen=0.5, rejected=-0.1, correct=1) + RewardSums(1, 0.3, 0.1, 0.4, 0)
    assert sums.metrics() == pytest.approx({
        "rewards/chosen": 0.2, "rewards/rejected": 0.1, "rewards/accuracy": 1 / 3, "rewards/margin": 0.1})
    assert set(sums.metrics("valid_")) == {"valid_rewards/chosen", "valid_rewards/rejected",
                                           "valid_rewards/accuracy", "valid_rewards/margin"}


def test_a_job_reads_its_preference_files(make_spec, tiny_tokenizer, tmp_path):
    train = write_preference_file(tmp_path / "train.jsonl", 10)
    valid = write_preference_file(tmp_path / "valid.jsonl", 4)
    spec = make_spec(method={"type": "dpo"}, data={"train_file": str(train), "validation_file": str(valid),
                                                   "format": "preference"})
    data = load_preference_data(spec, tiny_tokenizer)
    assert data.stats()["train_examples"] == 10 and data.validation.n_pairs == 4
    assert data.stats()["rows_per_epoch"] == 10
    batch = next(data.train.micro_batches())
    chosen, rejected = pair_halves(batch)
    assert chosen.input_ids.shape[0] == rejected.input_ids.shape[0] == spec.hyperparameters.micro_batch_size
    assert chosen.n_label_tokens > 0 and rejected.n_label_tokens > 0


def test_packing_a_dpo_job_is_refused(make_spec, tiny_tokenizer, tmp_path):
    train = write_preference_file(tmp_path / "train.jsonl", 4)
    spec = make_spec(method={"type": "dpo"}, data={"train_file": str(train), "validation_file": None,
                                                   "format": "preference", "packing": True})
    with pytest.raises(UserError) as err:
        load_preference_data(spec, tiny_tokenizer)
    assert err.value.code == "invalid_spec" and "packing" in str(err.value)


def test_a_bad_preference_line_is_invalid_dataset(make_spec, tiny_tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": {"messages": []}, "preferred_output": []}) + "\n", encoding="utf-8")
    spec = make_spec(method={"type": "dpo"}, data={"train_file": str(bad), "validation_file": None,
                                                   "format": "preference"})
    with pytest.raises(UserError) as err:
        load_preference_data(spec, tiny_tokenizer)
    assert err.value.code == "invalid_dataset" and "bad.jsonl" in str(err.value)


def test_a_dpo_metric_row_and_its_checkpoint_metrics_carry_the_rewards():
    from trainers.common.loop import METRIC_KEYS, checkpoint_metrics, metric_row

    base = {"step": 2, "total_steps": 4, "cursor_after": DataCursor(0, 4), "train_loss": 0.6,
            "learning_rate": 1e-3, "grad_norm": 0.5, "step_tokens": 100, "elapsed_s": 0.5,
            "tokens_seen": 200, "memory_bytes": 1024}
    rewards = RewardSums(pairs=4, loss=2.4, chosen=0.4, rejected=-0.4, correct=3).metrics()
    row = metric_row(**base, rewards=rewards)
    assert tuple(row)[: len(METRIC_KEYS)] == METRIC_KEYS
    assert row["rewards/accuracy"] == 0.75 and row["rewards/margin"] == pytest.approx(0.2)
    assert row["valid_rewards/accuracy"] is None  # this step did not evaluate
    evaluation = {"valid_loss": 0.5, "token_accuracy": None,
                  **RewardSums(pairs=2, loss=1.0, chosen=0.2, rejected=0.0, correct=2).metrics("valid_")}
    first = checkpoint_metrics(metric_row(**base, rewards=rewards, evaluation=evaluation))
    later = checkpoint_metrics(metric_row(**{**base, "step": 3, "train_loss": 0.4}, rewards=rewards), first)
    assert later["train_loss"] == 0.4 and later["rewards/chosen"] == pytest.approx(0.1)
    assert later["valid_loss"] == 0.5 and later["valid_rewards/accuracy"] == 1.0
    assert "rewards/chosen" not in checkpoint_metrics(metric_row(**base))  # supervised rows: none
