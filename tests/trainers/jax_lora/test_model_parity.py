"""Our JAX Llama vs transformers' LlamaForCausalLM on the same random weights (fp32)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.trainers.jax_lora.hf_tiny import load_hf
from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.model import forward
from trainers.jax_lora.sharding import check_divisible_heads, make_mesh

TOL = 1e-4


def _load(model_dir):
    cfg = DecoderConfig.from_pretrained(model_dir)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params, _ = load_params(model_dir, cfg, mesh, jnp.float32)
    return cfg, params


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("fixture", ["tiny_untied", "tiny_tied"])
def test_logits_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    cfg, params = _load(model_dir)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    ours = np.asarray(jax.jit(lambda p, t: forward(p, None, t, cfg=cfg))(params, tokens))
    ref = _hf_logits(load_hf(model_dir), tokens)
    assert np.abs(ref).max() > 0.5  # logits far from uniform: the comparison has teeth
    assert np.abs(ours - ref).max() <= TOL


def test_packed_batch_equals_separate_sequences(tiny_untied):
    """Each segment of a packed row gives the logits HF gives for it alone."""
    cfg, params = _load(tiny_untied)
    hf = load_hf(tiny_untied)
    rng = np.random.default_rng(1)
    lengths = [(13, 20), (33,)]
    seq = 40
    tokens = np.zeros((2, seq), np.int32)
    segments = np.zeros((2, seq), np.int32)
    positions = np.zeros((2, seq), np.int32)
    pieces = []
    for row, lens in enumerate(lengths):
        t = 0
        for seg, n in enumerate(lens, start=1):
            ids = rng.integers(0, cfg.vocab_size, n)
            tokens[row, t : t + n], segments[row, t : t + n], positions[row, t : t + n] = ids, seg, np.arange(n)
            pieces.append((row, t, ids))
            t += n
        positions[row, t:] = np.arange(seq - t) + (positions[row, t - 1] + 1)
    ours = np.asarray(
        jax.jit(lambda p, t, s, q: forward(p, None, t, cfg=cfg, segment_ids=s, positions=q))(
            params, tokens, segments, positions
        )
    )
    for row, start, ids in pieces:
        ref = _hf_logits(hf, ids[None])[0]
        assert np.abs(ours[row, start : start + len(ids)] - ref).max() <= TOL


def test_llama3_rope_scaling_is_applied(tiny_untied, tmp_path):
    """Same weights with rope scaling removed give different logits (the test above has teeth)."""
    raw = json.loads((tiny_untied / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == "llama3"
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_parameters"]["rope_theta"]}
    plain_cfg = DecoderConfig.from_hf_dict(raw)
    cfg, params = _load(tiny_untied)
    tokens = np.arange(48, dtype=np.int32)[None] % cfg.vocab_size
    scaled = np.asarray(forward(params, None, tokens, cfg=cfg))
    plain = np.asarray(forward(params, None, tokens, cfg=plain_cfg))
    assert np.abs(scaled - plain).max() > 1e-2


def test_old_style_rope_scaling_config_is_read():
    """Published Llama 3.1 configs: rope_theta at top level, rope_scaling with 'rope_type'."""
    raw = {
        "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    cfg = DecoderConfig.from_hf_dict(raw)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "unsupported_architecture"),
        ({"hidden_act": "gelu"}, "unsupported_architecture"),
        ({"num_key_value_heads": 3}, "unsupported_architecture"),
        ({"model_type": "gemma"}, "unsupported_architecture"),
    ],
)
def test_unsupported_configs_are_user_errors(tiny_untied, change, code):
    raw = json.loads((tiny_untied / "config.json").read_text())
    raw.update(change)
    with pytest.raises(UserError) as err:
        DecoderConfig.from_hf_dict(raw)
    assert err.value.code == code
    assert "yarn" in err.value.message if "rope_parameters" in change else True


def test_heads_not_divisible_by_tensor_axis_is_user_error():
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py (jax was initialized earlier)")
    mesh = make_mesh(2, 1, 4)  # heads = 4 split 4 ways, kv_heads = 2 cannot
    with pytest.raises(UserError) as err:
        check_divisible_heads(4, 2, mesh)
    assert err.value.code == "invalid_parallelism" and "kv_heads" in err.value.message


def test_mesh_product_must_equal_device_count():
    with pytest.raises(UserError) as err:
        make_mesh(1, jax.device_count() + 1, 1)
    assert err.value.code == "invalid_parallelism"
