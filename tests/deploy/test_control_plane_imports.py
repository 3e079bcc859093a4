"""The control-plane image installs the `server` extra only (api.Dockerfile): whatever its
programs import at start must come from that extra, or the worker, the scheduler or the
API dies at start in production while every test, run in the full venv, passes.

Checked without an image: a subprocess imports what each program imports at start
with every module that no distribution of deploy/docker/constraints/server.txt provides
refused, as it is missing in the image. (tests/deploy/images/ runs the built image itself.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import packages_distributions

from packaging.utils import canonicalize_name

from tests.deploy.test_dockerfiles import CONSTRAINTS, REPO_ROOT, _pins
from worker.celery_app import TASK_MODULES

# What the programs import as they start: uvicorn's app factory, the scheduler's loop, the
# Celery worker's task modules, the CLI.
START_MODULES = ("api.main", "worker.scheduler.loop", "worker.metrics", "tunefleet.cli", *TASK_MODULES)
GUARD = """
import importlib.abc, json, sys
MISSING = set(json.loads(sys.argv[1]))

class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the server extra)", name=name)
        return None

sys.meta_path.insert(0, NotInTheImage())
for module in sys.argv[2:]:
    __import__(module)
"""


def _modules_outside_the_server_extra() -> list[str]:
    server = set(_pins(CONSTRAINTS / "server.txt"))
    project = {"api", "control", "worker", "scheduling", "kube", "trainers", "tunefleet", "inference"}
    return sorted(module for module, dists in packages_distributions().items()
                  if module not in project and not {canonicalize_name(d) for d in dists} & server
                  and not module.startswith("_") and module.isidentifier())


def test_the_control_plane_programs_start_with_the_server_extra_alone():
    missing = _modules_outside_the_server_extra()
    assert {"torch", "jax", "transformers"} <= set(missing)  # the guard guards something
    result = subprocess.run([sys.executable, "-c", GUARD, json.dumps(missing), *START_MODULES],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
