"""FSDP2 over 2 gloo processes (OMP_NUM_THREADS=1) against single-process references.

One launch of ``fsdp_worker.py --suite`` (imports cost ~8-20 s per launch here) runs,
each from a freshly built model and optimizer:

- ``lora``: 2-process LoRA (fp32, reentrant activation checkpointing), 4 steps,
  sharded checkpoint at step 2. Must equal a
  plain single-process transformers + peft loop on the same global batches: losses and
  final adapter within 1e-5. Each rank does 2 micro-steps per optimizer step, so
  gradient accumulation without sync is covered.
- ``resumed``: a new model resumed from the step-2 DCP checkpoint = ``lora`` (1e-6).
- ``nf4``: 2-process QLoRA NF4 (non-reentrant checkpointing) = the same loop on Hugging Face's BitsAndBytesConfig
  model + peft (1e-5).
- ``checkpointed_later``: ``lora`` built without checkpointing, its first step taken and
  undone (``step_fit.TrainableState``), then checkpointing switched on in the sharded
  model, as the recipe's first-step step-down does; must equal the same reference (1e-5).

Each run also records what is gathered whole while a decoder layer runs: never the
embedding table or the LM head, and in the forward pass no other layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from trainers.fsdp_qlora.distributed import launch_local

from .fsdp_worker import LR, NF4_LR, synthetic_batches
from .reference import hf_peft_model, peft_adapter_tensors, read_adapter, reference_train

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))
MICRO, MICRO_BS, SEQ, R = 4, 2, 16, 4


@pytest.fixture(scope="module")
def suite(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp-suite")
    argv = [sys.executable, WORKER, "--suite", "--model", str(tiny_model_dir), "--out", str(out),
            "--micro", str(MICRO), "--micro-bs", str(MICRO_BS), "--seq", str(SEQ), "--r", str(R)]
    rc = launch_local(argv, 2, on_cpu=True)
    assert rc == 0, f"worker failed with exit code {rc}"
    return out, json.loads((out / "result.json").read_text())


def _reference(model_dir: Path, quant: str, steps: int, lr: float):
    model = hf_peft_model(model_dir, quant, r=R)
    step_batches = [synthetic_batches(s, MICRO, MICRO_BS, SEQ) for s in range(steps)]
    losses = reference_train(model, step_batches, lr=lr, max_grad_norm=1.0)
    return losses, peft_adapter_tensors(model)


def _assert_adapters_close(got: dict, want: dict, atol: float) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.float(), rtol=0, atol=atol, msg=k)


def test_two_process_lora_equals_single_process_loop(tiny_model_dir, suite):
    out, result = suite
    run = result["lora"]
    assert run["world_size"] == 2
    losses, adapter = _reference(tiny_model_dir, "none", 4, LR)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    got = read_adapter(out / "lora" / "adapter")
    _assert_adapters_close(got, adapter, atol=1e-5)
    # Training moved the adapter (B starts at zero).
    assert any(k.endswith("lora_B.weight") and got[k].abs().max() > 1e-3 for k in got)


def test_resume_from_sharded_checkpoint_equals_uninterrupted(suite):
    out, result = suite
    ckpt = out / "ckpt" / "step-2"
    assert (ckpt / "trainer_state.json").is_file()
    assert (ckpt / "dcp" / ".metadata").is_file()
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == 2  # one shard file per rank
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    full, resumed = result["lora"], result["resumed"]
    assert len(resumed["losses"]) == 2
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][2:]),
                               rtol=0, atol=1e-6)
    _assert_adapters_close(read_adapter(out / "resumed" / "adapter"), read_adapter(out / "lora" / "adapter"),
                           atol=1e-6)


def test_two_process_qlora_nf4_equals_single_process_bnb_peft_loop(tiny_model_dir, suite):
    out, result = suite
    run = result["nf4"]
    assert run["load"]["quantized_layers"] == 14
    losses, adapter = _reference(tiny_model_dir, "nf4", 3, NF4_LR)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    _assert_adapters_close(read_adapter(out / "nf4" / "adapter"), adapter, atol=1e-5)


def test_a_step_undone_then_checkpointing_switched_on_after_sharding_equals_the_loop(tiny_model_dir, suite):
    out, result = suite
    run = result["checkpointed_later"]
    assert run["checkpointed_layers"] == 2  # each decoder layer, around its FSDP unit
    losses, adapter = _reference(tiny_model_dir, "none", 4, LR)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    _assert_adapters_close(read_adapter(out / "checkpointed_later" / "adapter"), adapter, atol=1e-5)


def test_only_the_running_layer_is_held_whole(suite):
    """FSDP's point: a rank holds its shard of the model plus the layer it computes (and
    the next, prefetched). Two ways this was broken: the embedding and the LM head sat in
    the root group, gathered whole for the whole step next to every layer's activations
    (2 GiB per rank at Llama 3 8B in bf16, 4 GiB at 70B); and gradient accumulation kept
    every layer it had gathered whole after its backward, until the last micro-batch, so a
    70B model on two 24 GB cards held all of its weights on each. Both runs accumulate
    (2 micro-batches per rank and step)."""
    _, result = suite
    for name in ("lora", "nf4", "checkpointed_later"):  # reentrant, non-reentrant, switched on after sharding
        seen = result[name]["tables_whole_during_layers"]
        assert seen["embedding"] and len(seen["embedding"]) == len(seen["lm_head"]), seen
        assert not any(seen["embedding"]) and not any(seen["lm_head"]), (name, seen)
        forward = seen["forward_other_layers"]
        assert len(forward) >= 2 * 2 * 3 and max(forward) == 0, (name, forward)  # layers x micro-steps x steps
