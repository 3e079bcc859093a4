"""What several benches share: peak-RSS readings, the tiny-Llama shape options, and the
JAX trainer's compiled step on a model directory.

Peak memory on Linux: a child process records its RSS, resets the kernel's peak-RSS
counter (``VmHWM``) and later reads the peak, so ``peak - baseline`` is what the measured
work itself needed (imports excluded).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak RSS since the last :func:`reset_peak_rss` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets the peak-RSS counter to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def add_llama_shape_args(parser: argparse.ArgumentParser, *, hidden: int = 256, layers: int = 4, ffn: int = 1024,
                         seq: int = 256) -> None:
    """``--hidden --layers --ffn --seq`` of the random Llama a bench builds (``build_llama``)."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--ffn", type=int, default=ffn)
    parser.add_argument("--seq", type=int, default=seq)


def build_llama(path: Path, args: argparse.Namespace, vocab: int, **options: Any) -> Path:
    """A random Llama of ``args``' shape: heads of 32 dims, 2 query heads per kv head."""
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(path, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 32,
                            num_kv_heads=args.hidden // 64, intermediate_size=args.ffn, vocab_size=vocab, **options)


def jax_lora_step(model_dir: Path, mesh: Any, quantization: str, *, targets: tuple[str, ...], rank: int,
                  alpha: float, learning_rate: float, max_grad_norm: float | None):
    """The jax_lora trainer's jitted step on ``mesh``, built as its recipe builds it.

    Returns ``(train_step, state, params)``: fp32 base (``quantization`` "nf4": quantized
    while loading), LoRA from the trainer's init, AdamW at a constant ``learning_rate``
    without weight decay, unpacked rows, no dropout. Call ``jax_lora.host_devices`` first.
    """
    import jax
    import jax.numpy as jnp

    from trainers.jax_lora.config import DecoderConfig
    from trainers.jax_lora.loading import load_params
    from trainers.jax_lora.lora import init_lora, lora_axes, lora_runtime, lora_shapes
    from trainers.jax_lora.model import param_axes
    from trainers.jax_lora.sharding import tree_shardings
    from trainers.jax_lora.step import (
        StepConfig,
        compile_steps,
        init_state,
        make_optimizer,
        state_shardings,
    )

    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, mesh, jnp.float32, quantization)
    l_abs = lora_shapes(cfg, targets, rank, jnp.float32)
    l_shard = tree_shardings(l_abs, lora_axes(targets), mesh)
    opt = make_optimizer(lambda s: learning_rate, weight_decay=0.0, max_grad_norm=max_grad_norm)
    shardings = state_shardings(l_shard, opt, l_abs, mesh)
    lora = jax.jit(lambda k: init_lora(cfg, targets, rank, k), out_shardings=l_shard)(jax.random.key(0))
    state = init_state(lora, opt, shardings, jax.random.key(1))
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(alpha, rank, 0.0), packed=False)
    train_step, _ = compile_steps(sc, opt, mesh, shardings, tree_shardings(params, param_axes(cfg, quantization), mesh))
    return train_step, state, params
