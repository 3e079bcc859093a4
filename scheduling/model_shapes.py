"""The shape of a base model, read from its Hugging Face ``config.json``, with exact parameter counts.

The estimator plans memory and FLOPs from a :class:`ModelShape`. Four decoder families
share Llama's layout (embeddings, per layer q/k/v/o + SwiGLU gate/up/down + two RMSNorms,
a final norm, an LM head) and differ in a few parameters, each read from the config the
way the family's transformers module builds it:

- llama: biases on q/k/v/o with ``attention_bias``, on the MLP with ``mlp_bias``;
- mistral: nothing more (no bias switch);
- qwen2: q/k/v biases, always;
- qwen3: a ``head_dim`` RMSNorm weight for q and one for k per layer; q/k/v/o biases
  with ``attention_bias``.

Every family may tie the LM head to the input embeddings (counted once) and set
``head_dim`` apart from ``hidden_size / num_attention_heads``. A config of another
``model_type`` is read with Llama's layout, the closest estimate we have (the trainers
refuse such a model when the job starts). Counts are checked against transformers'
own modules on the published configs (tests/worker/test_model_shapes.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


class EstimateError(ValueError):
    """The model config or job settings cannot be estimated; ``code`` is stable."""

    def __init__(self, message: str, code: str = "invalid_estimate_input") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder-only (Llama-layout) config that decide memory and FLOPs.

    Attributes:
        bias_modules: linear modules of each layer that have a bias (Qwen2: q/k/v).
        qk_norm: each layer normalizes its query and key heads (Qwen3: two ``head_dim``
            weights per layer).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    head_dim: int | None = None
    bias_modules: tuple[str, ...] = ()
    qk_norm: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` dict of any of the families above."""
        try:
            heads = int(config["num_attention_heads"])
            model_type = config.get("model_type", "llama")
            return cls(
                hidden=int(config["hidden_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
                bias_modules=_bias_modules(model_type, config),
                qk_norm=model_type == "qwen3",
            )
        except KeyError as exc:
            raise EstimateError(f"model config is missing {exc.args[0]!r}", "invalid_model_config") from exc

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelShape:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise EstimateError(f"{cfg} not found", "model_not_found")
        return cls.from_hf_config(json.loads(cfg.read_text(encoding="utf-8")))

    # --- parameter counts -------------------------------------------------------------
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of one decoder layer."""
        q_out, kv_out = self.heads * self.hd, self.kv_heads * self.hd
        return {
            "q_proj": (self.hidden, q_out),
            "k_proj": (self.hidden, kv_out),
            "v_proj": (self.hidden, kv_out),
            "o_proj": (q_out, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of one layer's linear modules: what a 4-bit base quantizes."""
        return sum(i * o for i, o in self.module_shapes().values())

    @property
    def linear_params(self) -> int:
        return self.layers * self.linear_params_per_layer

    @property
    def norm_and_bias_params(self) -> int:
        """RMSNorm weights (two per layer, the final one, Qwen3's q/k norms) and biases."""
        shapes = self.module_shapes()
        per_layer = 2 * self.hidden + sum(shapes[name][1] for name in self.bias_modules)
        per_layer += 2 * self.hd if self.qk_norm else 0
        return self.layers * per_layer + self.hidden

    @property
    def embedding_params(self) -> int:
        """Input embedding + lm_head (once if tied) + norms and biases: kept in bf16 always."""
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return emb + self.norm_and_bias_params

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params


def _bias_modules(model_type: str, config: dict[str, Any]) -> tuple[str, ...]:
    """The biased linear modules of a layer, as each family's transformers module has them."""
    if model_type == "qwen2":
        return ATTENTION_MODULES[:3]
    if model_type == "mistral":
        return ()
    names = ATTENTION_MODULES if config.get("attention_bias") else ()
    if model_type != "qwen3" and config.get("mlp_bias"):
        names += MLP_MODULES
    return names


# Shapes of well-known base models (HF config values), for the estimate endpoint's
# examples, the anchor tests and the benchmarks.
KNOWN_MODELS: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(4096, 32, 32, 32, 11008, 32000),
    "llama-3.1-8b": ModelShape(4096, 32, 32, 8, 14336, 128256),
    "llama-3.1-70b": ModelShape(8192, 80, 64, 8, 28672, 128256),
    "llama-2-70b": ModelShape(8192, 80, 64, 8, 28672, 32000),
    "llama-3.1-405b": ModelShape(16384, 126, 128, 8, 53248, 128256),
}
