"""Putting an upload's parts together into one stored file, a chunk at a time.

The parts are read in the order the client gave and written through the store's
``put_stream`` (a file written in place locally; an S3 multipart upload of bounded
parts), so memory holds one chunk (S3: one part) whatever the file's size. The same pass
computes what the File needs and what the client asked to check: the sha256, the md5
and whether the bytes are UTF-8. Reading every byte once is needed for those anyway,
so a server-side copy of the parts would save the write and not the read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from api.files.uploads import Utf8Check
from control.artifacts import ArtifactStore


@dataclass
class Assembled:
    """What one pass over the parts found."""

    size: int = 0
    sha256: str = ""
    md5: str = ""
    utf8: Utf8Check = field(default_factory=Utf8Check)


def assemble(store: ArtifactStore, parts: Sequence[str], key: str) -> Assembled:
    """Write the objects ``parts`` (keys of ``store``) one after the other to ``key``;
    returns what the pass found."""
    found = Assembled()
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)

    def chunks() -> Iterator[bytes]:
        for part in parts:
            for chunk in store.iter_bytes(part):
                sha256.update(chunk)
                md5.update(chunk)
                found.utf8.feed(chunk)
                found.size += len(chunk)
                yield chunk

    store.put_stream(key, chunks())
    found.utf8.finish()
    found.sha256, found.md5 = sha256.hexdigest(), md5.hexdigest()
    return found
