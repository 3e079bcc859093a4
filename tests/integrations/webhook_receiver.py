"""A local HTTP server that receives webhooks and answers with scripted status codes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """``answer(received_so_far) -> status`` decides each response."""

    answer: Callable[[list[Received]], int] = lambda received: 204
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""
    server: ThreadingHTTPServer | None = None
    port: int = 0  # 0: any free port; a fixed one lets a test stop the receiver and bring it back

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    receiver.received.append(Received(dict(self.headers.items()), body, time.monotonic()))
                    status = receiver.answer(receiver.received)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def wait_for(self, predicate: Callable[[list[Received]], bool], timeout: float) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(self.received):
                    return list(self.received)
            time.sleep(0.05)
        with self.lock:
            raise AssertionError(f"receiver timed out; got {[r.body for r in self.received]}")
