"""Broken copies of the tiny test checkpoints, for failure-path tests."""

from __future__ import annotations

from pathlib import Path


def nan_copy(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` whose final norm has a NaN weight: every logit is NaN."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in model_dir.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(dest / "model.safetensors"))
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
