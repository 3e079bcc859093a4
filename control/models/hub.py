"""Base models named by their Hugging Face Hub id (``org/name`` or ``org/name@revision``).

The operator allows the Hub with ``TUNEFLEET_HUB_ALLOWED_REPOS`` (glob patterns of
``org/name``); unset, Hub ids are refused. An allowed repo is downloaded once, by the
worker, with ``huggingface_hub.snapshot_download`` into a scratch directory and moved into
the artifact store as ``models/hub/<org>/<name>/<commit sha>/`` (a bucket, or the local
``<data>/artifacts``), where trainer pods read it like any ``s3://`` base model. The
revision asked for (default ``main``) is resolved to its commit first, and a commit already
in the store (its completion marker written last) is reused.

``huggingface_hub`` reads ``HF_TOKEN`` (gated and private repos) and ``HF_ENDPOINT`` (a
mirror) from the environment. Both are set by the operator, never by a tenant, so the
endpoint does not go through the outbound-address checks that tenant-given URLs
(webhooks, trackers) do. Every request has a timeout: an unreachable Hub is an error
(``hub_unreachable``), never a hang.
"""

from __future__ import annotations

import fnmatch
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from control.artifacts import ArtifactStore
from control.settings import Settings

# org/name as the Hub allows them, then an optional @revision (branch, tag or commit).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<rev>[\w./-]{1,200}))?$")
_COMPLETE = ".tunefleet-complete"


class HubError(Exception):
    """A Hub repo that cannot be used, with a stable code (``model_not_found``,
    ``model_access_denied``, ``hub_unreachable``, ``hub_disabled``, ``hub_repo_not_allowed``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubSnapshot:
    location: str  # in the artifact store: a directory or s3:// prefix
    commit_sha: str


def parse_hub_id(source: str) -> HubRef | None:
    """``org/name[@revision]`` as a ``HubRef``; None for anything else (paths, URIs)."""
    if source.startswith(("/", ".", "~")) or "://" in source:
        return None
    match = _HUB_ID.match(source)
    if match is None or ".." in source:
        return None
    return HubRef(match["repo"], match["rev"])


def check_allowed(ref: HubRef, settings: Settings) -> None:
    """Raise ``HubError`` unless the operator allows ``ref``'s repo."""
    patterns = [p.strip() for p in (settings.hub_allowed_repos or "").split(",") if p.strip()]
    if not patterns:
        raise HubError("hub_disabled", f"'{ref}' is a Hugging Face Hub id, and this service does not "
                       "fetch models from the Hub (the operator sets TUNEFLEET_HUB_ALLOWED_REPOS).")
    if not any(fnmatch.fnmatchcase(ref.repo_id, p) for p in patterns):
        raise HubError("hub_repo_not_allowed", f"Hub repo '{ref.repo_id}' is not among the repos this "
                       f"service may fetch: {', '.join(patterns)}.")


def fetch_snapshot(ref: HubRef, settings: Settings, store: ArtifactStore) -> HubSnapshot:
    """Download ``ref`` into ``store`` (or reuse the commit already there); where it is.

    Raises:
        HubError: ``model_not_found`` (no such repo or revision), ``model_access_denied``
            (gated or private, and HF_TOKEN does not grant it), ``hub_unreachable``.
    """
    from huggingface_hub import HfApi, snapshot_download

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at huggingface_hub's import
    api = HfApi(endpoint=endpoint)
    with _hub_errors(ref):
        sha = api.repo_info(ref.repo_id, revision=ref.revision, timeout=settings.hub_timeout_s).sha
    if not sha:
        raise HubError("model_not_found", f"The Hub gave no commit for '{ref}'.")
    prefix = f"models/hub/{ref.repo_id}/{sha}"
    if store.exists(f"{prefix}/{_COMPLETE}"):
        return HubSnapshot(store.location(prefix), sha)
    # one scratch directory per download: two registrations of one commit may fetch at once
    scratch = settings.tmp_dir / "hub" / f"{ref.repo_id.replace('/', '--')}-{sha}-{secrets.token_hex(4)}"
    try:
        with _hub_errors(ref):
            snapshot_download(ref.repo_id, revision=sha, local_dir=scratch, endpoint=endpoint,
                              etag_timeout=settings.hub_timeout_s)
        for path in sorted(scratch.rglob("*")):
            relative = path.relative_to(scratch)
            if path.is_file() and relative.parts[0] != ".cache":  # huggingface_hub's own metadata
                store.put_file(f"{prefix}/{relative.as_posix()}", path, move=True)
        store.put_bytes(f"{prefix}/{_COMPLETE}", sha.encode())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return HubSnapshot(store.location(prefix), sha)


@contextmanager
def _hub_errors(ref: HubRef) -> Iterator[None]:
    """Map huggingface_hub's (and its HTTP client's) exceptions to ``HubError``."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError as exc:  # a subclass of RepositoryNotFoundError: first
        raise HubError("model_access_denied", f"'{ref.repo_id}' is gated on the Hub and HF_TOKEN does "
                       "not grant access to it (accept its terms with the token's account).") from exc
    except RepositoryNotFoundError as exc:
        raise HubError("model_not_found", f"No Hub repo '{ref.repo_id}' (or it is private and "
                       "HF_TOKEN cannot read it).") from exc
    except RevisionNotFoundError as exc:
        raise HubError("model_not_found", f"Hub repo '{ref.repo_id}' has no revision "
                       f"'{ref.revision}'.") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubError("model_access_denied", f"The Hub refused '{ref}' ({status}).") from exc
        raise HubError("hub_unreachable", f"The Hub answered {status} for '{ref}'.") from exc
    except (httpx2.TransportError, LocalEntryNotFoundError) as exc:
        raise HubError("hub_unreachable", f"Could not reach the Hub for '{ref}': {exc}") from exc
