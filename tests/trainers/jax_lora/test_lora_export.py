"""LoRA: PEFT-style init, and the exported adapter reproduces our logits in peft."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import PeftModel

from tests.trainers.jax_lora.batches import packed_batch
from tests.trainers.jax_lora.hf_tiny import load_hf
from trainers.common.peft_export import read_peft_adapter
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import export_adapter
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import init_lora, lora_axes, lora_runtime, lora_shapes
from trainers.jax_lora.model import forward, param_axes
from trainers.jax_lora.sharding import make_mesh, tree_shardings
from trainers.jax_lora.step import (
    StepConfig,
    compile_steps,
    init_state,
    make_optimizer,
    state_shardings,
)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_init_is_peft_default(tiny_untied):
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    lora = jax.jit(lambda k: init_lora(cfg, ALL, 8, k))(jax.random.key(0))
    for name, pair in lora.items():
        a, b = np.asarray(pair["lora_a"]), np.asarray(pair["lora_b"])
        fan_in = math.prod(a.shape[1:-1])
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) on (r, fan_in)
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound, name
        assert abs(a.mean()) < 0.1 * bound, name
        assert not b.any(), name
    # peft's own init on the same shape has the same bound (reference, not our formula)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(load_hf(tiny_untied), LoraConfig(r=8, lora_alpha=16, target_modules=["o_proj"]))
    o_proj = peft_model.base_model.model.model.layers[0].self_attn.o_proj
    peft_a = o_proj.lora_A["default"].weight.detach().numpy()
    assert not o_proj.lora_B["default"].weight.detach().numpy().any()
    ours_o = np.asarray(lora["o_proj"]["lora_a"])
    assert abs(np.abs(peft_a).max() - np.abs(ours_o).max()) < 0.1 / math.sqrt(peft_a.shape[1])


def test_trained_adapter_loads_in_peft_with_same_logits(tiny_untied, tmp_path):
    # All seven targets: every transpose/reshape case (split heads on input or output).
    targets = ALL
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params, _ = load_params(tiny_untied, cfg, mesh, jnp.float32)
    r, alpha = 4, 8.0
    l_abs = lora_shapes(cfg, targets, r, jnp.float32)
    l_shard = tree_shardings(l_abs, lora_axes(targets), mesh)
    p_shard = tree_shardings(params, param_axes(cfg), mesh)
    opt = make_optimizer(lambda s: 2e-2, weight_decay=0.0, max_grad_norm=1.0)
    shardings = state_shardings(l_shard, opt, l_abs, mesh)
    lora0 = jax.jit(lambda k: init_lora(cfg, targets, r, k))(jax.random.key(3))
    state = init_state(lora0, opt, shardings, jax.random.key(4))
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(alpha, r, dropout=0.1))
    train_step, _ = compile_steps(sc, opt, mesh, shardings, p_shard)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(5, accum=1, rows=2, seq=24, vocab=cfg.vocab_size).items()}
    losses = []
    for _ in range(3):
        state, metrics = train_step(state, params, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    lora = jax.tree.map(np.asarray, state["lora"])
    assert all(np.abs(p["lora_b"]).max() > 1e-3 for p in lora.values())  # training moved B

    out = export_adapter(tmp_path / "adapter", lora, r=r, alpha=alpha, dropout=0.1, target_modules=targets)
    config, weights = read_peft_adapter(out)
    assert config["r"] == r and config["lora_alpha"] == alpha
    assert len(weights) == 2 * cfg.num_layers * len(targets)

    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 30))
    both = jax.jit(lambda p, l, t: (forward(p, l, t, cfg=cfg, runtime=sc.runtime), forward(p, None, t, cfg=cfg)))
    ours, base = map(np.asarray, both(params, state["lora"], tokens))
    peft_model = PeftModel.from_pretrained(load_hf(tiny_untied), str(out))
    peft_model.eval()
    with torch.no_grad():
        ref = peft_model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - base).max() > 1e-3  # the adapter changes the logits
    assert np.abs(ours - ref).max() <= 1e-4


def test_bf16_base_with_fp32_adapter_tracks_fp32(tiny_untied):
    """The MI300X setting: bf16 base weights and compute, fp32 LoRA factors and grads."""
    from tests.trainers.jax_lora.batches import random_lora
    from trainers.jax_lora.step import make_loss_and_grads

    cfg = DecoderConfig.from_pretrained(tiny_untied)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    targets = ("q_proj", "v_proj", "down_proj")
    lora = jax.tree.map(jnp.asarray, random_lora(lora_shapes(cfg, targets, 4, jnp.float32), seed=9))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(8, accum=1, rows=2, seq=32, vocab=cfg.vocab_size).items()}
    results = {}
    for dtype in ("float32", "bfloat16"):
        params, _ = load_params(tiny_untied, cfg, mesh, jnp.dtype(dtype))
        sc = StepConfig(cfg=cfg, runtime=lora_runtime(8.0, 4, 0.0), compute_dtype=dtype)
        results[dtype] = jax.jit(make_loss_and_grads(sc, None))(lora, params, batch, None)
    (l32, g32, _), (l16, g16, _) = results["float32"], results["bfloat16"]
    assert l16.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
    assert abs(float(l16) - float(l32)) <= 0.05  # bf16 rounding; fp32 parity is tested above
    a = np.concatenate([np.ravel(g) for g in jax.tree.leaves(g32)])
    b = np.concatenate([np.ravel(g) for g in jax.tree.leaves(g16)])
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.99


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_remat_policies_give_the_same_loss_and_grads(tiny_untied, quantization):
    """per_layer / dots_saveable recompute activations in the backward pass: same numbers
    (on an NF4 base too, whose projections are custom_vjp calls inside the remat)."""
    from tests.trainers.jax_lora.batches import random_lora
    from trainers.jax_lora.step import make_loss_and_grads

    cfg = DecoderConfig.from_pretrained(tiny_untied)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params, _ = load_params(tiny_untied, cfg, mesh, jnp.float32, quantization)
    targets = ("q_proj", "o_proj", "up_proj")
    lora = jax.tree.map(jnp.asarray, random_lora(lora_shapes(cfg, targets, 4, jnp.float32), seed=11))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(12, accum=2, rows=2, seq=24, vocab=cfg.vocab_size).items()}
    # The layer-level policy appears in the jaxpr iff configured (the CPU attention's own
    # checkpoint has no policy, so it does not count).
    policies = {"none": set(), "per_layer": {"nothing_saveable"}, "dots_saveable": {"DotsSaveable"}}
    out = {}
    for remat in ("none", "per_layer", "dots_saveable"):
        sc = StepConfig(cfg=cfg, runtime=lora_runtime(8.0, 4, 0.0), remat=remat)
        fn = jax.jit(make_loss_and_grads(sc, None))
        jaxpr = str(fn.trace(lora, params, batch, None).jaxpr)
        assert set(re.findall(r"policy=(?:<function )?(\w+)", jaxpr)) - {"None"} == policies[remat]
        out[remat] = fn(lora, params, batch, None)
    for remat in ("per_layer", "dots_saveable"):
        assert abs(float(out[remat][0]) - float(out["none"][0])) <= 1e-6
        for a, b in zip(jax.tree.leaves(out[remat][1]), jax.tree.leaves(out["none"][1]), strict=True):
            assert float(jnp.abs(a - b).max()) <= 1e-6
