"""Checks of the built images (``make images``), run by ``make images-check`` and CI.

The tests here need the images ``scripts/build_images.py`` built on this machine, podman
and root (they mount and chroot into the images' filesystems), so they run only when
``TUNEFLEET_IMAGE_CHECKS=1`` (what ``make images-check`` sets after building them): then a
missing image fails them. Elsewhere (``make test``) they are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.images.container import Image, image_exists

REPO_ROOT = Path(__file__).resolve().parents[3]


def _build_script():  # scripts/ is not a package: the script names the images it builds
    spec = importlib.util.spec_from_file_location("build_images", REPO_ROOT / "scripts" / "build_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BUILD = _build_script()
ENABLED = os.environ.get("TUNEFLEET_IMAGE_CHECKS") == "1"
HERE = Path(__file__).resolve().parent
_opened: dict[str, Image] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="checks of the built images: `make images-check` builds and runs them")
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def images() -> Iterator[dict[str, Image]]:
    """Every image of deploy/docker/, its root filesystem mounted (``Image.root``)."""
    missing = [image.reference for image in BUILD.IMAGES if not image_exists(image.reference)]
    assert not missing, f"not built: {missing} (run `make images`)"
    opened = {image.name: Image(image.reference) for image in BUILD.IMAGES}
    try:
        for name, image in opened.items():
            image.open(f"tunefleet-check-{name}-{os.getpid()}")
        _opened.update(opened)
        yield opened
    finally:
        for image in opened.values():
            image.close()


@pytest.fixture(scope="session")
def api_image(images: dict[str, Image]) -> Image:
    return images["api"]


@pytest.fixture(scope="session")
def torch_image(images: dict[str, Image]) -> Image:
    return images["trainer-torch-cuda"]


@pytest.fixture(scope="session")
def jax_image(images: dict[str, Image]) -> Image:
    return images["trainer-jax-rocm"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _opened:
        terminalreporter.section("image sizes")
        for name, image in _opened.items():
            terminalreporter.write_line(f"{BUILD.image_reference(name)}: {image.size_bytes / 1e6:.0f} MB")
