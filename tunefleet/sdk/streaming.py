"""Following a job's event stream: what ``Jobs.stream`` and ``AsyncJobs.stream`` share.

``JobStream`` holds everything but the I/O: the request of each (re)connection (with
``Last-Event-ID`` once an event was seen, so the service resumes after it), decoding
lines into ``StreamEvent`` objects, and the retry budget for dropped connections, which
refills whenever an event gets through. The clients only read lines and sleep.
"""

from __future__ import annotations

import json

from tunefleet.sdk import requests as rq
from tunefleet.sdk.errors import APIConnectionError
from tunefleet.sdk.sse import SSEDecoder, SSEMessage
from tunefleet.sdk.transport import RequestOptions, backoff_seconds
from tunefleet.sdk.types import StreamEvent


def stream_event(message: SSEMessage) -> StreamEvent:
    """A decoded SSE message as the SDK's event: JSON data parsed, other data kept as text."""
    try:
        data = json.loads(message.data)
    except ValueError:
        data = message.data
    return StreamEvent(event=message.event, data=data, id=message.id)


class JobStream:
    def __init__(self, job_id: str, last_event_id: str | None, max_retries: int) -> None:
        self.job_id = job_id
        self.max_retries = max_retries
        self.attempt = 0
        self._decoder = SSEDecoder()
        self._decoder.last_event_id = last_event_id

    def request(self) -> RequestOptions:
        return rq.job_stream(self.job_id, self._decoder.last_event_id)

    def feed(self, line: str) -> StreamEvent | None:
        """One line of the stream; the event it completes, if any."""
        message = self._decoder.feed(line)
        if message is None:
            return None
        self.attempt = 0
        return stream_event(message)

    def close(self) -> StreamEvent | None:
        """The service ended the stream: the last event, if no blank line terminated it."""
        message = self._decoder.feed("")
        return None if message is None else stream_event(message)

    def retry_delay(self, exc: Exception) -> float:
        """Seconds to wait before reconnecting after ``exc`` dropped the connection.

        Raises:
            APIConnectionError: the connection dropped ``max_retries`` times in a row."""
        if self.attempt >= self.max_retries:
            raise APIConnectionError(f"event stream of {self.job_id} dropped: {exc}") from exc
        delay = backoff_seconds(self.attempt, None)
        self.attempt += 1
        return delay
