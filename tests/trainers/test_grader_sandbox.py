"""Tenant python graders against the sandbox (``trainers.common.graders.sandbox``): each
attack ends with its stable code, and the grading process (this test) goes on.

Every grader here is real tenant code in a real sandboxed interpreter; the limits are
small so that a test costs about a second.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainers.common.graders.sandbox import SandboxLimits, grade_in_sandbox

LIMITS = SandboxLimits(memory_bytes=512 << 20, seconds_per_sample=2, seconds_per_call=20, startup_seconds=20,
                       output_bytes=16 * 1024)
PAIR = ({"output_text": "a"}, {"label": "a"})


def run(body: str, pairs: list | None = None, limits: SandboxLimits = LIMITS) -> list:
    source = "import os, signal, socket, time\n\ndef grade(sample, item):\n" + "".join(
        f"    {line}\n" for line in body.splitlines())
    return grade_in_sandbox(source, pairs or [PAIR], limits)


def only(results: list) -> tuple[float | None, str | None, str | None]:
    assert len(results) == 1
    return results[0].reward, results[0].code, results[0].details


def test_a_grader_reads_nothing_but_its_inputs(tmp_path: Path) -> None:
    data = tmp_path / "jobs" / "ftjob-other" / "train.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text('{"secret": 1}\n')
    data.chmod(0o644)
    for path in (str(data), "/etc/passwd", f"/proc/{os.getpid()}/environ"):
        reward, code, details = only(run(f"return float(len(open({path!r}).read()))"))
        assert (reward, code) == (None, "exception") and "PermissionError" in details, path
    reward, code, details = only(run("return float(len(os.listdir('/tmp')))"))
    assert code == "exception" and "PermissionError" in details
    reward, code, details = only(run(f"open({str(tmp_path / 'out')!r}, 'w').write('x')\nreturn 1.0"))
    assert code == "exception" and not (tmp_path / "out").exists()
    assert only(run("return 1.0 if item['label'] == sample['output_text'] else 0.0")) == (1.0, None, None)


@pytest.mark.parametrize("attack", [
    "socket.create_connection(('127.0.0.1', 5432), timeout=1)\nreturn 1.0",
    "socket.socket(socket.AF_UNIX).connect('/var/run/postgresql/.s.PGSQL.5432')\nreturn 1.0",
    "while True:\n    os.fork()",
    "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'id'])\nreturn 1.0",
    "os.kill(os.getppid(), signal.SIGKILL)\nreturn 1.0",
    "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))\nreturn 1.0",
])
def test_network_processes_programs_signals_and_limits_are_forbidden(attack: str) -> None:
    reward, code, _details = only(run(attack))
    assert (reward, code) == (None, "forbidden_syscall")


def test_endless_loops_and_sleeps_time_out() -> None:
    assert only(run("while True:\n    pass"))[1] == "timeout"
    assert only(run("time.sleep(3600)"))[1] == "timeout"


def test_endless_allocation_hits_the_memory_limit() -> None:
    reward, code, _ = only(run("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))"))
    assert (reward, code) == (None, "memory_limit")


def test_huge_output_is_cut_off_and_closed_output_ends_the_process() -> None:
    assert only(run("print('x' * (10 << 20))\nreturn 1.0"))[1] == "output_limit"
    assert only(run("os.write(1, b'y' * (10 << 20))\nreturn 1.0"))[1] == "output_limit"
    assert only(run("os.close(1)\nos.close(2)\nwhile True:\n    pass"))[1] == "crashed"


def test_a_grader_that_misbehaves_answers_a_runtime_error() -> None:
    assert only(run("return 'yes'")) == (None, "exception", "TypeError: grade() returned str, not a number")
    assert only(run("return float('nan')"))[1] == "exception"
    assert only(run("raise KeyError('label')")) == (None, "exception", "KeyError: 'label'")
    assert only(grade_in_sandbox("def grade(sample, item):\n    return 1.0\nboom()\n", [PAIR], LIMITS))[1] == \
        "load_failed"


def test_one_process_grades_a_batch_and_a_death_costs_only_its_sample() -> None:
    pairs = [({"output_text": str(n)}, {"n": n}) for n in range(4)]
    results = run("if item['n'] == 1:\n    os.fork()\nreturn float(os.getpid())", pairs)
    assert [r.code for r in results] == [None, "forbidden_syscall", None, None]
    assert results[2].reward == results[3].reward != results[0].reward  # a fresh process took the rest
    batch = run("return float(os.getpid())", pairs)
    assert len({r.reward for r in batch}) == 1


def test_a_call_never_sees_what_another_call_left() -> None:
    source = ("seen = []\n\ndef grade(sample, item):\n    seen.append(item['tenant'])\n"
              "    return float(len(seen))\n")
    first = grade_in_sandbox(source, [(PAIR[0], {"tenant": "a"}), (PAIR[0], {"tenant": "a"})], LIMITS)
    second = grade_in_sandbox(source, [(PAIR[0], {"tenant": "b"})], LIMITS)
    assert [r.reward for r in first] == [1.0, 2.0] and second[0].reward == 1.0


def test_the_call_has_one_deadline_for_the_whole_batch() -> None:
    limits = SandboxLimits(memory_bytes=512 << 20, seconds_per_sample=2, seconds_per_call=3, startup_seconds=20)
    results = run("time.sleep(1.2)\nreturn 1.0", [PAIR] * 5, limits)
    assert [r.reward for r in results[:2]] == [1.0, 1.0]
    assert {r.code for r in results[2:]} == {"timeout"}

