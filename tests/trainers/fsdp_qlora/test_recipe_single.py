"""The (Q)LoRA recipe in one process, in process: exported adapter vs peft, resume vs
uninterrupted, micro-batching and packing."""

from __future__ import annotations

import json

import pytest
import torch

from trainers.common.checkpointing import list_checkpoints, load_trainer_state
from trainers.common.reporter import Reporter
from trainers.common.signals import StopFlag
from trainers.errors import Preempted
from trainers.fsdp_qlora.recipe import run


class StopAfterSteps(StopFlag):
    """Behaves as if SIGTERM arrived after ``n`` completed steps (the loop polls once per step)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.polls = 0
        self.n = n
        self.signal_name = "SIGTERM"

    @property
    def requested(self) -> bool:  # type: ignore[override]
        self.polls += 1
        return self.polls > self.n


def _run(spec, stop=None):
    reporter = Reporter(url=None, local_path=f"{spec.checkpoint.dir}/reports.jsonl", flush_interval_s=0.05)
    try:
        return run(spec, reporter=reporter, stop=stop or StopFlag())
    finally:
        reporter.close()


FIXED_BATCH = torch.tensor([[256, 259, 117, 115, 101, 114, 260, 10, 10, 97, 102, 116, 101, 114, 32, 114, 101, 100, 63,
                             261, 259, 97, 115, 115, 105, 115, 116, 97, 110, 116, 260, 10, 10]])


def test_exported_adapter_loads_in_peft_and_reproduces_trainer_logits(make_spec, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = make_spec(adapter={"target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]})
    result = _run(spec)
    out = result.output_dir
    assert result.final_step == 4
    assert (out / "adapter" / "adapter_config.json").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    names = {f["name"] for f in manifest["files"]}
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json",
            "training_config.json", "metrics.jsonl"} <= names
    config = json.loads((out / "training_config.json").read_text())
    assert config["report"]["token"] is None
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[1]["valid_loss"] is not None and 0 <= metrics[1]["token_accuracy"] <= 1

    result.model.eval()
    with torch.no_grad():
        trainer_logits = result.model(FIXED_BATCH).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        base_logits = base(FIXED_BATCH).logits
        loaded = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        peft_logits = loaded(FIXED_BATCH).logits
    assert (peft_logits - trainer_logits).abs().max() <= 1e-4
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter did change the model


def test_resumed_run_equals_uninterrupted_run_step_for_step(make_spec):
    # dropout > 0: the torch RNG state must be restored too, not only data order + weights
    common = {"adapter": {"dropout": 0.1}, "hyperparameters": {"max_steps": 6},
              "checkpoint": {"every_n_steps": 100, "keep_last": 2}}
    full = _run(make_spec("full", **common))

    interrupted = make_spec("resumed", **common)
    with pytest.raises(Preempted):
        _run(interrupted, stop=StopAfterSteps(3))
    (step, path), = list_checkpoints(interrupted.checkpoint.dir)
    assert step == 3 and load_trainer_state(path).cursor.position == 12  # 3 steps x 4 rows
    resumed_spec = make_spec("resumed", **{**common, "checkpoint": {**common["checkpoint"], "resume_from": "latest"}})
    resumed = _run(resumed_spec)

    assert sorted(resumed.losses) == [4, 5, 6]
    for s in (4, 5, 6):
        assert abs(resumed.losses[s] - full.losses[s]) <= 1e-6, (s, resumed.losses[s], full.losses[s])
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a, b), name
    # metrics.jsonl of the resumed run has each step once
    rows = [json.loads(x) for x in (resumed.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_micro_batching_does_not_change_the_update(make_spec):
    a = _run(make_spec("a", hyperparameters={"micro_batch_size": 1, "max_steps": 3}, eval={"every_n_steps": None}))
    b = _run(make_spec("b", hyperparameters={"micro_batch_size": 4, "max_steps": 3}, eval={"every_n_steps": None}))
    for s in (1, 2, 3):
        assert a.losses[s] == pytest.approx(b.losses[s], abs=1e-5)


def test_packed_training_runs_and_learns(make_spec):
    spec = make_spec("packed", data={"packing": True, "max_seq_len": 128},
                     hyperparameters={"batch_size": 2, "micro_batch_size": 1, "max_steps": 4},
                     eval={"every_n_steps": None})
    result = _run(spec)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert losses[-1] < losses[0]


def test_packed_rows_give_each_example_its_unpacked_logits(tiny_model_dir, tiny_tokenizer, tiny_datasets):
    """The recipe's model inputs for a packed row (4-D block-diagonal mask + reset
    positions) reproduce the logits of every example run on its own."""
    from transformers import AutoModelForCausalLM

    from trainers.common.data import TrainingData, tokenize_dataset
    from trainers.common.formats import read_examples
    from trainers.fsdp_qlora.train_step import model_inputs

    ds = tokenize_dataset(tiny_tokenizer, list(read_examples(tiny_datasets["chat_train"]))[:6], 64)
    data = TrainingData(ds, max_seq_len=128, micro_batch_size=2, seed=0, packing=True, pad_id=258)
    rows = data.rows(0)[:2]
    assert any(len(r) > 1 for r in rows)
    batch = data.collate(rows)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.no_grad():
        packed = model(**model_inputs(batch, torch.device("cpu"))).logits
        for r, row in enumerate(rows):
            t = 0
            for i in row:
                ids = torch.tensor([ds.examples[i].input_ids])
                alone = model(ids).logits[0]
                assert (packed[r, t : t + ids.shape[1]] - alone).abs().max() <= 1e-5
                t += ids.shape[1]
