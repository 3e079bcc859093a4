"""The local executor: the supervisor lock (one supervisor per job, released when it dies)
and the environment each trainer family starts with."""

import json
import subprocess
import sys
import threading
import time

import pytest

from trainers.exit_codes import ExitCode
from worker.executors.local.process import (
    JAX_MALLOC_TUNABLE,
    supervise_trainer,
    supervision_lock,
    trainer_env,
)

PROBE = """
import sys
from pathlib import Path
from worker.executors.local.process import supervision_lock
with supervision_lock(Path(sys.argv[1]), wait_s=0.2) as mine:
    sys.exit(0 if mine else 3)
"""


def _probe(job_dir) -> int:
    return subprocess.run([sys.executable, "-c", PROBE, str(job_dir)], check=False).returncode


def test_a_second_supervisor_is_turned_away_in_this_process_and_others(tmp_path):
    with supervision_lock(tmp_path, wait_s=0) as mine:
        assert mine
        got = []

        def another_thread():
            with supervision_lock(tmp_path, wait_s=0.2) as theirs:
                got.append(theirs)

        t = threading.Thread(target=another_thread)
        t.start()
        t.join()
        assert got == [False]
        assert _probe(tmp_path) == 3
    assert _probe(tmp_path) == 0


def test_a_supervisor_that_is_finishing_is_waited_for(tmp_path):
    held = threading.Event()

    def finishing():
        with supervision_lock(tmp_path, wait_s=0):
            held.set()
            time.sleep(0.5)

    t = threading.Thread(target=finishing)
    t.start()
    assert held.wait(5)
    with supervision_lock(tmp_path, wait_s=10) as mine:
        assert mine
    t.join()


def test_the_lock_dies_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; "
        "from worker.executors.local.process import supervision_lock\n"
        f"with supervision_lock(Path({str(tmp_path)!r})) as mine:\n"
        "    print(mine, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert _probe(tmp_path) == 3
    finally:
        holder.kill()
        holder.wait()
    assert _probe(tmp_path) == 0


@pytest.mark.parametrize(
    ("trainer", "current", "expected"),
    [
        ("jax_lora", None, {"GLIBC_TUNABLES": JAX_MALLOC_TUNABLE}),
        ("jax_lora", "glibc.malloc.arena_max=2", {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{JAX_MALLOC_TUNABLE}"}),
        ("jax_lora", "glibc.malloc.hugetlb=0", {}),  # an operator's choice stands
        ("fsdp_qlora", None, {}),  # the torch trainer's RSS checks see an unchanged malloc
    ],
)
def test_trainer_env_gives_only_the_jax_trainer_huge_pages_for_malloc(trainer, current, expected):
    environ = {} if current is None else {"GLIBC_TUNABLES": current}
    assert trainer_env(trainer, environ) == expected


@pytest.mark.parametrize(("trainer", "tunables"), [("jax_lora", JAX_MALLOC_TUNABLE), ("fsdp_qlora", "")])
def test_supervised_trainer_starts_with_its_familys_environment(tmp_path, monkeypatch, trainer, tunables):
    # A stand-in interpreter records the environment the supervisor starts it with.
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "GLIBC_TUNABLES=[$GLIBC_TUNABLES]"\n')
    fake_python.chmod(0o755)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"trainer": trainer}))
    log_path = tmp_path / "trainer.log"
    outcome = supervise_trainer(spec_path, log_path=log_path, termination_path=tmp_path / "termination.json",
                                pid_path=tmp_path / "trainer.pid", should_stop=lambda: False,
                                python=str(fake_python), poll_s=0.05)
    assert outcome.returncode == ExitCode.SUCCESS
    assert log_path.read_text().strip() == f"GLIBC_TUNABLES=[{tunables}]"
