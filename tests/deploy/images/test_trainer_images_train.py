"""Each trainer image trains the golden job to a PEFT adapter, through the trainers'
contract with the local executor: the spec in a file, ``python -m trainers --spec PATH``
(the image's entrypoint), the executor's environment for the trainer family, exit code 0.

As a Kubernetes Job runs it: the image's user on a read-only root, writing only to the
scratch volume (which holds the job's model, data and outputs here) and its home. The
losses are the golden values the test venv produces (tests/trainers/golden/), so the image
trains exactly as the tested code does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import PurePosixPath

import pytest

from tests.deploy.images.container import Mount
from tests.trainers.golden.job import golden_spec
from tests.trainers.golden.test_golden_losses import GOLDEN, TOLERANCE
from tests.trainers.tiny_datasets import write_tiny_datasets
from trainers.common.tiny_model import build_tiny_llama
from trainers.exit_codes import ExitCode
from worker.executors.local.process import trainer_env
from worker.executors.manifests import HOME_MOUNT, SCRATCH_MOUNT

IMAGE_OF = {"fsdp_qlora": "trainer-torch-cuda", "jax_lora": "trainer-jax-rocm"}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The scratch volume's contents: the tiny model and data files the golden job reads."""
    root = tmp_path_factory.mktemp("scratch")
    build_tiny_llama(root / "model", seed=0)
    (root / "data").mkdir()
    write_tiny_datasets(root / "data")
    return root


@pytest.mark.parametrize("trainer", list(IMAGE_OF))
def test_the_trainer_image_trains_the_golden_job_to_an_adapter(trainer, images, scratch, tmp_path):
    image = images[IMAGE_OF[trainer]]
    volume = tmp_path / "scratch"
    shutil.copytree(scratch, volume)
    inside = PurePosixPath(SCRATCH_MOUNT)  # where the pod sees the volume
    datasets = {p.stem: inside / p.relative_to(volume) for p in (volume / "data").glob("*.jsonl")}
    spec = golden_spec(trainer, inside / "model", datasets, inside / "run")
    (volume / "run").mkdir()
    spec.dump(volume / "run" / "spec.json")
    for path in (volume, *volume.rglob("*")):  # the pod's, as if it had staged them itself
        os.chown(path, *image.user)

    # the executor's environment for the family (on top of the image's), one thread
    env = {**trainer_env(trainer, {}), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [*image.config["Entrypoint"], "--spec", str(inside / "run" / "spec.json")]
    result = image.run(command, [Mount(SCRATCH_MOUNT, volume), Mount(HOME_MOUNT)], env, timeout=600)
    assert result.returncode == ExitCode.SUCCESS, (result.stdout + result.stderr)[-4000:]

    output = volume / "run" / "output"
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["train_loss"] for m in metrics] == pytest.approx(GOLDEN[trainer]["train_loss"], abs=TOLERANCE)
    assert metrics[-1]["valid_loss"] == pytest.approx(GOLDEN[trainer]["valid_loss"], abs=TOLERANCE)
    (adapter_config,) = output.rglob("adapter_config.json")
    assert (adapter_config.parent / "adapter_model.safetensors").is_file()
    config = json.loads(adapter_config.read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4, config
