"""Reading a Hugging Face checkpoint's index and shard headers, and the same errors for a
broken checkpoint on both trainers' loaders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trainers.common.hf_checkpoint import INDEX_FILE, read_checkpoint_index
from trainers.errors import UserError


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("sharded"), seed=1, max_shard_size="40KB")


def _safetensors_listing(paths) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """What the safetensors library itself reads from the files (the reference)."""
    from safetensors import safe_open

    out = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                sl = f.get_slice(name)
                out[name] = (path, tuple(sl.get_shape()), sl.get_dtype())
    return out


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_index_matches_the_safetensors_library(layout, tiny_model_dir, sharded_dir):
    root = tiny_model_dir if layout == "single" else sharded_dir
    shards = sorted(root.glob("*.safetensors"))
    assert (len(shards) > 1) == (layout == "sharded")
    found = read_checkpoint_index(root)
    want = _safetensors_listing(shards)
    assert {n: (loc.file, loc.shape, loc.dtype) for n, loc in found.items()} == want
    # the byte ranges hold the tensors: read one back through them
    from safetensors.torch import load_file

    name = "model.layers.1.self_attn.q_proj.weight"
    loc = found[name]
    raw = loc.file.read_bytes()[loc.start : loc.end]
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(loc.shape)
    assert torch.equal(tensor, load_file(str(loc.file))[name])


def _break(src: Path, dest: Path, how: str) -> Path:
    shutil.copytree(src, dest)
    index = dest / INDEX_FILE
    weight_map = json.loads(index.read_text())["weight_map"]
    shard = dest / max(weight_map.values())
    if how == "index not JSON":
        index.write_text("{not json")
    elif how == "index without weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    elif how == "missing shard":
        shard.unlink()
    elif how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "garbage shard":
        shard.write_bytes(b"\xff" * 64)
    elif how == "tensor not in its shard":
        weight_map["model.layers.0.extra.weight"] = shard.name
        index.write_text(json.dumps({"weight_map": weight_map}))
    return dest


BREAKAGES = ["index not JSON", "index without weight_map", "missing shard", "truncated shard",
             "garbage shard", "tensor not in its shard"]


def _open_jax(model_dir: Path) -> None:
    from trainers.jax_lora.loading import CheckpointReader

    CheckpointReader(model_dir)


def _open_fsdp(model_dir: Path) -> None:
    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model

    build_model(ModelOptions(model_dir=model_dir), DistContext(rank=0, world_size=1, local_rank=0,
                                                               device=torch.device("cpu")))


@pytest.mark.parametrize("how", BREAKAGES)
@pytest.mark.parametrize("trainer", ["jax_lora", "fsdp_qlora"])
def test_a_broken_checkpoint_is_corrupt_model_on_both_trainers(trainer, how, sharded_dir, tmp_path):
    broken = _break(sharded_dir, tmp_path / "model", how)
    with pytest.raises(UserError) as exc:
        (_open_jax if trainer == "jax_lora" else _open_fsdp)(broken)
    assert exc.value.code == "corrupt_model", exc.value.message


@pytest.mark.parametrize("trainer", ["jax_lora", "fsdp_qlora"])
def test_no_weights_at_all_is_model_not_found(trainer, tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(UserError) as exc:
        (_open_jax if trainer == "jax_lora" else _open_fsdp)(model)
    assert exc.value.code == "model_not_found"


def _read_config(trainer: str, model_dir: Path) -> None:
    if trainer == "jax_lora":
        from trainers.jax_lora.config import DecoderConfig

        DecoderConfig.from_pretrained(model_dir)
    else:
        from trainers.fsdp_qlora.loading import read_model_config

        read_model_config(model_dir)


@pytest.mark.parametrize(("how", "code"), [("missing", "model_not_found"), ("not JSON", "corrupt_model"),
                                           ("not an object", "corrupt_model")])
@pytest.mark.parametrize("trainer", ["jax_lora", "fsdp_qlora"])
def test_a_broken_config_json_is_the_same_error_on_both_trainers(trainer, how, code, tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = model / "config.json"
    if how == "missing":
        config.unlink()
    elif how == "not JSON":
        config.write_text("{not json")
    else:
        config.write_text("[1, 2]")
    with pytest.raises(UserError) as exc:
        _read_config(trainer, model)
    assert exc.value.code == code, exc.value.message
