"""A small Server-Sent Events decoder (the ``text/event-stream`` wire format).

Fed line by line; yields one ``(event, data, id)`` per blank-line-terminated block, per
the WHATWG rules: ``data`` lines join with newlines, comment lines (``:``) are
keep-alives, an event without data is not dispatched, the event name defaults to
``message``, the last ``id`` persists for reconnects (``Last-Event-ID``), and ``retry``
sets the stream's reconnection delay (``retry_ms``) whenever it appears.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEMessage:
    event: str
    data: str
    id: str | None


class SSEDecoder:
    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self._event = ""
        self._data: list[str] = []
        self.retry_ms: int | None = None

    def feed(self, line: str) -> SSEMessage | None:
        """Consume one line (without its newline); return a message when one completes."""
        if line == "":
            if not self._data:
                self._event = ""
                return None
            message = SSEMessage(
                event=self._event or "message",
                data="\n".join(self._data),
                id=self.last_event_id,
            )
            self._event, self._data = "", []
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None
