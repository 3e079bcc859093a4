"""What the Helm chart, the Kubernetes executor and the production rehearsal take for
granted about the images, checked against the built images themselves: the user they run
as, their home and working directory, their programs, where they may write on a read-only
root, which packages (at which versions) they hold, and the control plane's size."""

from __future__ import annotations

import itertools
import json
from importlib import metadata
from pathlib import Path

import yaml
from packaging.utils import canonicalize_name

from tests.deploy.chart import CHART_DIR, rendered_docs
from tests.deploy.images.container import Image, Mount
from tests.e2e.rehearsal import trainer_image_env
from worker.executors.manifests import HOME_MOUNT, SCRATCH_MOUNT, SPEC_FILE

CONSTRAINTS = Path(__file__).resolve().parents[3] / "deploy" / "docker" / "constraints"
# What each image installs, as its Dockerfile names it: the constraints files it is held to.
IMAGE_EXTRAS = {"api": ("server",), "trainer-torch-cuda": ("torch", "trackers"),
                "trainer-jax-rocm": ("jax", "trackers")}
ML_FRAMEWORKS = ("torch", "jax", "jaxlib", "transformers", "triton")
# The control plane without any ML framework (torch's CPU build alone installs ~700 MB).
API_IMAGE_MAX_BYTES = 600_000_000
# A Python probe run in an image: tries to write under each path given and prints
# {path: null (written) or the error}.
WRITE_PROBE = """
import json, os, sys, tempfile
result = {}
for path in sys.argv[1:]:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
        result[path] = None
    except OSError as exc:
        result[path] = exc.strerror
print(json.dumps(result))
"""


def _chart_values() -> dict:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))


def _installed(image: Image) -> dict[str, str]:
    assert image.root is not None
    (site,) = (image.root / "opt" / "venv" / "lib").glob("python3*/site-packages")
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=[str(site)])}


def _pins(extra: str) -> dict[str, str]:
    lines = (CONSTRAINTS / f"{extra}.txt").read_text(encoding="utf-8").splitlines()
    return {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in lines if line and line[0] != "#")}


def _write_probe(image: Image, paths: list[str], mounts: list[Mount], env: dict[str, str] | None = None) -> dict:
    result = image.run(["python", "-c", WRITE_PROBE, *paths], mounts, env or {})
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_every_image_runs_as_the_user_the_chart_and_the_executor_expect(images):
    security = _chart_values()["podSecurityContext"]
    for name, image in images.items():
        # runAsNonRoot can only verify a numeric USER; the chart names the same ids
        uid, gid = image.user
        assert image.config["User"] == f"{uid}:{gid}" and uid != 0, name
        assert (uid, gid) == (security["runAsUser"], security["runAsGroup"]), name
        # its home is where the executor mounts a trainer's home, and the working directory
        assert image.home == HOME_MOUNT == image.config["WorkingDir"], name
        assert (image.root / HOME_MOUNT.lstrip("/")).stat().st_uid == uid, name


def test_trainer_images_set_what_the_executor_and_the_rehearsal_assume(torch_image, jax_image):
    for image in (torch_image, jax_image):
        assert image.config["Entrypoint"] == ["python", "-m", "trainers"], image.reference
        assert image.config["Cmd"] == ["--spec", SPEC_FILE], image.reference
        # Hugging Face's cache on the scratch emptyDir of every trainer pod, offline
        assert image.env["HF_HOME"].startswith(SCRATCH_MOUNT + "/") and image.env["HF_HUB_OFFLINE"] == "1"
        # the production rehearsal gives its trainers what it reads from the Dockerfile
        assert trainer_image_env() == {"HOME": image.home, "HF_HOME": image.env["HF_HOME"]}


def test_the_programs_the_chart_and_executor_start_exist_in_the_images(images):
    commands = {tuple(c["command"]) for d in rendered_docs("default") if d["kind"] in ("Deployment", "Job")
                for c in d["spec"]["template"]["spec"]["containers"]}
    assert {c[0] for c in commands} == {"uvicorn", "tunefleet"}, commands
    scratch = [Mount("/tmp")]
    for command in sorted(commands):
        if command[0] == "tunefleet":  # the subcommand, then its --help
            argv = [*itertools.takewhile(lambda arg: not arg.startswith("-"), command), "--help"]
        else:  # the app factory uvicorn is given imports
            factory = next(a for a in command[1:] if not a.startswith("-"))
            module, _, function = factory.partition(":")
            argv = ["python", "-c", f"from {module} import {function}"]
        result = images["api"].run(argv, scratch)
        assert result.returncode == 0, (argv, result.stdout[-2000:], result.stderr[-2000:])
    assert images["api"].config["Cmd"][:3] == ["uvicorn", "--factory", "api.main:create_app"]
    for name in ("trainer-torch-cuda", "trainer-jax-rocm"):
        result = images[name].run([*images[name].config["Entrypoint"], "--help"], scratch)
        assert result.returncode == 0 and "--spec" in result.stdout, (name, result.stdout, result.stderr)


def test_the_images_write_only_to_the_volumes_they_are_given(api_image, torch_image):
    # the control plane as the chart mounts it: /tmp (its data dir), the API's metrics folder
    chart_env = {"TUNEFLEET_DATA_DIR": "/tmp/tunefleet", "PROMETHEUS_MULTIPROC_DIR": "/var/run/tunefleet-metrics"}
    mounts = [Mount("/tmp"), Mount("/var/run/tunefleet-metrics")]
    probe = _write_probe(api_image, [*chart_env.values(), api_image.home, "/opt/venv"], mounts, chart_env)
    assert probe == {"/tmp/tunefleet": None, "/var/run/tunefleet-metrics": None,
                     api_image.home: "Read-only file system", "/opt/venv": "Read-only file system"}
    # a trainer as the executor mounts it: scratch, home, /dev/shm
    mounts = [Mount(SCRATCH_MOUNT), Mount(HOME_MOUNT)]
    paths = [torch_image.env["HF_HOME"], HOME_MOUNT + "/.cache", "/dev/shm", "/opt/venv", "/etc"]
    probe = _write_probe(torch_image, paths, mounts)
    assert probe == {torch_image.env["HF_HOME"]: None, HOME_MOUNT + "/.cache": None, "/dev/shm": None,
                     "/opt/venv": "Read-only file system", "/etc": "Read-only file system"}


def test_each_image_holds_the_tested_versions_of_its_extras(images):
    for name, image in images.items():
        installed = _installed(image)
        for extra in IMAGE_EXTRAS[name]:
            for package, version in _pins(extra).items():
                # torch's local label (+cpu, +cu130) names the build, not the version
                assert installed.get(package, "").split("+")[0] == version, (name, package, installed.get(package))
    assert not set(ML_FRAMEWORKS) & set(_installed(images["api"])), "the control plane holds an ML framework"
    torch = _installed(images["trainer-torch-cuda"])
    jax = _installed(images["trainer-jax-rocm"])
    assert torch["torch"].endswith("+cpu") and "jax" not in torch  # built for the CPU: ACCELERATOR=cpu
    assert "torch" not in jax and not any(p.startswith("jax-rocm") for p in jax)
    trackers = {canonicalize_name(p) for p in ("mlflow-skinny", "wandb")}  # the trackers extra
    assert trackers <= set(torch) and trackers <= set(jax)


def test_the_control_plane_image_stays_small(api_image):
    assert api_image.size_bytes < API_IMAGE_MAX_BYTES, f"{api_image.size_bytes / 1e6:.0f} MB"
