"""The local executor's supervisor lock: one supervisor per job, released when it dies."""

import subprocess
import sys
import threading
import time

from worker.executors.local_process import supervision_lock

PROBE = """
import sys
from pathlib import Path
from worker.executors.local_process import supervision_lock
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
        "from worker.executors.local_process import supervision_lock\n"
        f"with supervision_lock(Path({str(tmp_path)!r})) as mine:\n"
        "    print(mine, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert _probe(tmp_path) == 3
    finally:
        holder.kill()
        holder.wait()
    assert _probe(tmp_path) == 0
