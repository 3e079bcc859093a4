"""Writing downloaded artifacts safely: temp file, sha256 while streaming, atomic rename.

A download whose checksum differs from the listed one is deleted and raises
``ChecksumMismatchError``; a partial file never appears under the final name.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tunefleet.sdk.errors import ChecksumMismatchError
from tunefleet.sdk.types import Artifact


class ArtifactWriter:
    def __init__(self, dest: Path, name: str, expected_sha256: str | None) -> None:
        self.dest = dest
        self.name = name
        self.expected = expected_sha256.lower() if expected_sha256 else None
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = dest.with_name(f".{dest.name}.part")
        self._fh = open(self.tmp, "wb")  # noqa: SIM115 (closed by finish/abort)
        self._hash = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self._fh.write(chunk)

    def abort(self) -> None:
        self._fh.close()
        self.tmp.unlink(missing_ok=True)

    def finish(self, header_sha256: str | None = None) -> Path:
        """Check the digest against the listing (or the response header) and publish the file."""
        self._fh.close()
        actual = self._hash.hexdigest()
        expected = self.expected or (header_sha256.lower() if header_sha256 else None)
        if expected is not None and actual != expected:
            self.tmp.unlink(missing_ok=True)
            raise ChecksumMismatchError(self.name, expected, actual)
        os.replace(self.tmp, self.dest)
        return self.dest


def local_path(dest_dir: Path, name: str) -> Path:
    """Where artifact ``name`` goes under ``dest_dir``; names never escape the directory."""
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid artifact name {name!r}")
    return dest_dir.joinpath(*parts)


def listed_sha256(artifacts: list[Artifact], name: str) -> str | None:
    """The digest the artifacts listing gives for ``name``, if it lists it."""
    listed = {a.name: a for a in artifacts}
    return listed[name].sha256 if name in listed else None


def download_plan(artifacts: list[Artifact], dest_dir: Path, prefix: str) -> list[tuple[Artifact, Path]]:
    """The artifacts whose names start with ``prefix``, each with where it goes under ``dest_dir``."""
    return [(a, local_path(dest_dir, a.name)) for a in artifacts if a.name.startswith(prefix)]
