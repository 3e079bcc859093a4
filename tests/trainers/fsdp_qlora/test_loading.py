"""Low-memory loading (single process) against Hugging Face's own loads, and bad input.

With LoRA B = 0 the loaded model IS the base, so its logits must equal those of the
base as Hugging Face loads it: plain ``from_pretrained``, ``BitsAndBytesConfig`` NF4,
or ``from_pretrained`` + hqq's ``AutoHQQHFModel.quantize_model``. The checkpoint is the
sharded-index kind (several safetensors files), so the streaming reader is exercised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trainers.errors import UserError
from trainers.fsdp_qlora.distributed import DistContext, check_parallelism
from trainers.fsdp_qlora.loading import ModelOptions, build_model

from .reference import hf_model

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def sharded_model_dir(tmp_path_factory) -> Path:
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("sharded"), seed=3, max_shard_size="40KB")


@pytest.mark.parametrize("quant", ["none", "nf4", "nf4_dq", "hqq4"])
def test_streamed_load_equals_hugging_face_load(sharded_model_dir, quant):
    assert len(list(sharded_model_dir.glob("*.safetensors"))) > 1
    opts = ModelOptions(model_dir=sharded_model_dir, quantization=quant.removesuffix("_dq"),
                        double_quant=quant.endswith("_dq"))
    model, report = build_model(opts, CPU)
    ref = hf_model(sharded_model_dir, quant)
    ids = torch.randint(0, 262, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
        want = ref(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert report.quantized_layers == (0 if quant == "none" else 2 * 7)
    assert report.peak_rss_bytes > 0
    assert model.training
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def _copy_config_only(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture_is_refused_before_reading_weights(tiny_model_dir, tmp_path):
    # No weights at all in the directory: the error must come from config.json alone.
    d = _copy_config_only(tiny_model_dir, tmp_path / "m", model_type="gemma")
    with pytest.raises(UserError) as exc:
        build_model(ModelOptions(model_dir=d, quantization="nf4"), CPU)
    assert exc.value.code == "unsupported_architecture"
    assert "gemma" in exc.value.message


def test_checkpoint_not_matching_config_is_corrupt_model(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    _copy_config_only(tiny_model_dir, d, intermediate_size=96)
    with pytest.raises(UserError) as exc:
        build_model(ModelOptions(model_dir=d), CPU)
    assert exc.value.code == "corrupt_model"
    assert "mlp" in exc.value.message


def test_missing_weights_is_model_not_found(tiny_model_dir, tmp_path):
    d = _copy_config_only(tiny_model_dir, tmp_path / "m")
    with pytest.raises(UserError) as exc:
        build_model(ModelOptions(model_dir=d), CPU)
    assert exc.value.code == "model_not_found"


def test_cpu_offload_on_cpu_is_refused_before_loading(tmp_path):
    # A directory with nothing in it: the offload check comes first.
    with pytest.raises(UserError) as exc:
        build_model(ModelOptions(model_dir=tmp_path, quantization="nf4", cpu_offload=True), CPU)
    assert exc.value.code == "offload_requires_accelerator"
    with pytest.raises(UserError) as exc:
        check_parallelism(world_size=2, batch_size=8, micro_batch_size=2, cpu_offload=True, has_accelerator=False)
    assert exc.value.code == "offload_requires_accelerator"


@pytest.mark.parametrize("world,batch,micro,ok", [(2, 8, 2, True), (2, 6, 2, False), (3, 8, 1, False), (1, 6, 2, True)])
def test_world_size_must_divide_the_batch(world, batch, micro, ok):
    if ok:
        assert check_parallelism(world_size=world, batch_size=batch, micro_batch_size=micro,
                                 cpu_offload=False, has_accelerator=False) == batch // (world * micro)
        return
    with pytest.raises(UserError) as exc:
        check_parallelism(world_size=world, batch_size=batch, micro_batch_size=micro,
                          cpu_offload=False, has_accelerator=False)
    assert exc.value.code == "invalid_parallelism"
    assert f"{micro} x {world}" in exc.value.message


def test_dora_is_refused_with_a_stable_code(tiny_model_dir):
    with pytest.raises(UserError) as exc:
        build_model(ModelOptions(model_dir=tiny_model_dir, use_dora=True), CPU)
    assert exc.value.code == "unsupported_option"
