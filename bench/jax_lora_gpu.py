"""JAX LoRA trainer on one GPU: 8B-shaped Llama, random bf16 weights, seq 2048.

Uses the trainer's own model, sharding rules, LoRA and jitted train step (mesh 1x1x1);
the base weights are generated directly on the device (no checkpoint, no network).
Reports tokens/s, MFU and peak device memory as one JSON line.

MFU counts 4 * N * tokens FLOPs per step (N = base parameters): forward 2N plus the
activation gradients 2N; no weight gradients exist for the frozen base, and attention's
seq^2 FLOPs are not counted (so this MFU is conservative). Peak bf16 dense FLOP/s is
taken from --peak-tflops (H200 / H100 SXM: 989).

    python bench/jax_lora_gpu.py                      # 8B shape (Llama 3.1 8B dims)
    python bench/jax_lora_gpu.py --tiny --steps 2     # a CPU self-check of this script

``--quantization nf4`` trains on an NF4 base (``trainers/jax_lora/nf4.py``): random 4-bit codes
and block scales of the shapes and dtypes the loader produces (the values do not change the
step's cost), so the same 8B shape measures QLoRA's speed and memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
}
TINY = {**LLAMA_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--remat", default="none", choices=["none", "per_layer", "dots_saveable"])
    ap.add_argument("--quantization", default="none", choices=["none", "nf4"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--query-block", type=int, default=None,
                    help="attention query rows per block on an accelerator (default: the trainer's)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--out", default=None, help="append the JSON line to this file")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import trainers.jax_lora.model as model_module
    from trainers.jax_lora.config import DecoderConfig
    from trainers.jax_lora.lora import count_params, init_lora, lora_axes, lora_runtime, lora_shapes
    from trainers.jax_lora.model import PROJECTIONS, init_params, param_axes, param_shapes
    from trainers.jax_lora.sharding import make_mesh, tree_shardings
    from trainers.jax_lora.step import (
        StepConfig,
        compile_steps,
        init_state,
        make_optimizer,
        state_shardings,
    )

    if args.query_block:
        model_module.ACCELERATOR_QUERY_BLOCK = args.query_block
    raw = dict(TINY if args.tiny else LLAMA_8B)
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    cfg = DecoderConfig.from_hf_dict(raw)
    targets = tuple(args.targets.split(","))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    p_abs = param_shapes(cfg, jnp.bfloat16, args.quantization)
    p_shard = tree_shardings(p_abs, param_axes(cfg, args.quantization), mesh)

    def init(key: jax.Array) -> dict:
        params = init_params(cfg, key, jnp.bfloat16)  # unused dense kernels are dropped by jit
        if args.quantization == "nf4":
            layers = dict(params["layers"])
            for i, name in enumerate(PROJECTIONS):
                shape = p_abs["layers"][name]
                codes = jax.random.randint(jax.random.fold_in(key, 100 + i), shape["codes"].shape, 0, 256)
                # |w| <= 0.04: about the init scale of init_params' dense kernels
                layers[name] = {"codes": codes.astype(jnp.uint8),
                                "absmax": jnp.full(shape["absmax"].shape, 0.04, jnp.float32)}
            params = {**params, "layers": layers}
        return params

    t0 = time.perf_counter()
    params = jax.jit(init, out_shardings=p_shard)(jax.random.key(0))
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0

    l_abs = lora_shapes(cfg, targets, args.rank, jnp.float32)
    l_shard = tree_shardings(l_abs, lora_axes(targets), mesh)
    opt = make_optimizer(lambda s: 1e-4, weight_decay=0.0, max_grad_norm=1.0)
    shardings = state_shardings(l_shard, opt, l_abs, mesh)
    lora = jax.jit(lambda k: init_lora(cfg, targets, args.rank, k), out_shardings=l_shard)(jax.random.key(1))
    state = init_state(lora, opt, shardings, jax.random.key(2))
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(2.0 * args.rank, args.rank, 0.0), remat=args.remat,
                    compute_dtype="bfloat16", packed=False)
    train_step, _ = compile_steps(sc, opt, mesh, shardings, p_shard)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32)
    batch = {
        "input_ids": jnp.asarray(ids), "labels": jnp.asarray(ids),
        "positions": jnp.asarray(np.broadcast_to(np.arange(args.seq, dtype=np.int32), ids.shape)),
        "segment_ids": jnp.asarray(np.ones_like(ids)),
    }
    t0 = time.perf_counter()
    state, out = train_step(state, params, batch)
    first_loss = float(out["loss"])
    compile_s = time.perf_counter() - t0
    state, out = train_step(state, params, batch)  # warm
    float(out["loss"])
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, out = train_step(state, params, batch)
    last_loss = float(out["loss"])  # blocks on the last step
    elapsed = time.perf_counter() - t0

    tokens_per_s = args.steps * args.batch * args.seq / elapsed
    n_params = cfg.num_params
    mfu = 4 * n_params * tokens_per_s / (args.peak_tflops * 1e12)
    stats = jax.devices()[0].memory_stats() or {}
    result = {
        "device": jax.devices()[0].device_kind, "layers": cfg.num_layers, "base_params": n_params,
        "lora_params": count_params(l_abs), "seq": args.seq, "batch": args.batch, "remat": args.remat,
        "quantization": args.quantization,
        "query_block": model_module.QUERY_BLOCK.get(jax.default_backend(), model_module.ACCELERATOR_QUERY_BLOCK),
        "tokens_per_s": round(tokens_per_s, 1), "mfu_4N": round(mfu, 4),
        "peak_memory_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
        "param_init_s": round(init_s, 2), "compile_s": round(compile_s, 2),
        "first_loss": round(first_loss, 4), "last_loss": round(last_loss, 4),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
