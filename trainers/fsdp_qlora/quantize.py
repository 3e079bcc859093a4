"""4-bit quantized bases for QLoRA: bitsandbytes NF4 and HQQ, stored FSDP-shardable.

QLoRA here is plain LoRA (peft) around quantized ``nn.Linear`` replacements, so the
recipe has ONE code path: load -> (optionally) quantize the decoder's linear layers ->
inject LoRA -> shard. Both libraries' layers are wrapped by peft natively (peft has LoRA
variants for ``bnb.nn.Linear4bit`` and ``hqq``'s ``HQQLinear``).

FSDP can only flatten and shard floating-point parameters of one dtype per group, so the
packed 4-bit weights are stored *viewed as a float dtype* (Answer.AI's trick):

- bitsandbytes: ``quant_storage`` = the FSDP parameter dtype (bf16 or fp32); the packed
  bytes live in a ``(n_bytes / itemsize, 1)`` tensor of that dtype.
- HQQ: ``view_as_float=True`` stores ``W_q`` in the compute dtype.

The quantization metadata (bnb's ``QuantState``: absmax, code, nested stats; HQQ's
``meta``: scale, zero) is NOT a parameter, so FSDP does not shard it: every rank holds a
full copy (it is small: ~1/16 of the packed weight for NF4 with block 64).
:func:`quant_state_tensors` lists those tensors so the loader can broadcast them.

The storage dtype must equal the dtype FSDP all-gathers in (the mixed-precision
``param_dtype`` when one is set): a cast of the packed bytes would destroy them.

Structure on ``meta``: :func:`quantize_linear` works on meta tensors (bnb's op has a fake
kernel; HQQ without its optimizer is shape-only), which is how non-zero ranks build the
quantized skeleton without ever holding weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

QuantMethod = Literal["nf4", "hqq4"]

# Linear layers of a decoder layer (Llama, Mistral, Qwen2 and Qwen3 name them alike). All
# of them are quantized (as Hugging Face's BitsAndBytesConfig does: every Linear except
# lm_head), not only the LoRA targets: the weights are where the memory goes. Their
# biases (Qwen2's q/k/v) stay in the compute dtype.
DECODER_LINEARS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

NF4_BLOCKSIZE = 64  # bitsandbytes' default; what BitsAndBytesConfig uses on CPU and CUDA
# Weights quantized per slice while loading (see quantize_nf4_in_chunks): ~16 MiB of bnb
# temporaries instead of ~16 bytes per weight of the whole matrix (an 8B model's MLP
# matrix: 880 MiB). Smaller slices cost time: on this 2-core CPU 256k-weight slices made
# loading 3-5x slower than one shot, 1M-weight slices 1.3-1.6x.
NF4_CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a base's linear layers.

    Attributes:
        method: ``nf4`` (bitsandbytes) or ``hqq4`` (HQQ 4-bit).
        compute_dtype: dtype of the layer's matmul (and of HQQ's float view).
        storage_dtype: float dtype the packed weight is stored in (= FSDP param dtype).
        double_quant: bnb only: quantize the absmax statistics too (saves ~0.4 bit/param).
        hqq_group_size: HQQ only: weights per (scale, zero) group.
    """

    method: QuantMethod
    compute_dtype: torch.dtype = torch.float32
    storage_dtype: torch.dtype = torch.float32
    double_quant: bool = False
    hqq_group_size: int = 64

    def __post_init__(self) -> None:
        if self.method not in ("nf4", "hqq4"):
            raise ValueError(f"unknown quantization method {self.method!r}")
        if not self.storage_dtype.is_floating_point:
            # Integer storage cannot be flattened by FSDP ("Cannot flatten integer dtype").
            raise ValueError(f"storage_dtype must be a float dtype, got {self.storage_dtype}")
        if self.method == "hqq4" and self.storage_dtype != self.compute_dtype:
            raise ValueError("hqq4 stores its packed weight viewed as the compute dtype")


def quantize_linear(linear: nn.Linear, cfg: QuantConfig) -> nn.Module:
    """Return a quantized replacement of ``linear`` (on the same device, meta included).

    The dense weight is quantized from its current dtype (as transformers does when it
    loads with ``BitsAndBytesConfig`` / ``dtype=``), so the quantized values are exactly
    what a Hugging Face load of the same checkpoint produces.
    """
    if cfg.method == "nf4":
        return _quantize_linear_nf4(linear, cfg)
    return _quantize_linear_hqq(linear, cfg)


def _quantize_linear_nf4(linear: nn.Linear, cfg: QuantConfig) -> nn.Module:
    import bitsandbytes as bnb

    with torch.device("meta"):
        # Build the module shell on meta: its own dense init is thrown away anyway.
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=cfg.compute_dtype,
            compress_statistics=cfg.double_quant,
            quant_type="nf4",
            quant_storage=cfg.storage_dtype,
        )
    # Works on meta too (bnb's ops have fake kernels): the skeleton of non-zero ranks.
    packed, state = quantize_nf4_in_chunks(linear.weight.data, cfg)
    # The module copy of the state is what bnb restores from after FSDP swaps the
    # parameter object.
    layer.quant_state = state
    layer.weight = bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=cfg.double_quant,
        quant_type="nf4",
        quant_storage=cfg.storage_dtype,
        module=layer,
        bnb_quantized=True,
    )
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.to(cfg.compute_dtype), requires_grad=False)
    return layer


def quantize_nf4_in_chunks(
    weight: torch.Tensor, cfg: QuantConfig, chunk_elements: int = NF4_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, object]:
    """NF4-quantize ``weight`` a slice at a time; returns (packed storage, ``QuantState``).

    Bitwise the same as ``bnb.functional.quantize_4bit`` on the whole matrix (NF4 blocks
    are consecutive runs of ``NF4_BLOCKSIZE`` weights and two codes share a byte, so
    slices that are whole blocks quantize independently), but bnb's CPU quantizer makes
    ~16 bytes of fp32/int32 temporaries per weight: whole-matrix, that transient was the
    peak of loading (40 MiB for one 1024 x 2816 matrix, 30x its packed size). Slices keep
    it at about ``16 * chunk_elements`` bytes. Double quantization (of the absmax statistics)
    runs once on the full absmax vector, as bnb does it.
    """
    import bitsandbytes.functional as bnbf

    if chunk_elements % NF4_BLOCKSIZE:
        raise ValueError(f"chunk_elements must be a multiple of {NF4_BLOCKSIZE}")
    flat = weight.contiguous().reshape(-1)
    n = flat.numel()
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(-(n // -NF4_BLOCKSIZE), dtype=torch.float32, device=weight.device)
    for start in range(0, n, chunk_elements):
        piece, piece_state = bnbf.quantize_4bit(
            flat[start : start + chunk_elements], blocksize=NF4_BLOCKSIZE,
            compress_statistics=False, quant_type="nf4", quant_storage=torch.uint8,
        )
        packed[start // 2 : start // 2 + piece.shape[0]] = piece
        block = start // NF4_BLOCKSIZE
        absmax[block : block + piece_state.absmax.numel()] = piece_state.absmax
        del piece, piece_state
    state_kwargs = {"shape": weight.shape, "dtype": weight.dtype, "blocksize": NF4_BLOCKSIZE,
                    "code": bnbf.get_4bit_type("nf4", device=weight.device), "quant_type": "nf4"}
    if cfg.double_quant:
        # bnb's default 8-bit map, passed explicitly: bnb caches its default on the device
        # of the first call, and a meta skeleton would leave a meta map in that cache. Built
        # on the CPU: under a caller's torch.device("meta") context it cannot be built.
        with torch.device("cpu"):
            dynamic_map = bnbf.create_dynamic_map()
        offset = absmax.mean()
        nested_absmax, nested_state = bnbf.quantize_blockwise(
            absmax - offset, code=dynamic_map.to(weight.device), blocksize=256
        )
        state = bnbf.QuantState(absmax=nested_absmax, offset=offset, state2=nested_state, **state_kwargs)
    else:
        state = bnbf.QuantState(absmax=absmax, **state_kwargs)
    # The float view FSDP shards (QuantConfig admits float storage dtypes only).
    return packed.view(-1).view(cfg.storage_dtype).unsqueeze(1), state


def _quantize_linear_hqq(linear: nn.Linear, cfg: QuantConfig) -> nn.Module:
    from hqq.core.quantize import HQQBackend, HQQLinear

    on_meta = linear.weight.is_meta
    quant_config = hqq_quant_config(cfg.hqq_group_size, optimize=not on_meta)
    HQQLinear.set_backend(HQQBackend.PYTORCH)  # the autograd-friendly backend
    layer = HQQLinear(
        linear,
        quant_config,
        compute_dtype=cfg.compute_dtype,
        device=str(linear.weight.device),
        del_orig=True,
    )
    # HQQLinear keeps W_q as a frozen Parameter; make sure of it (FSDP shards parameters).
    if not isinstance(layer.W_q, nn.Parameter):
        layer.W_q = nn.Parameter(layer.W_q, requires_grad=False)
    # Its bias is a plain tensor attribute: a frozen Parameter instead, so that FSDP shards
    # it, ``to_empty`` allocates it and the loader fills it like any other weight.
    if layer.bias is not None and not isinstance(layer.bias, nn.Parameter):
        layer.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
    return layer


def hqq_quant_config(group_size: int, *, optimize: bool = True) -> dict:
    """HQQ 4-bit config with the packed weight viewed as float (FSDP-shardable).

    ``optimize=False`` only skips HQQ's proximal refinement of (scale, zero); the layout is
    identical, which is what a meta skeleton needs (the optimizer calls ``.item()``).
    """
    from hqq.core.quantize import BaseQuantizeConfig

    cfg = BaseQuantizeConfig(nbits=4, group_size=group_size, view_as_float=True)
    cfg["weight_quant_params"]["optimize"] = optimize
    return cfg


def quantize_decoder_linears(
    layer: nn.Module, cfg: QuantConfig, names: tuple[str, ...] = DECODER_LINEARS
) -> int:
    """Replace the named ``nn.Linear`` children anywhere under ``layer``, one at a time.

    Each dense weight is dropped as soon as its quantized replacement exists, so the peak
    is one dense matrix above the quantized layer. Returns the number replaced.
    """
    replaced = 0
    for parent_name, parent in list(layer.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in names and type(child) is nn.Linear:
                setattr(parent, child_name, quantize_linear(child, cfg))
                del child
                replaced += 1
    return replaced


def is_quantized_linear(module: nn.Module) -> bool:
    """True for the layer types :func:`quantize_linear` produces."""
    kind = type(module).__name__
    return kind in ("Linear4bit", "HQQLinear")


def quant_state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The non-parameter tensors a quantized layer needs (FSDP leaves them replicated).

    Keys are stable names; values are the live tensors (assigning into them in place
    updates the layer). Used by the loader to broadcast rank 0's statistics.
    """
    kind = type(module).__name__
    if kind == "Linear4bit":
        qs = module.quant_state
        out = {"absmax": qs.absmax, "code": qs.code}
        if qs.state2 is not None:
            out.update(
                {"offset": qs.offset, "nested_absmax": qs.state2.absmax, "nested_code": qs.state2.code}
            )
        return out
    if kind == "HQQLinear":
        return {k: v for k, v in module.meta.items() if torch.is_tensor(v)}
    raise TypeError(f"not a quantized linear: {kind}")


def replace_quant_state_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Swap a quantized layer's statistics for ``tensors`` (same keys as
    :func:`quant_state_tensors`); used to materialize a meta skeleton's statistics."""
    kind = type(module).__name__
    if kind == "Linear4bit":
        qs = module.quant_state
        qs.absmax, qs.code = tensors["absmax"], tensors["code"]
        if qs.state2 is not None:
            qs.offset = tensors["offset"]
            qs.state2.absmax, qs.state2.code = tensors["nested_absmax"], tensors["nested_code"]
        if getattr(module.weight, "quant_state", None) is not None:
            module.weight.quant_state = qs
        return
    if kind == "HQQLinear":
        module.meta.update(tensors)
        return
    raise TypeError(f"not a quantized linear: {kind}")


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The dense weight as the owning library reconstructs it (for tests and export)."""
    kind = type(module).__name__
    if kind == "Linear4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(module.weight.data, module.quant_state)
    if kind == "HQQLinear":
        return module.dequantize()
    raise TypeError(f"not a quantized linear: {kind}")
