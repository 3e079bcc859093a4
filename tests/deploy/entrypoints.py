"""Check that a container command names something that really exists in this repository.

Static and honest about it: no image is built here (no Docker engine), so a command is
checked against the source tree the images are built from — the `tunefleet` CLI's command
tree (subcommands and options), `python -m <module>` against importable modules,
and `uvicorn --factory module:function` against the module's source.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import typer.main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _is_group(command: object) -> bool:
    # typer vendors its own click; a group is whatever has subcommands.
    return isinstance(getattr(command, "commands", None), dict)


def _cli() -> object:
    from tunefleet.cli import app

    return typer.main.get_command(app)


def _check_cli(args: list[str]) -> list[str]:
    command = _cli()
    path = ["tunefleet"]
    rest = list(args)
    while rest and _is_group(command) and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = command.commands.get(name)
        if sub is None:
            return [
                f"`{' '.join(path)}` has no subcommand {name!r} (has {sorted(command.commands)})"
            ]
        command, path = sub, path + [name]
    if _is_group(command):
        return [f"`{' '.join(path)}` is a command group, not a command"]
    known = {
        opt
        for p in command.params
        for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])
    }
    problems = []
    for arg in rest:
        if arg.startswith("--"):
            opt = arg.split("=", 1)[0]
            if opt not in known:
                problems.append(f"`{' '.join(path)}` has no option {opt} (has {sorted(known)})")
    return problems


def _module_source(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a missing parent package
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin)


def _check_factory(target: str) -> list[str]:
    module, _, func = target.partition(":")
    source = _module_source(module)
    if source is None:
        return [f"module {module} does not exist"]
    tree = ast.parse(source.read_text(encoding="utf-8"))
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return [] if func in names else [f"{module} defines no function {func}"]


def check_command(argv: list[str]) -> list[str]:
    """Problems with a container command (empty list: it names existing things)."""
    if not argv:
        return ["empty command"]
    program, args = argv[0], argv[1:]
    if program == "tunefleet":
        return _check_cli(args)
    if program in ("python", "python3") and args[:1] == ["-m"]:
        module = args[1]
        source = _module_source(module)
        if source is None:
            return [f"no module {module}"]
        if source.name == "__init__.py" and _module_source(module + ".__main__") is None:
            return [f"package {module} has no __main__ (not runnable with -m)"]
        return []
    if program == "uvicorn":
        if "--factory" not in args:
            return [
                "uvicorn without --factory: the app is built by a factory (api.main:create_app)"
            ]
        targets = [a for a in args if not a.startswith("-")]
        return _check_factory(targets[0]) if targets else ["uvicorn without an app"]
    return [f"unknown program {program!r}"]
