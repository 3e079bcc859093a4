"""Tiny random Llama checkpoints for the JAX tests, built with the shared builder.

``trainers.common.tiny_model.build_tiny_llama`` writes config + tokenizer + weights; we
then randomize the RMSNorm weights too (HF initializes them to 1, which would leave a
norm-weight loading bug invisible) and enlarge the weights a little so logits are far
from uniform, and save again with transformers (the reference implementation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from tests.model_files import randomize_weights
from trainers.common.tiny_model import build_tiny_llama

LLAMA3_ROPE = {
    # A small original context so that the low, medium and high frequency bands all occur
    # at head_dim 16; with 8192 the scaling would be a no-op at test lengths.
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class TinySpec:
    tied: bool = False
    rope: str = "llama3"  # "default" | "llama3"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 264  # divisible by 8 so vocab can shard on any test mesh
    seed: int = 0
    shards: bool = False  # sharded safetensors + index


def save_tiny_llama(path: Path, spec: TinySpec) -> Path:
    build_tiny_llama(
        path, hidden_size=spec.hidden, num_layers=spec.layers, num_heads=spec.heads,
        num_kv_heads=spec.kv_heads, intermediate_size=spec.intermediate, vocab_size=spec.vocab,
        rope_scaling=LLAMA3_ROPE if spec.rope == "llama3" else None,
        tie_word_embeddings=spec.tied, seed=spec.seed,
    )
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    randomize_weights(model, spec.seed + 1)
    for old in Path(path).glob("model*.safetensors*"):  # the builder's weights, now stale
        old.unlink()
    model.save_pretrained(path, max_shard_size="60KB" if spec.shards else "10GB")
    return Path(path)


def load_hf(path: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model
