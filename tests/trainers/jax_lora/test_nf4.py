"""NF4 QLoRA in JAX against bitsandbytes, transformers and peft (the references).

Quantization is checked byte for byte against ``bitsandbytes.functional.quantize_4bit``
and against what ``from_pretrained(..., BitsAndBytesConfig(nf4))`` stores in its
``Linear4bit`` layers (also through sharded loading, whose slices are not aligned to
quantization blocks); logits and LoRA gradients against peft on that same 4-bit model.
"""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from tests.trainers.fsdp_qlora.reference import hf_model
from tests.trainers.jax_lora.batches import random_lora
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.export import export_adapter, to_peft_weights
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import lora_runtime, lora_shapes
from trainers.jax_lora.model import PROJECTIONS, forward, param_axes, param_shapes
from trainers.jax_lora.nf4 import NF4_LEVELS, dequantize, nf4_project, quantize_kernel
from trainers.jax_lora.sharding import check_replication, make_mesh, sharding_report, tree_shardings
from trainers.jax_lora.step import StepConfig, make_loss_and_grads


def _weight(dtype: torch.dtype, seed: int = 0, shape: tuple[int, int] = (96, 192)) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = torch.tensor(0.05 * rng.standard_normal(shape), dtype=torch.float32)
    w[3, 64:128] = 0.0  # an all-zero block: absmax 0, every value dequantizes to 0
    w[5, :64] = torch.linspace(-1.0, 1.0, 64)  # every level and the block's extremes
    # Values exactly on the midpoints between levels (absmax 1: scaling is exact): a tie
    # goes to the lower level, as the library's bucketize does.
    levels = torch.tensor(NF4_LEVELS)
    w[7, :64] = 0.0
    w[7, :15] = (levels[:-1] + levels[1:]) / 2
    w[7, 15] = 1.0
    return w.to(dtype)


def _host(w: torch.Tensor) -> np.ndarray:
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return w.numpy()


def test_levels_are_the_library_table():
    levels = bnb_functional.get_4bit_type("nf4", device="cpu").numpy()
    assert np.array_equal(levels, NF4_LEVELS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_dequantize_match_bitsandbytes(dtype):
    w = _weight(dtype, shape=(512, 1024))  # half a million values: rare roundings show up
    packed, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4", quant_storage=torch.uint8)
    codes, absmax = quantize_kernel(_host(w))
    # Ours is (in / 2, out) and (in / 64, out); the library's the same bytes in HF order.
    assert np.array_equal(codes.T.reshape(-1), packed.reshape(-1).numpy())
    assert np.array_equal(absmax.T.reshape(-1), state.absmax.numpy())

    ref = bnb_functional.dequantize_4bit(packed, state).float().numpy()
    jdtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    ours = np.asarray(dequantize(jnp.asarray(codes), jnp.asarray(absmax), jdtype).astype(jnp.float32))
    assert np.array_equal(ours.T, ref)
    assert not ours[:, 3][64:128].any()
    if dtype == torch.float32:  # the ties: each midpoint maps to the level below it
        assert np.array_equal(ours[:15, 7], NF4_LEVELS[:-1])


def test_project_gradient_is_the_dequantized_transpose():
    """The hand-written backward: dx = dy @ W.T, W as bitsandbytes dequantizes it."""
    w = _weight(torch.float32, seed=1)
    packed, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4", quant_storage=torch.uint8)
    w_ref = bnb_functional.dequantize_4bit(packed, state).numpy()  # (out, in)
    codes, absmax = map(jnp.asarray, quantize_kernel(w.numpy()))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 192)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 96)).astype(np.float32)
    y, vjp = jax.vjp(lambda x: nf4_project(x, codes, absmax, (192,), (96,)), jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(y), x @ w_ref.T, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), dy @ w_ref, rtol=0, atol=1e-5)
    # Split-out dims (o_proj: (heads, head_dim) in) contract the same way.
    y4 = nf4_project(jnp.asarray(x).reshape(2, 3, 12, 16), codes, absmax, (12, 16), (96,))
    np.testing.assert_allclose(np.asarray(y4), x @ w_ref.T, rtol=0, atol=1e-5)


def _bnb_kernels(model) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"<layer>.<proj>": (packed (out, in / 2) uint8, absmax)}`` of a 4-bit HF model."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, proj in PROJECTIONS.items():
            module = getattr(getattr(layer, proj.parent), name)
            packed = module.weight.data.reshape(-1).view(torch.uint8).numpy()
            out[f"{i}.{name}"] = (packed.reshape(module.out_features, -1), module.weight.quant_state.absmax.numpy())
    return out


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 4, 2)])
def test_loaded_kernels_are_what_transformers_stores(tiny_untied, mesh_shape):
    """Sharded loading quantizes each device's slice; gathered, it is the HF 4-bit model.

    On (1, 4, 2) a shard of an embed-input kernel holds 8 packed rows (16 inputs): a
    quarter of a quantization block, so the block-aligned read is exercised.
    """
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    n = int(np.prod(mesh_shape))
    if jax.default_backend() != "cpu" and jax.device_count() < n:
        # On CPU the suite always has 8 (fake) devices; a one-GPU machine has one.
        pytest.skip(f"mesh {mesh_shape} needs {n} devices, this {jax.default_backend()} has {jax.device_count()}")
    params, stats = load_params(tiny_untied, cfg, make_mesh(*mesh_shape, devices=jax.devices()[:n]), jnp.float32, "nf4")
    ref = _bnb_kernels(hf_model(tiny_untied, "nf4"))
    for name in PROJECTIONS:
        kernel = params["layers"][name]
        if n > 1:
            assert len(kernel["codes"].sharding.device_set) == n
            # the scales are split over all 8 devices too, though in / 64 (1 or 2) is not
            assert kernel["absmax"].addressable_shards[0].data.size * n == kernel["absmax"].size
        codes, absmax = np.asarray(kernel["codes"]), np.asarray(kernel["absmax"])
        for layer in range(cfg.num_layers):
            packed, ref_absmax = ref[f"{layer}.{name}"]
            assert np.array_equal(codes[layer].T, packed), (name, layer)
            assert np.array_equal(absmax[layer].T.reshape(-1), ref_absmax), (name, layer)
    if n > 1:  # what the recipe checks before it loads: no more than 5 % above an even split
        shapes = param_shapes(cfg, jnp.float32, "nf4")
        mesh = make_mesh(*mesh_shape, devices=jax.devices()[:n])
        check_replication(sharding_report(shapes, tree_shardings(shapes, param_axes(cfg, "nf4"), mesh), mesh))
    dense = param_shapes(cfg, jnp.float32)
    dense_bytes = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(dense["layers"]))
    assert stats["param_bytes"] < sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(dense))
    quant_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
    assert quant_bytes < 0.2 * dense_bytes  # 0.5 + 4/64 bytes per weight vs 4


def _peft_nf4(model_dir, adapter_dir):
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model(model_dir, "nf4"), str(adapter_dir), is_trainable=True)
    # Train mode: on CPUs with avx512_bf16, bitsandbytes repacks an eval-mode Linear4bit's
    # weight in place into a CPU-only layout. No dropout here, so train mode changes nothing else.
    model.train()
    return model


def test_logits_and_lora_grads_match_peft_on_the_bnb_model(tiny_untied, tmp_path):
    targets = ("q_proj", "o_proj", "gate_proj", "down_proj")
    cfg = DecoderConfig.from_pretrained(tiny_untied)
    params, _ = load_params(tiny_untied, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32, "nf4")
    r, alpha = 4, 8.0
    lora = random_lora(lora_shapes(cfg, targets, r, jnp.float32), seed=3)
    adapter = export_adapter(tmp_path / "a", lora, r=r, alpha=alpha, dropout=0.0, target_modules=targets)
    lora = jax.tree.map(jnp.asarray, lora)

    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    labels = tokens.copy()
    labels[:, :5] = -100
    runtime = lora_runtime(alpha, r, 0.0)
    logits = np.asarray(jax.jit(lambda p, l, t: forward(p, l, t, cfg=cfg, runtime=runtime))(params, lora, tokens))
    base_logits = np.asarray(jax.jit(lambda p, t: forward(p, None, t, cfg=cfg))(params, tokens))
    dense, _ = load_params(tiny_untied, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32)
    dense_logits = np.asarray(jax.jit(lambda p, t: forward(p, None, t, cfg=cfg))(dense, tokens))

    batch = {
        "input_ids": tokens[None], "labels": labels[None],
        "positions": np.broadcast_to(np.arange(24, dtype=np.int32), (1, 2, 24)).copy(),
        "segment_ids": np.ones((1, 2, 24), np.int32),
    }
    sc = StepConfig(cfg=cfg, runtime=runtime, packed=False)
    loss, grads, _ = jax.jit(make_loss_and_grads(sc, None))(lora, params, jax.tree.map(jnp.asarray, batch), None)

    model = _peft_nf4(tiny_untied, adapter)
    ref_logits = model(input_ids=torch.tensor(tokens, dtype=torch.long), use_cache=False).logits
    shifted = ref_logits[:, :-1].reshape(-1, cfg.vocab_size)
    ref_loss = torch.nn.functional.cross_entropy(shifted, torch.tensor(labels[:, 1:], dtype=torch.long).reshape(-1))
    ref_loss.backward()

    assert np.abs(base_logits - dense_logits).max() > 1e-2  # 4-bit is not the dense model
    assert np.abs(logits - base_logits).max() > 1e-2  # the adapter matters
    assert np.abs(logits - ref_logits.detach().numpy()).max() <= 1e-4
    assert abs(float(loss) - ref_loss.item()) <= 1e-5
    ours = to_peft_weights(jax.tree.map(np.asarray, grads))
    ref_grads = {
        name: p.grad.numpy() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None
    }
    assert len(ref_grads) == len(ours) == 2 * cfg.num_layers * len(targets)
    for key, g in ours.items():
        ref = ref_grads[key.removesuffix(".weight") + ".default.weight"]  # PEFT's live name
        assert np.abs(ref).max() > 1e-4, key
        np.testing.assert_allclose(g, ref, rtol=0, atol=2e-5 * np.abs(ref).max(), err_msg=key)


def test_a_model_whose_inputs_are_not_whole_blocks_is_a_user_error(tiny_untied):
    from trainers.errors import UserError

    cfg = DecoderConfig.from_pretrained(tiny_untied)
    odd = DecoderConfig.from_hf_dict({**_hf_config(tiny_untied), "intermediate_size": 96})
    assert param_shapes(cfg, jnp.float32, "nf4")  # 64 / 128 inputs: whole blocks
    with pytest.raises(UserError, match="down_proj has 96 inputs") as err:
        param_shapes(odd, jnp.float32, "nf4")
    assert err.value.code == "invalid_spec"


def _hf_config(model_dir) -> dict:
    import json

    return json.loads((model_dir / "config.json").read_text())
