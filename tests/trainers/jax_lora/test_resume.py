"""A run preempted after step k and resumed = the uninterrupted run (fp32, <= 1e-6).

In-process through ``recipe.run`` on every local device (mesh (1, 4, 2) with the 8 fake
devices of conftest.py), with LoRA dropout, packing and shuffling on, so the restored
adapter, AdamW state, step, data cursor and dropout RNG all have to be right.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.trainers.jax_lora.specs import make_spec
from trainers.common.checkpointing import list_checkpoints, load_trainer_state
from trainers.common.peft_export import read_peft_adapter
from trainers.common.signals import StopFlag
from trainers.errors import Preempted
from trainers.jax_lora.recipe import run


def _mesh() -> dict:
    return {"data": 1, "fsdp": 4, "tensor": 2} if jax.device_count() == 8 else {"data": 1, "fsdp": 1, "tensor": 1}


def _losses(out_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


@pytest.fixture
def compilation_cache(tmp_path):
    """The three runs compile the same programs: let runs 2 and 3 reuse run 1's executables."""
    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


def test_resume_continues_the_same_loss_curve(recipe_model, tiny_datasets, tmp_path, compilation_cache):
    overrides = {
        "parallelism": {"mesh": _mesh()},
        "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.1},
        "data": {"packing": True, "shuffle": True, "max_seq_len": 96},
        "hyperparameters": {"max_steps": 4, "batch_size": 8, "micro_batch_size": 1, "learning_rate": 1e-2,
                            "warmup_steps": 1, "n_epochs": 1},
    }
    full = make_spec(recipe_model, tiny_datasets, tmp_path / "full", **overrides)
    run(full)

    part = make_spec(recipe_model, tiny_datasets, tmp_path / "part", **overrides)
    stop = StopFlag()
    with pytest.raises(Preempted):
        run(part, stop=stop, on_step=lambda step: stop.request("test") if step == 2 else None)
    (step, ckpt_dir), = list_checkpoints(part.checkpoint.dir)
    assert step == 2 and load_trainer_state(ckpt_dir).cursor.position > 0
    resumed = part.model_copy(update={"checkpoint": part.checkpoint.model_copy(update={"resume_from": "latest"})})
    run(resumed)

    a, b = _losses(tmp_path / "full" / "out"), _losses(tmp_path / "part" / "out")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        assert abs(a[s]["train_loss"] - b[s]["train_loss"]) <= 1e-6, s
        assert a[s]["grad_norm"] == pytest.approx(b[s]["grad_norm"], abs=1e-6)
    assert abs(a[4]["valid_loss"] - b[4]["valid_loss"]) <= 1e-6
    assert a[4]["tokens_seen"] == b[4]["tokens_seen"]
    assert len({round(a[s]["train_loss"], 6) for s in a}) == 4  # the curve moves
    _, wa = read_peft_adapter(tmp_path / "full" / "out" / "adapter")
    _, wb = read_peft_adapter(tmp_path / "part" / "out" / "adapter")
    assert wa.keys() == wb.keys()
    assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) <= 1e-6
