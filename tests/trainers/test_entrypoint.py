"""``python -m trainers --spec``: the real entry point in a subprocess, its exit codes and
termination messages, plus the exception -> exit code mapping."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.model_files import nan_copy
from tests.trainers.golden.job import golden_spec, run_entry_point
from trainers.__main__ import classify, main
from trainers.errors import UserError
from trainers.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def _write_spec(spec, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.dump(path)
    return path


def _start(spec_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainers", "--spec", str(spec_path)],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _run(spec_path: Path, timeout: float = 120) -> tuple[int, str]:
    proc = _start(spec_path)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _main(spec_path: Path) -> int:
    """The entry point's main() in this process: the same code path as the subprocess,
    without paying torch's import time again (the subprocess tests cover the process)."""
    return main(["--spec", str(spec_path)])


def _termination(spec) -> dict:
    return json.loads(Path(spec.termination_log).read_text())


def _reports(spec) -> list[dict]:
    path = Path(spec.checkpoint.dir) / "reports.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_trains_and_the_loss_goes_down(make_spec, tmp_path):
    spec = make_spec(hyperparameters={"max_steps": 8, "learning_rate": 1e-2}, eval={"every_n_steps": 4})
    code, out = _run(_write_spec(spec, tmp_path / "spec.json"))
    assert code == ExitCode.SUCCESS, out
    metrics = [json.loads(x) for x in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train_loss"] for m in metrics]
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert metrics[-1]["valid_loss"] < metrics[3]["valid_loss"] + 0.5  # evaluated at 4 and 8
    reports = _reports(spec)
    kinds = [r["type"] for r in reports]
    assert kinds.count("metric") == 8 and kinds.count("artifacts") == 1 and "error" not in kinds
    seqs = [r["seq"] for r in reports]
    assert seqs == sorted(seqs)
    assert [r["step"] for r in reports if r["type"] == "checkpoint"] == [2, 4, 6, 8]
    assert not Path(spec.termination_log).exists()


def test_unparseable_spec_is_a_user_error(tmp_path):
    bad = tmp_path / "spec.json"
    bad.write_text('{"job_id": "x", "trainer": "fsdp_qlora", "termination_log": "%s"' % (tmp_path / "term"))
    code, out = _run(bad)
    assert code == ExitCode.USER_ERROR
    assert '"invalid_spec"' in out
    # invalid JSON: no termination_log to read; a schema error does name one
    schema_bad = tmp_path / "spec2.json"
    schema_bad.write_text(json.dumps({"job_id": "x", "trainer": "nope", "termination_log": str(tmp_path / "term2")}))
    assert _run(schema_bad)[0] == ExitCode.USER_ERROR
    assert json.loads((tmp_path / "term2").read_text())["code"] == "invalid_spec"


def test_missing_dataset(make_spec, tmp_path):
    spec = make_spec(data={"train_file": str(tmp_path / "nope.jsonl")})
    code = _main(_write_spec(spec, tmp_path / "spec.json"))
    assert code == ExitCode.USER_ERROR
    assert _termination(spec)["code"] == "dataset_not_found"
    assert [r["code"] for r in _reports(spec) if r["type"] == "error"] == ["dataset_not_found"]


def test_corrupt_model_dir(make_spec, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    spec = make_spec(model={"path": str(broken)})
    code = _main(_write_spec(spec, tmp_path / "spec.json"))
    assert code == ExitCode.USER_ERROR
    assert _termination(spec)["code"] == "corrupt_model"


def test_nan_loss_stops_with_a_clear_error(make_spec, tiny_model_dir, tmp_path):
    # A checkpoint with a NaN weight: the first loss is NaN (a real failure mode, no hook).
    nan_model = nan_copy(tiny_model_dir, tmp_path / "nan-model")
    spec = make_spec(model={"path": str(nan_model)})
    code = _main(_write_spec(spec, tmp_path / "spec.json"))
    assert code == ExitCode.USER_ERROR
    term = _termination(spec)
    assert term["code"] == "nan_loss" and "step 1" in term["message"]
    assert not list(Path(spec.checkpoint.dir).glob("step-*"))  # nothing NaN was checkpointed


def test_nan_loss_is_the_same_error_on_the_jax_trainer(tiny_model_dir, tiny_datasets, tmp_path):
    nan_model = nan_copy(tiny_model_dir, tmp_path / "nan-model")
    spec = golden_spec("jax_lora", nan_model, tiny_datasets, tmp_path / "run")
    run = run_entry_point(spec, tmp_path / "run")
    assert run.returncode == ExitCode.USER_ERROR, run.output[-3000:]
    term = _termination(spec)
    assert term["code"] == "nan_loss" and "step 1" in term["message"]
    assert not list(Path(spec.checkpoint.dir).glob("step-*"))


def test_resume_from_a_directory_that_is_not_a_checkpoint(make_spec, tmp_path):
    (tmp_path / "not-a-checkpoint").mkdir()
    spec = make_spec(checkpoint={"resume_from": str(tmp_path / "not-a-checkpoint")})
    code = _main(_write_spec(spec, tmp_path / "spec.json"))
    assert code == ExitCode.USER_ERROR
    assert _termination(spec)["code"] == "checkpoint_not_found"


def test_sigterm_checkpoints_and_exits_preempted(make_spec, tmp_path):
    spec = make_spec(hyperparameters={"max_steps": 100_000}, checkpoint={"every_n_steps": 100_000},
                     eval={"every_n_steps": None})
    proc = _start(_write_spec(spec, tmp_path / "spec.json"))
    metrics = Path(spec.output_dir) / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.PREEMPTED, out
    (ckpt,) = Path(spec.checkpoint.dir).glob("step-*")
    step = int(ckpt.name.split("-")[1])
    assert step >= 2 and (ckpt / "adapter" / "adapter_model.safetensors").exists()
    assert (ckpt / "dcp" / ".metadata").exists()  # the optimizer and adapter state (DCP)
    assert _termination(spec)["code"] == "preempted"
    reports = _reports(spec)
    assert any(r["type"] == "checkpoint" and r["step"] == step for r in reports)
    assert not any(r["type"] == "error" for r in reports)


class OutOfMemoryError(RuntimeError):  # the name torch uses (torch.OutOfMemoryError)
    pass


class XlaRuntimeError(RuntimeError):  # the name jaxlib uses
    pass


@pytest.mark.parametrize(
    ("exc", "exit_code", "code"),
    [
        (UserError("bad", code="invalid_dataset"), ExitCode.USER_ERROR, "invalid_dataset"),
        (OutOfMemoryError("CUDA out of memory"), ExitCode.OUT_OF_MEMORY, "out_of_memory"),
        (XlaRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating"), ExitCode.OUT_OF_MEMORY, "out_of_memory"),
        (MemoryError(), ExitCode.OUT_OF_MEMORY, "out_of_memory"),
        (OSError(errno.ENOSPC, "No space left on device"), ExitCode.USER_ERROR, "disk_full"),
        (XlaRuntimeError("INTERNAL: something"), ExitCode.INTERNAL_ERROR, "internal_error"),
        (KeyError("x"), ExitCode.INTERNAL_ERROR, "internal_error"),
    ],
)
def test_exceptions_map_to_exit_codes(exc, exit_code, code):
    err = classify(exc)
    assert (err.exit_code, err.code) == (exit_code, code)


def test_wrapped_disk_full_is_still_disk_full():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    except RuntimeError as outer:
        assert classify(outer).code == "disk_full"


def test_a_recipe_missing_from_the_image_is_trainer_unavailable(monkeypatch):
    from trainers import __main__ as entry

    monkeypatch.setitem(entry.RECIPES, "fsdp_qlora", "trainers.no_such_recipe:run")
    with pytest.raises(UserError) as err:
        entry.load_recipe("fsdp_qlora")
    assert err.value.code == "trainer_unavailable"
    monkeypatch.setitem(entry.RECIPES, "fsdp_qlora", "trainers.exit_codes:run")
    with pytest.raises(UserError, match="has no run"):
        entry.load_recipe("fsdp_qlora")
    assert entry.load_recipe.__module__ == "trainers.__main__"


def test_disk_full_inside_a_distributed_checkpoint_failure_is_disk_full():
    """torch.distributed.checkpoint raises one CheckpointException carrying each rank's
    error in ``failures``, not as a cause: a rank that hit a full disk still makes the
    job fail as disk_full (not internal_error, which would be restarted into the same wall)."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    written = OSError(errno.ENOSPC, "No space left on device")
    failure = CheckpointException("save failed", {1: (written, traceback.extract_stack())})
    assert classify(failure).code == "disk_full"
    assert classify(CheckpointException("save failed", {0: (KeyError("x"), traceback.extract_stack())})).code \
        == "internal_error"


def test_the_log_keeps_training_and_errors_but_not_each_report_request():
    # In a fresh process: the entry point's logging setup, as `python -m trainers` runs it.
    script = (
        "import logging\n"
        "from trainers.__main__ import configure_logging\n"
        "configure_logging()\n"
        "logging.getLogger('httpx').info('HTTP Request: POST http://api/reports \"HTTP/1.1 200 OK\"')\n"
        "logging.getLogger('httpcore.http11').debug('send_request_headers.started')\n"
        "logging.getLogger('httpx').warning('httpx warning shown')\n"
        "logging.getLogger('trainers.common.reporter').warning('reporter: seq 3 got HTTP 503; will retry')\n"
        "logging.getLogger('trainers.common.reporter').error('reporter: API refused reports')\n"
        "logging.getLogger('trainers').info('step 10 loss 1.5')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=60, check=True).stderr
    assert "HTTP/1.1 200 OK" not in out and "send_request_headers" not in out, out
    for line in ("httpx warning shown", "seq 3 got HTTP 503", "API refused reports", "step 10 loss 1.5"):
        assert line in out, out
