"""The first-party import graph, read statically: no import cycles, and the layering rules.

Every ``.py`` file of the first-party packages (those pyproject.toml ships, and
``scheduling`` whenever it exists) is parsed with ``ast`` (nothing is imported
or executed), and each ``import`` / ``from ... import`` statement becomes an edge to the
first-party module it names.

Cycles: only imports that run when the module is imported count (module level, and the
bodies of ``if``/``try``/``with``/``class`` at module level). An import inside a function
runs later, when the importing module is complete, so it cannot see a half-initialized
module; an ``if TYPE_CHECKING:`` block never runs. The parent packages that Python imports
implicitly before a submodule are not edges either: ``pkg/__init__.py`` re-exporting
``pkg.sub`` is safe as long as ``pkg.sub`` does not import names from ``pkg`` itself, and
that import would be an explicit edge, which is counted.

Layering: these rules hold for every import statement in the file, at module level, inside
functions and under ``TYPE_CHECKING`` alike, because each one is a dependency of the code:

- ``api`` (the HTTP service) never imports ``worker`` (Celery tasks, executors, the
  scheduler loop): the API enqueues work by task name, so it runs without the worker code;
- ``worker`` never imports ``api``: what both need (settings, database, lifecycle,
  artifacts, errors, webhooks' outbox, report ingestion, ...) is the core, ``control``;
- ``control`` (the control-plane core both of them import) imports neither ``api`` nor
  ``worker``, nor ``tunefleet`` (the CLI and the SDK);
- nothing outside ``tunefleet`` imports the CLI (``tunefleet.cli``): it is the top of
  the graph, which starts the rest;
- ``trainers`` (run inside training pods) never imports ``api``, ``worker``, ``control``
  or ``scheduling``: a trainer image carries no service code;
- ``scheduling`` (placement and estimation decisions, pure) imports neither ``api`` nor
  ``worker``, and of ``control`` only the pure ``control.job_settings`` (a job's settings,
  which its requests are built from);
- ``control.job_settings`` itself is pure: the standard library, pydantic and
  ``trainers.spec``, nothing else;
- ``inference`` (the inference worker process) imports none of the service packages: the
  API resolves what a tenant may use into paths and sends them over the local channel;
- ``api`` and ``control`` reach ``inference`` only through its client
  (``inference.client`` and the ``inference.protocol`` shapes it speaks), never the engine
  that loads torch and models.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def first_party_packages() -> list[str]:
    """The top-level packages the wheel ships (pyproject's ``packages.find`` include list)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in patterns})


# `scheduling` and `control` are named too: their rules must apply as soon as the folder exists.
PACKAGES = sorted({*first_party_packages(), "api", "worker", "control", "trainers", "tunefleet", "scheduling",
                   "inference"})

# importer package -> packages it must never import
FORBIDDEN = {
    "api": ("worker",),
    "worker": ("api",),
    "control": ("api", "worker", "tunefleet"),
    "trainers": ("api", "worker", "control", "scheduling", "inference"),
    "scheduling": ("api", "worker", "inference"),
    "inference": ("api", "worker", "control", "scheduling", "tunefleet"),
}
# The only modules of ``inference`` the API may import.
INFERENCE_CLIENT = ("inference.client", "inference.protocol")
# The only module of ``control`` that ``scheduling`` may import.
SCHEDULING_READS_OF_CONTROL = ("control.job_settings",)
# What ``control.job_settings`` may import besides the standard library.
JOB_SETTINGS_IMPORTS = ("pydantic", "trainers.spec")


@dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. "api.jobs.routes"
    target: str  # the first-party module it names, e.g. "control.db.session"
    line: int
    at_import_time: bool  # runs when the importer is imported (counts for cycles)


def module_files() -> dict[str, Path]:
    """Module name -> file, for every first-party package present in the tree."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        if not (ROOT / package).is_dir():
            continue
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    body: list[ast.stmt], at_import_time: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``body``, with whether it runs at import time."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, at_import_time
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _import_nodes(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, False)
            yield from _import_nodes(node.orelse, at_import_time)
        else:
            for block in _blocks(node):
                yield from _import_nodes(block, at_import_time)


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement (class, if, try, with, for, match)."""
    blocks = [getattr(node, field, None) for field in ("body", "orelse", "finalbody")]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    blocks += [case.body for case in getattr(node, "cases", [])]
    return [block for block in blocks if isinstance(block, list)]


def _first_party(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a first-party module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` statement reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node, at_import_time in _import_nodes(tree.body, True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            source = _resolve_from(module, is_package, node)
            # `from pkg import sub` names the submodule when there is one, else pkg itself
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                     for alias in node.names]
        for name in names:
            target = _first_party(name, modules)
            if target is not None and target != module:
                found.append(Import(module, target, node.lineno, at_import_time))
    return found


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    modules = module_files()
    for package in ("api", "worker", "trainers", "tunefleet"):
        assert package in modules, f"{package}/ was not found: the graph would miss its imports"
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


def import_cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    successors: dict[str, set[str]] = {}
    for edge in edges:
        if edge.at_import_time:
            successors.setdefault(edge.importer, set()).add(edge.target)
            successors.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(successors[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return sorted(components)


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def test_no_module_level_import_cycles(graph: list[Import]) -> None:
    cycles = import_cycles(graph)
    described = []
    for members in cycles:
        inside = set(members)
        lines = [f"  {e.importer} -> {e.target} (line {e.line})" for e in graph
                 if e.at_import_time and e.importer in inside and e.target in inside]
        described.append("cycle among " + ", ".join(members) + ":\n" + "\n".join(sorted(set(lines))))
    assert not cycles, "module-level import cycles:\n" + "\n".join(described)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_layering(graph: list[Import], importer: str) -> None:
    assert (ROOT / importer).is_dir(), f"no {importer}/ package in this tree: the layering rule guards nothing"
    forbidden = FORBIDDEN[importer]
    violations = sorted(
        f"{e.importer} imports {e.target} (line {e.line})"
        for e in graph
        if _package(e.importer) == importer and _package(e.target) in forbidden
    )
    assert not violations, f"{importer} must not import {', '.join(forbidden)}:\n" + "\n".join(violations)


@pytest.mark.parametrize("importer", ["api", "control"])
def test_the_service_reaches_inference_only_through_its_client(graph: list[Import], importer: str) -> None:
    violations = sorted(
        f"{e.importer} imports {e.target} (line {e.line})"
        for e in graph
        if _package(e.importer) == importer and _package(e.target) == "inference"
        and e.target not in INFERENCE_CLIENT
    )
    assert not violations, f"{importer} may import only {', '.join(INFERENCE_CLIENT)}:\n" + "\n".join(violations)


def test_nothing_imports_the_cli_but_the_cli_package(graph: list[Import]) -> None:
    violations = sorted(
        f"{e.importer} imports {e.target} (line {e.line})"
        for e in graph
        if (e.target == "tunefleet.cli" or e.target.startswith("tunefleet.cli."))
        and _package(e.importer) != "tunefleet"
    )
    assert not violations, "only tunefleet may import tunefleet.cli:\n" + "\n".join(violations)


def test_scheduling_reads_only_the_job_settings_of_control(graph: list[Import]) -> None:
    violations = sorted(
        f"{e.importer} imports {e.target} (line {e.line})"
        for e in graph
        if _package(e.importer) == "scheduling" and _package(e.target) == "control"
        and e.target not in SCHEDULING_READS_OF_CONTROL
    )
    assert not violations, (f"scheduling may import only {', '.join(SCHEDULING_READS_OF_CONTROL)} of control:\n"
                            + "\n".join(violations))


def _imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """Every module an import statement of ``path`` names (absolute imports), with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node, _ in _import_nodes(tree.body, True):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif node.level == 0 and node.module:
            yield node.module, node.lineno
        else:
            yield "." * node.level + (node.module or ""), node.lineno


def _allowed_in_job_settings(name: str) -> bool:
    top = name.split(".", 1)[0]
    return top in sys.stdlib_module_names or any(
        name == allowed or name.startswith(f"{allowed}.") for allowed in JOB_SETTINGS_IMPORTS)


def test_job_settings_imports_only_the_standard_library_pydantic_and_the_trainer_contract() -> None:
    path = ROOT / "control" / "job_settings.py"
    assert path.is_file(), "control/job_settings.py was not found: the rule guards nothing"
    violations = sorted(f"{name} (line {line})" for name, line in _imported_names(path)
                        if not _allowed_in_job_settings(name))
    assert not violations, ("control.job_settings may import only the standard library and "
                            f"{', '.join(JOB_SETTINGS_IMPORTS)}:\n" + "\n".join(violations))


def test_the_purity_rule_tells_allowed_imports_from_others() -> None:
    assert all(map(_allowed_in_job_settings, ("typing", "collections.abc", "pydantic", "pydantic.fields",
                                              "trainers.spec", "__future__")))
    assert not any(map(_allowed_in_job_settings, ("sqlalchemy", "trainers", "trainers.common.formats",
                                                  "control.settings", "pydantic_settings", "scheduling", ".spec")))


def test_the_checker_sees_each_kind_of_import(tmp_path: Path) -> None:
    """The parser's own contract, on a small tree: which statements become which edges."""
    source = (
        "from __future__ import annotations\n"
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import thing\n"
        "import pkg.d\n"
        "try:\n"
        "    from pkg import e\n"
        "except ImportError:\n"
        "    from pkg import f\n"
        "if TYPE_CHECKING:\n"
        "    from pkg import g\n"
        "def later():\n"
        "    from pkg import h\n"
    )
    modules = {name: tmp_path / "x.py" for name in
               ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e", "pkg.f", "pkg.g", "pkg.h")}
    path = tmp_path / "a.py"
    path.write_text(source)
    edges = {(e.target, e.at_import_time) for e in imports_of("pkg.a", path, modules)}
    assert edges == {("pkg.b", True), ("pkg.c", True), ("pkg.d", True), ("pkg.e", True),
                     ("pkg.f", True), ("pkg.g", False), ("pkg.h", False)}
    loop = [Import("pkg.a", "pkg.b", 1, True), Import("pkg.b", "pkg.a", 1, True),
            Import("pkg.b", "pkg.c", 1, True), Import("pkg.c", "pkg.a", 1, False)]
    assert import_cycles(loop) == [["pkg.a", "pkg.b"]]
