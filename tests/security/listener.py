"""A loopback HTTP listener that records every request it gets (an SSRF target), or,
given ``answer``, a small fake server (a tenant's tracking server) that records its calls."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

# (method, path) -> (status, headers, JSON body)
Answer = Callable[[str, str], tuple[int, dict[str, str], object]]


def internal_service(method: str, path: str) -> tuple[int, dict[str, str], object]:
    return 200, {"Content-Type": "application/json"}, {"secret": "internal service answer"}


class Listener:
    """``with Listener() as target: ... target.hits``: requests seen, as ``METHOD path``."""

    def __init__(self, answer: Answer = internal_service) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                hits.append(f"{self.command} {self.path}")
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, body = answer(self.command, self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
