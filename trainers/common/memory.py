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
# The threshold of a heap that keeps freed tensors (:func:`keeps_a_fast_heap`), fixed from the
# start. Tensors below it come from the heap from step 1 on, so the first step's peak (what
# the step fit measures) is the steady state's: with glibc's own rising threshold the heap
# grew over the first steps (SmolLM2-135M: 1.71 -> 2.07 GiB over 8 steps), with this one it
# is flat (2.22 -> 2.27 GiB). 4 MiB, not glibc's 32 MiB maximum: a small model's activations
# (SmolLM2's MLP rows of 640 tokens are 3.9 MB) stay in the heap, where the faults cost the
# most for the least memory, while a large model's layer-sized tensors, whose holes made the
# heap grow step after step (the 32-layer 8B-shaped job: 3.1 -> 4.4 GiB over 12 steps under
# glibc's rule), are still mapped on their own and returned.
FAST_MMAP_THRESHOLD = 4 * 1024 * 1024


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


# How many times its planned memory a step on the host must fit under the device's limit
# for its trainer to leave glibc's heap as it is (see :func:`keeps_a_fast_heap`): the
# heap growth a bounded heap prevents was measured at about twice the live tensors.
FAST_HEAP_HEADROOM = 2.0


def keeps_a_fast_heap(*, on_host: bool, planned_bytes: int | None, limit_bytes: int | None) -> bool:
    """Whether a trainer may keep freed tensors in glibc's heap for reuse (a fixed
    ``FAST_MMAP_THRESHOLD``) instead of bounding it with :func:`return_freed_tensors_to_the_os`.

    The bound costs time: every tensor of ``FIXED_MMAP_THRESHOLD`` or more is mapped afresh
    and faulted in page by page each time it is allocated, and a step allocates its
    activations and gradients anew. With the step on the host (a CPU pool) that is most of
    its tensors: fine-tuning SmolLM2-135M in fp32 on 2 CPU cores (640 tokens a step) spent
    20 of its 68 CPU-seconds in the kernel and ran at 136 tokens/s bounded, against
    235 tokens/s and 1.70 -> 2.27 GiB of peak memory with a heap that keeps them (TRL by
    hand, on glibc's defaults: 2.26 GiB). So the heap keeps them where the step runs on the
    host and its plan, ``FAST_HEAP_HEADROOM`` times over, still fits the device's limit; it
    is bounded where memory is tight, where the plan or the limit is unknown (a spec written
    by hand), and on an accelerator (whose step's tensors are not on the host heap, while
    loading and CPU offload are, and large).
    """
    if not on_host or not planned_bytes or not limit_bytes:
        return False
    return FAST_HEAP_HEADROOM * planned_bytes <= limit_bytes


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
