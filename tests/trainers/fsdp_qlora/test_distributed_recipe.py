"""End to end through the real entry point: ``python -m trainers --spec`` with
``trainer: fsdp_qlora``, ``world_size: 2`` and an NF4 base launches 2 local ranks
(gloo), trains, checkpoints (DCP + adapter), evaluates, and exports a PEFT adapter;
the launcher's reporter carries rank 0's reports. Bad layouts fail before any rank
starts, with exit code USER_ERROR and a stable code in the termination log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[3]


def _entry(spec) -> subprocess.CompletedProcess:
    path = Path(spec.checkpoint.dir).parent / "spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.dump(path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "trainers", "--spec", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow  # ~30 s of CPU: 3 processes' imports + 4 steps on 2 ranks
def test_two_rank_qlora_job_through_the_entry_point(make_spec, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file

    from .reference import hf_model

    spec = make_spec(
        "e2e",
        hyperparameters={"batch_size": 4, "micro_batch_size": 1, "max_steps": 4},
        adapter={"method": "qlora", "quantization": "nf4", "target_modules": ["q_proj", "v_proj", "down_proj"]},
        parallelism={"world_size": 2},
    )
    proc = _entry(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, ckpt = Path(spec.output_dir), Path(spec.checkpoint.dir)
    names = {f["name"] for f in json.loads((out / "manifest.json").read_text())["files"]}
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "metrics.jsonl",
            "training_config.json"} <= names
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[1]["valid_loss"] is not None and rows[3]["valid_loss"] is not None
    # Checkpoints: sharded optimizer state (one DCP file per rank) + the adapter.
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-2", "step-4"]
    assert len(list((ckpt / "step-4" / "dcp").glob("*.distcp"))) == 2
    final = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    at_4 = load_file(str(ckpt / "step-4" / "adapter" / "adapter_model.safetensors"))
    assert final.keys() == at_4.keys() and all(torch.equal(final[k], at_4[k]) for k in final)
    # One reporter, one seq series, rank 0's items relayed.
    items = [json.loads(line) for line in (ckpt / "reports.jsonl").read_text().splitlines()]
    kinds = [i["type"] for i in items]
    assert kinds.count("metric") == 4 and kinds.count("checkpoint") == 2 and "artifacts" in kinds
    assert not [i for i in items if i["type"] == "error"]
    seqs = [i["seq"] for i in items]
    assert seqs == sorted(seqs)
    loaded = next(i for i in items if i.get("message") == "model loaded")["data"]
    assert loaded["quantized_layers"] == 14 and loaded["peak_rss_bytes"] > 0
    # The ranks hand freed tensors back (trainers.common.memory): glibc, no operator choice.
    started = next(i for i in items if i.get("message") == "trainer started")["data"]
    assert started["fixed_mmap_threshold"] is True and started["heap"] == "bounded"  # no plan declared
    # The adapter loads in peft on Hugging Face's own NF4 model.
    model = PeftModel.from_pretrained(hf_model(tiny_model_dir, "nf4"), str(out / "adapter"))
    assert sum(1 for n, _ in model.named_parameters() if "lora_A" in n) == 2 * 3


def test_world_size_not_dividing_the_batch_fails_before_launch(make_spec):
    spec = make_spec(
        "bad",
        hyperparameters={"batch_size": 4, "micro_batch_size": 1, "max_steps": 2},
        parallelism={"world_size": 3},
    )
    proc = _entry(spec)
    assert proc.returncode == int(ExitCode.USER_ERROR), proc.stderr[-2000:]
    error = json.loads(Path(spec.termination_log).read_text())
    assert error["code"] == "invalid_parallelism"
    assert not list(Path(spec.checkpoint.dir).glob("step-*"))
