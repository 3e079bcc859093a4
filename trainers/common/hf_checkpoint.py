"""Which file and bytes hold each tensor of a Hugging Face safetensors checkpoint.

Both trainers read their base model through :func:`read_config_json` and
:func:`read_checkpoint_index`, so a broken model directory fails the same way on either,
before any weight is read:

- ``model_not_found``: no ``config.json``, or neither ``model.safetensors`` nor
  ``model.safetensors.index.json``;
- ``corrupt_model``: ``config.json`` is not valid JSON or not an object;
- ``corrupt_model``: the index is not JSON or has no ``weight_map``, a shard it names is
  missing, a shard's header cannot be parsed, a tensor the index names is not in its
  shard, or a tensor's bytes lie past the end of its file (a truncated download).

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor:
``dtype``, ``shape``, ``data_offsets`` relative to the end of the header) and the raw
data. Only headers are read here (pure Python, no torch or jax), so this costs
milliseconds even for a model of hundreds of GB.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.errors import UserError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit; a larger length is garbage


@dataclass(frozen=True)
class TensorLocation:
    """One tensor: its file, dtype (safetensors name, e.g. ``BF16``), shape and the
    absolute byte range ``[start, end)`` of its data in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorLocation]:
    """Every tensor of one safetensors file (``__metadata__`` left out).

    Raises:
        UserError(corrupt_model): the file cannot be read as safetensors.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ValueError("shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise ValueError(f"implausible header length {header_len}")
            header = json.loads(fh.read(header_len))
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        header.pop("__metadata__", None)
        base = 8 + header_len
        tensors = {}
        for name, info in header.items():
            lo, hi = (int(x) for x in info["data_offsets"])
            if not 0 <= lo <= hi or base + hi > size:
                raise ValueError(f"tensor {name!r} lies past the end of the file (truncated?)")
            tensors[name] = TensorLocation(
                file=path, dtype=str(info["dtype"]), shape=tuple(int(d) for d in info["shape"]),
                start=base + lo, end=base + hi,
            )
    except FileNotFoundError as exc:
        raise UserError(f"checkpoint file missing: {path}", code="corrupt_model") from exc
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise UserError(f"{path} is not a readable safetensors file: {exc}", code="corrupt_model") from exc
    return tensors


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of the model in ``model_dir``; each trainer validates the
    fields it needs. See the module docstring for the errors."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"no {CONFIG_FILE} in the model directory {model_dir}", code="model_not_found")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}", code="corrupt_model") from exc
    if not isinstance(raw, dict):
        raise UserError(f"{path} does not hold a config object", code="corrupt_model")
    return raw


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map: Any = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{index} is not a safetensors index: {exc}", code="corrupt_model") from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise UserError(f"{index}: weight_map must map tensor names to file names", code="corrupt_model")
    return weight_map


def read_checkpoint_index(model_dir: str | Path) -> dict[str, TensorLocation]:
    """Where every tensor of the checkpoint in ``model_dir`` is (a single file or a
    sharded index); see the module docstring for the errors."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        shards = sorted(set(weight_map.values()))
        missing = [name for name in shards if not (root / name).is_file()]
        if missing:
            raise UserError(f"checkpoint shards missing in {root}: {', '.join(missing)}", code="corrupt_model")
        headers = {name: read_safetensors_header(root / name) for name in shards}
        tensors = {}
        for tensor, shard in weight_map.items():
            if tensor not in headers[shard]:
                raise UserError(f"{index} puts {tensor!r} in {shard}, which does not hold it", code="corrupt_model")
            tensors[tensor] = headers[shard][tensor]
        return tensors
    single = root / SINGLE_FILE
    if single.is_file():
        return read_safetensors_header(single)
    raise UserError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {root} (only safetensors checkpoints are supported)",
        code="model_not_found",
    )
