"""Streaming multipart upload: the file part goes to disk chunk by chunk, never into memory.

Starlette's ``request.form()`` would spool the whole body before a route sees it, so a
multi-gigabyte upload would be read in full before being refused. Here the body is fed
to python-multipart's push parser as it arrives: the file part is hashed, counted,
checked as UTF-8 and written to a temporary file, and the request is refused with 413
``file_too_large`` the moment it passes the limit (or before reading anything when
``Content-Length`` already says so). ``POST /v1/files`` and the parts of an upload
(``api/uploads``) both arrive this way; a part is checked as UTF-8 only once the whole
file is put together, since a part may end inside a character.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from control.errors import APIError

MAX_FIELD_BYTES = 4096
# A file and a purpose are all an upload carries; more parts are refused before parsing them.
MAX_FORM_PARTS = 8
# Multipart framing (boundaries, part headers) on top of the file's own bytes.
ENVELOPE_SLACK = 64 * 1024


@dataclass
class Upload:
    """A received upload: form fields, and the file part written to ``path``."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    path: Path | None = None
    size: int = 0
    sha256: str = ""
    file_field: str | None = None


class Utf8Check:
    """Whether a stream of chunks is UTF-8, and where the first bad byte is (offset, line)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._seen = 0
        self._newlines = 0
        self.bad_at: int | None = None
        self.bad_line: int | None = None

    def feed(self, chunk: bytes) -> None:
        if self.bad_at is None:
            try:
                self._decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                self.bad_at = self._seen + exc.start
                self.bad_line = self._newlines + chunk.count(b"\n", 0, exc.start) + 1
            else:
                self._newlines += chunk.count(b"\n")
        self._seen += len(chunk)

    def finish(self) -> None:
        """The end of the stream: a character cut off there is a bad byte too."""
        if self.bad_at is None:
            try:
                self._decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                self.bad_at = self._seen
                self.bad_line = self._newlines + 1

    def error(self, *, param: str) -> APIError | None:
        """The 400 ``not_utf8`` for a stream that was not UTF-8, else None."""
        if self.bad_at is None:
            return None
        return APIError(
            400, "not_utf8",
            f"The file is not UTF-8 text (line {self.bad_line}, first bad byte at "
            f"offset {self.bad_at}). Save it as UTF-8 JSONL.",
            param=param,
        )


def _too_large(limit: int) -> APIError:
    return APIError(
        413, "file_too_large",
        f"The file is larger than the upload limit of {limit} bytes "
        "(TUNEFLEET_MAX_UPLOAD_BYTES).",
        param="file",
    )


class _PartCollector:
    """python-multipart callbacks that route each part to a field or the temp file."""

    def __init__(self, upload: Upload, tmp_dir: Path, limit: int, *, too_large: APIError,
                 file_field: str, binary_field: bool, check_utf8: bool) -> None:
        self.upload = upload
        self.tmp_dir = tmp_dir
        self.limit = limit
        self.too_large = too_large
        self.file_field = file_field
        self.binary_field = binary_field
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._buffer = bytearray()
        self._handle = None
        self._digest = hashlib.sha256()
        self.utf8 = Utf8Check() if check_utf8 else None
        self.error: APIError | None = None
        self._parts = 0

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": lambda d, s, e: self._add("_header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("_header_value", d[s:e]),
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
        }

    def _add(self, attr: str, data: bytes) -> None:
        setattr(self, attr, getattr(self, attr) + data)

    def on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_FORM_PARTS:
            raise APIError(400, "invalid_request",
                           f"An upload has at most {MAX_FORM_PARTS} form parts (one file and its fields).")
        self._headers = {}
        self._name = None
        self._is_file = False
        self._buffer = bytearray()

    def on_header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = b""
        self._header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options or (self.binary_field and self._name == self.file_field):
            if self._handle is not None:
                raise APIError(400, "invalid_request", "Upload exactly one file.", param=self.file_field)
            self._is_file = True
            self.upload.file_field = self._name
            self.upload.filename = options.get(b"filename", b"").decode("utf-8", "replace") or None
            fd, name = tempfile.mkstemp(dir=self.tmp_dir, prefix="upload-", suffix=".part")
            self.upload.path = Path(name)
            self._handle = os.fdopen(fd, "wb")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if not self._is_file:
            self._buffer += chunk
            if len(self._buffer) > MAX_FIELD_BYTES:
                raise APIError(400, "invalid_request", f"Form field '{self._name}' is too long.",
                               param=self._name)
            return
        self.upload.size += len(chunk)
        if self.upload.size > self.limit:
            raise self.too_large
        self._digest.update(chunk)
        if self.utf8 is not None:
            self.utf8.feed(chunk)
        assert self._handle is not None
        self._handle.write(chunk)

    def on_part_end(self) -> None:
        if self._is_file:
            assert self._handle is not None
            if self.utf8 is not None:
                self.utf8.finish()
            self._handle.close()
            self.upload.sha256 = self._digest.hexdigest()
            self._is_file = False
        elif self._name:
            self.upload.fields[self._name] = bytes(self._buffer).decode("utf-8", "replace")

    def abort(self) -> None:
        if self._handle is not None and not self._handle.closed:
            self._handle.close()
        if self.upload.path is not None:
            self.upload.path.unlink(missing_ok=True)


async def receive_upload(
    request: Request, *, tmp_dir: Path, limit: int, too_large: APIError | None = None,
    file_field: str = "file", form: str = "a 'file' and a 'purpose' field", binary_field: bool = False,
    check_utf8: bool = True,
) -> Upload:
    """Parse a multipart/form-data body with exactly one file part, streaming it to disk.

    Args:
        limit: the most bytes the file may hold; past it, ``too_large`` is raised (default:
            413 ``file_too_large`` naming ``TUNEFLEET_MAX_UPLOAD_BYTES``).
        file_field: the file's form field, as errors name it.
        form: the fields the body should have, as the error for a body that is not
            multipart says.
        binary_field: the part named ``file_field`` is the file even without a filename
            (OpenAI's upload parts); otherwise the file is the part with a filename.
        check_utf8: refuse a file that is not UTF-8 text.

    Raises:
        APIError: ``too_large``; 400 ``invalid_request`` for a body that is not multipart
        or has no file; 400 ``not_utf8`` for a file that is not UTF-8.
    """
    content_type = request.headers.get("content-type", "")
    ctype, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise APIError(
            400, "invalid_request",
            f"Send the body as multipart/form-data with {form}.", param=file_field,
        )
    too_large = too_large or _too_large(limit)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + ENVELOPE_SLACK:
        raise too_large
    tmp_dir.mkdir(parents=True, exist_ok=True)
    upload = Upload()
    collector = _PartCollector(upload, tmp_dir, limit, too_large=too_large,
                               file_field=file_field, binary_field=binary_field, check_utf8=check_utf8)
    parser = MultipartParser(boundary, collector.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except APIError:
        collector.abort()
        raise
    except Exception as exc:
        collector.abort()
        raise APIError(400, "invalid_request", f"Malformed multipart body: {exc}") from exc
    if upload.path is None:
        raise APIError(400, "invalid_request", f"Missing required parameter: '{file_field}'.", param=file_field)
    if collector.utf8 is not None and (error := collector.utf8.error(param=file_field)) is not None:
        collector.abort()
        raise error
    return upload
