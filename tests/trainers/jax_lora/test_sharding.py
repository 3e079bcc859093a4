"""Sharded = single device: loss, LoRA grads and optimizer steps on three meshes.

The comparison runs in a subprocess (``mesh_check.py``) that owns its 8 fake CPU devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers.errors import UserError
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.model import param_axes, param_shapes
from trainers.jax_lora.sharding import (
    PARAM_RULES,
    check_replication,
    logical_to_spec,
    make_mesh,
    sharding_report,
    tree_shardings,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mesh_results(tiny_untied, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mesh") / "mesh.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trainers.jax_lora.mesh_check", str(tiny_untied), str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ["1x8x1", "2x2x2", "1x4x2"])
def test_loss_and_lora_grads_match_single_device(mesh_results, mesh):
    got = mesh_results[mesh]
    assert mesh_results["reference"]["n_tokens"] > 50
    assert got["loss_diff"] <= 1e-5
    assert got["grad_max"] > 1e-3  # grads are not trivially zero
    assert got["grad_diff"] <= 1e-5
    fsdp, tensor = (int(x) for x in mesh.split("x")[1:])
    ref = mesh_results["reference"]["param_bytes_per_device"]
    assert got["param_bytes_per_device"] <= ref / (fsdp * tensor) * 1.05


def test_train_step_on_mesh_matches_and_keeps_optimizer_state_sharded(mesh_results):
    got = mesh_results["1x4x2"]
    assert got["step_loss_diff"] <= 1e-5  # the second step's loss, after a sharded AdamW update
    assert got["lora_after_diff"] <= 1e-5
    assert got["mu_spec"] == "P(None, 'fsdp', None)"  # moments sharded like lora_a (layers, embed, r)
    assert got["mu_shard_shape"] == [2, 64 // 4, 4]
    assert got["compiles"] == 1  # state donated and re-fed with the same shardings: no recompile


def test_replication_check_reports_bytes_per_device():
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py (jax was initialized earlier)")
    raw = {
        "vocab_size": 1001, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4,
    }
    cfg = DecoderConfig.from_hf_dict(raw)  # vocab 1001 divides nothing: embeddings replicate
    mesh = make_mesh(1, 4, 2)
    shapes = param_shapes(cfg, jnp.bfloat16)
    report = sharding_report(shapes, tree_shardings(shapes, param_axes(cfg), mesh), mesh)
    assert report.bytes_per_device > report.ideal_bytes_per_device
    with pytest.raises(UserError) as err:
        check_replication(report)
    assert err.value.code == "invalid_parallelism"
    assert f"{report.bytes_per_device:,} bytes per device" in err.value.message
    even = DecoderConfig.from_hf_dict({**raw, "vocab_size": 1024})
    shapes = param_shapes(even, jnp.bfloat16)
    ok = sharding_report(shapes, tree_shardings(shapes, param_axes(even), mesh), mesh)
    check_replication(ok)
    # only the RMSNorm vectors (embed over fsdp, nothing on tensor) exceed the ideal split
    assert ok.bytes_per_device <= ok.ideal_bytes_per_device * 1.01 and ok.replicated_bytes == 0


def test_rules_table_maps_logical_axes():
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py (jax was initialized earlier)")
    mesh = make_mesh(2, 2, 2)
    spec = logical_to_spec(("layers", "embed", "heads", "head_dim"), mesh, PARAM_RULES, (2, 64, 4, 16))
    assert tuple(spec) == (None, "fsdp", "tensor", None)
    spec = logical_to_spec(("vocab", "embed"), mesh, PARAM_RULES, (1001, 64))
    assert tuple(spec) == (None, "fsdp")  # vocab not divisible: replicated, not an error


def test_loaded_shards_hold_the_right_slices(tiny_untied):
    """Each device's shard of a sharded load equals the slice of a single-device load."""
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py (jax was initialized earlier)")
    from trainers.jax_lora.loading import load_params

    cfg = DecoderConfig.from_pretrained(tiny_untied)
    full, _ = load_params(tiny_untied, cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), jnp.float32)
    sharded, stats = load_params(tiny_untied, cfg, make_mesh(1, 4, 2), jnp.float32)
    assert stats["host_peak_rss_bytes"] > 0
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(sharded), strict=True):
        for shard in b.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(a)[shard.index])
    q = sharded["layers"]["q_proj"]
    assert q.addressable_shards[0].data.shape == (2, 64 // 4, 4 // 2, 16)
