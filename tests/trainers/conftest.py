"""Shared trainer fixtures: a tiny random Llama checkpoint and tiny datasets.

The model is built once per test session (a few seconds) and must be treated as
read-only by tests; tests that need another shape build their own with
``trainers.common.tiny_model.build_tiny_llama``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.trainers.tiny_datasets import write_tiny_datasets

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, vocab 262) + byte-level tokenizer."""
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Chat train (32 rows) / validation (8 rows), prompt/completion and alpaca files."""
    return write_tiny_datasets(tmp_path_factory.mktemp("data"))


def deep_update(base: dict, changes: dict) -> dict:
    out = dict(base)
    for k, v in changes.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def make_spec(tmp_path: Path, tiny_model_dir: Path, tiny_datasets: dict[str, Path]):
    """Factory for a small fsdp_qlora TrainerSpec; keyword dicts are merged into the default.

    ``make_spec(run="a", hyperparameters={"max_steps": 3})`` -> a spec whose output and
    checkpoint dirs live under ``tmp_path / run``.
    """
    from trainers.spec import TrainerSpec

    def make(run: str = "run", **changes: dict) -> TrainerSpec:
        base = {
            "job_id": "ftjob-test",
            "trainer": "fsdp_qlora",
            "model": {"path": str(tiny_model_dir)},
            "data": {
                "train_file": str(tiny_datasets["chat_train"]),
                "validation_file": str(tiny_datasets["chat_valid"]),
                "format": "chat",
                "max_seq_len": 64,
            },
            "hyperparameters": {
                "n_epochs": 1, "batch_size": 4, "micro_batch_size": 2,
                "learning_rate": 2e-2, "warmup_steps": 0, "max_steps": 4,
            },
            "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.0},
            "eval": {"every_n_steps": 2, "max_batches": 2},
            "output_dir": str(tmp_path / run / "output"),
            "checkpoint": {"dir": str(tmp_path / run / "checkpoints"), "every_n_steps": 2, "keep_last": 2},
            "termination_log": str(tmp_path / run / "termination-log"),
            "seed": 0,
        }
        return TrainerSpec.model_validate(deep_update(base, changes))

    return make
