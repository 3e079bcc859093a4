"""4-bit NormalFloat (NF4) base weights for QLoRA in JAX, bit-compatible with bitsandbytes.

The format is bitsandbytes' ``quant_type="nf4"`` with its default block of 64 and no
double quantization: a weight matrix, read in Hugging Face's (out_features, in_features)
order, is cut into blocks of 64 consecutive values; each block keeps its absolute
maximum (float32) and each value the index of the nearest of 16 NF4 levels after
dividing by it, two indices per byte (the first value of a pair in the high nibble).
Quantizing a checkpoint here gives the same bytes and absmax as
``bitsandbytes.functional.quantize_4bit`` on the same tensor, and dequantizing gives
the same floats (tests/trainers/jax_lora/test_nf4.py checks both against the library).

Layout. Our kernels are (in..., out...); a quantized kernel of a projection with
``in_flat`` inputs and ``out_flat`` outputs is the pair

- ``codes``: uint8 (in_flat / 2, out_flat); ``codes[i, o]`` packs HF ``W[o, 2i]`` and
  ``W[o, 2i + 1]``;
- ``absmax``: float32 (in_flat / 64, out_flat), one per block of 64 inputs.

Blocks run along the inputs (HF rows), so ``in_flat`` must be a multiple of 64; it is
for every Llama (hidden sizes, heads x head_dim and MLP widths are multiples of 64).
The codes keep the projection's leading logical axes, so they shard like the dense kernel
would; the absmax (1/8 of the codes' bytes) splits over all parameter devices along its
outputs (``model.param_axes``, rule ``nf4_scales``).

Compute. :func:`nf4_project` is ``x @ dequantize(W)`` with a hand-written backward pass:
the base is frozen, so the only gradient is the input's, ``dy @ W.T``, and the
backward dequantizes the kernel again instead of keeping it. Autodiff would save each
layer's dequantized kernel as a residual of the layer scan - the whole model in the
compute dtype, which is what quantizing was meant to avoid.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

NF4_BLOCKSIZE = 64

# The 16 NF4 levels (quantiles of N(0, 1) scaled to [-1, 1], with an exact zero), as the
# float32 values bitsandbytes uses; the test compares them with the library's table.
NF4_LEVELS = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)
# A scaled value goes to level i when it lies in (bound[i - 1], bound[i]]: the midpoints
# between neighbouring levels, computed in float32 as the library does.
_BOUNDS = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / np.float32(2)


def quantize_kernel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An HF (out, in) weight (or a slice of whole rows and blocks) -> ``(codes, absmax)``.

    ``codes`` uint8 (in / 2, out) and ``absmax`` float32 (in / 64, out): our layout (see
    the module docstring); ``in`` must be a multiple of 64. The values are widened to
    float32 first (exact for bf16/fp16), as bitsandbytes does.

    Runs as one fused XLA computation on the host CPU: numpy's per-value level search
    made loading a 4-bit model ~6x slower than loading it dense (bench/RESULTS.md).
    """
    cols = w.shape[1]
    if cols % NF4_BLOCKSIZE:
        raise ValueError(f"NF4 quantizes whole blocks of {NF4_BLOCKSIZE}; got {cols} columns")
    with jax.default_device(_host_device()):
        codes, absmax = _quantize(np.asarray(w, dtype=np.float32))
    return np.asarray(codes), np.asarray(absmax)


def _host_device() -> jax.Device:
    """This process's CPU device (multi-host: ``jax.devices()`` lists every process's);
    its default device where ``JAX_PLATFORMS`` leaves no CPU backend."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


@jax.jit
def _quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // NF4_BLOCKSIZE, NF4_BLOCKSIZE)
    absmax = jnp.abs(blocks).max(axis=-1)
    # bitsandbytes multiplies by the reciprocal of max(absmax, 1e-38) (not a division):
    # the same rounding, bit for bit; an all-zero block scales to 0 (level 7), as there.
    inverse = jnp.where(absmax > 0, 1.0 / jnp.maximum(absmax, jnp.float32(1e-38)), 0.0)
    scaled = jnp.clip(blocks * inverse[..., None], -1.0, 1.0)
    # The level index = how many midpoints lie strictly below the value (bucketize).
    index = (scaled[..., None] > jnp.asarray(_BOUNDS)).sum(axis=-1, dtype=jnp.uint8)
    pairs = index.reshape(rows, cols // 2, 2)
    packed = (pairs[..., 0] << 4) | pairs[..., 1]
    return packed.T, absmax.T


def dequantize(codes: jax.Array, absmax: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``(codes, absmax)`` -> the (in_flat, out_flat) kernel in ``dtype``.

    As bitsandbytes: level x absmax in float32, then one cast to ``dtype``.
    """
    half, out = codes.shape
    index = jnp.stack([codes >> 4, codes & 0xF], axis=1).reshape(2 * half, out)
    levels = jnp.take(jnp.asarray(NF4_LEVELS), index.astype(jnp.int32), axis=0)
    blocks = levels.reshape(-1, NF4_BLOCKSIZE, out) * absmax[:, None, :]
    return blocks.reshape(2 * half, out).astype(dtype)


def _contract(n: int, ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim - n, ndim))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def nf4_project(
    x: jax.Array, codes: jax.Array, absmax: jax.Array, in_dims: tuple[int, ...], out_dims: tuple[int, ...]
) -> jax.Array:
    """``x @ W`` for a quantized kernel: x (..., *in_dims) -> (..., *out_dims) in x's dtype."""
    return _project_fwd(x, codes, absmax, in_dims, out_dims)[0]


def _project_fwd(x, codes, absmax, in_dims, out_dims):
    kernel = dequantize(codes, absmax, x.dtype).reshape(*in_dims, *out_dims)
    y = jax.lax.dot_general(x, kernel, ((_contract(len(in_dims), x.ndim), tuple(range(len(in_dims)))), ((), ())))
    return y, (codes, absmax)


def _project_bwd(in_dims, out_dims, residuals, dy):
    codes, absmax = residuals
    kernel = dequantize(codes, absmax, dy.dtype).reshape(*in_dims, *out_dims)
    n_out = len(out_dims)
    dx = jax.lax.dot_general(
        dy, kernel, ((_contract(n_out, dy.ndim), _contract(n_out, kernel.ndim)), ((), ()))
    )
    # The frozen codes and scales get no gradient (None: a zero cotangent).
    return dx, None, None


nf4_project.defvjp(_project_fwd, _project_bwd)
