"""Quantized linear layers against the libraries' own dequantization.

A quantized layer's forward must equal ``x @ W_deq.T`` where ``W_deq`` is what the
library itself reconstructs (bitsandbytes ``dequantize_4bit``, HQQ ``dequantize()``),
and ``W_deq`` must be within the format's own error of the dense weight. The meta
skeleton (what non-zero ranks build) must have exactly the real layout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainers.fsdp_qlora.quantize import (
    QuantConfig,
    dequantized_weight,
    quant_state_tensors,
    quantize_decoder_linears,
    quantize_linear,
)

CASES = [
    ("nf4", False, torch.float32),
    ("nf4", True, torch.float32),
    ("nf4", False, torch.bfloat16),
    ("hqq4", False, torch.float32),
    ("hqq4", False, torch.bfloat16),
]


def _dense(dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(256, 96, bias=False)
    return lin.to(dtype)


@pytest.mark.parametrize("method,double_quant,dtype", CASES)
def test_forward_equals_library_dequantize_then_matmul(method, double_quant, dtype):
    lin = _dense(dtype)
    dense = lin.weight.detach().clone().float()
    q = quantize_linear(lin, QuantConfig(method, compute_dtype=dtype, storage_dtype=dtype, double_quant=double_quant))
    q.train()
    x = torch.randn(4, 7, 256, dtype=dtype)
    w = dequantized_weight(q).to(dtype)
    expected = (x.float() @ w.float().t())
    got = q(x).float()
    # Same dequantized weight, same matmul in `dtype`: only the matmul's rounding differs.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())
    # The packed storage is the float dtype FSDP shards and all-gathers in.
    (packed,) = [p for p in q.parameters()]
    assert packed.dtype == dtype and not packed.requires_grad
    # 4 bits per weight (+ statistics outside the parameter).
    assert packed.numel() * packed.element_size() == dense.numel() // 2


def test_nf4_dequantized_weight_within_the_format_error():
    import bitsandbytes.functional as bnbf

    lin = _dense(torch.float32, seed=1)
    dense = lin.weight.detach().clone()
    q = quantize_linear(lin, QuantConfig("nf4"))
    w = dequantized_weight(q)
    # NF4 rounds each weight to the nearest of 16 levels scaled by its block's absmax:
    # the error is at most half the widest gap between levels, times absmax.
    code = bnbf.get_4bit_type("nf4", device="cpu")
    half_gap = float((code.sort().values.diff()).max()) / 2
    absmax = dense.reshape(-1, 64).abs().amax(dim=1, keepdim=True)
    err = (w - dense).reshape(-1, 64).abs()
    assert bool((err <= absmax * half_gap * (1 + 1e-4) + 1e-7).all())
    assert float(err.mean()) > 0  # it really is quantized


def test_hqq_dequantized_weight_is_close_to_dense():
    lin = _dense(torch.float32, seed=2)
    dense = lin.weight.detach().clone()
    q = quantize_linear(lin, QuantConfig("hqq4", hqq_group_size=64))
    w = dequantized_weight(q)
    # 4-bit affine per group of 64: max error is half a step, step = range / 15.
    g = dense.reshape(-1, 64)
    step = (g.amax(dim=1) - g.amin(dim=1)) / 15
    err = (w - dense).reshape(-1, 64).abs().amax(dim=1)
    # HQQ optimizes (scale, zero) for a robust norm, not the max error: allow a full step.
    assert bool((err <= step * 1.0 + 1e-6).all())
    assert float((w - dense).abs().mean()) > 0


@pytest.mark.parametrize("method,double_quant,dtype", CASES)
def test_meta_skeleton_has_the_real_layout(method, double_quant, dtype):
    cfg = QuantConfig(method, compute_dtype=dtype, storage_dtype=dtype, double_quant=double_quant)
    real = quantize_linear(_dense(dtype), cfg)
    meta = quantize_linear(nn.Linear(256, 96, bias=False, device="meta").to(dtype), cfg)
    assert [(n, p.shape, p.dtype) for n, p in real.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in meta.named_parameters()
    ]
    rs, ms = quant_state_tensors(real), quant_state_tensors(meta)
    assert {k: (v.shape, v.dtype) for k, v in rs.items()} == {k: (v.shape, v.dtype) for k, v in ms.items()}
    assert all(v.is_meta for v in ms.values())


def test_quantize_decoder_linears_replaces_all_projections_only():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    n = quantize_decoder_linears(layer, QuantConfig("nf4"))
    assert n == 7
    assert not any(type(m) is nn.Linear for m in layer.modules())


def test_integer_storage_is_refused():
    with pytest.raises(ValueError, match="float dtype"):
        QuantConfig("nf4", storage_dtype=torch.uint8)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (96, 256)), (torch.bfloat16, (96, 256)),
                                         (torch.bfloat16, (7, 100))])
def test_chunked_nf4_is_bitwise_bnbs_whole_matrix_quantization(double_quant, dtype, shape):
    """Quantizing slice by slice (to bound the loader's transient memory) must give exactly
    the bytes and statistics of bitsandbytes' own one-shot quantization, remainder block
    included (7 x 100 = 10 blocks of 64 + 60)."""
    import bitsandbytes.functional as bnbf

    from trainers.fsdp_qlora.quantize import quantize_nf4_in_chunks

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    want_packed, want = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant,
                                           quant_type="nf4", quant_storage=dtype)
    got_packed, got = quantize_nf4_in_chunks(weight, QuantConfig("nf4", compute_dtype=dtype, storage_dtype=dtype,
                                                                 double_quant=double_quant), chunk_elements=192)
    assert got_packed.dtype == want_packed.dtype and torch.equal(got_packed.view(torch.uint8),
                                                                 want_packed.view(torch.uint8))
    assert torch.equal(got.absmax, want.absmax) and got.shape == want.shape and got.dtype == want.dtype
    if double_quant:
        assert torch.equal(got.offset, want.offset)
        assert torch.equal(got.state2.absmax, want.state2.absmax) and torch.equal(got.state2.code, want.state2.code)
    torch.testing.assert_close(bnbf.dequantize_4bit(got_packed, got), bnbf.dequantize_4bit(want_packed, want),
                               rtol=0, atol=0)
