"""DPO on 2 ranks through the real entry point (``python -m trainers``, gloo, NF4 base)
equals the same job in one process (the objective is normalized over the global batch,
and each rank's reference forward is its FSDP-sharded base with the adapter off), and a
2-rank run resumed from its sharded checkpoint continues it exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainers.fsdp_qlora.test_distributed_recipe import _entry
from tests.trainers.fsdp_qlora.test_dpo_recipe import dpo_spec, preference_files  # noqa: F401 (fixtures)
from tests.trainers.fsdp_qlora.test_recipe_single import _run
from trainers.common.preference import REWARD_KEYS


def test_two_rank_dpo_qlora_job_equals_the_one_process_job_and_resumes(dpo_spec):  # noqa: F811
    from safetensors.torch import load_file

    common = {
        # AdamW turns the summation-order noise of tiny NF4 gradients into update noise
        # proportional to the learning rate (see fsdp_worker.NF4_LR): keep it small.
        "hyperparameters": {"batch_size": 4, "micro_batch_size": 1, "max_steps": 3, "learning_rate": 1e-3},
        "adapter": {"method": "qlora", "quantization": "nf4", "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "eval": {"every_n_steps": None, "max_batches": 2},
        "checkpoint": {"every_n_steps": 2, "keep_last": 2},
    }
    two = dpo_spec("two", parallelism={"world_size": 2}, **common)
    proc = _entry(two)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = _run(dpo_spec("one", **common))

    rows = [json.loads(x) for x in (Path(two.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        s = r["step"]
        assert r["train_loss"] == pytest.approx(one.losses[s], abs=1e-5), s
    ref_rows = [json.loads(x) for x in (one.output_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, ref_rows, strict=True):
        for k in REWARD_KEYS:
            assert a[k] == pytest.approx(b[k], abs=1e-5), k
    assert rows[-1]["valid_loss"] == pytest.approx(ref_rows[-1]["valid_loss"], abs=1e-5)
    assert rows[-1]["valid_rewards/margin"] == pytest.approx(ref_rows[-1]["valid_rewards/margin"], abs=1e-5)
    a = load_file(str(Path(two.output_dir) / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(one.output_dir / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert max(float(b[k].abs().max()) for k in b if "lora_B" in k) > 1e-4  # it trained

    # 2 ranks resumed from the 2-rank run's step-2 checkpoint (sharded DCP state) = step 3 of the run
    step_2 = str(Path(two.checkpoint.dir) / "step-2")
    resumed = dpo_spec("resumed", parallelism={"world_size": 2},
                       **{**common, "checkpoint": {**common["checkpoint"], "resume_from": step_2}})
    proc = _entry(resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = [json.loads(x) for x in (Path(resumed.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [3]
    for k in ("train_loss", "grad_norm", *REWARD_KEYS):
        assert again[0][k] == pytest.approx(rows[2][k], abs=1e-6), k
    c = load_file(str(Path(resumed.output_dir) / "adapter" / "adapter_model.safetensors"))
    assert max(float((a[k] - c[k]).abs().max()) for k in a) <= 1e-6
