"""Every supported decoder family (Llama, Mistral, Qwen2, Qwen3) against transformers.

One tiny random checkpoint per family (``tests.model_files``): Mistral's sliding window
(8) is shorter than the test sequences, Qwen2 has q/k/v biases, Qwen3 q/k norms, tied
embeddings and a head_dim apart from hidden / heads. Our logits, our NF4 logits and our
exported adapters are compared with transformers, bitsandbytes and peft (fp32, 1e-4).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.model_files import FAMILIES, save_tiny_family
from tests.trainers.fsdp_qlora.reference import hf_model
from tests.trainers.jax_lora.batches import random_lora
from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import export_adapter
from trainers.jax_lora.loading import iter_hf_names, load_params
from trainers.jax_lora.lora import lora_runtime, lora_shapes
from trainers.jax_lora.model import forward, param_axes
from trainers.jax_lora.sharding import make_mesh, tree_shardings

TOL = 1e-4
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return save_tiny_family(tmp_path_factory.mktemp(request.param), request.param)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long), use_cache=False).logits.numpy()


def _load(model_dir, quantization="none"):
    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32, quantization)
    return cfg, params


def _tokens(cfg, seed=0, shape=(2, 40)):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape).astype(np.int32)


def test_config_switches_follow_the_family(family_dir):
    cfg = DecoderConfig.from_pretrained(family_dir)
    expected = {
        "llama": ((), False, None, False),
        "mistral": ((), False, 8, False),
        "qwen2": (("q_proj", "k_proj", "v_proj"), False, None, False),
        "qwen3": ((), True, None, True),
    }[cfg.model_type]
    assert (cfg.bias_projections, cfg.qk_norm, cfg.sliding_window, cfg.tie_word_embeddings) == expected
    # Every tensor the checkpoint stores is read (none ignored, none invented).
    from safetensors import safe_open

    with safe_open(str(family_dir / "model.safetensors"), "np") as f:
        stored = set(f.keys())
    assert set(iter_hf_names(cfg)) == stored
    hf = hf_model(family_dir)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


def test_logits_match_transformers(family_dir):
    cfg, params = _load(family_dir)
    tokens = _tokens(cfg)
    ours = np.asarray(jax.jit(lambda p, t: forward(p, None, t, cfg=cfg))(params, tokens))
    ref = _hf_logits(hf_model(family_dir), tokens)
    assert np.abs(ref).max() > 0.5  # logits far from uniform: the comparison has teeth
    assert np.abs(ours - ref).max() <= TOL


def test_packed_segments_match_transformers_alone(family_dir):
    """Each segment of a packed row gives the logits transformers gives it alone (for
    Mistral the segments are longer than the window, so window and segments combine)."""
    cfg, params = _load(family_dir)
    hf = hf_model(family_dir)
    rng = np.random.default_rng(1)
    seq, lengths = 40, (13, 20)
    tokens, segments, positions = (np.zeros((1, seq), np.int32) for _ in range(3))
    pieces, t = [], 0
    for seg, n in enumerate(lengths, start=1):
        ids = rng.integers(0, cfg.vocab_size, n)
        tokens[0, t : t + n], segments[0, t : t + n], positions[0, t : t + n] = ids, seg, np.arange(n)
        pieces.append((t, ids))
        t += n
    positions[0, t:] = np.arange(seq - t) + lengths[-1]
    run = jax.jit(lambda p, t, s, q: forward(p, None, t, cfg=cfg, segment_ids=s, positions=q))
    ours = np.asarray(run(params, tokens, segments, positions))
    for start, ids in pieces:
        assert np.abs(ours[0, start : start + len(ids)] - _hf_logits(hf, ids[None])[0]).max() <= TOL


def test_mistral_sliding_window_masks_distant_tokens(tmp_path):
    """Without the window the same weights give other logits past position 8 (the parity
    test above has teeth), and the same logits within it."""
    model_dir = save_tiny_family(tmp_path / "m", "mistral")
    cfg, params = _load(model_dir)
    full = DecoderConfig.from_hf_dict({**json.loads((model_dir / "config.json").read_text()), "sliding_window": None})
    tokens = _tokens(cfg, shape=(1, 24))
    windowed = np.asarray(forward(params, None, tokens, cfg=cfg))
    causal = np.asarray(forward(params, None, tokens, cfg=full))
    assert np.abs(windowed[:, :8] - causal[:, :8]).max() <= 1e-6
    assert np.abs(windowed[:, 8:] - causal[:, 8:]).max() > 1e-2


def test_nf4_logits_match_the_bitsandbytes_model(family_dir):
    """Biases and q/k norms stay unquantized; the projections are bitsandbytes' NF4."""
    cfg, params = _load(family_dir, "nf4")
    for name in cfg.bias_projections:
        assert params["layers"]["biases"][name].dtype == jnp.float32
    tokens = _tokens(cfg, seed=2, shape=(2, 24))
    ours = np.asarray(jax.jit(lambda p, t: forward(p, None, t, cfg=cfg))(params, tokens))
    assert np.abs(ours - _hf_logits(hf_model(family_dir, "nf4"), tokens)).max() <= TOL


def test_exported_adapter_loads_in_peft_with_our_logits(family_dir, tmp_path):
    from peft import PeftModel

    cfg, params = _load(family_dir)
    r, alpha = 4, 8.0
    lora = random_lora(lora_shapes(cfg, ALL, r, jnp.float32), seed=3)
    adapter = export_adapter(tmp_path / "adapter", lora, r=r, alpha=alpha, dropout=0.0, target_modules=ALL)
    tokens = _tokens(cfg, seed=4, shape=(2, 24))
    runtime = lora_runtime(alpha, r, 0.0)
    run = jax.jit(lambda p, l, t: (forward(p, l, t, cfg=cfg, runtime=runtime), forward(p, None, t, cfg=cfg)))
    ours, base = map(np.asarray, run(params, jax.tree.map(jnp.asarray, lora), tokens))
    ref = _hf_logits(PeftModel.from_pretrained(hf_model(family_dir), str(adapter)), tokens)
    assert np.abs(ours - base).max() > 1e-2  # the adapter changes the logits
    assert np.abs(ours - ref).max() <= TOL


def test_sharded_load_splits_biases_and_norms_by_the_rules(tmp_path):
    """A (1, 4, 2) mesh: q/k/v biases split over heads on ``tensor`` (as their
    projections' outputs), o_proj's over ``embed`` on ``fsdp``; q/k norms replicate; every
    shard holds the single-device slice."""
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py (jax was initialized earlier)")
    # Qwen3 with attention_bias: all four projections biased, plus the q/k norms.
    model_dir = save_tiny_family(tmp_path / "q", "qwen3", attention_bias=True)
    cfg, full = _load(model_dir)
    assert cfg.bias_projections == ("q_proj", "k_proj", "v_proj", "o_proj")
    mesh = make_mesh(1, 4, 2)
    sharded, _ = load_params(model_dir, cfg, mesh, jnp.float32)
    specs = jax.tree.map(lambda s: tuple(s.spec), tree_shardings(sharded, param_axes(cfg), mesh))
    layers = specs["layers"]
    assert layers["biases"]["q_proj"] == (None, "tensor", None)
    assert layers["biases"]["k_proj"] == (None, "tensor", None)
    assert layers["biases"]["o_proj"] == (None, "fsdp")
    assert layers["q_norm"] == (None, None) and layers["k_norm"] == (None, None)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(sharded), strict=True):
        for shard in b.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(a)[shard.index])
    tokens = _tokens(cfg, shape=(2, 16))
    ref = _hf_logits(hf_model(model_dir), tokens)
    assert np.abs(np.asarray(forward(sharded, None, tokens, cfg=cfg)) - ref).max() <= TOL


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"model_type": "gemma2"}, "supported: llama, mistral, qwen2, qwen3"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "sliding"),
    ],
)
def test_unsupported_families_and_windows_are_user_errors(raw, needle):
    base = {"vocab_size": 264, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(UserError) as err:
        DecoderConfig.from_hf_dict({**base, **raw})
    assert err.value.code == "unsupported_architecture"
    assert needle in err.value.message
