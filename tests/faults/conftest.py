"""Fixtures of the fault tests on the service in production mode (``tests.faults.production``).

``production`` (session)
    One ``ProductionStack`` (throwaway PostgreSQL and Redis, API, Celery worker,
    scheduler, local executor) shared by the tests that ask for it: starting one costs
    tens of seconds. Its ``<data>/jobs`` and ``<data>/artifacts`` are small tmpfs mounts
    where the process may mount (``disks``), so a test can fill one.
``stack``
    ``production`` for one test: afterwards every filled disk is emptied and any backend
    or role the test stopped runs again, so the next test starts from a working service;
    on failure the service's logs are printed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.production import ProductionStack, ScratchDisk, production_stack

# Webhook retries in seconds, not minutes; receivers on 127.0.0.1 are allowed.
STACK_ENV = {"TUNEFLEET_WEBHOOK_ALLOW_PRIVATE": "true", "TUNEFLEET_WEBHOOK_RETRY_BASE_S": "0.5",
             "TUNEFLEET_WEBHOOK_TIMEOUT_S": "30"}
DISK_MIB = 64  # far more than a tiny model's job writes, little enough to fill in a blink


@pytest.fixture(scope="session")
def production(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionStack]:
    from tunefleet.demo import ensure_demo_model

    tiny_model = ensure_demo_model(tmp_path_factory.mktemp("models"))
    root = tmp_path_factory.mktemp("production")
    disks: dict[str, ScratchDisk] = {}

    def mount_disks(data_dir: Path) -> None:
        for name in ("jobs", "artifacts"):
            disks[name] = ScratchDisk(data_dir / name, DISK_MIB)
            disks[name].mount()

    try:
        with production_stack(root, tiny_model, before_start=mount_disks, **STACK_ENV) as stack:
            stack.disks = disks
            yield stack
    finally:
        for disk in disks.values():
            disk.unmount()


@pytest.fixture
def stack(production: ProductionStack, request: pytest.FixtureRequest) -> Iterator[ProductionStack]:
    failures_before = request.session.testsfailed
    yield production
    if request.session.testsfailed > failures_before:
        print(production.service.dump_logs())
    for disk in production.disks.values():
        disk.free()
    production.ensure_up()
