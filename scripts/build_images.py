"""Build the three images of deploy/docker/ on this machine with podman (`make images`).

No registry can be reached from the machines this runs on, so the base image is made here:
``debootstrap --variant=minbase`` of Debian bookworm with Python 3.11, imported into podman
as ``localhost/tunefleet/base:bookworm-<key>`` and kept there, so later builds on the
same machine reuse it (the key changes with what goes into it). Every Dockerfile takes its
base as a build argument; the trainer images are built for the CPU (``ACCELERATOR=cpu``)
on that base instead of their CUDA / ROCm bases, which is the only difference from a
production build.

``RUN`` steps reach the package index with this machine's CA bundle mounted, and with the
package sources this machine's pip is configured with (``pip config list``: index URLs,
local indexes and wheel folders such as the CPU build of torch): they are written into a
pip.conf mounted at /etc/pip.conf during the build and never into an image. pip's cache is
a build cache mount (``RUN --mount=type=cache``), kept between builds like the layers.

    python scripts/build_images.py [NAME ...]     # default: all three

Images are tagged ``localhost/tunefleet/<name>:<TUNEFLEET_IMAGE_TAG>`` (default ``local``);
the image an older build left under that tag is removed. tests/deploy/images/ checks and
smoke-runs the result (``make images-check``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
TAG = os.environ.get("TUNEFLEET_IMAGE_TAG", "local")
WORK_DIR = Path(os.environ.get("TUNEFLEET_IMAGE_WORK_DIR", "/var/tmp/tunefleet-images"))

BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates")
# What the official python images set and the Dockerfiles rely on (`python` on PATH, UTF-8).
BASE_CHANGES = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                "CMD [\"python3\"]")
CA_CERTS = Path("/etc/ssl/certs")
PIP_KEYS = ("index-url", "extra-index-url", "find-links")


@dataclass(frozen=True)
class ImageBuild:
    """One image: its Dockerfile and the build arguments that point it at the local base."""

    name: str
    base_arg: str
    build_args: dict[str, str] = field(default_factory=dict)

    @property
    def dockerfile(self) -> Path:
        return DOCKER_DIR / f"{self.name}.Dockerfile"

    @property
    def reference(self) -> str:
        return image_reference(self.name)


IMAGES = (
    ImageBuild("api", base_arg="PYTHON_IMAGE"),
    ImageBuild("trainer-torch-cuda", base_arg="PYTHON_IMAGE", build_args={"ACCELERATOR": "cpu"}),
    ImageBuild("trainer-jax-rocm", base_arg="ROCM_IMAGE", build_args={"ACCELERATOR": "cpu"}),
)


def image_reference(name: str) -> str:
    """The local name of image ``name`` (``api``, ``trainer-torch-cuda``, ...)."""
    return f"localhost/tunefleet/{name}:{TAG}"


def base_reference() -> str:
    """The base image's name: its tag changes with what debootstrap puts into it."""
    key = hashlib.sha256(repr((BASE_SUITE, BASE_PACKAGES, BASE_CHANGES)).encode()).hexdigest()[:12]
    return f"localhost/tunefleet/base:{BASE_SUITE}-{key}"


def podman(*args: str, capture: bool = False, check: bool = True) -> str:
    result = subprocess.run(["podman", *args], check=False, text=True,
                            stdout=subprocess.PIPE if capture else None)
    if check and result.returncode != 0:
        raise SystemExit(f"podman {shlex.join(args[:3])} ... failed (exit {result.returncode})")
    return (result.stdout or "").strip()


def image_id(reference: str) -> str | None:
    result = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", reference],
                            capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def ensure_base() -> str:
    """The base image, made by debootstrap the first time on this machine."""
    reference = base_reference()
    if image_id(reference):
        print(f"base image {reference}: cached")
        return reference
    started = time.monotonic()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK_DIR, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                        BASE_SUITE, str(rootfs)], check=True, stdout=subprocess.DEVNULL)
        # What debootstrap leaves behind that an image should not carry.
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        shutil.rmtree(rootfs / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
        subprocess.run(["podman", "import", "--quiet", *changes, "-", reference], stdin=tar.stdout,
                       check=True, stdout=subprocess.DEVNULL)
        tar.stdout.close()  # type: ignore[union-attr]
        if tar.wait() != 0:
            raise SystemExit("tar of the debootstrap root failed")
    print(f"base image {reference}: made in {time.monotonic() - started:.0f} s")
    return reference


def _pip_config() -> dict[str, str]:
    """This machine's pip settings for the package sources, as pip resolves them: the
    environment over the site (virtualenv), user and global files."""
    output = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=True).stdout
    rank = {":env:": 3, "site": 2, "user": 1, "global": 0}
    found: dict[str, tuple[int, str]] = {}
    for line in output.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key not in PIP_KEYS or scope not in rank:
            continue
        if key not in found or rank[scope] >= found[key][0]:
            found[key] = (rank[scope], value.strip().strip("'\""))
    return {key: value for key, (_, value) in found.items()}


def _local_folder(source: str) -> Path | None:
    """The folder a build must see for a local source (a wheel folder, a file:// index)."""
    if source.startswith("file:"):
        path = Path(urlparse(source).path)
    elif "://" in source:
        return None  # a remote index: reached through the network
    else:
        path = Path(source)
    # A PEP 503 index in <root>/simple links its files relative to <root>.
    return path.parent if path.name == "simple" else path


def pip_sources(conf_path: Path) -> list[str]:
    """Write the build's pip.conf (this machine's package sources) to ``conf_path``; the
    ``podman build -v`` arguments that make it and the local sources visible to RUN steps."""
    settings = _pip_config()
    lines = ["[global]"]
    folders: set[Path] = set()
    for key in PIP_KEYS:
        if key in settings:
            lines.append(f"{key} = {settings[key]}")
            for source in settings[key].split():
                folder = _local_folder(source)
                if folder is not None and folder.is_dir():
                    folders.add(folder)
    lines.append(f"cert = {CA_CERTS / 'ca-certificates.crt'}")
    conf_path.write_text("\n".join(lines) + "\n")
    volumes = [f"{CA_CERTS}:{CA_CERTS}:ro", f"{conf_path}:/etc/pip.conf:ro"]
    volumes += [f"{folder}:{folder}:ro" for folder in sorted(folders)]
    return [arg for volume in volumes for arg in ("-v", volume)]


def build(image: ImageBuild, base: str, volumes: list[str]) -> None:
    previous = image_id(image.reference)
    started = time.monotonic()
    args = {image.base_arg: base, **image.build_args}
    # Docker's image format: OCI's has no SHELL (the torch image's pipefail) nor HEALTHCHECK.
    podman("build", "--format", "docker", "--isolation", "chroot", "--layers", "--pull=never", *volumes,
           *(arg for key, value in args.items() for arg in ("--build-arg", f"{key}={value}")),
           "-f", str(image.dockerfile), "-t", image.reference, str(REPO_ROOT))
    current = image_id(image.reference)
    if previous and previous != current:
        podman("rmi", previous, check=False)  # still used by a container: left for a prune
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image.reference, capture=True))
    print(f"{image.reference}: built in {time.monotonic() - started:.0f} s, {size / 1e6:.0f} MB")


@contextmanager
def build_lock() -> Iterator[None]:
    """One build at a time on this machine (they share the base, the layers and pip's cache)."""
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    with (WORK_DIR / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main(names: list[str]) -> None:
    unknown = set(names) - {image.name for image in IMAGES}
    if unknown:
        raise SystemExit(f"unknown image(s) {sorted(unknown)}: {', '.join(i.name for i in IMAGES)}")
    with build_lock():
        base = ensure_base()
        volumes = pip_sources(WORK_DIR / "pip.conf")
        for image in IMAGES:
            if not names or image.name in names:
                build(image, base, volumes)


if __name__ == "__main__":
    main(sys.argv[1:])
