"""The documented "auto" rule (control/jobs/hyperparameters.py), value by value."""

from __future__ import annotations

import pytest

from control.jobs.hyperparameters import resolve_hyperparameters


@pytest.mark.parametrize(
    ("n", "epochs", "batch", "steps"),
    [
        (1, 25, 1, 25),          # ceil(100/1)=100 -> capped at 25 epochs
        (12, 9, 1, 108),         # ceil(100/12)=9
        (40, 3, 1, 120),         # 120 examples seen >= 100: the default 3
        (1000, 3, 2, 1500),      # 0.2 % of 1000 = 2
        (5000, 3, 8, 1875),      # 15000 seen <= 25000: 3 epochs; 0.2 % = 10 -> power of two 8
        (200_000, 1, 256, 782),  # 25000/200000 -> at least 1; 400 -> capped at 256
    ],
)
def test_auto_rule(n: int, epochs: int, batch: int, steps: int) -> None:
    hp = resolve_hyperparameters({}, n)
    assert (hp["n_epochs"], hp["batch_size"], hp["total_steps"]) == (epochs, batch, steps)
    assert hp["learning_rate"] == pytest.approx(2e-4) and hp["lr_scheduler"] == "cosine"
    assert hp["warmup_steps"] == round(0.03 * steps)
    assert hp["batch_size"] % hp["micro_batch_size"] == 0 and hp["micro_batch_size"] <= 4


def test_given_values_win() -> None:
    hp = resolve_hyperparameters(
        {"n_epochs": 2, "batch_size": 6, "learning_rate_multiplier": 0.5, "warmup_steps": 0,
         "max_steps": 7}, 100)
    assert (hp["n_epochs"], hp["batch_size"], hp["micro_batch_size"]) == (2, 6, 3)
    assert hp["learning_rate"] == pytest.approx(1e-4)
    assert hp["total_steps"] == 7 and hp["warmup_steps"] == 0
    assert resolve_hyperparameters({"learning_rate": 3e-5}, 10)["learning_rate"] == 3e-5


def test_dpo_adds_beta_and_sft_weight_to_the_same_rule() -> None:
    supervised = resolve_hyperparameters({}, 12)
    dpo = resolve_hyperparameters({"beta": "auto"}, 12, method="dpo")
    # 12 preference pairs resolve n_epochs, batch and steps as 12 supervised examples do.
    assert {k: v for k, v in dpo.items() if k not in ("beta", "sft_weight")} == supervised
    assert (dpo["beta"], dpo["sft_weight"]) == (0.1, 0.0)
    given = resolve_hyperparameters({"beta": 0.5, "sft_weight": 0.2, "batch_size": 4}, 12, method="dpo")
    assert (given["beta"], given["sft_weight"], given["batch_size"]) == (0.5, 0.2, 4)
    assert "beta" not in supervised and "sft_weight" not in supervised
