"""Artifact stores: where uploaded files and job outputs live.

Two implementations of one small interface: ``LocalArtifactStore`` (a directory; the
embedded default and shared PVCs) and ``S3ArtifactStore`` (any S3-compatible bucket via
boto3; ``endpoint_url`` for MinIO/Ceph/...). A store is rooted at a location (a path or
``s3://bucket/prefix``) and addressed by relative keys such as ``files/file-abc.jsonl`` or
``adapter/adapter_model.safetensors``.

Keys come from users (artifact names in URLs), so every key goes through ``safe_key``:
absolute paths, ``..`` segments, backslashes and control characters are refused with
``invalid_artifact_path``, and the local store re-checks that the resolved path stays
under its root (symlinks included).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from control.errors import APIError
from control.settings import resolved_dir

if TYPE_CHECKING:
    from control.settings import Settings

CHUNK = 1024 * 1024
# What the S3 store holds in memory while it writes a stream: one part of a multipart
# upload (S3 wants at least 5 MiB in every part but the last).
S3_STREAM_PART = 8 * 1024 * 1024


def safe_key(name: str) -> str:
    """``name`` as a normalized relative key, or a 400 ``invalid_artifact_path``."""
    bad = (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(ord(c) < 32 for c in name)
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise APIError(
            400, "invalid_artifact_path",
            "Artifact names are relative paths inside the job's output, without '..'.",
            param="name",
        )
    return name  # already normal: no empty, "." or ".." part, no leading or doubled "/"


def _has_symlink(root: str, key: str) -> bool:
    """Whether some existing component of ``root/key`` below ``root`` is a symlink."""
    current = root
    for part in key.split("/"):
        current = os.path.join(current, part)
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                return True
        except (FileNotFoundError, NotADirectoryError):
            return False  # nothing below a missing component exists, links included
    return False


@dataclass(frozen=True)
class OpenedObject:
    """A stored object opened for reading: its size, and its bytes in chunks. Once opened
    it is read whole even if it is deleted meanwhile (a local file through its handle, an
    S3 object through the GET that started)."""

    size: int
    chunks: Iterator[bytes]


def _read_chunks(handle: IO[bytes], chunk_size: int) -> Iterator[bytes]:
    try:
        while chunk := handle.read(chunk_size):
            yield chunk
    finally:
        handle.close()


class ArtifactStore(Protocol):
    """A rooted key -> bytes store."""

    def location(self, key: str = "") -> str:
        """Where ``key`` lives as a trainer sees it: a local path or an s3:// URI."""

    def put_file(self, key: str, source: Path, *, move: bool = False) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> None:
        """Write ``chunks`` as one object without holding more than a part of it in memory;
        nothing is left at ``key`` when ``chunks`` raises."""

    def read_bytes(self, key: str) -> bytes: ...

    def iter_bytes(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]: ...

    def open(self, key: str, chunk_size: int = CHUNK) -> OpenedObject:
        """``key`` opened now (``FileNotFoundError`` if it is not stored): what a download
        answers from, so its status and length are those of an object it holds."""

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under the folder ``prefix`` (nothing when there is none)."""

    def list(self, prefix: str = "") -> list[str]: ...

    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None:
        """A URL a client can GET without credentials, or None (local store)."""


class LocalArtifactStore:
    """Files under a root directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = resolved_dir(Path(root))
        self._root_text = str(self.root)

    def _text(self, key: str) -> str:
        """The absolute path of ``key``, checked to stay under the root.

        The root is resolved and ``safe_key`` leaves no ``..``, so the joined path is
        already canonical unless some component under the root is a symlink: only then
        is the path resolved and compared with the root. (The trainer spec of every
        admitted job asks for several locations; this costs one ``lstat`` per key part
        instead of one per component from ``/``, bench/scheduler_cycle_db.py.)
        """
        text = os.path.join(self._root_text, safe_key(key))
        if not _has_symlink(self._root_text, key):
            return text
        resolved, root = os.path.realpath(text), self._root_text
        if resolved != root and not resolved.startswith(root.rstrip(os.sep) + os.sep):
            raise APIError(400, "invalid_artifact_path", "Artifact path escapes the job output.")
        return resolved

    def _path(self, key: str) -> Path:
        return Path(self._text(key))

    def location(self, key: str = "") -> str:
        return self._text(key) if key else self._root_text

    def put_file(self, key: str, source: Path, *, move: bool = False) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        if move:
            os.replace(source, target)
        else:
            tmp = target.with_name(target.name + ".partial")
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)

    def put_bytes(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        # Tenant data: readable by the service's user only, like an upload's temporary file.
        handle = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        try:
            with handle:
                for chunk in chunks:
                    handle.write(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, target)

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def iter_bytes(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        yield from self.open(key, chunk_size).chunks

    def open(self, key: str, chunk_size: int = CHUNK) -> OpenedObject:
        handle = self._path(key).open("rb")
        return OpenedObject(size=os.fstat(handle.fileno()).st_size, chunks=_read_chunks(handle, chunk_size))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        folder = self._path(prefix)
        if folder.is_dir():
            shutil.rmtree(folder)

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root).as_posix()) for p in base.rglob("*") if p.is_file()
        )

    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None:
        return None


class S3ArtifactStore:
    """Objects under ``s3://bucket/prefix`` (AWS or any S3-compatible endpoint)."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        # Path-style addressing works with every S3-compatible server (MinIO, moto, Ceph).
        self._client = boto3.client(
            "s3", endpoint_url=endpoint_url,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
        )

    def _key(self, key: str) -> str:
        key = safe_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str = "") -> str:
        if not key:
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"s3://{self.bucket}/{self._key(key)}"

    def put_file(self, key: str, source: Path, *, move: bool = False) -> None:
        self._client.upload_file(str(source), self.bucket, self._key(key))
        if move:
            Path(source).unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> None:
        """One PUT for a stream shorter than ``S3_STREAM_PART``, else a multipart upload of
        parts of that size (aborted if ``chunks`` raises, so S3 keeps no orphan parts)."""
        target = self._key(key)
        buffer = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, object]] = []

        def flush() -> None:
            nonlocal upload_id
            if upload_id is None:
                upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=target)["UploadId"]
            number = len(parts) + 1
            answer = self._client.upload_part(Bucket=self.bucket, Key=target, UploadId=upload_id,
                                              PartNumber=number, Body=bytes(buffer))
            parts.append({"ETag": answer["ETag"], "PartNumber": number})
            buffer.clear()

        try:
            for chunk in chunks:
                buffer += chunk
                if len(buffer) >= S3_STREAM_PART:
                    flush()
            if upload_id is None:
                self._client.put_object(Bucket=self.bucket, Key=target, Body=bytes(buffer))
                return
            if buffer:
                flush()
            self._client.complete_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload_id,
                                                   MultipartUpload={"Parts": parts})
        except BaseException:
            if upload_id is not None:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=target, UploadId=upload_id)
            raise

    def read_bytes(self, key: str) -> bytes:
        return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def iter_bytes(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        yield from self.open(key, chunk_size).chunks

    def open(self, key: str, chunk_size: int = CHUNK) -> OpenedObject:
        from botocore.exceptions import ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _is_missing(exc):
                raise FileNotFoundError(f"s3://{self.bucket}/{self._key(key)}") from exc
            raise
        return OpenedObject(size=int(response["ContentLength"]), chunks=_read_chunks(response["Body"], chunk_size))

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if _is_missing(exc):
                return False
            raise

    def size(self, key: str) -> int:
        return int(self._client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> None:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix) + "/")
        for page in pages:  # at most 1,000 keys a page, as many as one delete_objects takes
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def list(self, prefix: str = "") -> list[str]:
        full = self._key(prefix) if prefix else self.prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        names: list[str] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full
        ):
            names.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        return sorted(names)

    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None:
        return self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s
        )


def open_or_404(store: ArtifactStore, key: str, missing: APIError) -> OpenedObject:
    """``store.open(key)``, or ``missing`` (a 404) when the object is not stored: a download
    answers only once it holds its object."""
    try:
        return store.open(key)
    except FileNotFoundError:
        raise missing from None


def _is_missing(exc: Exception) -> bool:
    """Whether a botocore ``ClientError`` says the object is not there."""
    return getattr(exc, "response", {}).get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}


def store_for(location: str, *, s3_endpoint_url: str | None = None) -> ArtifactStore:
    """The store rooted at ``location``: ``s3://bucket/prefix`` or a directory path."""
    if location.startswith("s3://"):
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {location!r}")
        return S3ArtifactStore(bucket, prefix, endpoint_url=s3_endpoint_url)
    return LocalArtifactStore(location)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_stored(store: ArtifactStore, key: str) -> str:
    """The sha256 of a stored object, read through the store (local file or S3 object)."""
    digest = hashlib.sha256()
    for chunk in store.iter_bytes(key):
        digest.update(chunk)
    return digest.hexdigest()


def artifact_store(settings: Settings) -> ArtifactStore:
    """The store for job outputs: ``TUNEFLEET_ARTIFACT_URL`` or ``<data>/artifacts``."""
    return store_for(settings.resolved_artifact_url, s3_endpoint_url=settings.s3_endpoint_url)


def file_store(settings: Settings) -> ArtifactStore:
    """The store for uploaded files (keys ``files/<id>.jsonl``; jobs' results files ``files/<id>.csv``).

    Embedded default: the data dir itself, so files land in ``<data>/files/``. With
    ``TUNEFLEET_ARTIFACT_URL`` set (a bucket or a shared volume), files go there too, so
    training pods on other machines can read them.
    """
    if settings.artifact_url is None:
        return LocalArtifactStore(settings.data_path)
    return artifact_store(settings)
