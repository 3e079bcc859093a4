"""The torch trainer confirms the scheduler's step with its first step (``trainers/fsdp_qlora/step_fit.py``).

The first step runs with the planned micro batch and activation checkpointing and its
peak is measured; a peak over the device's memory, or an out-of-memory error, puts the
adapter and AdamW state back and takes the step again with the next choice in the speed
order. How a step is computed changes, never what it computes: step 1's loss (and the
next step's) equals a run with micro batches of 1 and checkpointing.

On CPU the peak is the process's resident set, so the measured case runs the real entry
point, in fresh processes, on a model whose step memory is dominated by its logits (a
vocabulary of 8192 rows: 16 MiB of fp32 logits per 512-token row, and as much again for
their gradient), which makes the micro batch's share of the peak far larger than what
varies between processes. A GPU's out-of-memory error cannot happen here: that case
runs in this process with the real step behind a stand-in for a device too small for
some choices.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.trainers.golden.job import run_entry_point
from trainers.common.reporter import Reporter
from trainers.common.step_fit import USABLE, fallback_steps
from trainers.errors import OutOfMemory
from trainers.exit_codes import ExitCode
from trainers.fsdp_qlora import recipe
from trainers.fsdp_qlora.step_fit import (
    CHECKPOINTING_ORDER,
    MeasuredStep,
    PeakMemory,
    device_limit_bytes,
)
from trainers.fsdp_qlora.train_step import train_step
from trainers.spec import TrainerSpec

MIB = 2**20


@pytest.fixture(scope="module")
def logits_heavy_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, training file): the tiny Llama with 8192 vocabulary rows, and 8 rows
    of about 512 tokens, all trained (a prompt of a few bytes, a long completion)."""
    from trainers.common.tiny_model import build_tiny_llama

    root = tmp_path_factory.mktemp("logits-heavy")
    model = build_tiny_llama(root / "model", vocab_size=8192, seed=0)
    text = "abcdefghij klmnopqrst " * 30
    rows = [{"prompt": f"{i}", "completion": text[i:]} for i in range(8)]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return model, data


def _entry_spec(job: tuple[Path, Path], root: Path, *, micro: int, checkpointing: str,
                device_bytes: int) -> TrainerSpec:
    model, data = job
    return TrainerSpec.model_validate({
        "job_id": "ftjob-stepfit", "trainer": "fsdp_qlora", "model": {"path": str(model)},
        "data": {"train_file": str(data), "format": "prompt_completion", "max_seq_len": 512, "shuffle": False},
        "hyperparameters": {"n_epochs": 1, "batch_size": 8, "micro_batch_size": micro, "learning_rate": 1e-3,
                            "max_steps": 1},
        "adapter": {"r": 4, "alpha": 8.0},
        "parallelism": {"activation_checkpointing": checkpointing, "planned_memory_bytes": 123_456_789,
                        "device_memory_bytes": device_bytes},
        "output_dir": str(root / "output"),
        "checkpoint": {"dir": str(root / "checkpoints"), "every_n_steps": 100, "keep_last": 1},
        "termination_log": str(root / "termination-log"),
        "seed": 0,
    })


def _loss_and_step_event(run) -> tuple[float, dict]:
    assert run.returncode == ExitCode.SUCCESS, run.output[-3000:]
    (event,) = [r for r in run.reports if r.get("type") == "event" and r["message"].startswith("step ")]
    return run.metrics[0]["train_loss"], event


def test_a_first_step_over_the_device_steps_down_with_the_same_loss(logits_heavy_job, tmp_path):
    # The reference: micro batches of 1 with checkpointing, the least memory of any choice.
    single_run = run_entry_point(_entry_spec(logits_heavy_job, tmp_path / "micro1", micro=1,
                                             checkpointing="non_reentrant", device_bytes=2**40), tmp_path / "micro1")
    single, confirmed = _loss_and_step_event(single_run)
    assert confirmed["message"].startswith("step confirmed: micro-batch 1, non_reentrant checkpointing: "
                                           "the first step peaked at")
    floor = confirmed["data"]["peak_bytes"]
    # A CPU step with room for twice its plan keeps glibc's heap (trainers.common.memory).
    started = next(r for r in single_run.reports if r.get("message") == "trainer started")["data"]
    assert started["heap"] == "fast" and started["fixed_mmap_threshold"] is True
    assert 0 < floor < confirmed["data"]["limit_bytes"]

    # A device 64 MiB above that floor: the whole batch at once (128 MiB more logits and
    # their gradient) is over it; a smaller micro batch without checkpointing, or the
    # floor's own choice, fits.
    limit = floor + 64 * MIB
    stepped, event = _loss_and_step_event(run_entry_point(
        _entry_spec(logits_heavy_job, tmp_path / "small", micro=8, checkpointing="none",
                    device_bytes=int(limit / USABLE) + 1), tmp_path / "small"))
    assert event["message"].startswith("step stepped down: micro-batch 8, no checkpointing: the first step peaked")
    assert event["level"] == "warning"
    first, *_, chosen = event["data"]["tried"]
    assert first["peak_bytes"] > first["limit_bytes"] == limit >= chosen["peak_bytes"]
    assert event["data"]["step"]["micro_batch"] == chosen["micro_batch"] < 8
    assert stepped == pytest.approx(single, abs=1e-5)


def _run(spec):
    reporter = Reporter(url=None, local_path=f"{spec.checkpoint.dir}/reports.jsonl", flush_interval_s=0.05)
    try:
        return recipe.run(spec, reporter=reporter)
    finally:
        reporter.close()


def _reports(spec) -> list[dict]:
    return [json.loads(line) for line in (Path(spec.checkpoint.dir) / "reports.jsonl").read_text().splitlines()]


def _device_that_fits(max_rows: int | None):
    """The real step on a device that runs out of memory unless every layer is
    checkpointed and a micro batch has at most ``max_rows`` rows (None: never fits). It
    fails as late as a step can, after the update: the state must be put back."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    def step(model, optimizer, micro_batches, ctx, **kwargs):
        stats = train_step(model, optimizer, micro_batches, ctx, **kwargs)
        checkpointed = any(isinstance(m, CheckpointWrapper) for m in model.modules())
        if max_rows is None or not checkpointed or len(micro_batches[0].input_ids) > max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return stats

    return step


def test_out_of_memory_in_the_first_step_steps_down_to_checkpointing_with_the_same_update(make_spec, monkeypatch):
    common = {"hyperparameters": {"max_steps": 2}, "eval": {"every_n_steps": None}}
    reference = _run(make_spec("micro1", parallelism={"activation_checkpointing": "non_reentrant"},
                               **{**common, "hyperparameters": {"max_steps": 2, "micro_batch_size": 1}}))

    monkeypatch.setattr(recipe, "train_step", _device_that_fits(max_rows=2))
    spec = make_spec("small", **{**common, "hyperparameters": {"max_steps": 2, "micro_batch_size": 4}})
    result = _run(spec)
    (event,) = [r for r in _reports(spec) if r.get("type") == "event" and r["message"].startswith("step ")]
    tried = event["data"]["tried"]
    running = MeasuredStep(2, "non_reentrant", tried[-1]["peak_bytes"], None)
    assert event["message"] == f"step stepped down: micro-batch 4, no checkpointing: out of memory; running " \
                               f"{running.describe()}"
    assert [(t["micro_batch"], t["activation_checkpointing"], t["peak_bytes"] is None) for t in tried] == [
        (4, "none", True), (2, "none", True), (1, "none", True), (4, "non_reentrant", True),
        (2, "non_reentrant", False)]
    config = json.loads((result.output_dir / "training_config.json").read_text())
    assert (config["hyperparameters"]["micro_batch_size"], config["parallelism"]["activation_checkpointing"]) \
        == (2, "non_reentrant")
    # Step 1 taken again from the state before it, and step 2 from the data it left.
    for s in (1, 2):
        assert result.losses[s] == pytest.approx(reference.losses[s], abs=1e-5)
    for (name, a), (_, b) in zip(reference.model.named_parameters(), result.model.named_parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)


def test_a_device_too_small_for_every_step_fails_before_any_step_is_reported(make_spec, monkeypatch):
    monkeypatch.setattr(recipe, "train_step", _device_that_fits(max_rows=None))
    spec = make_spec("none-fits", hyperparameters={"batch_size": 2, "micro_batch_size": 2})
    with pytest.raises(OutOfMemory, match=r"^no step fits one device: micro-batch 2, no checkpointing: out of "
                                          r"memory; micro-batch 1, no checkpointing: out of memory; micro-batch 2, "
                                          r"non_reentrant checkpointing: out of memory; micro-batch 1, "):
        _run(spec)
    assert not [r for r in _reports(spec) if r.get("type") == "metric"]


@pytest.mark.parametrize("rows,micro,checkpointing,expected", [
    (4, 4, "none", [(2, "none"), (1, "none"), (4, "non_reentrant"), (2, "non_reentrant"), (1, "non_reentrant")]),
    (6, 3, "none", [(2, "none"), (1, "none"), (6, "non_reentrant"), (3, "non_reentrant"), (2, "non_reentrant"),
                    (1, "non_reentrant")]),
    (4, 2, "non_reentrant", [(1, "non_reentrant")]),
    (4, 4, "reentrant", [(2, "reentrant"), (1, "reentrant")]),  # already the most recomputation
    (1, 1, "non_reentrant", []),
])
def test_fallbacks_follow_the_speed_order(rows, micro, checkpointing, expected):
    assert fallback_steps(rows, micro, checkpointing, CHECKPOINTING_ORDER) == expected


@pytest.mark.parametrize("peak,limit,fits,words", [
    (600 * MIB, 900 * MIB, True, "micro-batch 4, no checkpointing: the first step peaked at 0.586 GiB of 0.879 GiB"),
    (900 * MIB + 1, 900 * MIB, False, "the first step peaked at 0.879 GiB of 0.879 GiB"),
    (600 * MIB, None, True, "the first step peaked at 0.586 GiB"),
    (None, None, False, "micro-batch 4, no checkpointing: out of memory"),
])
def test_a_measured_step_fits_under_its_limit(peak, limit, fits, words):
    step = MeasuredStep(4, "none", peak, limit)
    assert step.fits is fits
    assert step.describe().endswith(words)


def test_the_cpu_limit_is_the_pools_usable_share(make_spec):
    cpu = torch.device("cpu")
    assert device_limit_bytes(make_spec(parallelism={"device_memory_bytes": 1000}), cpu) == 900
    assert device_limit_bytes(make_spec(), cpu) is None


def test_the_cpu_peak_is_reset_to_what_is_resident():
    peak = PeakMemory(torch.device("cpu"))
    if not peak.reset():
        # Linux resets a process's peak RSS through /proc/self/clear_refs since 4.0; where a
        # kernel cannot, the first step is judged by the process's peak so far (a step-down
        # may come sooner than needed there). CI's kernel can, so there it must work.
        assert os.environ.get("CI") != "true", "/proc/self/clear_refs cannot reset the peak RSS on CI"
        pytest.skip("this kernel cannot reset the process's peak resident set")
    big = torch.ones(64 * MIB // 4)  # written, so resident
    with_tensor = peak.read()
    del big
    assert peak.reset()
    # The kernel's counters move in steps of a few pages per thread: compare in MiBs.
    assert peak.read() < with_tensor - 32 * MIB  # the freed tensor is no longer in the new peak
    assert peak.since_start() > peak.read() + 32 * MIB  # what the metric rows report keeps it
