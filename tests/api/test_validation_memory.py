"""Validating an upload streams it: memory stays flat whatever the file's size.

The probe: 30 MB of short lines took the worker from 130 to 739 MB (the file read whole,
then split into a list of one bytes object per line: ~20x the file). Here the real task
body validates two files of short lines, one eight times the other, under ``tracemalloc``:
the peaks must be about the same, and far below the file.
"""

from __future__ import annotations

import tracemalloc

import pytest

MiB = 1024 * 1024


@pytest.fixture
def backend() -> str:
    return "sqlite"  # the file is read the same way whatever the database


def peak_while_validating(client, inline_queue, headers: dict[str, str], size: int) -> int:
    line = b'{"x": 1}\n'  # short lines: the most per-line overhead per byte
    inline_queue.run_validation = False
    upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                         files={"file": ("short.jsonl", line * (size // len(line)), "application/jsonl")})
    assert upload.status_code == 200, upload.text
    tracemalloc.start()
    try:
        inline_queue.validate(upload.json()["id"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    shown = client.get(f"/v1/files/{upload.json()['id']}", headers=headers).json()
    assert shown["status"] == "error" and "unknown_format" in shown["status_details"]
    return peak


def test_validation_memory_does_not_grow_with_the_file(client, inline_queue, tenant_key) -> None:
    headers = tenant_key().headers
    peak_while_validating(client, inline_queue, headers, 1024)  # first use: imports, caches
    small = peak_while_validating(client, inline_queue, headers, MiB // 8)
    # A file large enough that the fixed cost of one validation (statements compiled, rows
    # loaded: about 0.2 MiB, more in a process that has run other tests) is well below a
    # quarter of it.
    large = peak_while_validating(client, inline_queue, headers, MiB)
    assert large < MiB // 4, f"peak {large / MiB:.2f} MiB validating a 1 MiB file"
    assert large < small * 1.5, f"peaks {small / MiB:.2f} -> {large / MiB:.2f} MiB for 0.125 -> 1 MiB"
