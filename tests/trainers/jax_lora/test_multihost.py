"""Multi-host: 2 processes x 2 CPU devices joined by jax.distributed (gloo) = one process.

Each process is started like an Indexed Job pod (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID); the mesh (1, 2, 2) spans both. Only process 0 may write outputs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.trainers.jax_lora.specs import make_spec
from trainers.common.peft_export import read_peft_adapter
from trainers.jax_lora.recipe import run

# Three trainer runs (two processes + the in-process reference): the slowest test here.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
HP = {"max_steps": 2, "batch_size": 4, "micro_batch_size": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("adapter", [
    {"method": "lora"},
    # QLoRA: each process quantizes only the NF4 shards its own devices hold.
    {"method": "qlora", "quantization": "nf4"},
], ids=["lora", "qlora-nf4"])
def test_two_processes_train_like_one(recipe_model, tiny_datasets, tmp_path, adapter):
    adapter = {"r": 4, "alpha": 8.0, **adapter}
    spec = make_spec(recipe_model, tiny_datasets, tmp_path / "cluster", adapter=adapter,
                     parallelism={"mesh": {"data": 1, "fsdp": 2, "tensor": 2}}, hyperparameters=HP)
    spec_path = tmp_path / "spec.json"
    spec.dump(spec_path)
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {
            **os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid),
        }
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.trainers.jax_lora.multihost_worker", str(spec_path)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)

    # Reference: this process on its own devices (any mesh: sharded = unsharded, tested).
    mesh = {"data": 1, "fsdp": 4, "tensor": 2} if jax.device_count() == 8 else {"data": 1, "fsdp": 1, "tensor": 1}
    ref = make_spec(recipe_model, tiny_datasets, tmp_path / "single", parallelism={"mesh": mesh},
                    hyperparameters={**HP, "batch_size": 4}, adapter=adapter)
    run(ref)

    got, want = _rows(tmp_path / "cluster" / "out"), _rows(tmp_path / "single" / "out")
    assert [r["step"] for r in got] == [1, 2]  # written once (process 0), not twice
    for a, b in zip(got, want, strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5
    _, wa = read_peft_adapter(tmp_path / "cluster" / "out" / "adapter")
    _, wb = read_peft_adapter(tmp_path / "single" / "out" / "adapter")
    assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) <= 1e-5
