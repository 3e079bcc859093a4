"""Llama, Mistral, Qwen2 and Qwen3 on the fsdp_qlora trainer, against the libraries.

One tiny random checkpoint per family (``tests.model_files``: Mistral's window of 8 is
shorter than the sequences, Qwen2 has q/k/v biases, Qwen3 q/k norms and tied
embeddings). The streamed, quantized load equals transformers' own load (plain, with
``BitsAndBytesConfig`` NF4, or hqq's ``quantize_model``); FSDP over 2 gloo processes
equals the single-process transformers + peft loop; the exported adapter reproduces
the trainer's logits in peft; and step 1 of one job reports the same loss on both
trainers through the real entry point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.model_files import FAMILIES, save_tiny_family
from trainers.errors import UserError
from trainers.fsdp_qlora.distributed import (
    DistContext,
    apply_activation_checkpointing,
    launch_local,
)
from trainers.fsdp_qlora.loading import (
    ModelOptions,
    build_meta_model,
    build_model,
    read_model_config,
)

from .fsdp_worker import NF4_LR, synthetic_batches
from .reference import (
    TARGETS,
    forward_logits,
    hf_model,
    hf_peft_model,
    peft_adapter_tensors,
    read_adapter,
    reference_train,
)

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
DECODER_LAYER = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer",
                 "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer"}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> Path:
    return save_tiny_family(tmp_path_factory.mktemp(request.param), request.param)


def _family(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


@pytest.mark.parametrize("quant", ["none", "nf4", "hqq4"])
def test_streamed_load_equals_hugging_face_load(family_dir, quant):
    """LoRA B = 0: the loaded model is the base, so its logits are the library load's."""
    model, report = build_model(ModelOptions(model_dir=family_dir, quantization=quant), CPU)
    ref = hf_model(family_dir, quant)
    ids = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
        want = ref(input_ids=ids, use_cache=False).logits
    assert want.abs().max() > 0.5  # far from uniform: the comparison has teeth
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert report.quantized_layers == (0 if quant == "none" else 2 * 7)
    biases = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert len(biases) == (2 * 3 if _family(family_dir) == "qwen2" else 0)


def test_fsdp_wraps_and_checkpoints_the_family_decoder_layer(family_dir):
    config = read_model_config(family_dir)
    model = build_meta_model(config, ModelOptions(model_dir=family_dir, quantization="nf4"))
    apply_activation_checkpointing(model, "non_reentrant")
    wrapped = [type(m._checkpoint_wrapped_module).__name__ for m in model.modules()
               if hasattr(m, "_checkpoint_wrapped_module")]
    assert wrapped == [DECODER_LAYER[_family(family_dir)]] * config.num_hidden_layers


def test_qlora_adapter_reproduces_the_trainers_logits_in_peft(family_dir, tmp_path):
    from peft import PeftModel

    from trainers.fsdp_qlora.checkpoint import export_adapter
    from trainers.fsdp_qlora.train_step import build_optimizer, train_step

    r = 4
    opts = ModelOptions(model_dir=family_dir, quantization="nf4", lora_r=r, lora_alpha=2.0 * r,
                        target_modules=TARGETS)
    model, _ = build_model(opts, CPU)
    optimizer = build_optimizer(model, learning_rate=2e-2, weight_decay=0.0)
    batches = synthetic_batches(0, 1, 2, 24)
    for step in range(3):
        train_step(model, optimizer, batches, CPU, step=step, seed=0, learning_rate=2e-2, max_grad_norm=1.0)
    adapter = export_adapter(tmp_path / "adapter", model, CPU, r=r, alpha=2.0 * r, dropout=0.0,
                             target_modules=TARGETS)
    probe = synthetic_batches(99, 1, 2, 24)[0]
    reloaded = PeftModel.from_pretrained(hf_model(family_dir, "nf4"), str(adapter))
    reloaded.train()  # bitsandbytes on CPU: see reference.hf_model (no dropout here)
    with torch.no_grad():
        ours, ref, base = forward_logits(model, probe), forward_logits(reloaded, probe), None
        with reloaded.disable_adapter():
            base = forward_logits(reloaded, probe)
    assert (ours - base).abs().max() > 1e-2  # training moved the adapter
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


# Mistral has Llama's layout (its window is not used at seq 16): slow, nothing new to shard.
@pytest.mark.parametrize("family", [pytest.param("mistral", marks=pytest.mark.slow), "qwen2", "qwen3"])
def test_two_process_qlora_equals_single_process_bnb_peft_loop(family, tmp_path):
    """FSDP2 over 2 gloo ranks shards the family's own layers (Qwen2's biases and Qwen3's
    q/k norms included) and trains exactly as the one-process library loop."""
    model_dir = save_tiny_family(tmp_path / family, family)
    out = tmp_path / "run"
    micro, micro_bs, seq, steps, r = 4, 2, 16, 2, 4
    worker = str(Path(__file__).with_name("fsdp_worker.py"))
    argv = [sys.executable, worker, "--model", str(model_dir), "--out", str(out), "--quant", "nf4",
            "--ac", "non_reentrant", "--steps", str(steps), "--lr", str(NF4_LR), "--micro", str(micro),
            "--micro-bs", str(micro_bs), "--seq", str(seq), "--r", str(r)]
    assert launch_local(argv, 2, on_cpu=True) == 0
    run = json.loads((out / "result.json").read_text())["run"]
    reference = hf_peft_model(model_dir, "nf4", r=r)
    losses = reference_train(reference, [synthetic_batches(s, micro, micro_bs, seq) for s in range(steps)],
                             lr=NF4_LR, max_grad_norm=1.0)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    got, want = read_adapter(out / "adapter"), peft_adapter_tensors(reference)
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value.float(), rtol=0, atol=1e-5, msg=key)


def test_a_target_module_the_model_lacks_is_a_user_error(tmp_path):
    model_dir = save_tiny_family(tmp_path / "q", "qwen3")
    with pytest.raises(UserError) as err:
        build_model(ModelOptions(model_dir=model_dir, target_modules=("q_proj", "qkv_proj")), CPU)
    assert err.value.code == "invalid_target_modules"
    assert "qkv_proj" in err.value.message and "down_proj" in err.value.message


def test_packed_rows_longer_than_the_sliding_window_are_refused(tmp_path):
    model_dir = save_tiny_family(tmp_path / "m", "mistral")  # window 8
    with pytest.raises(UserError) as err:
        build_model(ModelOptions(model_dir=model_dir, packing=True, max_seq_len=16), CPU)
    assert err.value.code == "sequence_exceeds_sliding_window" and "8" in err.value.message
    # Unpacked rows get transformers' own sliding-window mask; packed rows within the window are exact.
    for packing, max_seq_len in ((False, 16), (True, 8)):
        build_model(ModelOptions(model_dir=model_dir, packing=packing, max_seq_len=max_seq_len), CPU)


def test_gemma_is_an_unsupported_architecture_naming_the_supported_ones(tmp_path):
    model_dir = save_tiny_family(tmp_path / "q", "qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(UserError) as err:
        build_model(ModelOptions(model_dir=model_dir), CPU)
    assert err.value.code == "unsupported_architecture"
    assert "llama, mistral, qwen2, qwen3" in err.value.message


# Qwen2's biases are compared at the logits on each trainer; here slow (a minute a family).
@pytest.mark.parametrize("family", ["mistral", pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_step_one_loss_is_the_same_on_both_trainers(family, tiny_datasets, tmp_path):
    """The golden job (chat data, max_seq_len 64: past Mistral's window of 8) for one step
    through ``python -m trainers`` on each trainer: LoRA B starts at zero, so both report
    the base model's loss, computed by transformers in one and by our JAX decoder in the
    other. (Llama: tests/trainers/golden.)"""
    from tests.trainers.golden.job import TRAINERS, golden_spec, run_entry_point
    from trainers.exit_codes import ExitCode
    from trainers.spec import TrainerSpec

    model_dir = save_tiny_family(tmp_path / family, family)
    first = {}
    for trainer in TRAINERS:
        spec = golden_spec(trainer, model_dir, tiny_datasets, tmp_path / trainer).model_dump()
        spec["hyperparameters"]["max_steps"] = 1
        spec["data"]["validation_file"] = None
        run = run_entry_point(TrainerSpec.model_validate(spec), tmp_path / trainer)
        assert run.returncode == ExitCode.SUCCESS, f"{trainer}: {run.output[-3000:]}"
        first[trainer] = run.metrics[0]["train_loss"]
    assert first["fsdp_qlora"] == pytest.approx(first["jax_lora"], abs=1e-4)
