"""The Llama-layout decoder in pure JAX (Llama 3.x, Mistral, Qwen2/2.5, Qwen3).

Parameters are a pytree, with a parallel pytree of logical axes. The families differ
by a few switches of ``DecoderConfig`` (``config.py``), each a branch here rather than a
copy of the model: biases on some projections (``layers.biases``, Qwen2), RMSNorm of
each query and key head (``layers.q_norm`` / ``k_norm``, Qwen3), and a sliding attention
window (Mistral).

Why pure JAX rather than Flax NNX: the trainer needs exactly three things from a model -
a pytree of frozen base weights, a separate pytree of LoRA factors to differentiate, and
logical axis names for both - and plain dicts give all three with no framework state to
split or merge (``nnx.split``/``nnx.state`` filters), no module objects to trace, and a
direct ``jax.grad`` w.r.t. the LoRA pytree alone. The whole model is ~200 lines that
read like the math, and stacking the layers along a leading ``layers`` axis lets one
``lax.scan`` compile a single layer body (compile time independent of depth; remat is a
``jax.checkpoint`` around that body).

A job that continues a fine-tuned model carries the parent's adapter, frozen, among the
base weights: ``params["layers"][PARENT_LORA]`` (``lora.parent_lora``), the LoRA layout
with its scale folded into ``lora_b``. Every projection it adapts adds its path (no
dropout) beside the trained one, so the model without the trained adapter (``lora=None``,
DPO's reference) is the model the job started from.

Layout. Kernels are stored (in..., out...) with heads split out, e.g. ``q_proj`` is
(layers, embed, heads, head_dim) and ``o_proj`` is (layers, heads, head_dim, embed), so
every named dimension can be sharded by the rules in ``sharding.py``. Activations are
constrained with logical names through an injected ``constrain(x, axes)``; this module
never mentions a mesh axis.

Numerics follow transformers' ``LlamaForCausalLM`` (and its Mistral/Qwen2/Qwen3
siblings): RMSNorm in float32 then cast back before the weight multiply, rotate-half
RoPE (incl. Llama 3.1 ``llama3`` frequency scaling), softmax in float32
(``attention``), SwiGLU MLP, tied or untied LM head. Packed sequences use
``segment_ids`` (0 = padding) and per-segment ``positions``: a token attends only to
earlier tokens of its own segment (and, with a sliding window, only to the last
``sliding_window`` of them, as transformers' sliding-window causal mask).

Decoding. ``cached_hidden_states`` runs the same layers (``decoder_layer``: only the
attention differs) on a few new tokens per row against a KV cache, for the reinforcement
sampler (``sampling.py``): left-padded rows, each token's keys and values written at its
slot, attention over the cached slots under an explicit mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig, rope_inverse_frequencies
from trainers.jax_lora.nf4 import NF4_BLOCKSIZE, nf4_project

Params = dict[str, Any]
Quantization = Literal["none", "nf4"]
# The key, among a layer's base weights, of a parent fine-tuned model's frozen adapter.
PARENT_LORA = "parent_lora"
Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]
RematPolicy = Literal["none", "per_layer", "dots_saveable"]


@dataclass(frozen=True)
class Projection:
    """A linear layer inside a decoder layer: where it lives and the logical axes of its input/output."""

    parent: str  # "self_attn" | "mlp" (the HF module path segment)
    in_axes: tuple[str, ...]
    out_axes: tuple[str, ...]


PROJECTIONS: dict[str, Projection] = {
    "q_proj": Projection("self_attn", ("embed",), ("heads", "head_dim")),
    "k_proj": Projection("self_attn", ("embed",), ("kv_heads", "head_dim")),
    "v_proj": Projection("self_attn", ("embed",), ("kv_heads", "head_dim")),
    "o_proj": Projection("self_attn", ("heads", "head_dim"), ("embed",)),
    "gate_proj": Projection("mlp", ("embed",), ("mlp",)),
    "up_proj": Projection("mlp", ("embed",), ("mlp",)),
    "down_proj": Projection("mlp", ("mlp",), ("embed",)),
}


def axis_sizes(cfg: DecoderConfig) -> dict[str, int]:
    return {
        "layers": cfg.num_layers,
        "vocab": cfg.vocab_size,
        "embed": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp": cfg.intermediate_size,
    }


def projection_shape(cfg: DecoderConfig, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of one projection, without the layers axis."""
    sizes = axis_sizes(cfg)
    proj = PROJECTIONS[name]
    return tuple(sizes[a] for a in proj.in_axes), tuple(sizes[a] for a in proj.out_axes)


def _flat_axis(axes: tuple[str, ...]) -> str:
    """Logical name of a flattened group of dims (e.g. heads x head_dim) in an NF4 kernel.

    The group shards like its leading dim, but without that dim's strictness (a
    quantization block may span heads; the dense heads are checked separately).
    """
    return f"{axes[0]}_flat" if len(axes) > 1 else axes[0]


def param_axes(cfg: DecoderConfig, quantization: Quantization = "none") -> Params:
    """Logical axis names of every base parameter (same tree structure as the params).

    With ``quantization="nf4"`` each projection is ``{"codes", "absmax"}`` (``nf4.py``),
    both (layers, in_flat / k, out_flat); the codes shard like the dense kernel (the
    projection's leading logical axes), the small absmax over its outputs only.
    """
    layers: dict[str, Any] = {
        "input_layernorm": ("layers", "embed"),
        "post_attention_layernorm": ("layers", "embed"),
    }
    if cfg.qk_norm:  # one head_dim weight shared by every head
        layers["q_norm"] = ("layers", "head_dim")
        layers["k_norm"] = ("layers", "head_dim")
    if cfg.bias_projections:  # never quantized: a bias shards like its projection's outputs
        layers["biases"] = {name: ("layers", *PROJECTIONS[name].out_axes) for name in cfg.bias_projections}
    for name, proj in PROJECTIONS.items():
        if quantization == "nf4":
            # The scales split over every parameter axis along their outputs: a model's
            # input blocks (in / 64) rarely divide the fsdp size of a small model.
            layers[name] = {"codes": ("layers", _flat_axis(proj.in_axes), _flat_axis(proj.out_axes)),
                            "absmax": ("layers", None, "nf4_scales")}
        else:
            layers[name] = ("layers", *proj.in_axes, *proj.out_axes)
    axes: Params = {"embed_tokens": ("vocab", "embed"), "layers": layers, "norm": ("embed",)}
    if not cfg.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def param_shapes(cfg: DecoderConfig, dtype: Any, quantization: Quantization = "none") -> Params:
    """``jax.ShapeDtypeStruct`` of every base parameter (``dtype`` for the unquantized ones)."""
    sizes = axis_sizes(cfg)
    shapes = jax.tree.map(
        lambda axes: jax.ShapeDtypeStruct(tuple(sizes[a] for a in axes), jnp.dtype(dtype)),
        param_axes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    if quantization == "nf4":
        for name in PROJECTIONS:
            in_dims, out_dims = projection_shape(cfg, name)
            in_flat, out_flat = math.prod(in_dims), math.prod(out_dims)
            if in_flat % NF4_BLOCKSIZE:
                raise UserError(f"{name} has {in_flat} inputs; the JAX trainer's NF4 needs a multiple of "
                                f"{NF4_BLOCKSIZE} (train this model with trainer fsdp_qlora)", code="invalid_spec")
            shapes["layers"][name] = {
                "codes": jax.ShapeDtypeStruct((cfg.num_layers, in_flat // 2, out_flat), jnp.uint8),
                "absmax": jax.ShapeDtypeStruct((cfg.num_layers, in_flat // NF4_BLOCKSIZE, out_flat), jnp.float32),
            }
    return shapes


def init_params(cfg: DecoderConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> Params:
    """Random weights (normal(0, std), norms = 1) for tests and benchmarks; real runs load."""
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    out = []
    for k, leaf, path in zip(keys, leaves, paths, strict=True):
        if "norm" in path:
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        else:
            out.append((std * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, out)


def _identity_constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    return x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As HF: normalize in float32, cast back to the activation dtype, then scale.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape (batch, seq, head_dim) for rotate-half RoPE."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (batch, seq, heads, head_dim); cos/sin: (batch, seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


@dataclass(frozen=True)
class LoraRuntime:
    """How LoRA factors enter the forward pass (the factors themselves are an argument)."""

    scaling: float = 1.0
    dropout: float = 0.0


def project(
    x: jax.Array,
    kernel: jax.Array | dict[str, jax.Array],
    lora: dict[str, jax.Array] | None,
    n_in: int,
    runtime: LoraRuntime,
    dropout_key: jax.Array | None,
    out_dims: tuple[int, ...] | None = None,
    bias: jax.Array | None = None,
    frozen: dict[str, jax.Array] | None = None,
) -> jax.Array:
    """``x @ W (+ bias)`` plus the LoRA path ``dropout(x) @ A @ B * scaling`` (as PEFT's lora.Linear),
    and with ``frozen`` (a parent fine-tuned model's adapter, scale folded in) ``x @ A' @ B'``.

    ``kernel`` is a dense (in..., out...) array or an NF4 ``{"codes", "absmax"}`` pair
    (then ``out_dims`` gives the output dims), as bitsandbytes' ``Linear4bit`` under
    PEFT: the base product runs on the dequantized weight in the input's dtype. The
    bias, shaped like the outputs, belongs to the base layer (PEFT adds the LoRA path to
    the biased output).
    """
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    if isinstance(kernel, dict):
        y = nf4_project(x, kernel["codes"], kernel["absmax"], x.shape[x.ndim - n_in:], out_dims)
    else:
        y = jax.lax.dot_general(x, kernel.astype(x.dtype), (contract, ((), ())))
    if bias is not None:
        y = y + bias.astype(y.dtype)
    if frozen is not None:
        fa = jax.lax.dot_general(x, frozen["lora_a"].astype(x.dtype), (contract, ((), ())))
        fb = frozen["lora_b"].astype(x.dtype)
        y = y + jax.lax.dot_general(fa, fb, (((fa.ndim - 1,), (0,)), ((), ()))).astype(y.dtype)
    if lora is None:
        return y
    x_in = x
    if runtime.dropout > 0.0 and dropout_key is not None:
        keep = jax.random.bernoulli(dropout_key, 1.0 - runtime.dropout, x.shape)
        x_in = jnp.where(keep, x / (1.0 - runtime.dropout), 0).astype(x.dtype)
    a = jax.lax.dot_general(x_in, lora["lora_a"].astype(x.dtype), (contract, ((), ())))
    b = lora["lora_b"].astype(x.dtype)
    delta = jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())))
    return y + (runtime.scaling * delta).astype(y.dtype)


# Query rows per block of ``blockwise_attention``, per backend. CPU: 2 blocks at seq 256
# compute 3/4 of the full (seq x seq) scores (bench/RESULTS.md, "jax_lora as shipped on a
# CPU-only local pool"). Accelerators: bigger blocks, fewer and larger matmuls; a block's
# transient scores are (batch, heads, block, seq) in float32 (512 MiB at batch 4, 32
# heads, 512 x 2048), freed before the next block.
QUERY_BLOCK = {"cpu": 128}
ACCELERATOR_QUERY_BLOCK = 512


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, head_dim: int,
    query_block: int | None = None,
) -> jax.Array:
    """Causal GQA attention, (batch, seq, heads, head_dim) in and out; softmax in float32.

    ``mask`` is ``attention_mask``'s (batch, 1, seq, seq) or None for plain causal rows.
    Every backend runs ``blockwise_attention``, whose backward pass keeps FlashAttention's
    residuals (inputs, output, one log-sum-exp per row): the memory a layer keeps for the
    backward pass grows with seq, not seq^2. ``jax.nn.dot_product_attention``'s generic
    (XLA) path, which a packed batch's mask requires, saves the float32 probabilities of
    every layer instead: 64 GiB for an 8B Llama at batch 4 x 2048 (32 layers x 32 heads x
    2048^2 x 4 B x 4 rows), more than the model, measured on one H200 (bench/RESULTS.md,
    "jax_lora on one H200"). On CPU the blockwise form was also the faster one: the
    generic path spent a large share of the step on transposes of the (batch, heads, seq,
    seq) scores, on a mask broadcast per query group, and on page faults of the temp
    buffer XLA:CPU maps afresh on every call (bench/RESULTS.md, "jax_lora CPU step profile").
    ``query_block``: query rows per block (default: ``QUERY_BLOCK`` for the backend).
    """
    scale = 1.0 / math.sqrt(head_dim)
    if mask is None:
        seq = q.shape[1]
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
    if query_block is None:
        query_block = QUERY_BLOCK.get(jax.default_backend(), ACCELERATOR_QUERY_BLOCK)
    return blockwise_attention(q, k, v, mask, scale, query_block)


def blockwise_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float, query_block: int
) -> jax.Array:
    """Causal GQA attention that skips the key blocks no query of a block can see.

    Queries go in blocks of ``query_block`` rows; the block ending at row ``e``
    scores keys ``[0, e)`` only. Every key at or after ``e`` is masked for all its rows
    (``attention_mask`` is causal), so its softmax weight would be exactly zero: leaving
    it out changes no value, and saves the scores, softmax and backward of the upper
    triangle of blocks.
    """
    seq = q.shape[1]
    q = q * jnp.asarray(scale, q.dtype)
    outs = [
        _attention_block(q[:, start:end], k[:, :end], v[:, :end], mask[:, :, start:end, :end])
        for start, end in ((s, min(s + query_block, seq)) for s in range(0, seq, query_block))
    ]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


@jax.custom_vjp
def _attention_block(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention of pre-scaled queries, with a hand-written backward pass.

    Query heads are split as (kv_heads, group) and the scores kept in the order the
    matmul produces them, (batch, kv_heads, q_seq, group, k_seq), so the mask and the
    softmax over the last axis read them where they are; every matmul writes its natural
    layout and the (small) attention output is transposed afterwards. Same math as
    ``jax.nn.dot_product_attention``: masked scores are the float32 minimum, not -inf,
    and every row has at least one visible key (``attention_mask``).

    The backward pass keeps FlashAttention's residuals - inputs, output and each row's
    log-sum-exp, no (q x k) probabilities - and recomputes the probabilities from them.
    Before, ``jax.checkpoint`` + autodiff recomputed the whole forward, and XLA:CPU
    wrote the attention output (and its cotangents) through transposed matmul outputs;
    this is ~6 % more tokens/s on the whole CPU train step (bench/RESULTS.md, "jax_lora CPU
    attention with a hand-written backward pass").
    """
    return _attention_block_fwd(q, k, v, mask)[0]


def _attention_block_fwd(q, k, v, mask):
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqkgd,btkd->bkqgt", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, :, :, None, :], scores, jnp.finfo(jnp.float32).min)
    row_max = scores.max(axis=-1, keepdims=True)
    exp = jnp.exp(scores - row_max)
    row_sum = exp.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bkqgt,btkd->bkqgd", (exp / row_sum).astype(v.dtype), v).transpose(0, 2, 1, 3, 4)
    log_sum_exp = (row_max + jnp.log(row_sum))[..., 0]  # (batch, kv, q, group)
    return out.reshape(batch, seq, heads, head_dim), (q, k, v, mask, out, log_sum_exp)


def _attention_block_bwd(residuals, d_out):
    q, k, v, mask, out, log_sum_exp = residuals  # q and out: (batch, q, kv, group, d)
    d_out = d_out.reshape(out.shape)
    # Σ_d dO·O per query row = Σ_k dP·P: softmax's backward without saved probabilities.
    row_dot = jnp.einsum("bqkgd,bqkgd->bkqg", d_out.astype(jnp.float32), out.astype(jnp.float32))
    scores = jnp.einsum("bqkgd,btkd->bkqgt", q, k, preferred_element_type=jnp.float32)
    probs = jnp.where(mask[:, :, :, None, :], jnp.exp(scores - log_sum_exp[..., None]), 0.0)
    d_probs = jnp.einsum("bqkgd,btkd->bkqgt", d_out, v, preferred_element_type=jnp.float32)
    d_scores = probs * (d_probs - row_dot[..., None])
    d_q = jnp.einsum("bkqgt,btkd->bkqgd", d_scores.astype(k.dtype), k).transpose(0, 2, 1, 3, 4)
    d_k = jnp.einsum("bkqgt,bqkgd->btkd", d_scores.astype(q.dtype), q)
    d_v = jnp.einsum("bkqgt,bqkgd->btkd", probs.astype(d_out.dtype), d_out)
    batch, seq, kv_heads, group, head_dim = d_q.shape
    return (d_q.reshape(batch, seq, kv_heads * group, head_dim).astype(q.dtype), d_k.astype(k.dtype),
            d_v.astype(v.dtype), None)


_attention_block.defvjp(_attention_block_fwd, _attention_block_bwd)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``. The layer checkpoints it: the backward pass recomputes this
    cheap elementwise product from the two saved matmul outputs instead of keeping its
    intermediates, two fewer (batch, seq, mlp) activations per layer in memory (on CPU,
    fewer fresh pages to fault in per step)."""
    return jax.nn.silu(gate) * up


Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
"""A layer's attention over its rotated queries, keys and values (batch, seq, heads,
head_dim): the output and whatever the caller keeps (a decoding step: the layer's KV cache)."""


def decoder_layer(
    h: jax.Array,
    layer: Params,
    lora: Params,
    key: jax.Array | None,
    *,
    cfg: DecoderConfig,
    cos: jax.Array,
    sin: jax.Array,
    attend: Attend,
    runtime: LoraRuntime,
    constrain: Constrain,
) -> tuple[jax.Array, Any]:
    """One decoder layer: ``(h + attention + MLP, attend's extra)``. ``attend`` is the one
    difference between a training forward (causal attention over the sequence) and a
    decoding step (attention over the KV cache, ``decode.py``)."""
    biases = layer.get("biases", {})
    parent = layer.get(PARENT_LORA, {})

    def proj(name: str, x: jax.Array) -> jax.Array:
        k = None if key is None else jax.random.fold_in(key, list(PROJECTIONS).index(name))
        return project(x, layer[name], lora.get(name), len(PROJECTIONS[name].in_axes), runtime, k,
                       projection_shape(cfg, name)[1], biases.get(name), parent.get(name))

    x = rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps)
    q = constrain(proj("q_proj", x), ("batch", "seq", "heads", "head_dim"))
    k = constrain(proj("k_proj", x), ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(proj("v_proj", x), ("batch", "seq", "kv_heads", "head_dim"))
    if cfg.qk_norm:  # Qwen3: normalize each head over head_dim, then rotate
        q, k = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, kept = attend(q, k, v)
    attn = constrain(attn, ("batch", "seq", "heads", "head_dim"))
    h = h + constrain(proj("o_proj", attn), ("batch", "seq", "embed"))

    x = rms_norm(h, layer["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = constrain(proj("gate_proj", x), ("batch", "seq", "mlp"))
    up = constrain(proj("up_proj", x), ("batch", "seq", "mlp"))
    mlp = proj("down_proj", jax.checkpoint(swiglu)(gate, up))
    return h + constrain(mlp, ("batch", "seq", "embed")), kept


def attention_mask(segment_ids: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """(batch, 1, seq, seq) boolean: query q may attend to key k iff k <= q and both are
    in the same non-padding segment (``trainers.common.data.block_causal_mask``), and,
    with ``sliding_window``, ``q - k < sliding_window`` (transformers' sliding-window
    causal mask: the window holds the query itself and the ``sliding_window - 1`` before).

    Padding queries (segment 0) attend to themselves only, so no softmax row is empty;
    their outputs are never trained on.
    """
    seq = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    if sliding_window is not None:
        causal = causal & ~jnp.tril(jnp.ones((seq, seq), dtype=bool), -sliding_window)
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
    pad_self = jnp.eye(seq, dtype=bool)[None] & (segment_ids[:, :, None] == 0)
    return ((causal[None] & same) | pad_self)[:, None]


def forward(
    params: Params,
    lora: Params | None,
    tokens: jax.Array,
    *,
    cfg: DecoderConfig,
    constrain: Constrain = _identity_constrain,
    **options: Any,
) -> jax.Array:
    """Logits (batch, seq, vocab) in float32: ``lm_head`` of ``hidden_states`` (``options``:
    its keyword arguments).

    The train and eval steps never call this: they apply the head a chunk of positions
    at a time (``loss.py``), so that no (batch, seq, vocab) array exists.
    """
    h = hidden_states(params, lora, tokens, cfg=cfg, constrain=constrain, **options)
    return lm_head(params, h, cfg=cfg, constrain=constrain)


def hidden_states(
    params: Params,
    lora: Params | None,
    tokens: jax.Array,
    *,
    cfg: DecoderConfig,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    runtime: LoraRuntime = LoraRuntime(),
    dropout_key: jax.Array | None = None,
    remat: RematPolicy = "none",
    compute_dtype: Any = jnp.float32,
    constrain: Constrain = _identity_constrain,
) -> jax.Array:
    """The final-normed hidden states (batch, seq, embed) in ``compute_dtype``: the LM head's input.

    Args:
        params: base weights (see ``param_axes``); never differentiated by the trainer.
        lora: ``{proj_name: {"lora_a", "lora_b"}}`` with a leading layers axis, or None.
        tokens: (batch, seq) int token ids.
        segment_ids: (batch, seq) packing segments (1, 2, ...; 0 = padding). None means
            one causal sequence per row (lets GPUs use their fused causal attention
            unless a sliding window shorter than the sequence applies).
        positions: (batch, seq) positions restarting at 0 in each segment; default arange.
        dropout_key: enables LoRA dropout (training); None = no dropout (eval).
        remat: "per_layer" recomputes each layer in the backward pass; "dots_saveable"
            keeps matmul outputs and recomputes the cheap elementwise parts.
    """
    batch, seq = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    # A window as long as the sequence masks nothing: keep the plain causal path then.
    window = cfg.sliding_window if cfg.sliding_window is not None and cfg.sliding_window < seq else None
    if segment_ids is None and window is not None:
        segment_ids = jnp.ones((batch, seq), jnp.int32)
    mask = None if segment_ids is None else attention_mask(segment_ids, window)
    cos, sin = rope_cos_sin(positions, rope_inverse_frequencies(cfg.rope, cfg.head_dim), compute_dtype)

    h = embed(params, tokens, compute_dtype, constrain)
    lora = lora or {}
    keys = None if dropout_key is None else jax.random.split(dropout_key, cfg.num_layers)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, None]:
        return attention(q, k, v, mask, cfg.head_dim), None

    def body(carry: jax.Array, xs: tuple[Params, Params, jax.Array | None]) -> tuple[jax.Array, None]:
        layer, layer_lora, key = xs
        out, _ = decoder_layer(
            carry, layer, layer_lora, key,
            cfg=cfg, cos=cos, sin=sin, attend=attend, runtime=runtime, constrain=constrain,
        )
        return out, None

    if remat == "per_layer":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    elif remat == "dots_saveable":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)
    elif remat != "none":
        raise ValueError(f"unknown remat policy {remat!r}")
    h, _ = jax.lax.scan(body, h, (params["layers"], lora, keys))

    return rms_norm(h, params["norm"], cfg.rms_norm_eps)


def embed(params: Params, tokens: jax.Array, compute_dtype: Any, constrain: Constrain) -> jax.Array:
    """The token embeddings (batch, seq, embed) in ``compute_dtype``."""
    # Gather the embed (fsdp) dim of the table first: XLA partitions a row lookup from a
    # vocab-sharded table (masked gather + all-reduce) but not from a 2-D sharded one.
    table = constrain(params["embed_tokens"], ("vocab", None))
    return constrain(jnp.take(table, tokens, axis=0).astype(compute_dtype), ("batch", "seq", "embed"))


# The KV cache of decoding: each layer's rotated keys and its values at every slot of
# every row, {"k", "v"} each (layers, rows, slots, kv_heads, head_dim) in the compute
# dtype. Rows are left-padded: row r's tokens fill slots starts[r]..., so every row's
# next token goes to the same slot and one dynamic_update_slice writes a step's keys.
CACHE_AXES = ("layers", "batch", "kv_seq", "kv_heads", "head_dim")


def cache_shapes(cfg: DecoderConfig, rows: int, slots: int, dtype: Any) -> Params:
    """``jax.ShapeDtypeStruct`` of a KV cache for ``rows`` rows of ``slots`` tokens."""
    shape = (cfg.num_layers, rows, slots, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), "v": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))}


def cached_hidden_states(
    params: Params,
    lora: Params | None,
    tokens: jax.Array,
    cache: Params,
    *,
    index: jax.Array | int,
    starts: jax.Array,
    cfg: DecoderConfig,
    runtime: LoraRuntime = LoraRuntime(),
    compute_dtype: Any = jnp.float32,
    constrain: Constrain = _identity_constrain,
) -> tuple[jax.Array, Params]:
    """The final-normed hidden states of ``tokens`` written at cache slots ``index``...,
    and the cache with their keys and values in it (prefill: the whole prompt at slot 0;
    a decoding step: one token per row at the next slot).

    Row ``r``'s first real token is at slot ``starts[r]`` (the slots before are left
    padding), so a token at slot ``i`` has position ``i - starts[r]`` and sees the cached
    slots ``starts[r]..i`` (and with a sliding window only the last ``sliding_window`` of
    them): the same positions and keys as the row alone in ``hidden_states``, so the
    logits are the full forward's (``tests/trainers/jax_lora/test_sampling.py``). A
    padding slot sees itself only; what it writes is never seen. No dropout: decoding
    samples the policy as evaluated.
    """
    seq = tokens.shape[1]
    slots = cache["k"].shape[2]
    query_slots = index + jnp.arange(seq)
    key_slots = jnp.arange(slots)
    q_at, k_at = query_slots[None, :, None], key_slots[None, None, :]
    visible = (k_at <= q_at) & (k_at >= starts[:, None, None])
    if cfg.sliding_window is not None:
        visible = visible & (q_at - k_at < cfg.sliding_window)
    mask = (visible | (k_at == q_at))[:, None]  # (rows, 1, seq, slots)
    positions = jnp.maximum(query_slots[None, :] - starts[:, None], 0)
    cos, sin = rope_cos_sin(positions, rope_inverse_frequencies(cfg.rope, cfg.head_dim), compute_dtype)
    scale = jnp.asarray(1.0 / math.sqrt(cfg.head_dim), compute_dtype)
    h = embed(params, tokens, compute_dtype, constrain)

    def body(carry: tuple[jax.Array, Params], xs: tuple[Params, Params, jax.Array]):
        h, cache = carry
        layer, layer_lora, i = xs

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Params]:
            # Write this step's keys and values in place, then attend over the layer's slots.
            new = {name: constrain(jax.lax.dynamic_update_slice(cache[name], x[None].astype(cache[name].dtype),
                                                                (i, 0, index, 0, 0)), CACHE_AXES)
                   for name, x in (("k", k), ("v", v))}
            return _attention_block(q * scale, new["k"][i], new["v"][i], mask), new

        return decoder_layer(h, layer, layer_lora, None, cfg=cfg, cos=cos, sin=sin, attend=attend, runtime=runtime,
                             constrain=constrain), None

    (h, cache), _ = jax.lax.scan(body, (h, cache), (params["layers"], lora or {}, jnp.arange(cfg.num_layers)))
    return rms_norm(h, params["norm"], cfg.rms_norm_eps), cache


def lm_head(
    params: Params, h: jax.Array, *, cfg: DecoderConfig, constrain: Constrain = _identity_constrain
) -> jax.Array:
    """Float32 logits (batch, positions, vocab) of hidden states ``h`` (batch, positions, embed).

    The head (tied: the embedding table) is cast to ``h``'s dtype, the compute dtype, and
    the product accumulates in float32, where the loss's log-softmax runs.
    """
    if cfg.tie_word_embeddings:
        head = params["embed_tokens"].astype(h.dtype)
        logits = jnp.einsum("bse,ve->bsv", h, head, preferred_element_type=jnp.float32)
    else:
        head = params["lm_head"].astype(h.dtype)
        logits = jnp.einsum("bse,ev->bsv", h, head, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))
