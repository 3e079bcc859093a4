"""Node pools from YAML: the shipped examples load, bad files fail with a stable code."""

from pathlib import Path

import pytest

from scheduling.pools import GIB, PoolConfigError, load_pools, parse_pools

ROOT = Path(__file__).resolve().parents[2]


def test_example_pools_load():
    pools = {p.name: p for p in load_pools(ROOT / "deploy/pools/mixed.yaml")}
    assert pools["mi300x"].gpu_memory_bytes == 192 * GIB
    assert pools["mi300x"].trainers == ("jax_lora",)
    assert pools["rtx4090"].resource_name == "nvidia.com/gpu"
    assert pools["rtx4090"].quota_for("org-anyone") == 32
    assert pools["mi300x"].quota_for("org-anyone") is None
    assert [p.name for p in load_pools(ROOT / "deploy/pools/local.yaml")] == ["local"]


def test_default_is_one_local_pool():
    (pool,) = load_pools(None, local_slots=3)
    assert (pool.name, pool.accelerator, pool.gpus_per_node) == ("local", "cpu", 3)
    assert set(pool.trainers) == {"fsdp_qlora", "jax_lora"}


@pytest.mark.parametrize("text, fragment", [
    (("pools: [{name: a, accelerator: nvidia-rtx-4090, gpu_memory_gib: 24, gpus_per_node: 2, "
      "trainer: fsdp_qlora, peak_tflops: 1}]"),
     "needs resource_name"),
    ("pools: []", "at least one pool"),
    ("pools: [{name: A_B, accelerator: cpu, gpu_memory_gib: 1, gpus_per_node: 1, trainer: jax_lora, peak_tflops: 1}]",
     "pools.0.name"),
    ("pools: [{name: a, accelerator: cpu, gpu_memory_gib: 1, gpus_per_node: 1, trainer: pytorch, peak_tflops: 1}]",
     "pools.0.trainers"),
    (("pools: [{name: a, accelerator: cpu, gpu_memory_gib: 1, gpus_per_node: 1, trainer: jax_lora, peak_tflops: 1},"
      " {name: a, accelerator: cpu, gpu_memory_gib: 1, gpus_per_node: 1, trainer: jax_lora, peak_tflops: 1}]"),
     "duplicate pool names: a"),
    ("pools: {", "not valid YAML"),
])
def test_bad_pool_files_name_the_problem(text, fragment):
    with pytest.raises(PoolConfigError) as err:
        parse_pools(text, source="pools.yaml")
    assert fragment in str(err.value)
    assert str(err.value).startswith("pools.yaml")
    assert err.value.code == "invalid_node_pools"
