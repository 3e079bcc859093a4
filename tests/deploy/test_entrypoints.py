"""The command checker used by the compose, chart and Dockerfile tests can say no."""

from __future__ import annotations

import pytest

from tests.deploy.entrypoints import check_command


@pytest.mark.parametrize(
    "argv",
    [
        ["tunefleet", "db", "upgrade"],
        ["tunefleet", "worker", "--concurrency=4"],
        ["tunefleet", "scheduler"],
        ["python", "-m", "trainers"],
        ["uvicorn", "--factory", "api.main:create_app", "--port=8000"],
    ],
)
def test_commands_the_deployments_use_exist(argv):
    assert check_command(argv) == []


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["tunefleet", "migrate"], "no subcommand 'migrate'"),
        (["tunefleet", "db"], "command group"),
        (["tunefleet", "worker", "--threads=4"], "no option --threads"),
        (["python", "-m", "trainer"], "no module trainer"),
        (["python", "-m", "api"], "has no __main__"),
        (["uvicorn", "--factory", "api.main:app_factory"], "no function app_factory"),
        (["uvicorn", "api.main:app"], "without --factory"),
        (["gunicorn", "api.main:app"], "unknown program"),
    ],
)
def test_commands_that_do_not_exist_are_reported(argv, problem):
    problems = check_command(argv)
    assert len(problems) == 1 and problem in problems[0]
