"""Send trainer reports (metrics, events, checkpoints, artifacts, errors) to the API.

Protocol (docs/internals.md, "Trainer reports"): ``POST <report.url>`` with
``Authorization: Bearer <job token>`` and body ``{"seq": N, "items": [...]}``; the API
answers ``200 {"acked_seq": N, "duplicate": bool}`` and applies each ``seq`` once.

Delivery guarantees, and how:

- Items are grouped into batches by a background thread every ``flush_interval_s``.
  Each batch gets the next ``seq`` and is written to the spool directory
  (``<seq>.json``, fsynced) BEFORE it is sent; the file is deleted only once the API
  acknowledged it. So an unreachable API, or a killed trainer, never loses a batch
  that was formed: the next attempt (or the next process) re-sends it.
- Batches are sent strictly in ``seq`` order: the oldest spooled batch first, and
  nothing newer until it is acknowledged, so the API sees 1, 2, 3, ... with no gaps.
- The next ``seq`` is persisted in the spool directory (``next_seq``), so a restarted
  trainer never reuses a number (the API would drop a reused one as a duplicate).
- Transport errors and 5xx/408/429 answers are retried with exponential backoff (capped).
  An answer's ``Retry-After`` (seconds or an HTTP date: the API sends one with its 503
  while its database is down, and with 429) is honoured as the least wait before the next
  try, within the same cap: retrying sooner only adds load where the server said it cannot
  take any, and a server cannot stall a trainer past the cap.
  Other 4xx (wrong token, job gone) cannot succeed by retrying: the reporter stops
  sending, keeps the spool, and exposes the answer in ``rejected``.
- ``persist()`` spools every queued item now, and ``checkpoint()`` spools its item and
  every item queued before it before it returns. ``save_checkpoint``
  (``trainers.common.checkpointing``) persists before it renames a checkpoint into
  place: a trainer killed the instant the checkpoint became visible (the next run
  resumes from it, so it never produces those steps again) must not lose the metric
  steps that led to it, which otherwise wait in memory for the next tick. The resumed
  run's reporter finds them in the spool and sends them first.
- ``unacknowledged_checkpoints()`` names the checkpoints whose listing the API has not
  acknowledged yet (queued or spooled): ``save_checkpoint`` never prunes those.
- ``close()`` forms a last batch and tries to deliver everything within a deadline;
  what is left stays spooled. Items it cannot spool (the disk is full) are sent from
  memory after the spooled batches: the trainer's last word (its error) still arrives.

Without a URL (standalone use) each item is appended to a local JSONL file instead.
Uses httpx's sync client; one sender thread, so ordering needs no extra locking.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Self

import httpx

log = logging.getLogger(__name__)

NEXT_SEQ_FILE = "next_seq"
_RETRYABLE_STATUS = {408, 429}


class Reporter:
    """Batches report items and delivers them (see module docstring).

    Args:
        url: the API's report endpoint for this job; None = write ``local_path`` JSONL.
        token: the per-job bearer token.
        spool_dir: where unacknowledged batches and the next seq live (required with url).
        flush_interval_s: how often the background thread forms and sends a batch.
        local_path: JSONL file for standalone mode (url None).
        max_items_per_batch: larger pending queues are split into several batches.
        max_bytes_per_batch: so are those whose items are larger than this as JSON (the API
            refuses reports over its caps, 1000 items and 1 MiB by default, with 413
            ``report_too_large``; these defaults stay well under them).
        timeout_s: per-request timeout.
        max_backoff_s: cap of the exponential retry delay.
        clock: monotonic clock (injectable for tests).
        first_seq: the lowest seq to use (one past what the API has applied for the job),
            for a run whose spool starts empty, e.g. in a new pod.
    """

    def __init__(
        self,
        *,
        url: str | None,
        token: str | None = None,
        spool_dir: str | Path | None = None,
        flush_interval_s: float = 2.0,
        local_path: str | Path | None = None,
        max_items_per_batch: int = 500,
        max_bytes_per_batch: int = 512 * 1024,
        timeout_s: float = 10.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        first_seq: int = 1,
    ) -> None:
        if url is None and local_path is None:
            raise ValueError("a Reporter needs a url or a local_path")
        if url is not None and spool_dir is None:
            raise ValueError("a Reporter with a url needs a spool_dir")
        self.url = url
        self.flush_interval_s = flush_interval_s
        self.max_items_per_batch = max_items_per_batch
        self.max_bytes_per_batch = max_bytes_per_batch
        self.max_backoff_s = max_backoff_s
        self.rejected: tuple[int, str] | None = None
        self.mirror: Any | None = None  # an object with add(item), e.g. a TrackerMirror
        self.sent_batches = 0
        self._clock = clock
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._backoff_s = 0.0
        self._server_wait_s = 0.0  # the last answer's Retry-After, 0 when it had none
        self._retry_at = 0.0
        self._local_path = Path(local_path) if local_path is not None else None
        self._spool = Path(spool_dir) if spool_dir is not None else None
        self._client: httpx.Client | None = None
        if url is not None:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._client = httpx.Client(timeout=timeout_s, headers=headers)
        if self._spool is not None:
            self._spool.mkdir(parents=True, exist_ok=True)
            spooled = self._spooled_seqs()
            self._next_seq = max([first_seq, self._read_next_seq(), *(s + 1 for s in spooled)])
        else:
            self._next_seq = first_seq
        if self._local_path is not None:
            self._local_path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="reporter", daemon=True)
        self._thread.start()
        if self._has_undelivered():
            self._wake.set()  # a previous run's batches (e.g. killed after a checkpoint)

    # ---- items -------------------------------------------------------------------------

    def add(self, item: dict[str, Any]) -> None:
        """Queue one report item (a dict with a ``type``); non-blocking."""
        if "type" not in item:
            raise ValueError("a report item needs a 'type'")
        with self._lock:
            self._pending.append(item)
        if self.mirror is not None:
            # Experiment trackers (trainers.common.integrations) see exactly what the API
            # sees; a mirror never raises (it switches a failing tracker off).
            self.mirror.add(item)

    def metric(self, **fields: Any) -> None:
        self.add({"type": "metric", "time": time.time(), **fields})

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self.add({"type": "event", "level": level, "message": message, "data": data or {}})

    def checkpoint(self, step: int, location: str, metrics: dict[str, Any]) -> None:
        """Report a saved checkpoint; returns once it and everything before it is spooled.

        Raises:
            OSError: the spool could not be written; training must not go on past a
                checkpoint whose report could be lost.
        """
        self.add({"type": "checkpoint", "step": step, "location": location, "metrics": metrics})
        self._form_batches()  # on disk (fsynced) now, not at the next tick
        self._wake.set()  # and sent now, not at the next tick

    def persist(self) -> None:
        """Spool every item queued so far (fsynced) now, not at the next tick.

        Raises:
            OSError: the spool could not be written.
        """
        self._form_batches()

    def unacknowledged_checkpoints(self) -> set[int]:
        """Steps of the checkpoints reported to the API that it has not acknowledged yet:
        queued, or spooled and not sent. Empty in standalone mode (no API to wait for)."""
        if self._client is None:
            return set()
        with self._lock:
            steps = {int(item["step"]) for item in self._pending if item["type"] == "checkpoint"}
        for seq in self._spooled_seqs():
            try:
                batch = json.loads((self._spool / f"{seq:012d}.json").read_text(encoding="utf-8"))  # type: ignore[operator]
            except FileNotFoundError:
                continue  # acknowledged (and deleted) since the listing
            steps.update(int(item["step"]) for item in batch["items"] if item.get("type") == "checkpoint")
        return steps

    def artifacts(self, location: str, files: list[dict[str, Any]]) -> None:
        self.add({"type": "artifacts", "location": location, "files": files})

    def error(self, code: str, message: str) -> None:
        self.add({"type": "error", "code": code, "message": message})

    # ---- control -----------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Send everything queued so far; True if all of it was delivered in time."""
        deadline = self._clock() + timeout_s
        with self._lock:
            self._wake.set()
            while self._pending or self._has_undelivered():
                remaining = deadline - self._clock()
                if remaining <= 0 or self.rejected is not None or not self._thread.is_alive():
                    return False
                self._idle.wait(min(remaining, 0.05))
                self._wake.set()
            return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread, then try to deliver everything within ``timeout_s``.

        Returns:
            True if nothing is left undelivered (spooled batches remain on disk otherwise).
        """
        self._closing.set()
        self._wake.set()
        self._thread.join()
        deadline = self._clock() + timeout_s
        try:
            self._form_batches()
        except OSError:
            # The spool cannot be written (a full disk): the last items -- the trainer's
            # error among them -- go out from memory after the spooled batches, rather
            # than die with this process.
            log.exception("reporter: spooling failed at close; sending the last items from memory")
        delivered = self._send_spooled(deadline=deadline) and self._send_unspooled(deadline=deadline)
        if self._client is not None:
            self._client.close()
        return delivered

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- background thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._closing.is_set():
                return
            try:
                # Batches are formed (and spooled) every tick, even while the API is down
                # and sending waits for its backoff, so a kill loses at most one tick.
                self._form_batches()
                if self._clock() >= self._retry_at:
                    self._send_spooled(deadline=None)
            except OSError:
                # A spool write failed (disk full?): keep the items queued and try again
                # at the next tick rather than kill the thread and every later report.
                log.exception("reporter: spooling failed; will retry")
            with self._lock:
                self._idle.notify_all()

    def _batch_length(self) -> int:
        """How many pending items the next batch takes: at most ``max_items_per_batch``
        and ``max_bytes_per_batch`` of JSON, and at least one (call with the lock held)."""
        size = 0
        for count, item in enumerate(self._pending[: self.max_items_per_batch]):
            size += len(json.dumps(item, default=str)) + 1
            if size > self.max_bytes_per_batch and count:
                return count
        return self.max_items_per_batch

    def _form_batches(self) -> None:
        """Move pending items into numbered batches (spooled or written locally)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                items = self._pending[: self._batch_length()]
                seq = self._next_seq
                if self._spool is not None:
                    # Persist the batch and the next seq before dropping the items from
                    # memory, so neither a crash nor an exception loses them.
                    batch = self._spool / f"{seq:012d}.json"
                    self._write_json(batch, {"seq": seq, "items": items})
                    try:
                        self._write_text(self._spool / NEXT_SEQ_FILE, str(seq + 1))
                    except OSError:
                        # Both or neither: a batch left on disk while its items stay
                        # pending under the same seq would be sent twice under that seq,
                        # and the API drops the second as a duplicate -- with whatever
                        # items were added since (on a full disk: the trainer's error).
                        batch.unlink(missing_ok=True)
                        raise
                else:
                    assert self._local_path is not None
                    with open(self._local_path, "a", encoding="utf-8") as f:
                        f.writelines(json.dumps({"seq": seq, **item}) + "\n" for item in items)
                self._next_seq = seq + 1
                del self._pending[: len(items)]

    def _send_spooled(self, *, deadline: float | None) -> bool:
        """Send spooled batches oldest first; stop at the first one not acknowledged.

        ``deadline`` None: the background mode (one attempt per batch now; after a failure
        the next attempt waits for ``_retry_at``). Otherwise retry until the deadline.
        """
        if self._spool is None or self._client is None:
            return True
        for seq in self._spooled_seqs():
            if self.rejected is not None:
                return False
            path = self._spool / f"{seq:012d}.json"
            if not self._deliver(json.loads(path.read_text(encoding="utf-8")), deadline=deadline):
                return False
            path.unlink()
        return True

    def _send_unspooled(self, *, deadline: float) -> bool:
        """Send the items ``close`` could not spool, from memory, in numbered batches.

        Their seqs are taken as spooled ones would be, and persisted where the disk still
        lets (a restarted process must not reuse one the API applied)."""
        if self._client is None:
            return not self._pending
        while self._pending:
            if self.rejected is not None:
                return False
            with self._lock:
                items = self._pending[: self._batch_length()]
                seq = self._next_seq
                self._next_seq = seq + 1
            try:
                self._write_text(self._spool / NEXT_SEQ_FILE, str(seq + 1))  # type: ignore[operator]
            except OSError:
                log.warning("reporter: cannot persist the next seq %d (disk full?)", seq + 1)
            if not self._deliver({"seq": seq, "items": items}, deadline=deadline):
                return False
            with self._lock:
                del self._pending[: len(items)]
        return True

    def _deliver(self, body: dict[str, Any], *, deadline: float | None) -> bool:
        """Post one batch until acknowledged, backing off between tries (see ``_send_spooled``)."""
        while not self._post(body):
            if self.rejected is not None:
                return False
            self._backoff_s = min(self.max_backoff_s, max(0.25, self._backoff_s * 2))
            wait_s = min(self.max_backoff_s, max(self._backoff_s, self._server_wait_s))
            if deadline is None:
                self._retry_at = self._clock() + wait_s  # the thread retries then
                return False
            if self._clock() + wait_s > deadline:
                return False
            time.sleep(wait_s)
        self._backoff_s = 0.0
        self.sent_batches += 1
        return True

    def _post(self, body: dict[str, Any]) -> bool:
        assert self._client is not None and self.url is not None
        self._server_wait_s = 0.0
        try:
            resp = self._client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            log.warning("reporter: seq %s not delivered (%s); will retry", body["seq"], exc)
            return False
        if resp.status_code == 200:
            try:
                acked = resp.json().get("acked_seq")
            except ValueError:
                acked = None
            if acked != body["seq"]:
                log.warning("reporter: sent seq %s, API acked %s; will retry", body["seq"], acked)
                return False
            return True
        if resp.status_code >= 500 or resp.status_code in _RETRYABLE_STATUS:
            self._server_wait_s = retry_after_s(resp.headers.get("Retry-After"), now=time.time())
            log.warning("reporter: seq %s got HTTP %s; will retry%s", body["seq"], resp.status_code,
                        f" after {self._server_wait_s:g} s (Retry-After)" if self._server_wait_s else "")
            return False
        self.rejected = (resp.status_code, resp.text[:500])
        log.error("reporter: API refused reports (HTTP %s: %s); keeping the spool",
                  resp.status_code, resp.text[:200])
        return False

    # ---- spool files -------------------------------------------------------------------

    def _has_undelivered(self) -> bool:
        return bool(self._spool is not None and self._client is not None and self._spooled_seqs())

    def _spooled_seqs(self) -> list[int]:
        assert self._spool is not None
        return sorted(int(p.stem) for p in self._spool.glob("*.json") if p.stem.isdigit())

    def _read_next_seq(self) -> int:
        assert self._spool is not None
        path = self._spool / NEXT_SEQ_FILE
        return int(path.read_text(encoding="utf-8").strip()) if path.exists() else 1

    @staticmethod
    def _write_text(path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)  # a half-written file would hold disk space for nothing
            raise
        os.replace(tmp, path)

    def _write_json(self, path: Path, obj: Any) -> None:
        self._write_text(path, json.dumps(obj))

    @property
    def next_seq(self) -> int:
        return self._next_seq


def reporter_from_spec(report: Any, *, default_spool_dir: str | Path, local_path: str | Path) -> Reporter:
    """Build the Reporter a trainer uses from ``TrainerSpec.report``.

    ``default_spool_dir`` is used when the spec names none; pass a directory that
    survives a restart of the trainer (the checkpoint dir) so seq numbers persist.
    """
    return Reporter(
        url=report.url,
        # In Kubernetes the token comes from the job's Secret (env), never from the ConfigMap spec.
        token=report.token or os.environ.get("TUNEFLEET_REPORT_TOKEN"),
        spool_dir=report.spool_dir or (default_spool_dir if report.url else None),
        flush_interval_s=report.flush_interval_s,
        local_path=local_path,
        first_seq=report.first_seq,
    )


def retry_after_s(value: str | None, *, now: float) -> float:
    """Seconds a ``Retry-After`` header asks to wait (RFC 9110: delay-seconds or an
    HTTP-date); 0 for none, a date in the past or a value that is neither."""
    if not value:
        return 0.0
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now)
    except (TypeError, ValueError):
        return 0.0

