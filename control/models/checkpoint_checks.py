"""Checks a Hugging Face checkpoint directory before it is registered as a base model.

A broken checkpoint should be refused when an admin registers it, not found out by the
first job that trains on it. ``check_checkpoint`` reads the checkpoint through an artifact
store (a local directory or ``s3://`` prefix, control/artifacts.py) and only small parts of it:
``config.json``, whether the tokenizer's files exist, the safetensors index and each
shard's header (the tensor names), never the weights themselves.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import get_args

from control.artifacts import ArtifactStore
from control.errors import APIError
from scheduling.model_shapes import EstimateError, ModelShape
from trainers.spec import Architecture

SUPPORTED_ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
# What transformers' AutoTokenizer loads a tokenizer from (fast, SentencePiece, BPE files).
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class CheckpointInfo:
    """What the registry records about a checkpoint that passed the checks."""

    architecture: str
    max_seq_len: int
    params_b: float


def checkpoint_error(code: str, message: str) -> APIError:
    return APIError(400, code, message, param="source")


def check_checkpoint(files: ArtifactStore) -> CheckpointInfo:
    """Check that ``files`` (a store rooted at the checkpoint) holds one the trainers can load.

    Raises:
        APIError: 400 ``model_config_unreadable`` (no or invalid config.json),
            ``unsupported_architecture``, ``tokenizer_missing``, ``weights_missing``
            (no safetensors) or ``inconsistent_weights`` (index and shards disagree).
    """
    path = files.location()
    if not files.exists("config.json"):
        raise checkpoint_error("model_config_unreadable", f"{path} has no config.json.")
    try:
        config = json.loads(files.read_bytes("config.json"))
        if not isinstance(config, dict):
            raise TypeError("not a JSON object")
    except (OSError, ValueError, TypeError) as exc:
        raise checkpoint_error("model_config_unreadable",
                               f"Cannot read config.json of {path}: {exc}.") from exc
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise checkpoint_error("unsupported_architecture",
                               f"config.json says model_type {model_type!r}; the trainers support "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    if not any(all(files.exists(name) for name in names) for names in _TOKENIZER_FILES):
        raise checkpoint_error("tokenizer_missing",
                               f"{path} has no tokenizer (tokenizer.json, tokenizer.model or "
                               "vocab.json + merges.txt).")
    _check_weights(files)
    try:
        shape = ModelShape.from_hf_config(config)
    except (EstimateError, KeyError, TypeError, ValueError) as exc:
        raise checkpoint_error("model_config_unreadable",
                               f"config.json of {path} lacks what the trainers need: {exc}.") from exc
    max_seq_len = config.get("max_position_embeddings")
    if not isinstance(max_seq_len, int) or max_seq_len < 8:
        raise checkpoint_error("model_config_unreadable",
                               f"config.json of {path} has no usable max_position_embeddings.")
    return CheckpointInfo(architecture=model_type, max_seq_len=max_seq_len,
                          params_b=shape.params / 1e9)


def _check_weights(files: ArtifactStore) -> None:
    path = files.location()
    if not files.exists(_INDEX):
        if not files.exists(_SINGLE):
            raise checkpoint_error("weights_missing", f"{path} has neither {_SINGLE} nor {_INDEX}.")
        _shard_tensors(files, _SINGLE)
        return
    try:
        weight_map = json.loads(files.read_bytes(_INDEX))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty or not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise checkpoint_error("inconsistent_weights", f"Cannot read {_INDEX}: {exc}.") from exc
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(str(shard), set()).add(tensor)
    for shard, expected in sorted(by_shard.items()):
        if "/" in shard or "\\" in shard or not files.exists(shard):
            raise checkpoint_error("inconsistent_weights",
                                   f"{_INDEX} names shard {shard!r}, which is not in {path}.")
        stored = _shard_tensors(files, shard)
        if stored != expected:
            missing = sorted(expected - stored)[:3]
            extra = sorted(stored - expected)[:3]
            raise checkpoint_error("inconsistent_weights",
                                   f"Shard {shard} does not hold what {_INDEX} says: missing "
                                   f"{missing or 'none'}, not indexed {extra or 'none'}.")


def _shard_tensors(files: ArtifactStore, shard: str) -> set[str]:
    """The tensor names in a safetensors file's header (8-byte length, then JSON), read
    from the start of the file only."""
    head = b""
    try:
        chunks = files.iter_bytes(shard)
        for chunk in chunks:
            head += chunk
            if len(head) >= 8 and len(head) >= 8 + struct.unpack("<Q", head[:8])[0]:
                break
            if len(head) > _MAX_HEADER:
                break
        if len(head) < 8:
            raise ValueError("shorter than a header")
        (length,) = struct.unpack("<Q", head[:8])
        if length > _MAX_HEADER or len(head) < 8 + length:
            raise ValueError(f"header of {length} bytes in a file of {len(head)}")
        header = json.loads(head[8:8 + length])
        if not isinstance(header, dict):
            raise TypeError("header is not an object")
    except (OSError, ValueError, TypeError, struct.error) as exc:
        raise checkpoint_error("inconsistent_weights",
                               f"{shard} is not a readable safetensors file: {exc}.") from exc
    return {name for name in header if name != "__metadata__"}
