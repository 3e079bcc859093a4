"""Tenant data on disk is its owner's alone: files 0600, directories 0700.

A training run writes a tenant's data through many hands: our own code (metrics,
``training_config.json``, the report spool), torch's distributed checkpoint writer
(``dcp/*.distcp``), safetensors, tokenizers' ``save_pretrained``, and the ranks the
launcher starts. None of those take a file mode, so the trainer process sets its umask to
``OWNER_ONLY_UMASK`` before it writes anything (``restrict_new_files``): every file and
directory it or its children create is then private from the first byte, with no window
between create and chmod and no writer that can be forgotten. The local executor, which
creates the job's directory and the trainer's log before the trainer runs, uses the same
modes through ``private_dir`` and ``open_private_log``.

Pure standard library: the trainers and the worker share it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

OWNER_ONLY_UMASK = 0o077
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def restrict_new_files() -> int:
    """Make every file this process (and its children) creates owner-only; the old umask."""
    return os.umask(OWNER_ONLY_UMASK)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) owner-only; an existing ``path`` is narrowed
    to owner-only too, its parents are left as they are."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    path.chmod(PRIVATE_DIR_MODE)
    return path


def open_private_log(path: Path) -> BinaryIO:
    """``path`` opened for appending, created owner-only (an existing file is narrowed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)
    return os.fdopen(fd, "ab")


def write_private_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, owner-only from its first byte.

    The text goes to a temporary file beside ``path`` and is renamed over it, so a reader
    (or a restart after a kill) sees the old content or the new, never half of it.
    """
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    # O_CREAT's mode applies only to a new file: a leftover temporary keeps its own.
    os.fchmod(fd, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
