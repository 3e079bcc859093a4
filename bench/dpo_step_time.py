"""DPO step time / SFT step time, on the same CPU shape, for each trainer.

Same random Llama (hidden 256, 4 layers, heads 8/4, ffn 1024, vocab 1024), LoRA r 8 on
q/k/v/o, fp32, one process / one device. A step is one micro-batch of ROWS sequences of
SEQ tokens (the second half of each row is the trained completion), then clipping and
AdamW: the SFT step trains ROWS examples, the DPO step ROWS / 2 pairs (chosen and
rejected rows of the same tensor shape) and also runs the reference forward (adapter off,
no backward). Also printed: DPO per pair against SFT per example (twice the DPO ratio's
rows per example), the figure a user comparing epochs sees.

Each trainer's own step functions are timed (torch: ``train_step`` / ``dpo_train_step``;
JAX: the jitted step of ``compile_steps``, compiled before timing), alternating step by
step so machine load affects both alike; the median step time is reported.

Run:  OMP_NUM_THREADS=2 .venv/bin/python bench/dpo_step_time.py [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trainers.common.data import IGNORE_INDEX, Batch
from trainers.common.tiny_model import build_tiny_llama

SEQ, ROWS, R, ALPHA = 128, 4, 8, 16.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1024,
         "vocab_size": 1024}


def make_batch(seed: int) -> Batch:
    """ROWS full rows; labels on the second half (the completion)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, size=(ROWS, SEQ), dtype=np.int64)
    labels = ids.copy()
    labels[:, : SEQ // 2] = IGNORE_INDEX
    ones = np.ones_like(ids)
    return Batch(ids, labels, np.broadcast_to(np.arange(SEQ), ids.shape).copy(), ones, ones.copy())


def time_rounds(fns: dict[str, callable], steps: int, rounds: int) -> dict[str, float]:
    """Median seconds per call; the functions alternate call by call, so a load spike on
    this shared machine hits both alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds * steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def torch_times(model_dir: Path, steps: int, rounds: int) -> dict[str, float]:
    import torch

    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import (
        PreferenceObjective,
        build_optimizer,
        dpo_train_step,
        train_step,
    )

    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    model, _ = build_model(ModelOptions(model_dir=model_dir, lora_r=R, lora_alpha=ALPHA, target_modules=MODULES), ctx)
    opt = build_optimizer(model, learning_rate=1e-4, weight_decay=0.0)
    batch = make_batch(0)
    kw = {"step": 0, "seed": 0, "learning_rate": 1e-4, "max_grad_norm": 1.0}
    fns = {
        "sft": lambda: train_step(model, opt, [batch], ctx, **kw),
        "dpo": lambda: dpo_train_step(model, opt, [batch], ctx, PreferenceObjective(0.1), **kw),
    }
    for fn in fns.values():  # warm up allocators and lazily created optimizer state
        fn()
        fn()
    return time_rounds(fns, steps, rounds)


class JaxSetup(NamedTuple):
    """The bench model on one device as the JAX trainer holds it, and an AdamW at 1e-4."""

    cfg: Any
    mesh: Any
    params: Any
    param_shardings: Any
    lora_shardings: Any
    optimizer: Any
    state_shardings: Any


def jax_setup(model_dir: Path) -> JaxSetup:
    import jax
    import jax.numpy as jnp

    from trainers.jax_lora.config import DecoderConfig
    from trainers.jax_lora.loading import load_params
    from trainers.jax_lora.lora import lora_axes, lora_shapes
    from trainers.jax_lora.model import param_axes
    from trainers.jax_lora.sharding import make_mesh, tree_shardings
    from trainers.jax_lora.step import make_optimizer, state_shardings

    cfg = DecoderConfig.from_pretrained(model_dir)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params, _ = load_params(model_dir, cfg, mesh, jnp.float32)
    l_abs = lora_shapes(cfg, MODULES, R, jnp.float32)
    l_shard = tree_shardings(l_abs, lora_axes(MODULES), mesh)
    opt = make_optimizer(lambda s: 1e-4, weight_decay=0.0, max_grad_norm=1.0)
    return JaxSetup(cfg, mesh, params, tree_shardings(params, param_axes(cfg), mesh), l_shard, opt,
                    state_shardings(l_shard, opt, l_abs, mesh))


def jax_times(model_dir: Path, steps: int, rounds: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from trainers.jax_lora.lora import init_lora, lora_runtime
    from trainers.jax_lora.step import PreferenceLoss, StepConfig, compile_steps, init_state

    cfg, mesh, params, p_shard, l_shard, opt, shardings = jax_setup(model_dir)
    b = make_batch(0)
    host = {"input_ids": b.input_ids, "labels": b.labels, "positions": b.position_ids, "segment_ids": b.segment_ids}
    batch = {k: jnp.asarray(v[None], jnp.int32) for k, v in host.items()}  # (accum 1, rows, seq)
    fns = {}
    for name, pref in (("sft", None), ("dpo", PreferenceLoss(beta=0.1))):
        sc = StepConfig(cfg=cfg, runtime=lora_runtime(ALPHA, R, 0.0), packed=False, preference=pref)
        step, _ = compile_steps(sc, opt, mesh, shardings, p_shard)
        lora = jax.jit(lambda k: init_lora(cfg, MODULES, R, k), out_shardings=l_shard)(jax.random.key(0))
        holder = {"state": init_state(lora, opt, shardings, jax.random.key(1))}

        def run_step(step=step, holder=holder) -> None:
            holder["state"], out = step(holder["state"], params, batch)
            float(out["loss"])  # wait for the result

        run_step()  # compile
        fns[name] = run_step
    return time_rounds(fns, steps, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "model", **SHAPE, seed=0)
        for trainer, measure in (("fsdp_qlora", torch_times), ("jax_lora", jax_times)):
            t = measure(model_dir, args.steps, args.rounds)
            ratio = t["dpo"] / t["sft"]
            print(f"{trainer}: rows {ROWS} x seq {SEQ}: SFT step {t['sft'] * 1e3:.1f} ms, DPO step "
                  f"{t['dpo'] * 1e3:.1f} ms -> DPO/SFT {ratio:.2f}x per step ({2 * ratio:.2f}x per pair "
                  "vs per SFT example)")


if __name__ == "__main__":
    main()
