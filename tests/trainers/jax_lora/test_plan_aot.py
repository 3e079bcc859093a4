"""bench/plan_aot.py plans exactly the step the trainer runs.

The bench compiles the trainer's train step from abstract inputs; these tests pin those
inputs to what ``recipe.run`` really hands its jitted step on a tiny checkpoint (every
leaf's shape, dtype and sharding, and the step's static config), and check the two
numbers the bench reads from XLA against XLA itself: per-device argument bytes against
the shards of the inputs, and the loop-aware matmul FLOPs against ``cost_analysis()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import plan_aot
from tests.trainers.jax_lora.specs import make_spec
from trainers.jax_lora import step as step_module
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.recipe import run


def _mesh() -> dict:
    return {"data": 2, "fsdp": 2, "tensor": 2} if jax.device_count() == 8 else {"data": 1, "fsdp": 1, "tensor": 1}


def _describe(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype), x.sharding), tree)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_abstract_inputs_are_what_the_recipe_passes_its_step(
    recipe_model, tiny_datasets, tmp_path, monkeypatch, method
):
    spec = make_spec(
        recipe_model, tiny_datasets, tmp_path,
        data={"validation_file": None},
        hyperparameters={"max_steps": 1, "batch_size": 2 * _mesh()["data"] * _mesh()["fsdp"], "micro_batch_size": 1},
        adapter={"method": method, "quantization": "nf4" if method == "qlora" else "none", "r": 4, "alpha": 8.0,
                 "target_modules": ["q_proj", "v_proj", "down_proj"]},
        parallelism={"mesh": _mesh(), "remat": "per_layer"},
        precision={"base_dtype": "bfloat16", "compute_dtype": "bfloat16", "adapter_dtype": "float32"},
        eval={"every_n_steps": None},
    )
    seen: dict = {}
    real_compile_steps = step_module.compile_steps

    def recording_compile_steps(sc, optimizer, mesh, shardings, param_shardings):
        train_step, eval_step = real_compile_steps(sc, optimizer, mesh, shardings, param_shardings)

        def record(state, params, batch):
            seen.setdefault("inputs", _describe((state, params, batch)))
            seen.setdefault("step_config", sc)

        def recorded(state, params, batch):
            record(state, params, batch)
            return train_step(state, params, batch)

        def compile_recorded(state, params, batch):  # the recipe compiles its step before step 1
            record(state, params, batch)
            return train_step.compile(state, params, batch)

        recorded.compile = compile_recorded
        return recorded, eval_step

    monkeypatch.setattr(step_module, "compile_steps", recording_compile_steps)
    run(spec)

    planned = plan_aot.abstract_step_inputs(spec, DecoderConfig.from_pretrained(recipe_model))
    assert planned.step_config == seen["step_config"]
    got = _describe((planned.state, planned.params, planned.batch))
    assert jax.tree.structure(got) == jax.tree.structure(seen["inputs"])
    for path_and_leaf, real in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(seen["inputs"]),
                                   strict=True):
        path, leaf = path_and_leaf
        assert leaf == real, jax.tree_util.keystr(path)
    # the batch really is (accum, rows, seq) with accumulation, and the mesh really splits
    assert planned.batch["input_ids"].shape == (2, spec.hyperparameters.batch_size // 2, spec.data.max_seq_len)
    if jax.device_count() == 8:
        kernel = planned.params["layers"]["q_proj"]
        kernel = kernel["codes"] if method == "qlora" else kernel
        assert kernel.sharding.spec != jax.sharding.PartitionSpec()


def test_xla_argument_bytes_are_the_per_device_shards(recipe_model):
    """``memory_analysis`` is per device: its arguments are one device's shards."""
    n = 4 if jax.device_count() >= 4 else 1
    job = plan_aot.PlanJob(str(recipe_model), n, "qlora", seq=32, batch=1, tensor=2 if n == 4 else 1)
    row = plan_aot.plan_row(job)
    spec = plan_aot.trainer_spec(job, "amd-mi300x")
    inputs = plan_aot.abstract_step_inputs(spec, DecoderConfig.from_pretrained(recipe_model), jax.devices()[:n])

    def shard_bytes(leaf) -> int:
        return int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize

    total = sum(shard_bytes(leaf) for leaf in jax.tree.leaves((inputs.state, inputs.params, inputs.batch)))
    # unpacked rows never read segment_ids, and jit drops unused arguments
    assert not spec.data.packing
    assert row["per_device"]["arguments"] == total - shard_bytes(inputs.batch["segment_ids"])
    assert row["per_device"]["aliased"] > 0  # the donated train state is updated in place
    assert row["per_device_bytes"] == (row["per_device"]["arguments"] + row["per_device"]["outputs"]
                                       - row["per_device"]["aliased"] + row["per_device"]["temps"]
                                       + row["per_device"]["generated_code"])
    assert row["fits"] == (row["per_device_bytes"] <= row["budget_bytes"])
    assert row["estimator_bytes"] > 0 and row["flops_per_step"] > 0


def test_matmul_flops_count_every_loop_iteration():
    def layers(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    single = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(x, jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile()
    xla_single = single.cost_analysis()["flops"]
    assert plan_aot.hlo_matmul_flops(single.as_text()) == 2 * 32 * 64 * 64
    assert xla_single >= 2 * 32 * 64 * 64  # XLA's own count agrees (plus the tanh)
    looped = jax.jit(layers).lower(x, jax.ShapeDtypeStruct((6, 64, 64), jnp.float32)).compile()
    assert plan_aot.hlo_matmul_flops(looped.as_text()) == 6 * 2 * 32 * 64 * 64
    assert looped.cost_analysis()["flops"] < 2 * 2 * 32 * 64 * 64  # what the bench works around
