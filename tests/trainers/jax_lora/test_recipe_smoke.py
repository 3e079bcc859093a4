"""The real entry point: ``python -m trainers --spec spec.json`` with trainer jax_lora.

The first step's loss is checked against transformers: the fresh adapter has B = 0, so
step 1's loss is the base model's completion-only loss on the first batch, which we
recompute with ``LlamaForCausalLM`` from the same data pipeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tests.trainers.jax_lora.specs import make_spec
from trainers.common.job_data import load_job_data, load_tokenizer
from trainers.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[3]


def _run_entry(spec, tmp_path: Path, xla_flags: str | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "spec.json"
    spec.dump(path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device: mesh (1, 1, 1)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run(
        [sys.executable, "-m", "trainers", "--spec", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )


def _reference_first_loss(spec) -> float:
    """transformers' completion-only loss on the first batch (bitsandbytes NF4 for qlora)."""
    from tests.trainers.fsdp_qlora.reference import hf_model

    tok = load_tokenizer(spec.model.path)
    data = load_job_data(spec, tok, pad_to=spec.data.max_seq_len)
    stream = data.train.micro_batches()
    n_micro = spec.hyperparameters.batch_size // spec.hyperparameters.micro_batch_size
    batches = [next(stream) for _ in range(n_micro)]
    # train mode (no dropout in the base): bnb repacks its CPU weights in eval mode
    model = hf_model(Path(spec.model.path), spec.adapter.quantization)
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(torch.tensor(b.input_ids), attention_mask=torch.tensor(b.attention_mask)).logits
            labels = torch.tensor(b.labels)[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            nll += float(loss)
            count += int((labels != -100).sum())
    return nll / count


def test_entry_point_trains_and_exports(recipe_model, tiny_datasets, tmp_path):
    spec = make_spec(recipe_model, tiny_datasets, tmp_path,
                     hyperparameters={"max_steps": 4, "batch_size": 4, "micro_batch_size": 2})
    proc = _run_entry(spec, tmp_path)
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr[-3000:]

    out = Path(spec.output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    losses = [r["train_loss"] for r in rows]
    assert abs(losses[0] - _reference_first_loss(spec)) <= 1e-4
    assert losses[-1] < losses[0] - 0.05  # lr 1e-2 on a 4-step run: the loss must fall
    assert rows[1]["valid_loss"] is not None and 0.0 <= rows[1]["token_accuracy"] <= 1.0
    assert [round(r["learning_rate"], 8) for r in rows] == [0.01, 0.01, 0.0075, 0.0025]  # warmup 1, cosine

    manifest = json.loads((out / "manifest.json").read_text())
    names = {f["name"] for f in manifest["files"]}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors",
            "training_config.json", "metrics.jsonl"} <= names
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    reports = [json.loads(line) for line in (Path(spec.checkpoint.dir) / "reports.jsonl").read_text().splitlines()]
    types = {r["type"] for r in reports}
    assert {"metric", "event", "checkpoint", "artifacts"} <= types
    assert np.isfinite(losses).all()


def test_bad_parallelism_fails_fast_with_user_error(recipe_model, tiny_datasets, tmp_path):
    # tensor=3 cannot divide 4 heads; with 1 device the mesh product check fires first:
    # either way a user error before anything compiles.
    spec = make_spec(recipe_model, tiny_datasets, tmp_path, parallelism={"mesh": {"data": 1, "fsdp": 1, "tensor": 3}})
    proc = _run_entry(spec, tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-2000:]
    error = json.loads(Path(spec.termination_log).read_text())
    assert error["code"] == "invalid_parallelism"
    assert not (Path(spec.output_dir) / "adapter").exists()


def test_host_devices_split_the_cpu_into_the_specs_mesh(recipe_model, tiny_datasets, tmp_path):
    # What the spec builder writes for a local CPU pool: 2 host devices, data=2. The trainer
    # configures them itself (even over an XLA_FLAGS asking for 8) and trains the same
    # numbers: step 1's loss is still transformers' loss on the first batch.
    spec = make_spec(recipe_model, tiny_datasets, tmp_path,
                     hyperparameters={"max_steps": 2, "batch_size": 4, "micro_batch_size": 2},
                     parallelism={"mesh": {"data": 2, "fsdp": 1, "tensor": 1}, "host_devices": 2})
    proc = _run_entry(spec, tmp_path, xla_flags="--xla_force_host_platform_device_count=8")
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr[-3000:]

    reports = [json.loads(line) for line in (Path(spec.checkpoint.dir) / "reports.jsonl").read_text().splitlines()]
    loaded = next(r for r in reports if r["type"] == "event" and r["message"].startswith("jax_lora: model loaded"))
    assert loaded["data"]["devices"] == 2
    assert loaded["data"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
    rows = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["train_loss"] - _reference_first_loss(spec)) <= 1e-4


def test_host_devices_must_fill_the_mesh(recipe_model, tiny_datasets, tmp_path):
    with pytest.raises(ValidationError, match="host_devices"):
        make_spec(recipe_model, tiny_datasets, tmp_path,
                  parallelism={"mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "host_devices": 2})


def test_qlora_nf4_trains_sharded_over_fsdp(recipe_model, tiny_datasets, tmp_path):
    """A 4-bit base on a (1, 2, 1) mesh: every NF4 kernel split over two devices, step 1's
    loss is transformers' on the same checkpoint loaded with BitsAndBytesConfig(nf4)."""
    spec = make_spec(recipe_model, tiny_datasets, tmp_path,
                     adapter={"method": "qlora", "quantization": "nf4", "r": 4, "alpha": 8.0,
                              "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]},
                     hyperparameters={"max_steps": 4, "batch_size": 4, "micro_batch_size": 2},
                     parallelism={"mesh": {"data": 1, "fsdp": 2, "tensor": 1}, "host_devices": 2})
    proc = _run_entry(spec, tmp_path)
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr[-3000:]

    rows = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in rows]
    assert abs(losses[0] - _reference_first_loss(spec)) <= 1e-4
    dense = _reference_first_loss(spec.model_copy(update={"adapter": spec.adapter.model_copy(
        update={"method": "lora", "quantization": "none"})}))
    assert abs(losses[0] - dense) > 1e-3  # the 4-bit base is not the dense one
    assert losses[-1] < losses[0] - 0.05
    reports = [json.loads(line) for line in (Path(spec.checkpoint.dir) / "reports.jsonl").read_text().splitlines()]
    loaded = next(r for r in reports if r["type"] == "event" and r["message"].startswith("jax_lora: model loaded"))
    assert loaded["data"]["devices"] == 2 and loaded["data"]["base_quantization"] == "nf4"
    assert (Path(spec.output_dir) / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("adapter", [
    {"method": "qlora", "quantization": "hqq4"},
    {"method": "qlora", "quantization": "nf4", "double_quant": True},
])
def test_4bit_formats_of_the_torch_trainer_are_a_user_error(recipe_model, tiny_datasets, tmp_path, adapter):
    spec = make_spec(recipe_model, tiny_datasets, tmp_path, adapter=adapter)
    proc = _run_entry(spec, tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-2000:]
    error = json.loads(Path(spec.termination_log).read_text())
    assert error["code"] == "invalid_spec" and "fsdp_qlora" in error["message"]
