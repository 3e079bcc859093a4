"""What the API uses to reach the inference worker: one async call, typed errors.

:meth:`InferenceClient.generate` is an async iterator of the worker's
:class:`~inference.protocol.StreamEvent`; the worker's refusals arrive as
:class:`InferenceRejected` on the first ``__anext__`` (before any event), an unreachable
worker -- or one that dies mid-stream -- as :class:`InferenceUnavailable`, a worker that
stops answering as :class:`TimeoutError`. :meth:`InferenceClient.preload` hints the worker
to load a base model now. This module and ``protocol`` are the only parts of the package
the API imports: neither loads torch.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx

from inference.protocol import (
    GENERATE_PATH,
    PRELOAD_PATH,
    SECRET_HEADER,
    GenerationRequest,
    ModelRef,
    StreamEvent,
)

__all__ = ["GenerationRequest", "InferenceClient", "InferenceRejected", "InferenceUnavailable", "ModelRef",
           "StreamEvent"]

log = logging.getLogger(__name__)


class InferenceUnavailable(Exception):
    """The worker could not be reached (not started, crashed, wrong URL)."""


class InferenceRejected(Exception):
    """The worker refused the request: its HTTP ``status``, ``code``, ``message``, the request
    field at fault (``param``) and, while a model loads, ``retry_after_s``."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s
        self.param = param


class InferenceClient:
    def __init__(self, base_url: str, secret: str, *, idle_timeout_s: float = 300.0) -> None:
        """``idle_timeout_s``: the longest wait for the next event (a long queue or a slow token)."""
        self.base_url = base_url.rstrip("/")
        self._secret = secret
        self._timeout = httpx.Timeout(idle_timeout_s, connect=5.0)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        headers = {SECRET_HEADER: self._secret}
        body = request.model_dump_json(exclude_none=True)
        try:
            async with httpx.AsyncClient(timeout=self._timeout) as http, http.stream(
                "POST", self.base_url + GENERATE_PATH, content=body,
                headers={**headers, "Content-Type": "application/json"},
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _rejection(response)
                async for line in response.aiter_lines():
                    if line.strip():
                        yield StreamEvent.model_validate_json(line)
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"the inference worker at {self.base_url} did not answer in time") from exc
        except httpx.TransportError as exc:  # refused, reset, or cut mid-stream (the worker died)
            raise InferenceUnavailable(f"the inference worker at {self.base_url} is not reachable: {exc!r}") from exc

    def preload(self, base: ModelRef) -> str:
        """Ask the worker to load ``base`` now if it is idle; its answer (``loading``,
        ``loaded``, ``busy``, ``unavailable``), or ``unreachable``. Never raises: a hint."""
        try:
            response = httpx.post(self.base_url + PRELOAD_PATH, content=base.model_dump_json(),
                                  headers={SECRET_HEADER: self._secret, "Content-Type": "application/json"},
                                  timeout=5.0)
            return str(response.json()["status"]) if response.status_code == 202 else f"http {response.status_code}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.info("no preload hint for %s: %s", base.id, exc)
            return "unreachable"


def _rejection(response: httpx.Response) -> InferenceRejected:
    param = None
    try:
        payload = response.json()
        code, message = str(payload["code"]), str(payload["message"])
        param = payload.get("param") if isinstance(payload.get("param"), str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message = "inference_failed", response.text[:500] or f"HTTP {response.status_code}"
    retry = response.headers.get("Retry-After")
    return InferenceRejected(response.status_code, code, message,
                             int(retry) if retry and retry.isdigit() else None, param)
