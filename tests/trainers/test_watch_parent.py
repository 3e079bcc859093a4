"""A local trainer stops (as on SIGTERM) once the worker that started it is gone."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

GRANDCHILD = """
import sys, time
from trainers.__main__ import watch_parent
from trainers.common.signals import StopFlag
stop = StopFlag()
watch_parent(stop, interval_s=0.1)
deadline = time.monotonic() + 20
while not stop.requested and time.monotonic() < deadline:
    time.sleep(0.05)
open(sys.argv[1], "w").write("stopped" if stop.requested else "still running")
"""

MIDDLE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(1.5)  # the "worker" lives a little, then dies without stopping its trainer
"""


def test_trainer_notices_its_parent_died(tmp_path: Path) -> None:
    out = tmp_path / "result"
    subprocess.run([sys.executable, "-c", MIDDLE, GRANDCHILD, str(out)], check=True, timeout=30)
    deadline = time.monotonic() + 25
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.read_text() == "stopped"


def test_trainer_keeps_running_while_its_parent_lives(tmp_path: Path) -> None:
    out = tmp_path / "result"
    script = GRANDCHILD.replace("time.monotonic() + 20", "time.monotonic() + 1.5")
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=30)
    assert out.read_text() == "still running"
