"""Where the SDK and CLI find the service URL and the API key.

Precedence, highest first: explicit arguments, environment (``TUNEFLEET_BASE_URL``,
``TUNEFLEET_API_KEY``), the config file ``$XDG_CONFIG_HOME/tunefleet/config.toml``
(default ``~/.config/tunefleet/config.toml``, overridable with ``TUNEFLEET_CONFIG``),
then the embedded default ``http://127.0.0.1:8000``.

The file is plain TOML with top-level keys ``base_url`` and ``api_key``; ``tunefleet
login`` writes it with mode 0600 because it holds a secret.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tunefleet.sdk.errors import ConfigurationError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
_KEYS = ("base_url", "api_key")


def config_path() -> Path:
    """The config file this process reads and ``login`` writes."""
    explicit = os.environ.get("TUNEFLEET_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    root = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(root).expanduser() / "tunefleet" / "config.toml"


def read_config_file(path: Path | None = None) -> dict[str, str]:
    """Read the config file; a missing file is an empty config, a broken one an error."""
    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"{path} is not valid TOML: {exc}") from exc
    return {k: str(data[k]) for k in _KEYS if isinstance(data.get(k), str)}


def write_config_file(values: dict[str, str], path: Path | None = None) -> Path:
    """Merge ``values`` into the config file, created with mode 0600.

    JSON string syntax is valid TOML basic-string syntax for the escapes it produces,
    so ``json.dumps`` quotes safely without a TOML writer dependency.
    """
    path = path or config_path()
    merged = {**read_config_file(path), **{k: v for k, v in values.items() if v is not None}}
    unknown = set(merged) - set(_KEYS)
    if unknown:
        raise ConfigurationError(f"unknown config keys: {sorted(unknown)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{k} = {json.dumps(merged[k], ensure_ascii=False)}\n" for k in _KEYS if k in merged)
    write_private_file(path, text)
    return path


def write_private_file(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by its owner only (it holds a secret).

    The text goes to a temporary file created with mode 0600 and then renamed over
    ``path``, so the secret is never in a file with wider permissions and a reader never
    sees half a file.
    """
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # O_CREAT's mode applies only to a new file: a leftover temporary keeps its own.
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def normalize_base_url(url: str) -> str:
    """Service root without a trailing slash; an OpenAI-style ``.../v1`` suffix is dropped.

    Users often paste the URL they give the ``openai`` SDK (``http://host:8000/v1``); the
    SDK also calls root routes (``/healthz``, ``/metrics``), so it keeps the root.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigurationError(f"base_url must be an http(s) URL, got {url!r}")
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    return url


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    api_key: str | None


def resolve_config(base_url: str | None = None, api_key: str | None = None) -> ClientConfig:
    """Apply the precedence rules above and validate the result."""
    file_values: dict[str, str] | None = None

    def from_file(key: str) -> str | None:
        nonlocal file_values
        if file_values is None:
            file_values = read_config_file()
        return file_values.get(key)

    url = base_url or os.environ.get("TUNEFLEET_BASE_URL") or from_file("base_url") or DEFAULT_BASE_URL
    key = api_key or os.environ.get("TUNEFLEET_API_KEY") or from_file("api_key")
    return ClientConfig(base_url=normalize_base_url(url), api_key=key or None)
