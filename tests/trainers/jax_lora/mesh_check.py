"""Sharded vs single-device loss, LoRA grads and two optimizer steps (run as a subprocess).

``python -m tests.trainers.jax_lora.mesh_check MODEL_DIR OUT_JSON`` with 8 fake CPU
devices; writes max abs differences per mesh, plus the sharding facts the test asserts.
Run in its own process so the XLA device count is under our control whatever other test
directories imported jax first.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests.trainers.jax_lora.batches import packed_batch, random_lora
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.loading import load_params
from trainers.jax_lora.lora import lora_axes, lora_runtime, lora_shapes
from trainers.jax_lora.model import param_axes
from trainers.jax_lora.sharding import (
    make_mesh,
    sharding_report,
    tree_shardings,
)
from trainers.jax_lora.step import (
    StepConfig,
    batch_sharding,
    compile_steps,
    init_state,
    make_loss_and_grads,
    make_optimizer,
    state_shardings,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MESHES = [(1, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)]


# The train step (sharded AdamW state, donation, compile count) is run on the reference
# and on the mesh that uses both fsdp and tensor; loss and grads on every mesh. Each
# compile costs seconds on 2 shared cores.
TRAIN_ON = {(1, 1, 1), (1, 4, 2)}


def run_on_mesh(model_dir: str, shape: tuple[int, int, int]) -> dict:
    devices = jax.devices()[: int(np.prod(shape))]
    mesh = make_mesh(*shape, devices=devices)
    cfg = DecoderConfig.from_pretrained(model_dir)
    params, _ = load_params(model_dir, cfg, mesh, jnp.float32)
    p_shard = tree_shardings(params, param_axes(cfg), mesh)
    l_abs = lora_shapes(cfg, TARGETS, 4, jnp.float32)
    l_shard = tree_shardings(l_abs, lora_axes(TARGETS), mesh)
    lora = jax.device_put(random_lora(l_abs, seed=1), l_shard)
    batch_np = packed_batch(seed=2, accum=2, rows=8, seq=32, vocab=cfg.vocab_size)
    batch = {k: jax.device_put(v, batch_sharding(mesh, v.shape)) for k, v in batch_np.items()}
    sc = StepConfig(cfg=cfg, runtime=lora_runtime(alpha=8.0, r=4, dropout=0.0))

    lg = jax.jit(make_loss_and_grads(sc, mesh), static_argnums=())
    loss, grads, n_tok = lg(lora, params, batch, None)

    result = {
        "loss": float(loss),
        "grads": jax.tree.map(lambda g: np.asarray(g).tolist(), grads),
        "n_tokens": int(n_tok),
        "param_bytes_per_device": sharding_report(params, p_shard, mesh).bytes_per_device,
    }
    if shape not in TRAIN_ON:
        return result
    opt = make_optimizer(lambda step: 1e-2, weight_decay=0.01, max_grad_norm=1.0)
    shardings = state_shardings(l_shard, opt, l_abs, mesh)
    state = init_state(lora, opt, shardings, jax.random.key(0))
    train_step, _ = compile_steps(sc, opt, mesh, shardings, p_shard)
    losses = []
    for _ in range(2):
        state, metrics = train_step(state, params, batch)
        losses.append(float(metrics["loss"]))
    mu = state["opt_state"][1][0].mu["q_proj"]["lora_a"]
    return {
        **result,
        "lora_after": jax.tree.map(lambda g: np.asarray(g).tolist(), state["lora"]),
        "step_losses": losses,
        "mu_spec": str(mu.sharding.spec),
        "mu_shard_shape": list(mu.addressable_shards[0].data.shape),
        "compiles": len(train_step.cache),
    }


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    results = {}
    ref = run_on_mesh(model_dir, MESHES[0])
    for shape in MESHES[1:]:
        got = run_on_mesh(model_dir, shape)
        diff = lambda a, b: float(max(np.max(np.abs(np.asarray(x) - np.asarray(y)))
                                      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
        row = {
            "loss_diff": abs(got["loss"] - ref["loss"]),
            "grad_diff": diff(got["grads"], ref["grads"]),
            "grad_max": float(max(np.max(np.abs(np.asarray(g))) for g in jax.tree.leaves(ref["grads"]))),
            "param_bytes_per_device": got["param_bytes_per_device"],
        }
        if "step_losses" in got:
            row.update(
                lora_after_diff=diff(got["lora_after"], ref["lora_after"]),
                step_loss_diff=max(abs(a - b) for a, b in zip(got["step_losses"], ref["step_losses"])),
                mu_spec=got["mu_spec"], mu_shard_shape=got["mu_shard_shape"], compiles=got["compiles"],
            )
        results["x".join(map(str, shape))] = row
    results["reference"] = {"loss": ref["loss"], "n_tokens": ref["n_tokens"],
                            "param_bytes_per_device": ref["param_bytes_per_device"]}
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
