"""Host memory of the trainer process, measured the same way by both trainers."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """This process image's resident-set high-water mark, in bytes.

    Read from ``VmHWM`` in /proc/self/status, not ``ru_maxrss``: Linux carries
    ``ru_maxrss`` over ``execve`` from the forked parent, so a trainer started by a large
    Celery worker (or pytest) would report the parent's size. Falls back to ``ru_maxrss``
    where /proc is missing.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
