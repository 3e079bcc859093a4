"""The Llama architecture config our JAX model supports, parsed from an HF ``config.json``.

Validation happens here, on plain Python values, so that a model we cannot run exactly
(an unknown RoPE type, attention biases, a non-SiLU MLP...) is refused with a
``UserError`` before anything is allocated or compiled. Both the transformers-5 layout
(``rope_parameters`` holding ``rope_theta``) and the older one (``rope_theta`` +
``rope_scaling``, as in the published Llama 3.1 checkpoints) are accepted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainers.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` 'default' (plain) or 'llama3' (3.1 scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeConfig

    @property
    def num_params(self) -> int:
        """Base parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build and validate from the contents of an HF Llama ``config.json``.

        Raises:
            UserError: ``unsupported_architecture`` for anything this model would not
                reproduce exactly.
        """
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise _unsupported(f"model_type {model_type!r} is not 'llama'")
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key):
                raise _unsupported(f"{key}=true is not supported (Llama 3 has no biases)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(f"hidden_act {act!r} is not supported (only 'silu')")
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise _unsupported("pretraining_tp != 1 is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                rope=_parse_rope(raw),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"config.json is missing or has a bad value: {exc}", code="corrupt_model") from exc
        if cfg.num_heads % cfg.num_kv_heads:
            raise _unsupported(
                f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})"
            )
        if cfg.head_dim % 2:
            raise _unsupported(f"head_dim ({cfg.head_dim}) must be even for rotary embeddings")
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> LlamaConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UserError(f"no config.json in the model directory {model_dir}", code="model_not_found")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON: {exc}", code="corrupt_model") from exc
        return cls.from_hf_dict(raw)


def _unsupported(why: str) -> UserError:
    return UserError(f"the JAX trainer cannot run this model: {why}", code="unsupported_architecture")


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes everything under rope_parameters; older checkpoints
    # (e.g. meta-llama/Llama-3.1-8B) keep rope_theta at the top and rope_scaling apart.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _unsupported(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    try:
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
            ),
        )
    except KeyError as exc:
        raise _unsupported(f"llama3 rope scaling needs {exc.args[0]!r}") from exc


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies (head_dim/2,) in float32, computed in float64 on the host.

    For 'llama3' the Llama 3.1 recipe: wavelengths longer than
    ``original_max / low_freq_factor`` are divided by ``factor``, shorter than
    ``original_max / high_freq_factor`` are kept, and the band between is interpolated.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents.astype(np.float64))
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)
