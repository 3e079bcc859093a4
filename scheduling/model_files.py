"""A base model's shape read from its files: the one part of estimation that touches the
filesystem (``scheduling.estimator`` itself is arithmetic over the shape it is given)."""

from __future__ import annotations

import json
from pathlib import Path

from scheduling.model_shapes import KNOWN_MODELS, EstimateError, ModelShape


def missing_model_files(path: str, model_id: str) -> str | None:
    """What is missing of a local base model's files (its directory, its ``config.json``),
    or None when they are there or the model is an ``s3://`` one.

    A job on such a model could never load it. ``s3://`` models are not looked up here:
    that would be a round trip to the object store (with its credentials) per job and per
    scheduling cycle; the trainer lists the model's prefix when it starts and fails the
    job with ``model_not_found`` when the files are not there.
    """
    if path.startswith("s3://"):
        return None
    directory = Path(path)
    if not directory.is_dir():
        return f"base model {model_id!r} is unavailable: its directory {path} does not exist"
    if not (directory / "config.json").is_file():
        return f"base model {model_id!r} is unavailable: {path} has no config.json"
    return None


def base_model_shape(path: str, params_b: float | None, *, model_id: str) -> tuple[ModelShape, str]:
    """A base model's shape and where it came from: a local model's ``config.json``, an
    ``s3://`` model's nearest known model in ``params_b`` (its files are not read here).

    The API's estimates and the scheduler's placements both ask here. A local model whose
    files are missing is never given a guessed shape: ``EstimateError``
    (``model_unavailable``, see :func:`missing_model_files`). A config that cannot be read
    is one too (``model_config_unavailable``), so one broken model makes its jobs wait
    with that reason and never stops a cycle for the others.
    """
    if not path.startswith("s3://"):
        missing = missing_model_files(path, model_id)
        if missing is not None:
            raise EstimateError(missing, "model_unavailable")
        config = Path(path) / "config.json"
        try:
            return ModelShape.from_hf_config(json.loads(config.read_text(encoding="utf-8"))), "config.json"
        except EstimateError:
            raise
        except (OSError, ValueError, TypeError) as exc:
            raise EstimateError(f"cannot read {config}: {exc}", "model_config_unavailable") from exc
    if params_b:
        name, shape = min(KNOWN_MODELS.items(), key=lambda kv: abs(kv[1].params / 1e9 - params_b))
        return shape, f"nearest known model {name} (params_b {params_b:g})"
    raise EstimateError(
        f"cannot read the config of base model {model_id!r} at {path}, and it declares no params_b",
        "model_config_unavailable",
    )
