"""The Dockerfiles, checked statically: no Docker engine runs here, so no image is built.

What is checked: the files parse with BuildKit's own parser (the `dockerfile` package
wraps it), hadolint reports nothing, base images are pinned, builds are multi-stage, the
final stage runs as a non-root user, trainers start with `python -m trainers`, the API
image has a HEALTHCHECK, everything COPY'd exists and survives .dockerignore, and the
pinned versions agree with pyproject.toml. Whether the pinned base tags still exist in
their registries, and whether the builds succeed, is not checked here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.entrypoints import check_command

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
DOCKERFILES = {
    p.name.removesuffix(".Dockerfile"): p for p in sorted(DOCKER_DIR.glob("*.Dockerfile"))
}
TRAINERS = ("trainer-jax-rocm", "trainer-torch-cuda")
CONSTRAINTS = DOCKER_DIR / "constraints"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_three_images_exist():
    assert set(DOCKERFILES) == {"api", *TRAINERS}


def _commands(name: str) -> tuple:
    return dockerfile.parse_file(str(DOCKERFILES[name]))


def _stages(name: str) -> list[list]:
    stages: list[list] = []
    for command in _commands(name):
        if command.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(command)
    return stages


def _global_args(name: str) -> dict[str, str]:
    args = {}
    for command in _commands(name):
        if command.cmd == "FROM":
            break
        if command.cmd == "ARG":
            key, _, default = command.value[0].partition("=")
            args[key] = default.strip('"')
    return args


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_hadolint_reports_nothing(name):
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILES[name])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_base_images_are_pinned_and_builds_are_multi_stage(name):
    args = _global_args(name)
    stage_names: set[str] = set()
    froms = [c for c in _commands(name) if c.cmd == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    for command in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], command.value[0])
        if image not in stage_names:
            ref, _, digest = image.partition("@")
            repo, _, tag = ref.rpartition(":")
            assert repo and tag and "/" not in tag, f"{image}: no tag"
            assert tag != "latest" and not tag.startswith("latest"), image
            assert not digest or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), image
        if len(command.value) == 3 and command.value[1].upper() == "AS":
            stage_names.add(command.value[2])
    assert froms[-1].value[-1] == "runtime"


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_the_runtime_stage_runs_as_a_non_root_user(name):
    final = _stages(name)[-1]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users, "no USER in the runtime stage (it would run as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid (runAsNonRoot can check it)"
    # Nothing after USER switches back to root.
    after = final[[c.cmd for c in final].index("USER") :]
    assert all(c.cmd != "RUN" for c in after)


@pytest.mark.parametrize("name", TRAINERS)
def test_trainers_start_with_python_m_trainers(name):
    final = _stages(name)[-1]
    (entrypoint,) = [c for c in final if c.cmd == "ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["python", "-m", "trainers"]
    assert check_command(list(entrypoint.value)) == []
    # The default arguments name the spec where the Kubernetes executor mounts it.
    from worker.executors.manifests import SPEC_FILE

    (cmd,) = [c for c in final if c.cmd == "CMD"]
    assert list(cmd.value) == ["--spec", SPEC_FILE]


def test_api_image_has_a_healthcheck_and_a_real_default_command():
    final = _stages("api")[-1]
    (health,) = [c for c in final if c.cmd == "HEALTHCHECK"]
    assert "/healthz" in " ".join(health.value)
    (cmd,) = [c for c in final if c.cmd == "CMD"]
    assert cmd.json and check_command(list(cmd.value)) == []
    # The production control plane carries no ML framework.
    (extras,) = [
        c.value[0] for c in _stages("api")[0] if c.cmd == "ARG" and c.value[0].startswith("EXTRAS")
    ]
    assert extras == "EXTRAS=server"


# ---- the build context -------------------------------------------------------------------


def _dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (REPO_ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            elif pattern[i] == "[" and "]" in pattern[i:]:  # a character class, as in Go
                end = pattern.index("]", i)
                regex += pattern[i : end + 1]
                i = end + 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(regex.replace(".*/", "(.*/)?") + "$")))
    return rules


def sent_to_builder(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, regex in _dockerignore_rules():
        if any(regex.match(c) for c in candidates):
            included = negate
    return included


def test_dockerignore_matcher_agrees_with_docker_semantics():
    assert sent_to_builder("control/settings.py")
    assert sent_to_builder("deploy/docker/constraints/server.txt")
    assert not sent_to_builder(".venv/bin/python")
    assert not sent_to_builder("tests/deploy/test_dockerfiles.py")
    assert not sent_to_builder("api/__pycache__/settings.cpython-311.pyc")
    assert not sent_to_builder("deploy/docker/api.Dockerfile")
    assert not sent_to_builder(".env")
    assert not sent_to_builder("worker/tasks/jobs.pyc")


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_everything_copied_exists_and_is_sent_to_the_builder(name):
    for command in _commands(name):
        if command.cmd not in ("COPY", "ADD") or any(f.startswith("--from") for f in command.flags):
            continue
        for source in command.value[:-1]:
            path = REPO_ROOT / source
            assert path.exists(), f"COPY {source}: not in the repository"
            assert sent_to_builder(source), f"COPY {source}: excluded by .dockerignore"
            if path.is_dir():
                for file in path.rglob("*.py"):
                    rel = file.relative_to(REPO_ROOT).as_posix()
                    if "__pycache__" not in rel:
                        assert sent_to_builder(rel), rel


# ---- versions ----------------------------------------------------------------------------


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("extra", ["server", "torch", "jax", "trackers"])
def test_constraints_satisfy_pyproject(extra):
    pins = _pins(CONSTRAINTS / f"{extra}.txt")
    requirements = (
        PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"][extra]
    )
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        regenerate = "run .venv/bin/python deploy/docker/update_constraints.py"
        assert name in pins, f"{extra}.txt does not pin {name}: {regenerate}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            text,
            pins[name],
            regenerate,
        )


def test_torch_and_jax_pins_agree_everywhere():
    torch_pin = (
        (REPO_ROOT / "requirements" / "torch.txt")
        .read_text(encoding="utf-8")
        .split("==")[1]
        .strip()
    )
    assert _pins(CONSTRAINTS / "torch.txt")["torch"] == torch_pin
    assert f"torch=={torch_pin}" in PYPROJECT["project"]["optional-dependencies"]["torch"]
    jax_pin = _pins(CONSTRAINTS / "jax.txt")["jax"]
    run = " ".join(" ".join(c.value) for c in _commands("trainer-jax-rocm") if c.cmd == "RUN")
    for package in ("jax-rocm7-pjrt", "jax-rocm7-plugin", "jaxlib", "jax"):
        assert f'"{package}=={jax_pin}"' in run, package


@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_images_install_every_tracker_a_job_may_name(name):
    """A job's `integrations` mirror to MLflow / W&B from the trainer pod: each tracker
    type the spec accepts is importable in both trainer images, at the tested versions."""
    from importlib.metadata import packages_distributions
    from typing import get_args

    from trainers.spec import IntegrationSpec

    trackers = {
        canonicalize_name(Requirement(r).name)
        for r in PYPROJECT["project"]["optional-dependencies"]["trackers"]
    }
    providers = packages_distributions()
    for tracker in get_args(IntegrationSpec.model_fields["type"].annotation):
        # the module the trainer imports for it (trainers/common/integrations.py)
        assert {canonicalize_name(d) for d in providers[tracker]} & trackers, tracker
    install = [
        " ".join(c.value) for c in _stages(name)[0] if c.cmd == "RUN" and "pip install" in " ".join(c.value)
    ]
    (project,) = [line for line in install if '".[' in line]
    extras = re.search(r'"\.\[([a-z,]+)\]"', project).group(1).split(",")
    assert "trackers" in extras, project
    copies = {c.value[-1]: c.value[0] for c in _stages(name)[0] if c.cmd == "COPY"}
    constraint_files = {copies[path] for path in re.findall(r"-c (/tmp/[\w.-]+)", project) if path in copies}
    assert "deploy/docker/constraints/trackers.txt" in constraint_files
    assert "import mlflow, wandb" in project  # the build fails without them


def test_every_constraints_file_pins_a_package_to_one_version():
    # pip refuses two constraints that pin one package to different versions: the trainer
    # images combine their extra's file with trackers.txt, the API image combines them all.
    versions: dict[str, dict[str, str]] = {}
    for path in sorted(CONSTRAINTS.glob("*.txt")):
        for name, version in _pins(path).items():
            versions.setdefault(name, {})[path.name] = version
    clash = {name: files for name, files in versions.items() if len(set(files.values())) > 1}
    assert not clash, f"{clash}: run .venv/bin/python deploy/docker/update_constraints.py"
