"""What `pip install .` puts into the images, built from exactly the Docker build context.

The Dockerfiles install the project non-editable from the context that `.dockerignore`
lets through; the test venv installs it editable from the working tree, so a file that is
in the tree but not in the wheel (an asset type missing from package-data, a folder the
context leaves out) would work in every test and be missing in every image. This test
copies the build context as Docker would send it, builds the wheel from that copy with the
project's build backend, and requires every runtime file of the packages to be in it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.deploy.test_dockerfiles import REPO_ROOT, sent_to_builder

PACKAGES = ("api", "worker", "control", "scheduling", "kube", "trainers", "tunefleet")


def _build_context(dest: Path) -> None:
    for path in REPO_ROOT.rglob("*"):
        rel = path.relative_to(REPO_ROOT).as_posix()
        top = rel.split("/", 1)[0]
        if top in (".venv", ".git", "node_modules") or not path.is_file():
            continue
        if sent_to_builder(rel):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def test_the_wheel_built_from_the_docker_context_holds_every_runtime_file(tmp_path):
    context = tmp_path / "context"
    _build_context(context)
    assert (context / "pyproject.toml").is_file() and not (context / "tests").exists()
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("tunefleet-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        p.relative_to(context).as_posix()
        for package in PACKAGES
        for p in (context / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    missing = sorted(expected - in_wheel)
    assert not missing, f"in the source tree but not in the image's wheel: {missing}"
    # The image's entry points: the console script and the migrations it runs.
    entry_points = next(n for n in in_wheel if n.endswith(".dist-info/entry_points.txt"))
    assert "tunefleet = tunefleet.cli.main:app" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert any(n.startswith("control/db/migrations/versions/") for n in in_wheel)
