"""A small stand-in for the Hugging Face Hub: what ``huggingface_hub.snapshot_download``
asks of it, served from directories on disk (``HF_ENDPOINT`` points at it).

No Hub is reachable here. What this fake answers as the Hub does (huggingface_hub 2.x):

- ``GET /api/models/{org}/{name}[/revision/{revision}]``: the model info, ``sha`` = the
  commit the branch (default main, or the commit itself) names, and ``siblings``;
- ``GET /api/models/{org}/{name}/tree/{commit}?recursive=...``: the files as
  ``{type: file, path, size, oid}`` (no LFS or Xet fields, so plain HTTP downloads follow);
- ``HEAD``/``GET /{org}/{name}/resolve/{revision}/{path}``: the file, with ``X-Repo-Commit``,
  ``ETag`` and ``Content-Length``, the headers ``hf_hub_download`` reads;
- errors with the ``X-Error-Code`` header huggingface_hub maps to its exceptions:
  ``RepoNotFound`` (404) for an unknown repo, ``RevisionNotFound`` (404) for an unknown
  branch or commit, ``EntryNotFound`` (404) for an unknown file, ``GatedRepo`` (401 without
  a token, 403 with a token not granted) on a gated repo's files (its metadata is public,
  as on the Hub).

What it does not: pagination, LFS/Xet, ranges, uploads. One commit per repo.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str
    branches: tuple[str, ...] = ("main",)
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)  # tokens granted access to gated repos
    requests: list[tuple[str, str]] = field(default_factory=list)

    def add_repo(self, repo_id: str, directory: Path, *, gated: bool = False) -> FakeRepo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes()
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode())
        for name, data in sorted(files.items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        repo = FakeRepo(files=files, sha=digest.hexdigest(), gated=gated)
        self.repos[repo_id] = repo
        return repo

    def serve(self) -> tuple[str, ThreadingHTTPServer]:
        """Start on a free loopback port; returns (endpoint URL, server to shut down)."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}", server

    # --- protocol -----------------------------------------------------------------------
    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) == 4:
            parts += ["revision", "main"]  # the model info without a revision: the main branch
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, what, revision = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
            repo = self._repo(handler, repo_id, revision)
            if repo is None:
                return
            if what == "revision":
                info = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                        "gated": "auto" if repo.gated else False,
                        "siblings": [{"rfilename": name} for name in repo.files]}
                return _json(handler, info, body=body)
            tree = [{"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                    for name, data in repo.files.items()]
            return _json(handler, tree, body=body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self._repo(handler, repo_id, revision)
            if repo is None:
                return
            if repo.gated and not self._granted(handler):
                has_token = handler.headers.get("Authorization", "").startswith("Bearer ")
                return _error(handler, 403 if has_token else 401, "GatedRepo",
                              f"Access to model {repo_id} is restricted.")
            data = repo.files.get(name)
            if data is None:
                return _error(handler, 404, "EntryNotFound", f"{name} does not exist on {revision}.")
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(len(data)))
            handler.send_header("ETag", f'"{_git_oid(data)}"')
            handler.send_header("X-Repo-Commit", repo.sha)
            handler.end_headers()
            if body:
                handler.wfile.write(data)
            return None
        return _error(handler, 404, None, "Not Found")

    def _repo(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(handler, 404, "RepoNotFound", "Repository not found")
            return None
        if revision not in repo.branches and revision != repo.sha:
            _error(handler, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _granted(self, handler: BaseHTTPRequestHandler) -> bool:
        auth = handler.headers.get("Authorization", "")
        return auth.startswith("Bearer ") and auth.removeprefix("Bearer ") in self.tokens


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _json(handler: BaseHTTPRequestHandler, value: object, *, body: bool) -> None:
    data = json.dumps(value).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if body:
        handler.wfile.write(data)


def _error(handler: BaseHTTPRequestHandler, status: int, code: str | None, message: str) -> None:
    data = json.dumps({"error": message}).encode()
    handler.send_response(status)
    if code is not None:
        handler.send_header("X-Error-Code", code)
    handler.send_header("X-Error-Message", message)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)
