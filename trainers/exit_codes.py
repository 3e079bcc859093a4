"""Process exit codes of a trainer (`python -m trainers --spec spec.json`).

The executor (local subprocess or Kubernetes pod) maps the exit code of the trainer
process to the job's next state, so the codes are part of the trainer contract:

====================  ====  ==============================================================
name                  code  meaning / what the executor does
====================  ====  ==============================================================
SUCCESS                  0  adapter exported; job -> succeeded
INTERNAL_ERROR           1  an unexpected exception (a bug); restarted up to max_restarts
USER_ERROR              10  bad data, config or model the user can fix; job -> failed, no retry
OUT_OF_MEMORY           11  the device (or host) ran out of memory; job -> failed with a hint
PREEMPTED               12  SIGTERM received, checkpoint written; job -> queued/paused/cancelled
====================  ====  ==============================================================

Codes 10-12 sit above the shell's 1/2 and below 126 (reserved by shells), so they never
collide with Python's own exit statuses. A process killed by a signal has no exit code
(negative returncode in ``subprocess``); the executor treats it as a crash.

Alongside the code, a trainer that fails writes a one-line JSON error
``{"code": ..., "message": ...}`` to the termination file (``TrainerSpec.termination_log``,
which is ``/dev/termination-log`` in Kubernetes), so the job's error is specific.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    SUCCESS = 0
    INTERNAL_ERROR = 1
    USER_ERROR = 10
    OUT_OF_MEMORY = 11
    PREEMPTED = 12
