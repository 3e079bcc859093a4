"""Run a built image's programs from its filesystem, as a container runtime would.

``podman run`` cannot start containers on these machines (the sandbox refuses crun's
setrlimit), so an image is run the way a runtime sets a container up, by hand: podman
creates a container from the image and mounts its root filesystem; each process then gets
a mount namespace of its own (``unshare``) in which that root is bound read-only, with
``/proc``, the host's ``/dev`` and its ``/etc/hosts`` and ``/etc/resolv.conf``, and the
writable volumes the deployment gives it (an empty tmpfs for an emptyDir, or a folder of
this machine bound there); it is entered with ``chroot`` as the image's ``USER``, without
the right to gain privileges (``setpriv --no-new-privs``), in the image's working
directory, with the image's ``ENV`` plus the ``HOME`` of that user and the deployment's
environment. Its network is this machine's (``hostNetwork``).

Mount points are made in the container's own writable layer before the root turns
read-only, as a runtime makes them (the image itself is never changed), with the image's
symbolic links followed inside its root: never onto this machine's paths.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from tests.conftest import stop_process_group

# What every container gets from the runtime, whatever its spec says.
RUNTIME_FILES = ("/etc/hosts", "/etc/resolv.conf")


@dataclass(frozen=True)
class Mount:
    """A volume: ``source`` (a folder or file of this machine) bound at ``target``, or an
    empty tmpfs there when ``source`` is None (an emptyDir)."""

    target: str
    source: Path | None = None
    read_only: bool = False


def podman(*args: str) -> str:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"podman {shlex.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


def image_exists(reference: str) -> bool:
    return subprocess.run(["podman", "image", "exists", reference], check=False).returncode == 0


@dataclass
class Image:
    """A built image, its configuration and its root filesystem (mounted by ``open``)."""

    reference: str
    container: str | None = None
    root: Path | None = None
    _made: list[str] = field(default_factory=list)

    @cached_property
    def inspect(self) -> dict[str, Any]:
        return json.loads(podman("image", "inspect", self.reference))[0]

    @property
    def config(self) -> dict[str, Any]:
        return self.inspect["Config"]

    @property
    def size_bytes(self) -> int:
        return int(self.inspect["Size"])

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config.get("Env") or [])

    @property
    def user(self) -> tuple[int, int]:
        uid, _, gid = self.config["User"].partition(":")
        return int(uid), int(gid or uid)

    def passwd_entry(self, uid: int) -> list[str]:
        """The image's /etc/passwd line of ``uid``, split into its fields."""
        assert self.root is not None
        for line in (self.root / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if fields[2] == str(uid):
                return fields
        raise LookupError(f"{self.reference}: uid {uid} is not in /etc/passwd")

    @property
    def home(self) -> str:
        """What a runtime sets ``HOME`` to: the image's, else its user's in /etc/passwd."""
        return self.env.get("HOME") or self.passwd_entry(self.user[0])[5]

    def open(self, name: str) -> Image:
        self.container = podman("create", "--name", name, self.reference)
        self.root = Path(podman("mount", self.container))
        return self

    def close(self) -> None:
        if self.container is not None:
            podman("umount", self.container)
            podman("rm", "--force", "--volumes", self.container)  # and the anonymous VOLUME ones
            self.container = self.root = None

    def resolve(self, target: str) -> str:
        """``target`` with the image's symbolic links followed inside its root, as a runtime
        resolves a mount path (``/var/run`` is a link to ``/run`` in Debian)."""
        assert self.root is not None
        resolved, parts, hops = PurePosixPath("/"), list(PurePosixPath(target).parts[1:]), 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                resolved = resolved.parent
                continue
            here = self.root / (resolved / part).relative_to("/")
            if not here.is_symlink():
                resolved = resolved / part
                continue
            hops += 1
            assert hops < 40, f"{target}: too many symbolic links"
            link = PurePosixPath(os.readlink(here))
            parts = [*link.parts[1:], *parts] if link.is_absolute() else [*link.parts, *parts]
            resolved = PurePosixPath("/") if link.is_absolute() else resolved
        return str(resolved)

    def _mount_point(self, target: str, *, file: bool) -> None:
        assert self.root is not None
        path = self.root / self.resolve(target).lstrip("/")
        if path.exists() or path.is_symlink():
            return
        if file:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            path.mkdir(parents=True)

    def argv(self, command: Sequence[str], mounts: Sequence[Mount] = (), *, read_only_root: bool = True,
             workdir: str | None = None) -> list[str]:
        """The command line on this machine that runs ``command`` in the image (see the
        module docstring); its environment is the caller's (``environment``)."""
        assert self.root is not None, "open() the image first"
        root = str(self.root)
        for target in RUNTIME_FILES:
            self._mount_point(target, file=True)
        for m in mounts:
            self._mount_point(m.target, file=m.source is not None and m.source.is_file())
        steps = [f"mount --bind {shlex.quote(root)} {shlex.quote(root)}"]
        if read_only_root:
            steps.append(f"mount -o remount,bind,ro {shlex.quote(root)}")
        steps += [f"mount -t proc proc {shlex.quote(root)}/proc",
                  f"mount --rbind /dev {shlex.quote(root)}/dev",
                  f"mount -t tmpfs -o mode=1777 shm {shlex.quote(root)}/dev/shm"]
        steps += [f"mount --bind -o ro {f} {shlex.quote(root + self.resolve(f))}" for f in RUNTIME_FILES]
        for m in mounts:
            target = shlex.quote(root + self.resolve(m.target))
            if m.source is None:
                steps.append(f"mount -t tmpfs -o mode=0777 emptydir {target}")
            else:
                steps.append(f"mount --bind {shlex.quote(str(m.source))} {target}")
            if m.read_only:
                steps.append(f"mount -o remount,bind,ro {target}")
        uid, gid = self.user
        enter = ["setpriv", "--no-new-privs", "chroot", f"--userspec={uid}:{gid}", f"--groups={gid}", root,
                 "/usr/bin/env", f"--chdir={workdir or self.config.get('WorkingDir') or '/'}", "--", *command]
        script = "set -e\n" + "\n".join(steps) + "\nexec " + shlex.join(enter)
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    def environment(self, extra: Mapping[str, str] = ()) -> dict[str, str]:
        """What a process in a container of this image starts with: the image's ``ENV``,
        the user's ``HOME``, then the deployment's ``extra``."""
        return {**self.env, "HOME": self.home, "HOSTNAME": "tunefleet-image-check", **dict(extra)}

    def run(self, command: Sequence[str], mounts: Sequence[Mount] = (), env: Mapping[str, str] = (),
            timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command, mounts, **kwargs), env=self.environment(env), capture_output=True,
                              text=True, timeout=timeout, check=False)

    def start(self, command: Sequence[str], log: Path, mounts: Sequence[Mount] = (),
              env: Mapping[str, str] = (), **kwargs: Any) -> Process:
        with log.open("ab") as out:
            proc = subprocess.Popen(self.argv(command, mounts, **kwargs), env=self.environment(env), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return Process(command[0], proc, log)


@dataclass
class Process:
    """A long-running program started in an image (a Deployment's container)."""

    name: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        stop_process_group(self.proc, timeout=timeout)

    def tail(self, chars: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"----- {self.name} -----\n{text[-chars:]}"
