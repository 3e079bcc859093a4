"""The sandboxed side of a python grader: a fresh interpreter that locks itself in, then
grades.

``trainers.common.graders.sandbox`` starts this file as ``python -I -S -B`` (isolated: no
environment variables, no user site, no site-packages, no bytecode written) with an empty
environment, its own session and three pipes. It reads one line of JSON at a time on
stdin and answers one line of JSON per request on stdout:

1. the parent's configuration (trusted): limits and the library folders it may read;
2. then it locks itself in (:func:`lock_in`), in this order: drop root (to ``nobody``)
   where it runs as root; resource limits (address space, CPU seconds, no file writes, a
   few descriptors, no core dumps); Landlock (read-only access to the interpreter's
   libraries, nothing else; no TCP; signals and abstract Unix sockets scoped to itself);
   a seccomp filter that kills it on any system call that creates a socket or a process,
   runs a program, reaches another process, raises a limit or touches the kernel's
   global state. Only then does it read anything the tenant wrote;
3. the grader's source: compiled, run once, ``grade`` looked up (``{"ready": true}``, or
   ``{"error": ...}``);
4. ``{"sample": ..., "item": ...}`` lines, each answered ``{"reward": x}`` or
   ``{"error": {"kind", "details"}}``, until stdin closes.

The grader's ``print`` goes to stderr, which the parent reads up to a bound. Nothing here
imports the project: only the standard library and the two binding libraries, loaded
before the lock closes.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import traceback
from typing import Any

NOBODY = 65534
MAX_DETAILS = 2000

# Syscalls that kill the process (SIGSYS), whatever their arguments: networking, new
# processes and programs, other processes' memory and state, raising limits, mounts and
# namespaces, the kernel's global state, kernel interfaces that bypass the rest (io_uring
# runs socket operations without the socket syscall; bpf, userfaultfd, perf events).
FORBIDDEN_SYSCALLS = (
    "socket", "socketpair", "fork", "vfork", "execve", "execveat",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd",
    "pidfd_send_signal", "tkill", "setrlimit",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "personality", "name_to_handle_at", "open_by_handle_at",
    "mknod", "mknodat", "migrate_pages", "move_pages",
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "acct",
    "quotactl", "syslog", "ioperm", "iopl", "setuid", "setgid", "setreuid", "setregid",
    "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capset",
    # Landlock governs reading and writing, not a file's owner, mode, attributes or times.
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "utime", "utimes", "utimensat", "futimesat",
)
# clone() makes threads (CLONE_THREAD set) and processes (unset): only threads pass.
CLONE_THREAD = 0x00010000
# Linux system libraries the interpreter's extension modules load (libm, libz, libffi...).
SYSTEM_LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")


def answer(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message, allow_nan=False) + "\n").encode())


def read_message() -> Any:
    line = sys.stdin.buffer.readline()
    return json.loads(line) if line else None


def others_can_read(path: str) -> bool:
    """Whether a user owning nothing can read the folder ``path`` (every ancestor searchable)."""
    parts = os.path.abspath(path).split(os.sep)
    for depth in range(1, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:depth]) or os.sep).st_mode
        if not mode & 0o001 or (depth == len(parts) and not mode & 0o004):
            return False
    return True


def drop_capabilities() -> None:
    """capset(2) with empty effective, permitted and inheritable sets (version 3)."""
    import ctypes

    import pyseccomp

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "capset"), header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def drop_root(library_paths: list[str]) -> None:
    """Root could undo much of the rest: a grader runs as ``nobody`` where the libraries
    allow it, else as a root without any capability (it still owns root's files, which
    Landlock and the filter keep it from reading, writing or changing)."""
    if os.geteuid() != 0:
        return
    if all(others_can_read(path) for path in library_paths if os.path.isdir(path)):
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    else:
        drop_capabilities()


def limit_resources(limits: dict[str, int]) -> None:
    memory = limits["memory_bytes"]
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # SIGXCPU at the soft limit, SIGKILL one second later if it is caught.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))


def restrict_filesystem_and_network(library_paths: list[str]) -> int:
    """Landlock: read-only libraries, nothing else; no TCP; signals and abstract sockets
    kept inside. Returns the kernel's Landlock ABI (the parent refuses to start without)."""
    import landlockpy
    from landlockpy import AccessFS, Ruleset, Scope

    abi = landlockpy.abi_version()
    if abi < 1:
        return 0
    readable = AccessFS.READ_FILE | AccessFS.READ_DIR
    with Ruleset(scoped=Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL) as ruleset:
        for path in dict.fromkeys([*library_paths, *SYSTEM_LIBRARIES]):
            if os.path.isdir(path):
                ruleset.allow_path(path, readable)
        ruleset.restrict()
    return abi


def restrict_syscalls() -> None:
    import pyseccomp as seccomp

    pid = os.getpid()
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in FORBIDDEN_SYSCALLS:
        try:
            rules.add_rule(seccomp.KILL_PROCESS, name)
        except OSError:  # a name this architecture does not have
            continue
    rules.add_rule(seccomp.KILL_PROCESS, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    # glibc makes threads with clone3 and falls back to clone on ENOSYS; clone3's flags
    # sit in memory a filter cannot read.
    rules.add_rule(seccomp.ERRNO(38), "clone3")
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        rules.add_rule(seccomp.KILL_PROCESS, name, seccomp.Arg(0, seccomp.NE, pid))
    rules.add_rule(seccomp.KILL_PROCESS, "prlimit64", seccomp.Arg(2, seccomp.NE, 0))
    rules.load()


def lock_in(config: dict[str, Any]) -> None:
    sys.path.extend(config["library_paths"])
    import landlockpy  # noqa: F401  (loaded while its files are still readable)
    import pyseccomp  # noqa: F401

    drop_root(config["library_paths"])
    limit_resources(config["limits"])
    if restrict_filesystem_and_network(config["library_paths"]) < 1:
        answer({"error": {"kind": "sandbox_unavailable", "details": "this kernel has no Landlock"}})
        raise SystemExit(3)
    restrict_syscalls()


def exception_details(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:MAX_DETAILS]


def load_grader(source: str) -> Any:
    namespace: dict[str, Any] = {"__name__": "grader"}
    exec(compile(source, "grader.py", "exec"), namespace)  # noqa: S102 (the tenant code, locked in)
    grade = namespace.get("grade")
    if not callable(grade):
        raise TypeError("the source defines no grade(sample, item) function")
    return grade


def reward_of(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"grade() returned {type(value).__name__}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"grade() returned {reward}, not a finite number")
    return reward


def error(kind: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, MemoryError):
        kind = "memory_limit"
    elif isinstance(exc, RecursionError):
        kind = "exception"
    return {"error": {"kind": kind, "details": exception_details(exc)}}


def serve(grade: Any) -> None:
    while (request := read_message()) is not None:
        try:
            answer({"reward": reward_of(grade(request["sample"], request["item"]))})
        except Exception as exc:  # noqa: BLE001 (the tenant's code failed: its error is the answer)
            answer(error("exception", exc))


def main() -> None:
    config = read_message()
    lock_in(config)
    sys.stdout = sys.stderr  # the grader's prints never mix with the answers
    source = read_message()
    try:
        grade = load_grader(source)
    except Exception as exc:  # noqa: BLE001 (whatever the source raises is its load error)
        answer(error("load_failed", exc))
        return
    answer({"ready": True})
    serve(grade)


if __name__ == "__main__":
    main()
