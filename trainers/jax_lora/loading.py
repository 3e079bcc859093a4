"""Load an HF checkpoint (Llama, Mistral, Qwen2, Qwen3) tensor by tensor straight into sharded device arrays.

Each parameter is created with ``jax.make_array_from_callback``: for every local device
the callback reads only that device's slice of the stored tensor(s) from a memory-mapped
safetensors file, converts it to the target dtype, and hands it over. The host never
holds the whole model, nor a whole tensor in float32: the peak is about one device
shard (plus the page cache, which the OS can drop). A 405B model loads on a host with
far less RAM than the model.

Why our own safetensors reader: ``safe_open(framework="numpy")`` cannot return bfloat16
(numpy has no such dtype) and the "flax" framework materializes arrays on the default
device. The format is an 8-byte header length, a JSON header (dtype, shape, byte
offsets per tensor) and raw little-endian data, so the headers
(``trainers.common.hf_checkpoint``, shared with the torch trainer) plus ``np.memmap``
with ``ml_dtypes`` give zero-copy, lazily-paged views of any tensor in any dtype.

HF stores ``nn.Linear`` weights as (out_features, in_features); our kernels are
(in..., out...), so each slice is transposed and reshaped on the way in. Biases
(out_features,) are reshaped to their projection's split-out outputs (heads, head_dim).

A QLoRA base (``quantization="nf4"``) is quantized the same way, slice by slice: each
device's callback reads its rows over whole 64-input blocks and keeps its packed codes
or block maxima (``nf4.py``), so a 4-bit model never exists in 16 bits on the host
either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from trainers.common.hf_checkpoint import read_checkpoint_index
from trainers.common.memory import peak_rss_bytes
from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.model import (
    PROJECTIONS,
    Params,
    Quantization,
    param_axes,
    param_shapes,
    projection_shape,
)
from trainers.jax_lora.nf4 import NF4_BLOCKSIZE, quantize_kernel
from trainers.jax_lora.sharding import PARAM_RULES, tree_shardings

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}


class CheckpointReader:
    """All tensors of an HF checkpoint dir (single file or sharded with an index).

    Where each tensor lies comes from ``trainers.common.hf_checkpoint`` (the same checks,
    and ``corrupt_model`` errors, as the torch trainer); the data is memory-mapped.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self._where = read_checkpoint_index(model_dir)
        self._mmaps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        """A zero-copy view; only the pages that are sliced are read from disk."""
        loc = self._where.get(name)
        if loc is None:
            raise UserError(f"the checkpoint has no tensor {name!r}", code="corrupt_model")
        dtype = _DTYPES.get(loc.dtype)
        if dtype is None:
            raise UserError(f"{loc.file}: tensor {name} has unsupported dtype {loc.dtype}", code="corrupt_model")
        mmap = self._mmaps.get(loc.file)
        if mmap is None:
            mmap = self._mmaps[loc.file] = np.memmap(loc.file, dtype=np.uint8, mode="r")
        return mmap[loc.start : loc.end].view(dtype).reshape(loc.shape)


@dataclass(frozen=True)
class _Source:
    """How one JAX parameter is assembled from HF tensors."""

    hf_names: tuple[str, ...]  # one per layer for stacked params, else one
    stacked: bool
    transpose: bool  # HF (out, in) -> our (in, out)
    in_dims: tuple[int, ...] = ()
    out_dims: tuple[int, ...] = ()  # without transpose: HF's flat vector split into these


def _sources(cfg: DecoderConfig) -> Params:
    layers: dict[str, Any] = {}
    norms = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}
    if cfg.qk_norm:
        norms.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
    for norm, hf_path in norms.items():
        layers[norm] = _Source(
            tuple(f"model.layers.{i}.{hf_path}.weight" for i in range(cfg.num_layers)), True, False
        )
    if cfg.bias_projections:
        layers["biases"] = {
            name: _Source(
                tuple(f"model.layers.{i}.{PROJECTIONS[name].parent}.{name}.bias" for i in range(cfg.num_layers)),
                True, False, out_dims=projection_shape(cfg, name)[1],
            )
            for name in cfg.bias_projections
        }
    for name, proj in PROJECTIONS.items():
        in_dims, out_dims = projection_shape(cfg, name)
        layers[name] = _Source(
            tuple(f"model.layers.{i}.{proj.parent}.{name}.weight" for i in range(cfg.num_layers)),
            True, True, in_dims, out_dims,
        )
    tree: Params = {
        "embed_tokens": _Source(("model.embed_tokens.weight",), False, False),
        "layers": layers,
        "norm": _Source(("model.norm.weight",), False, False),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = _Source(("lm_head.weight",), False, True, (cfg.hidden_size,), (cfg.vocab_size,))
    return tree


def _flat_range(index: tuple[slice, ...], dims: tuple[int, ...]) -> slice:
    """A slice over a group of split-out dims (e.g. heads, head_dim) as one flat HF range.

    Only the first dim of a group may be partial (the rules never shard ``head_dim``).
    """
    first = index[0].indices(dims[0])
    for s, d in zip(index[1:], dims[1:], strict=True):
        if s.indices(d) != (0, d, 1):
            raise AssertionError("only the leading dim of a split-out group can be sharded")
    inner = int(np.prod(dims[1:], dtype=np.int64))
    return slice(first[0] * inner, first[1] * inner)


def _read_shard(
    reader: CheckpointReader, src: _Source, shape: tuple[int, ...], index: tuple[slice, ...], dtype: Any
) -> np.ndarray:
    def one(hf: np.ndarray, idx: tuple[slice, ...]) -> np.ndarray:
        if not src.transpose:
            if src.out_dims:  # a flat bias viewed as (heads, head_dim): no copy
                hf = hf.reshape(src.out_dims)
            return np.asarray(hf[idx], dtype=dtype)
        n_in = len(src.in_dims)
        in_idx, out_idx = idx[:n_in], idx[n_in:]
        rows, cols = _flat_range(out_idx, src.out_dims), _flat_range(in_idx, src.in_dims)
        part = np.asarray(hf[rows, cols], dtype=dtype).T  # (in_flat, out_flat) of this shard
        local_in = tuple(s.indices(d)[1] - s.indices(d)[0] for s, d in zip(in_idx, src.in_dims, strict=True))
        local_out = tuple(s.indices(d)[1] - s.indices(d)[0] for s, d in zip(out_idx, src.out_dims, strict=True))
        return np.ascontiguousarray(part).reshape(local_in + local_out)

    if not src.stacked:
        hf = reader.get(src.hf_names[0])
        if not src.transpose and tuple(hf.shape) != shape:
            raise UserError(f"{src.hf_names[0]} has shape {tuple(hf.shape)}, config implies {shape}",
                            code="corrupt_model")
        return one(hf, index)
    layer_range = range(*index[0].indices(shape[0]))
    parts = []
    for layer in layer_range:
        hf = reader.get(src.hf_names[layer])
        if src.transpose:
            expected = (int(np.prod(src.out_dims)), int(np.prod(src.in_dims)))
        else:
            expected = (int(np.prod(src.out_dims)),) if src.out_dims else shape[1:]
        if tuple(hf.shape) != tuple(expected):
            raise UserError(
                f"{src.hf_names[layer]} has shape {tuple(hf.shape)}, config implies {tuple(expected)}",
                code="corrupt_model",
            )
        parts.append(one(hf, index[1:]))
    return np.stack(parts)


def _read_nf4_shard(
    reader: CheckpointReader, src: _Source, part: str, shape: tuple[int, ...], index: tuple[slice, ...], dtype: Any
) -> np.ndarray:
    """One device's slice of an NF4 kernel's ``codes`` or ``absmax`` (``nf4.py`` layout).

    The slice's inputs are widened to whole blocks of 64, read in ``dtype`` (the values a
    load in the base dtype gives, which is what a Hugging Face 4-bit load quantizes),
    quantized, and cut back to the slice.
    """
    per_element = 2 if part == "codes" else NF4_BLOCKSIZE  # HF inputs per stored element
    lo, hi, _ = index[1].indices(shape[1])
    first = lo * per_element // NF4_BLOCKSIZE * NF4_BLOCKSIZE
    last = -(-hi * per_element // NF4_BLOCKSIZE) * NF4_BLOCKSIZE
    skip = (lo * per_element - first) // per_element
    expected = (int(np.prod(src.out_dims)), int(np.prod(src.in_dims)))
    parts = []
    for layer in range(*index[0].indices(shape[0])):
        hf = reader.get(src.hf_names[layer])
        if tuple(hf.shape) != expected:
            raise UserError(
                f"{src.hf_names[layer]} has shape {tuple(hf.shape)}, config implies {expected}", code="corrupt_model"
            )
        rows = np.asarray(hf[index[2], first:last], dtype=dtype)
        stored = quantize_kernel(rows)[part == "absmax"]  # one fused pass yields both
        parts.append(stored[skip : skip + hi - lo])
    return np.stack(parts)


def load_params(
    model_dir: str | Path, cfg: DecoderConfig, mesh: Mesh, dtype: Any = jnp.bfloat16,
    quantization: Quantization = "none",
) -> tuple[Params, dict[str, int]]:
    """Load the base weights into arrays sharded by ``PARAM_RULES`` on ``mesh``.

    ``quantization="nf4"`` quantizes the decoder's linear weights shard by shard while
    loading (``nf4.py``); embeddings, norms, biases and the LM head stay in ``dtype``.

    Returns:
        (params, stats) with stats ``host_peak_rss_bytes`` (after loading) and
        ``param_bytes`` (total, as stored on the devices).
    """
    reader = CheckpointReader(model_dir)
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in reader:
        raise UserError("config says untied embeddings but the checkpoint has no lm_head.weight", code="corrupt_model")
    shapes = param_shapes(cfg, dtype, quantization)
    shardings = tree_shardings(shapes, param_axes(cfg, quantization), mesh, PARAM_RULES)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def load_one(src: _Source, shape: Any, sharding: Any) -> Any:
        if isinstance(shape, dict):  # an NF4 kernel: {"codes", "absmax"}
            return {
                part: jax.make_array_from_callback(
                    s.shape, sharding[part],
                    lambda index, part=part, s=s: _read_nf4_shard(reader, src, part, s.shape, index, np_dtype),
                )
                for part, s in shape.items()
            }
        return jax.make_array_from_callback(
            shape.shape, sharding, lambda index: _read_shard(reader, src, shape.shape, index, np_dtype)
        )

    params = jax.tree.map(load_one, _sources(cfg), shapes, shardings, is_leaf=lambda x: isinstance(x, _Source))
    total = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
    return params, {"host_peak_rss_bytes": peak_rss_bytes(), "param_bytes": total}


def iter_hf_names(cfg: DecoderConfig) -> Iterator[str]:
    """Every HF tensor name the model reads (for diagnostics and tests)."""
    for src in jax.tree.leaves(_sources(cfg), is_leaf=lambda x: isinstance(x, _Source)):
        yield from src.hf_names
