"""Play the executor + trainer side of one job through the service's real interfaces.

Used by the browser tests only when this build has no local executor to run a real
trainer (``worker.tasks.jobs`` or ``worker.tasks.scheduling`` missing): the job is moved to ``running`` with the one
lifecycle function (as the executor would), a per-job token is issued with
``api.jobs.issue_job_token``, and metric/event/checkpoint/artifact batches are POSTed to
the real internal report endpoint with that token, exactly as ``trainers.common.reporter``
sends them. The adapter written is a real safetensors file with PEFT key names (random
LoRA weights: no training happened), so its download and sha256 are checked for real.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
from pathlib import Path

import httpx
import numpy as np

from api.db.session import session_scope
from api.jobs import issue_job_token
from api.lifecycle import lock_job, transition
from api.settings import Settings


def real_executor_available() -> bool:
    """True when jobs can train for real: a scheduling task places them and the local
    executor task runs the trainer."""
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("worker.tasks.jobs", "worker.tasks.scheduling")
    )


class ReportDriver:
    """Drives one job: ``start()``, ``metrics(...)``, ``finish()`` or ``fail(...)``."""

    def __init__(self, url: str, data_dir: Path, job_id: str) -> None:
        self.url = url
        self.job_id = job_id
        self.settings = Settings(data_dir=data_dir)
        self.seq = 0
        self.token = ""
        self.out_dir = self.settings.data_path / "artifacts" / job_id / "output"

    def _transition(self, to: str, **changes: object) -> None:
        with session_scope(self.settings.resolved_database_url) as session:
            job = lock_job(session, self.job_id)
            assert job is not None
            transition(session, job, to, actor="executor", **changes)
            if to == "running":
                self.token = issue_job_token(session, job)

    def post(self, items: list[dict]) -> None:
        self.seq += 1
        answer = httpx.post(
            f"{self.url}/internal/v1/jobs/{self.job_id}/reports",
            json={"seq": self.seq, "items": items},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        answer.raise_for_status()

    def start(self) -> None:
        self._transition("running", pool="local", gpus=1, trainer="fsdp_qlora")

    def metrics(self, steps: range, total: int, pause_s: float = 0.0) -> None:
        for step in steps:
            loss = 5.6 * math.exp(-step / 6) + 0.9
            self.post([{
                "type": "metric", "step": step, "total_steps": total, "epoch": 0,
                "train_loss": loss, "learning_rate": 2e-4 * min(1.0, step / 2),
                "tokens_per_s": 900.0 + 10 * step, "tokens_seen": 20 * step,
                "memory_bytes": 300_000_000 + step * 1_000_000, "time": time.time(),
            }])
            if pause_s:
                time.sleep(pause_s)

    def finish(self, total: int) -> None:
        files = self._write_outputs()
        self.post([
            {"type": "checkpoint", "step": total, "location": str(self.out_dir / "checkpoint"),
             "metrics": {"train_loss": 0.95, "token_accuracy": 0.8}},
            {"type": "artifacts", "location": str(self.out_dir), "files": files},
        ])
        self._transition("succeeded")

    def _write_outputs(self) -> list[dict]:
        from safetensors.numpy import save_file

        adapter = self.out_dir / "adapter"
        adapter.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        tensors = {}
        for layer in range(2):
            for proj in ("q_proj", "v_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((8, 64)).astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = np.zeros((64, 8), np.float32)
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
        (adapter / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
        files = []
        for path in sorted(adapter.iterdir()):
            data = path.read_bytes()
            files.append({"name": f"adapter/{path.name}", "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
        return files
