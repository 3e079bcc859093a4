"""Fixtures for the JAX trainer tests: tiny random HF Llama checkpoints.

8 fake CPU devices are requested here, before anything imports jax, so that meshes such
as (2, 2, 2) can be built. If jax was already initialized by another test directory in
the same pytest process, the multi-device tests run their checks in a subprocess
(see ``multidevice.py``), so they never silently degrade to one device.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.trainers.jax_lora.hf_tiny import TinySpec, save_tiny_llama


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_untied"), TinySpec(tied=False, rope="llama3"))


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_tied"), TinySpec(tied=True, rope="default"))


@pytest.fixture(scope="session")
def recipe_model(tmp_path_factory: pytest.TempPathFactory):
    """The shared tiny Llama with a vocab of 264 (divisible by every test mesh axis)."""
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("recipe_model"), vocab_size=264, seed=0)
