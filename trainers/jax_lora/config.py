"""The decoder configs our JAX model supports, parsed from an HF ``config.json``.

One decoder covers four Hugging Face families; what differs between them is read from
the config into a few switches on :class:`DecoderConfig`:

- llama: the reference layout; biases on q/k/v/o with ``attention_bias``, on the MLP
  with ``mlp_bias``;
- mistral: sliding-window attention when ``sliding_window`` is set (every layer);
- qwen2: q/k/v projections always have a bias;
- qwen3: RMSNorm of each query and key head before RoPE; biases with ``attention_bias``.

Qwen's ``use_sliding_window`` (a window on some layers only) is refused.

All four may tie the LM head to the embeddings (``tie_word_embeddings``) and set
``head_dim`` apart from ``hidden_size / num_attention_heads`` (Qwen3 does).

Validation happens here, on plain Python values, so that a model we cannot run exactly
(another family, an unknown RoPE type, a non-SiLU MLP, Qwen's per-layer sliding
windows...) is refused with a ``UserError`` before anything is allocated or compiled.
Both the transformers-5 layout (``rope_parameters`` holding ``rope_theta``) and the older
one (``rope_theta`` + ``rope_scaling``, as in the published Llama 3.1 checkpoints) are
accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainers.common.hf_checkpoint import read_config_json
from trainers.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "llama3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Mistral's configuration class defaults to a 4096-token window when config.json omits it.
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096


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
class DecoderConfig:
    """A Llama-layout decoder and its family switches.

    Attributes:
        model_type: the HF family (one of ``SUPPORTED_MODEL_TYPES``).
        bias_projections: projections with an additive bias (Qwen2: q/k/v).
        qk_norm: RMSNorm (a ``head_dim`` weight shared by all heads) on each query and
            key head after projection, before RoPE (Qwen3).
        sliding_window: a query sees only the last ``sliding_window`` tokens, itself
            included (Mistral); None for full causal attention.
    """

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
    model_type: str = "llama"
    bias_projections: tuple[str, ...] = ()
    qk_norm: bool = False
    sliding_window: int | None = None

    @property
    def num_params(self) -> int:
        """Base parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (2 * q + 2 * kv)
        mlp = 3 * h * self.intermediate_size
        bias_sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h,
                      "gate_proj": self.intermediate_size, "up_proj": self.intermediate_size, "down_proj": h}
        biases = sum(bias_sizes[name] for name in self.bias_projections)
        per_layer = attn + mlp + 2 * h + biases + (2 * d if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DecoderConfig:
        """Build and validate from the contents of an HF ``config.json``.

        Raises:
            UserError: ``unsupported_architecture`` for anything this model would not
                reproduce exactly.
        """
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _unsupported(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
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
                model_type=model_type,
                bias_projections=_bias_projections(model_type, raw),
                qk_norm=model_type == "qwen3",
                sliding_window=_sliding_window(model_type, raw),
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
    def from_pretrained(cls, model_dir: str | Path) -> DecoderConfig:
        return cls.from_hf_dict(read_config_json(model_dir))


def _bias_projections(model_type: str, raw: dict[str, Any]) -> tuple[str, ...]:
    """Which projections have biases, as each family's transformers module builds them."""
    if model_type == "qwen2":  # hard-wired in Qwen2Attention, whatever the config says
        return ("q_proj", "k_proj", "v_proj")
    if model_type == "mistral":  # MistralAttention/MistralMLP have no bias switch
        return ()
    names: tuple[str, ...] = ATTENTION_PROJECTIONS if raw.get("attention_bias") else ()
    if model_type == "llama" and raw.get("mlp_bias"):
        names += MLP_PROJECTIONS
    return names


def _sliding_window(model_type: str, raw: dict[str, Any]) -> int | None:
    if model_type == "mistral":
        # Every layer uses the window when one is set (MistralModel); published v0.2+
        # checkpoints set null.
        window = raw.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        if window is None:
            return None
        if int(window) < 1:
            raise _unsupported(f"sliding_window ({window}) must be >= 1")
        return int(window)
    sliding_layers = "sliding_attention" in (raw.get("layer_types") or ())
    if model_type in ("qwen2", "qwen3") and (raw.get("use_sliding_window") or sliding_layers):
        # Qwen windows only the layers from max_window_layers on; one window for some
        # layers and none for others is not built.
        raise _unsupported("use_sliding_window=true (per-layer sliding windows) is not supported")
    return None


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
