"""The golden job, run once per session on each trainer through the real entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainers.golden.job import TRAINERS, EntryPointRun, golden_spec, run_entry_point


@pytest.fixture(scope="session")
def golden_runs(tiny_model_dir: Path, tiny_datasets: dict[str, Path], tmp_path_factory) -> dict[str, EntryPointRun]:
    runs = {}
    for trainer in TRAINERS:
        root = tmp_path_factory.mktemp(f"golden-{trainer}")
        runs[trainer] = run_entry_point(golden_spec(trainer, tiny_model_dir, tiny_datasets, root), root)
    return runs
