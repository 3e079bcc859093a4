"""A job's live stream (Server-Sent Events): what it sends, how often it polls, who may open one.

A stream polls the database for the job's new events and metrics: every ``POLL_S`` while
the job runs, every ``IDLE_POLL_S`` while it waits (queued, paused, validating its files),
since nothing but a status change can happen then. Each poll takes a pooled connection
for the length of its queries and gives it back: an open stream holds none between polls,
so however many streams are open, other requests find the pool free.

Open streams are capped per API key and per API process (``StreamSlots``): each one
costs a poll every ``POLL_S`` and a task, and a single client must not be able to open
enough of them to slow every other tenant down. Past a cap the request is answered 429
``too_many_streams``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Receive, Scope, Send

from api.jobs.schemas import JobEventPublic
from api.responses import EventStreamResponse
from control.db.models import Job, JobEvent, JobMetric
from control.errors import APIError

POLL_S = 0.5
IDLE_POLL_S = 3.0
HEARTBEAT_S = 15.0
BATCH = 500
# How long a client refused a stream should wait: streams end when jobs end or clients leave.
STREAM_RETRY_AFTER_S = 10


@dataclass(frozen=True)
class Poll:
    """One poll's SSE messages, the cursor after them, and the job's status then."""

    messages: list[str]
    cursor: tuple[int, int]
    status: str
    done: bool


def parse_cursor(value: str | None) -> tuple[int, int]:
    """SSE ids are ``<event seq>.<metric seq>``; anything else restarts from the beginning."""
    try:
        events, metrics = (value or "").split(".")
        return max(0, int(events)), max(0, int(metrics))
    except ValueError:
        return 0, 0


def sse(kind: str, data: dict[str, Any], event_id: str) -> str:
    return f"id: {event_id}\nevent: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def poll_job(factory: sessionmaker[Session], job_id: str, cursor: tuple[int, int],
             metric_dict: Callable[[JobMetric], dict[str, Any]]) -> Poll:
    """New SSE messages since ``cursor``; the session (and its connection) is closed on return."""
    event_seq, metric_seq = cursor
    out: list[str] = []
    with factory() as session:
        job = session.get_one(Job, job_id)
        events = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > event_seq)
            .order_by(JobEvent.seq).limit(BATCH)
        ).all()
        metrics = session.scalars(
            select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.seq > metric_seq)
            .order_by(JobMetric.seq).limit(BATCH)
        ).all()
        for event in events:
            event_seq = event.seq
            kind = "status" if event.type == "status" else "event"
            payload = JobEventPublic.of(event).model_dump()
            if kind == "status":
                payload["status"] = (event.data or {}).get("to")
            out.append(sse(kind, payload, f"{event_seq}.{metric_seq}"))
        for metric in metrics:
            metric_seq = metric.seq
            out.append(sse("metric", metric_dict(metric), f"{event_seq}.{metric_seq}"))
        done = job.is_terminal and len(events) < BATCH and len(metrics) < BATCH
        return Poll(out, (event_seq, metric_seq), job.status, done)


def poll_interval(poll: Poll) -> float:
    """A running job (or one with more to send) is polled often; a waiting one rarely."""
    return POLL_S if poll.messages or poll.status == "running" else IDLE_POLL_S


async def watch_disconnect(request: Request, gone: asyncio.Event) -> None:
    """Set ``gone`` once the client disconnects, by reading the ASGI channel until it says so.

    ``request.is_disconnected()`` only peeks (it cancels its read at once), so on a server
    whose disconnect message takes a moment to arrive it never saw one and the stream
    kept polling and writing for a client that had left, until its job ended.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def job_messages(request: Request, factory: sessionmaker[Session], job_id: str,
                       cursor: tuple[int, int],
                       metric_dict: Callable[[JobMetric], dict[str, Any]]) -> AsyncIterator[str]:
    """The stream's messages until the job ends or the client leaves."""
    quiet = 0.0
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch_disconnect(request, gone))
    try:
        yield "retry: 2000\n\n"
        while not gone.is_set():
            poll = await run_in_threadpool(poll_job, factory, job_id, cursor, metric_dict)
            if gone.is_set():
                return
            cursor = poll.cursor
            for message in poll.messages:
                yield message
            if poll.done:
                yield sse("end", {"id": job_id}, f"{cursor[0]}.{cursor[1]}")
                return
            interval = poll_interval(poll)
            quiet = 0.0 if poll.messages else quiet + interval
            if quiet >= HEARTBEAT_S:
                quiet = 0.0
                yield ": keep-alive\n\n"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), interval)  # the poll interval, or less
    finally:
        watcher.cancel()


class StreamSlots:
    """Open streams of this process, per API key; ``take`` refuses past either cap."""

    def __init__(self, *, per_key: int, per_process: int) -> None:
        self.per_key = per_key
        self.per_process = per_process
        self._by_key: dict[str, int] = {}
        self._open = 0

    def take(self, key_id: str) -> Callable[[], None]:
        """Hold a slot for ``key_id``; returns its release (call it exactly once). 429 past a cap."""
        if self._by_key.get(key_id, 0) >= self.per_key:
            raise _too_many(f"This API key has {self.per_key} job streams open already (the most "
                            "one key may hold); close one, or retry after "
                            f"{STREAM_RETRY_AFTER_S} s.")
        if self._open >= self.per_process:
            raise _too_many(f"The service holds {self.per_process} job streams open already; retry after "
                            f"{STREAM_RETRY_AFTER_S} s, or poll GET /v1/fine_tuning/jobs/{{id}}/events.")
        self._by_key[key_id] = self._by_key.get(key_id, 0) + 1
        self._open += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._open -= 1
            left = self._by_key[key_id] - 1
            if left:
                self._by_key[key_id] = left
            else:
                del self._by_key[key_id]

        return release

    @property
    def open(self) -> int:
        return self._open


def _too_many(message: str) -> APIError:
    return APIError(429, "too_many_streams", message, headers={"Retry-After": str(STREAM_RETRY_AFTER_S)})


class SlotStreamResponse(EventStreamResponse):
    """An SSE response that gives its stream slot back however it ends: the job ended, the
    client left, or sending failed before the body iterator was ever started (then no
    ``finally`` of the iterator would run)."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()

