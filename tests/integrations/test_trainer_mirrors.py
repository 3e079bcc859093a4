"""A real trainer run (``python -m trainers`` entry point, tiny Llama, fsdp_qlora recipe
single-process) with an MLflow integration: the run holds every training step's loss
and the exported PEFT adapter, byte for byte."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainers.conftest import make_spec, tiny_datasets, tiny_model_dir  # noqa: F401 (fixtures)


@pytest.mark.slow
def test_trainer_mirrors_losses_and_adapter_to_mlflow(make_spec: Any, tmp_path: Path,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    from trainers.__main__ import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the operator's tracker (a file store here)
    spec = make_spec(hyperparameters={"max_steps": 3},
                     integrations=[{"type": "mlflow", "project": "tunefleet-e2e"}])
    spec_path = tmp_path / "spec.json"
    spec.dump(spec_path)
    assert main(["--spec", str(spec_path)]) == 0

    rows = [json.loads(x) for x in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r["train_loss"] for r in rows}
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tunefleet-e2e").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["tunefleet.job_id"] == spec.job_id
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert history == trained and len(history) == 3
    local = Path(client.download_artifacts(run.info.run_id, "adapter", str(tmp_path / "dl")))
    adapter = Path(spec.output_dir) / "adapter"

    def digests(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.is_file()}

    assert digests(local) == digests(adapter) and "adapter_model.safetensors" in digests(local)
