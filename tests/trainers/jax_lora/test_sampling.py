"""The JAX sampler (``trainers/jax_lora/sampling.py``) against transformers (+ peft).

A tiny random Llama with a random LoRA adapter on (fp32): greedy decoding of left-padded
prompts of different lengths and budgets, stopping at a stop token, equals transformers'
``generate`` of each prompt alone on the same model with the adapter loaded by peft; the
first token drawn at a temperature follows ``softmax(logits / T)`` of transformers'
logits; a seed gives the same draws on one device and on a (2, 2, 2) mesh; and the KV
cache's logits (prefill, then one token at a time) equal the full forward's, a sliding
window included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.model_files import save_tiny_family
from tests.trainers.jax_lora.batches import random_lora
from tests.trainers.jax_lora.hf_tiny import load_hf
from trainers.common.reinforcement import Prompt
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import export_adapter
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import lora_axes, lora_runtime, lora_shapes
from trainers.jax_lora.model import cache_shapes, cached_hidden_states, forward, lm_head, param_axes
from trainers.jax_lora.sampling import DecodeConfig, Sampler, SamplingShape
from trainers.jax_lora.sharding import make_mesh, tree_shardings

TARGETS = ("q_proj", "v_proj", "down_proj")
R, ALPHA = 4, 8.0
SHAPE = SamplingShape(rows=8, prompt_len=11, new_tokens=9)
NO_STOP = 100_000  # no token has this id


def _prompts() -> list[Prompt]:
    """Four prompts of 11, 6, 3 and 8 tokens with budgets 9, 4, 9 and 7."""
    rng = np.random.default_rng(3)
    return [Prompt(tuple(int(x) for x in rng.integers(0, 256, n)), {}, budget)
            for n, budget in ((11, 9), (6, 4), (3, 9), (8, 7))]


@pytest.fixture(scope="module")
def policy(tiny_untied, tmp_path_factory):
    """A random adapter on transformers via peft, its greedy answers, and a stop token: one
    the first answer draws for the first time after a few others, which then ends every
    answer that draws it."""
    from peft import PeftModel

    cfg = DecoderConfig.from_pretrained(tiny_untied)
    lora = random_lora(lora_shapes(cfg, TARGETS, R, jnp.float32), seed=2, scale=0.3)
    adapter_dir = export_adapter(tmp_path_factory.mktemp("adapter"), lora, r=R, alpha=ALPHA, dropout=0.0,
                                 target_modules=TARGETS)
    reference = PeftModel.from_pretrained(load_hf(tiny_untied), str(adapter_dir)).eval()
    prompts = _prompts()
    free = [_hf_greedy(reference, p, NO_STOP) for p in prompts]
    assert [len(c) for c in free] == [p.max_new_tokens for p in prompts]
    at = next(j for j in range(2, len(free[0])) if free[0][j] not in free[0][:j])
    stop = free[0][at]
    greedy = [_hf_greedy(reference, p, stop) for p in prompts]
    assert len(greedy[0]) == at + 1 and greedy != free
    return {"cfg": cfg, "lora": lora, "reference": reference, "stop": stop, "greedy": greedy}


@pytest.fixture(scope="module")
def one_device(tiny_untied, policy):
    return _sampler(tiny_untied, policy, (1, 1, 1))


def _sampler(model_dir, policy, mesh_shape):
    cfg = policy["cfg"]
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    params, _ = load_params(model_dir, cfg, mesh, jnp.float32)
    lora_shardings = tree_shardings(lora_shapes(cfg, TARGETS, R, jnp.float32), lora_axes(TARGETS), mesh)
    lora = jax.tree.map(lambda x, s: jax.device_put(x, s), policy["lora"], lora_shardings)
    dc = DecodeConfig(cfg=cfg, runtime=lora_runtime(ALPHA, R, 0.0), shape=SHAPE, stop_ids=(policy["stop"],),
                      pad_id=0)
    return Sampler(dc, mesh, tree_shardings(params, param_axes(cfg), mesh), lora_shardings), params, lora


def _hf_greedy(model, prompt: Prompt, stop: int) -> list[int]:
    ids = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=prompt.max_new_tokens, eos_token_id=stop, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_decode_equals_transformers_generate_with_the_adapter(policy, one_device):
    sampler, params, lora = one_device
    prompts, expected = _prompts(), policy["greedy"]
    # two rows per prompt, 8 rows in one call; 3 prompts = 6 rows and 2 padding rows
    assert sampler.sample(params, lora, prompts, 2, seed=1, greedy=True) == [c for c in expected for _ in (0, 1)]
    assert (sampler.sample(params, lora, prompts[1:], 2, seed=1, greedy=True)
            == [c for c in expected[1:] for _ in (0, 1)])
    # a temperature near 0 draws the argmax
    assert sampler.sample(params, lora, prompts, 2, seed=1, temperature=1e-4) == [c for c in expected for _ in (0, 1)]


def test_drawn_tokens_follow_the_temperature_and_the_seed(policy, one_device):
    sampler, params, lora = one_device
    prompts = _prompts()
    a = sampler.sample(params, lora, prompts, 2, seed=7)
    assert a == sampler.sample(params, lora, prompts, 2, seed=7)  # a seed's draws are fixed
    assert a != sampler.sample(params, lora, prompts, 2, seed=8)
    assert a[0] != a[1]  # the same prompt's rows draw apart

    first = Prompt(prompts[0].input_ids, {}, 1)
    with torch.no_grad():
        logits = policy["reference"](torch.tensor([first.input_ids])).logits[0, -1].double()
    n = 2048
    top_1 = {}
    for temperature in (0.5, 2.0):
        p = torch.softmax(logits / temperature, -1).numpy()
        drawn = np.array([c[0] for c in sampler.sample(params, lora, [first], n, seed=11, temperature=temperature)])
        freq = np.bincount(drawn, minlength=len(p)) / n
        for token in np.argsort(p)[-3:]:  # the three likeliest tokens, within 4.5 binomial sigmas
            sigma = np.sqrt(p[token] * (1 - p[token]) / n)
            assert abs(freq[token] - p[token]) <= 4.5 * sigma, (temperature, token, freq[token], p[token])
        top_1[temperature] = p.max()
    assert top_1[0.5] - top_1[2.0] > 0.1  # the temperatures' distributions are far apart: the test has teeth


def test_a_mesh_draws_what_one_device_draws(tiny_untied, policy, one_device):
    if jax.device_count() != 8:
        pytest.fail("the mesh test needs the 8 host devices of tests/trainers/jax_lora/conftest.py")
    prompts = _prompts()
    draws = []
    for sampler, params, lora in (one_device, _sampler(tiny_untied, policy, (2, 2, 2))):
        draws.append((sampler.sample(params, lora, prompts, 2, seed=5),
                      sampler.sample(params, lora, prompts, 2, seed=5, greedy=True)))
    assert draws[0] == draws[1]
    assert draws[0][1] == [c for c in policy["greedy"] for _ in (0, 1)]


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a window of 8 < 19 tokens
def test_kv_cache_decode_logits_equal_the_full_forward(family, tmp_path):
    model_dir = save_tiny_family(tmp_path / family, family)
    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32)
    lora = random_lora(lora_shapes(cfg, TARGETS, R, jnp.float32), seed=4, scale=0.3)
    runtime = lora_runtime(ALPHA, R, 0.0)
    rng = np.random.default_rng(0)
    prompt_len, steps, lengths = 11, 8, (11, 4)
    rows = [rng.integers(0, 256, n + steps).astype(np.int32) for n in lengths]
    starts = np.array([prompt_len - n for n in lengths], np.int32)
    prompt = np.zeros((2, prompt_len), np.int32)
    for r, n in enumerate(lengths):
        prompt[r, starts[r]:] = rows[r][:n]

    @jax.jit
    def step(cache, tokens, index):
        h, cache = cached_hidden_states(params, lora, tokens, cache, index=index, starts=starts, cfg=cfg,
                                        runtime=runtime)
        return lm_head(params, h, cfg=cfg), cache

    empty = cache_shapes(cfg, 2, prompt_len + steps, jnp.float32)
    logits, cache = step({k: jnp.zeros(s.shape, s.dtype) for k, s in empty.items()}, prompt, 0)
    decoded = [np.asarray(logits)]
    for t in range(steps - 1):
        logits, cache = step(cache, np.array([[row[n + t]] for row, n in zip(rows, lengths, strict=True)]),
                             prompt_len + t)
        decoded.append(np.asarray(logits))
    # The reference: both rows in one causal forward, the shorter one right-padded (padding
    # after a row's tokens changes none of their logits).
    both = np.zeros((2, max(lengths) + steps - 1), np.int32)
    for r, n in enumerate(lengths):
        both[r, : n + steps - 1] = rows[r][: n + steps - 1]
    full = np.asarray(jax.jit(lambda tokens: forward(params, lora, tokens, cfg=cfg, runtime=runtime))(both))
    assert np.abs(full).max() > 0.5
    for r, n in enumerate(lengths):
        ours = np.concatenate([decoded[0][r, starts[r]:]] + [d[r] for d in decoded[1:]])
        np.testing.assert_allclose(ours, full[r, : n + steps - 1], atol=1e-5, rtol=0, err_msg=f"row {r}")
