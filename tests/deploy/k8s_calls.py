"""Derive the RBAC permissions that service code needs from its Kubernetes client calls.

Not a hand-written list: every attribute of the service code that names a method of the
official client's API classes (``BatchV1Api.create_namespaced_job``,
``CoreV1Api.read_namespaced_pod_log``, ...) is looked up in the client itself, whose
generated ``_<method>_serialize`` carries the HTTP method and resource path. The path
gives the API group, resource, subresource and scope; the HTTP method (and, for
collections, whether the call is a watch) gives the RBAC verb, following the Kubernetes
API server's request-to-verb mapping.

A ``list_*`` method counts as ``watch`` when it is handed to ``watch.Watch().stream`` or
called with ``watch=True``, and as ``list`` when it is called directly. A method only
referenced (stored, passed on) counts as its plain request; a ``list_*`` method referenced
in a module that streams a function it holds in a variable (the informer pattern:
``Informer(core.list_namespaced_pod)`` ... ``w.stream(self.list_fn, ...)``) counts as
both ``list`` and ``watch``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True, order=True)
class Permission:
    group: str  # "" = core
    resource: str  # "pods", "pods/log", ...
    verb: str
    namespaced: bool


@lru_cache(maxsize=1)
def client_methods() -> dict[str, tuple[str, str]]:
    """Every public API method of the client -> (HTTP method, resource path).

    Read from the client's generated sources (kubernetes/client/api/*.py) without importing
    them: importing all 60-odd API modules costs seconds.
    """
    spec = importlib.util.find_spec("kubernetes")
    assert spec is not None and spec.submodule_search_locations, (
        "the kubernetes client is not installed"
    )
    api_dir = Path(spec.submodule_search_locations[0]) / "client" / "api"
    serialize = re.compile(
        r"def _(\w+)_serialize\(.*?method='(\w+)',\s*resource_path='([^']+)'", re.DOTALL
    )
    methods: dict[str, tuple[str, str]] = {}
    for source in sorted(api_dir.glob("*_api.py")):
        for name, method, path in serialize.findall(source.read_text(encoding="utf-8")):
            methods.setdefault(name, (method, path))
    return methods


def permission_for(method: str, path: str, *, watch: bool = False) -> Permission:
    """The RBAC permission of one request (the API server's RequestInfo rules)."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":  # /api/v1/...
        group, rest = "", parts[2:]
    elif parts[0] == "apis":  # /apis/<group>/<version>/...
        group, rest = parts[1], parts[3:]
    else:
        raise ValueError(f"not a resource path: {path}")
    namespaced = len(rest) >= 2 and rest[0] == "namespaces" and rest[1] == "{namespace}"
    if namespaced:
        rest = rest[2:]
    resource = rest[0]
    has_name = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        verb = "get" if has_name else ("watch" if watch else "list")
    elif method == "POST":
        verb = "create"
    elif method == "PUT":
        verb = "update"
    elif method == "PATCH":
        verb = "patch"
    elif method == "DELETE":
        verb = "delete" if has_name else "deletecollection"
    else:
        raise ValueError(f"unexpected HTTP method {method} for {path}")
    return Permission(group, resource, verb, namespaced)


def permissions_in_source(source: str) -> set[Permission]:
    """Permissions needed by the client calls in one Python source."""
    known = client_methods()
    tree = ast.parse(source)
    watched: set[int] = set()  # id() of Attribute nodes passed to .stream(...)
    called_with_watch: set[int] = set()
    called: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "stream"
                and node.args
                and isinstance(node.args[0], ast.Attribute)
            ):
                watched.add(id(node.args[0]))
            if isinstance(func, ast.Attribute):
                called.add(id(func))
                for kw in node.keywords:
                    if kw.arg == "watch" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False
                    ):
                        called_with_watch.add(id(func))
    # .stream(<something that is not a client method>): an informer streaming a stored list_fn.
    streams_stored_functions = any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "stream"
        and node.args
        and not (isinstance(node.args[0], ast.Attribute) and node.args[0].attr in known)
        for node in ast.walk(tree)
    )
    needed: set[Permission] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in known):
            continue
        method, path = known[node.attr]
        if id(node) in watched or id(node) in called_with_watch:
            needed.add(permission_for(method, path, watch=True))
        referenced_only = id(node) not in watched and id(node) not in called
        if referenced_only and streams_stored_functions and node.attr.startswith("list_"):
            needed.add(permission_for(method, path, watch=True))
        if (
            id(node) in called
            and id(node) not in called_with_watch
            or (id(node) not in watched and id(node) not in called)
        ):
            needed.add(permission_for(method, path))
    return needed


def permissions_in_tree(*roots: Path) -> dict[Permission, list[str]]:
    """Permission -> the files that need it, over every .py file under ``roots``."""
    found: dict[Permission, list[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if "kubernetes" not in text:
                continue
            for perm in permissions_in_source(text):
                found.setdefault(perm, []).append(str(path))
    return found
