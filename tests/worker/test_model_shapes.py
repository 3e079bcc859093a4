"""Parameter counts of the published configs, against transformers' own modules.

Each config below is the ``config.json`` of the checkpoint as published on the Hugging
Face Hub (only the keys that matter to the architecture; generation and dtype keys left
out). The expected count is not ours: transformers instantiates each config on the meta
device and we sum its parameters (a tied LM head is one parameter, counted once).
"""

from __future__ import annotations

import pytest
import torch

from scheduling.estimator import ModelShape, memory_per_gpu
from scheduling.model_shapes import KNOWN_MODELS
from scheduling.model_shapes import ModelShape as ModelShapeHome

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_LLAMA_31 = {"model_type": "llama", "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
             "max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
             "rope_scaling": LLAMA_31_ROPE, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "vocab_size": 128256, "pretraining_tp": 1}
# What the published configs of one family share, as _LLAMA_31 for Llama 3.1.
_QWEN25 = {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
           "use_sliding_window": False}
_QWEN3 = {"model_type": "qwen3", "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
          "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32,
          "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
          "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936}

PUBLISHED_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2.5-7B": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944,
                        "max_position_embeddings": 131072, "max_window_layers": 28, "num_attention_heads": 28,
                        "num_hidden_layers": 28, "num_key_value_heads": 4, "sliding_window": 131072,
                        "tie_word_embeddings": False, "vocab_size": 152064},
    "Qwen/Qwen2.5-3B": {  # tied embeddings and Qwen's 151,936-token vocabulary
        **_QWEN25, "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 32768,
        "max_window_layers": 36, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
        "sliding_window": 32768, "tie_word_embeddings": True, "vocab_size": 151936,
    },
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    # tied, and head_dim (128) != hidden / heads (80)
    "Qwen/Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "mistralai/Mistral-7B-v0.3": {
        "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32768,
    },
    "meta-llama/Llama-3.1-8B": {**_LLAMA_31, "hidden_size": 4096, "intermediate_size": 14336,
                                "num_attention_heads": 32, "num_hidden_layers": 32},
    "meta-llama/Llama-3.1-70B": {**_LLAMA_31, "hidden_size": 8192, "intermediate_size": 28672,
                                 "num_attention_heads": 64, "num_hidden_layers": 80},
    "meta-llama/Llama-3.1-405B": {**_LLAMA_31, "hidden_size": 16384, "intermediate_size": 53248,
                                  "num_attention_heads": 128, "num_hidden_layers": 126},
}


def _transformers_count(config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_parameter_count_equals_transformers(name):
    config = PUBLISHED_CONFIGS[name]
    assert ModelShape.from_hf_config(config).params == _transformers_count(config)


def test_family_parameters_are_counted():
    """Biases and q/k norms are what separates the families' counts (not the lookups above)."""
    qwen2 = ModelShape.from_hf_config(PUBLISHED_CONFIGS["Qwen/Qwen2.5-7B"])
    assert qwen2.bias_modules == ("q_proj", "k_proj", "v_proj") and not qwen2.qk_norm
    # 28 layers x (q 3584 + k 512 + v 512) biases
    assert qwen2.params - ModelShape.from_hf_config({**PUBLISHED_CONFIGS["Qwen/Qwen2.5-7B"],
                                                     "model_type": "llama"}).params == 28 * 4608
    qwen3 = ModelShape.from_hf_config(PUBLISHED_CONFIGS["Qwen/Qwen3-8B"])
    assert qwen3.qk_norm and qwen3.bias_modules == ()
    assert ModelShape.from_hf_config({**PUBLISHED_CONFIGS["Qwen/Qwen3-8B"], "attention_bias": True}).params == (
        _transformers_count({**PUBLISHED_CONFIGS["Qwen/Qwen3-8B"], "attention_bias": True}))
    tied = ModelShape.from_hf_config(PUBLISHED_CONFIGS["Qwen/Qwen3-4B"])
    untied = ModelShape.from_hf_config({**PUBLISHED_CONFIGS["Qwen/Qwen3-4B"], "tie_word_embeddings": False})
    assert untied.params - tied.params == 151936 * 2560


def test_known_models_are_the_published_llamas():
    for name, key in (("llama-3.1-8b", "8B"), ("llama-3.1-70b", "70B"), ("llama-3.1-405b", "405B")):
        assert KNOWN_MODELS[name] == ModelShape.from_hf_config(PUBLISHED_CONFIGS[f"meta-llama/Llama-3.1-{key}"])


def test_estimator_weights_hold_every_unquantized_parameter():
    """The estimator's bf16 weight bytes are 2 bytes for every parameter the family has
    (biases and norms included), and it reads the shape from this module."""
    from scheduling.estimator import TrainingShape

    assert ModelShape is ModelShapeHome
    shape = ModelShape.from_hf_config(PUBLISHED_CONFIGS["Qwen/Qwen2.5-7B"])
    mem = memory_per_gpu(shape, TrainingShape(method="lora"), 1, accelerator="nvidia-rtx-4090")
    assert mem.weights == 2 * _transformers_count(PUBLISHED_CONFIGS["Qwen/Qwen2.5-7B"])


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"), ALL])
def test_fp32_saved_activations_match_autograd_per_family(family, targets):
    """What one layer saves for backward (fp32, SDPA, peft LoRA) as autograd counts it:
    Qwen2's biases add nothing, Qwen3's q/k norms keep their inputs and rsqrts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from scheduling.estimator import TrainingShape, activation_bytes_per_layer
    from tests.model_files import tiny_family_config
    from tests.worker.test_estimator import _bytes_layer_1_saves

    # Mistral as v0.2+ publish it (no window): a windowed mask is an explicit tensor SDPA
    # keeps, outside this per-layer count.
    config = tiny_family_config(family, attn_implementation="sdpa",
                                **({"sliding_window": None} if family == "mistral" else {}))
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=list(targets)))
    model.train()
    ids = torch.randint(0, 256, (2, 48))
    training = TrainingShape(r=4, target_modules=targets, seq_len=48, micro_batch=2, compute_bytes=4)
    shape = ModelShape.from_hf_config(config.to_dict())
    assert activation_bytes_per_layer(shape, training) == _bytes_layer_1_saves(model, ids)
