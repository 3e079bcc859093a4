"""Host memory of the trainer process, measured the same way by both trainers."""

from __future__ import annotations

import ctypes
import os
import platform
import resource

# mallopt(3)'s parameter number for M_MMAP_THRESHOLD (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3
# glibc's own starting threshold: blocks of at least this size get their own mapping.
FIXED_MMAP_THRESHOLD = 128 * 1024


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


def reset_peak_rss() -> bool:
    """Lower this process's ``VmHWM`` to its resident set now, so :func:`peak_rss_bytes`
    then measures the peak of what runs next (Linux 4.0+: ``5`` to /proc/self/clear_refs).
    Returns False where the kernel offers no reset (the peak stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def return_freed_tensors_to_the_os(threshold: int = FIXED_MMAP_THRESHOLD) -> bool:
    """Make glibc's malloc give every block of ``threshold`` bytes or more back when freed.

    By default glibc raises its mmap threshold to the size of each large block freed (up
    to 32 MiB), so from the first freed tensor on, every tensor below that size comes from
    the heap, and the heap keeps what they free. A training step frees large tensors all
    the time (a sharded layer's gathered weights, activations, dequantized kernels) while
    small long-lived ones (a layer's saved input, autograd's bookkeeping) land between
    them, so the free holes rarely fit the next layer's tensors and the heap grows with
    the number of layers and keeps growing from step to step: a 32-layer Llama-3.1-8B
    QLoRA step on CPU peaked at about twice the memory its live tensors need. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the raising off) maps each
    large tensor on its own and unmaps it when it is freed, so the process holds what is
    live.

    Does nothing where the C library is not glibc, or where the operator chose a threshold
    already (``MALLOC_MMAP_THRESHOLD_`` or ``glibc.malloc.mmap_threshold`` in
    ``GLIBC_TUNABLES``). Returns whether the threshold was set.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
