"""Identifiers and secrets: prefixed object ids, API keys and per-job tokens.

Object ids (``file-…``, ``ftjob-…``, ``ftevent-…``, ``ftckpt-…``, ``org-…``, ``key-…``)
are opaque to clients. API keys look like ``tf_<prefix8>_<secret32>``; the database keeps
only ``sha256(key)`` and the prefix, so a leaked database does not leak keys.
"""

from __future__ import annotations

import hashlib
import secrets
import string

_ALPHABET = string.ascii_letters + string.digits


_UNBIASED = 256 - 256 % len(_ALPHABET)  # bytes below this map uniformly onto the alphabet


def _random(n: int) -> str:
    """``n`` characters drawn uniformly from the alphabet by the OS's CSPRNG: random bytes,
    those that would bias the modulo rejected (3%), instead of one ``secrets.choice`` per
    character (30x slower: the scheduler writes thousands of event ids per cycle)."""
    out = ""
    while len(out) < n:
        out += "".join(_ALPHABET[b % len(_ALPHABET)] for b in secrets.token_bytes(n + 8) if b < _UNBIASED)
    return out[:n]


def new_id(prefix: str) -> str:
    """A new opaque id such as ``ftjob-3fQ9…`` (24 random alphanumerics: ~143 bits)."""
    return f"{prefix}-{_random(24)}"


def hash_secret(secret: str) -> str:
    """sha256 hex digest of an API key or a job token: what the database stores."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_api_key() -> tuple[str, str]:
    """A new API key and its displayable prefix: (``tf_<prefix>_<secret>``, ``<prefix>``)."""
    prefix = _random(8)
    return f"tf_{prefix}_{_random(32)}", prefix


def key_prefix(key: str) -> str | None:
    """The prefix of a well-formed key, None for anything else."""
    parts = key.split("_")
    if len(parts) != 3 or parts[0] != "tf" or len(parts[1]) != 8 or len(parts[2]) != 32:
        return None
    return parts[1]


def new_job_token() -> str:
    """A per-job bearer token for the trainer's report endpoint."""
    return "tfjob_" + secrets.token_urlsafe(32)
