"""Serving one completion request: admission, the inference worker, OpenAI's answers.

Steps (:func:`serve_completion`):

1. admission: a tenant may have ``TUNEFLEET_INFERENCE_MAX_CONCURRENT_PER_TENANT``
   completions running in this API process; one more is 429 ``too_many_requests`` with
   ``Retry-After`` (before the worker is asked anything). With
   ``TUNEFLEET_INFERENCE_TOKENS_PER_MINUTE_PER_TENANT``, a tenant whose requests of the last
   60 s used that many tokens (prompt + completion, counted when each ends) gets 429
   ``token_limit_exceeded`` until enough of them are a minute old (``Retry-After``);
2. the worker's first event (it answers once the base model is loaded -- the worker holds
   the request up to ``TUNEFLEET_INFERENCE_LOAD_WAIT_S`` for that -- and the request has
   its turn on the model): its refusals become errors here, e.g. 400
   ``context_length_exceeded``, 503 ``model_loading`` with ``Retry-After`` when the model
   is still loading after that wait (the OpenAI SDK retries those by itself), 503
   ``inference_unavailable`` when the worker cannot be reached. A client that disconnects
   meanwhile gets its slot back at once and its generation is cancelled;
3. the answer: one ``chat.completion`` / ``text_completion`` object, or Server-Sent Events
   with OpenAI's chunks, ending ``data: [DONE]``. The whole request has
   ``TUNEFLEET_INFERENCE_TIMEOUT_S``: 504 ``inference_timeout``, or an error event in a
   stream that already started (so does a worker that dies mid-stream). A client that
   leaves mid-stream closes the worker's stream too, which ends that generation at the
   next token.

Prometheus metrics: requests by endpoint and outcome, prompt and completion tokens, time
to first token, time queued for the model, and each request's decode tokens/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, Histogram
from starlette.types import Receive, Scope, Send

from api.inference.served_models import ServedModel
from control.errors import APIError
from control.ids import new_id
from control.settings import Settings
from inference.client import (
    GenerationRequest,
    InferenceClient,
    InferenceRejected,
    InferenceUnavailable,
    ModelRef,
    StreamEvent,
)

log = logging.getLogger(__name__)

Kind = Literal["chat", "text"]

REQUESTS = Counter("tunefleet_inference_requests", "Completion requests by endpoint and outcome",
                   ["endpoint", "outcome"])
TOKENS = Counter("tunefleet_inference_tokens", "Tokens of completion requests", ["kind"])
TIME_TO_FIRST_TOKEN = Histogram(
    "tunefleet_inference_time_to_first_token_seconds", "From the request to its first generated text",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
QUEUE_TIME = Histogram(
    "tunefleet_inference_queue_seconds", "Time a request waited for its base model (other generations)",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0),
)
DECODE_RATE = Histogram(
    "tunefleet_inference_tokens_per_second", "Completion tokens per second of each request after its first",
    buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
)


class TenantSlots:
    """How many completions each tenant has running; used from the event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running: dict[str, int] = defaultdict(int)

    def acquire(self, tenant_id: str) -> bool:
        if self.running[tenant_id] >= self.limit:
            return False
        self.running[tenant_id] += 1
        return True

    def release(self, tenant_id: str) -> None:
        self.running[tenant_id] -= 1
        if self.running[tenant_id] <= 0:
            del self.running[tenant_id]


class TokenBudget:
    """Tokens each tenant used in the last ``window_s`` seconds (this API process)."""

    def __init__(self, limit: int, *, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.used: dict[str, deque[tuple[float, int]]] = defaultdict(deque)

    def retry_after(self, tenant_id: str) -> int | None:
        """None while the tenant is under its limit, else the seconds until it is again."""
        now, spent = self.clock(), self.used[tenant_id]
        while spent and spent[0][0] <= now - self.window_s:
            spent.popleft()
        total = sum(n for _, n in spent)
        if total < self.limit:
            return None
        for at, n in spent:  # the oldest uses that must age out to get under the limit
            total -= n
            if total < self.limit:
                return max(1, math.ceil(at + self.window_s - now))
        return math.ceil(self.window_s)

    def spend(self, tenant_id: str, tokens: int) -> None:
        if tokens > 0:
            self.used[tenant_id].append((self.clock(), tokens))


@dataclass
class _Tally:
    """What a request produced, for its usage and its metrics."""

    endpoint: str
    started: float
    budget: TokenBudget | None = None
    tenant_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_text_at: float | None = None
    finish: dict[int, str] = field(default_factory=dict)

    def see(self, event: StreamEvent) -> None:
        if event.type == "start":
            self.prompt_tokens = event.prompt_tokens or 0
            if event.queued_s is not None:
                QUEUE_TIME.observe(event.queued_s)
        elif event.type == "text" and self.first_text_at is None:
            self.first_text_at = time.perf_counter()
            TIME_TO_FIRST_TOKEN.observe(self.first_text_at - self.started)
        elif event.type == "finish":
            self.completion_tokens += event.completion_tokens or 0
            self.finish[event.index] = event.finish_reason or "stop"

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def done(self, outcome: str) -> None:
        if self.budget is not None:
            self.budget.spend(self.tenant_id, self.prompt_tokens + self.completion_tokens)
        REQUESTS.labels(self.endpoint, outcome).inc()
        TOKENS.labels("prompt").inc(self.prompt_tokens)
        TOKENS.labels("completion").inc(self.completion_tokens)
        if self.first_text_at is not None and self.completion_tokens > 1:
            elapsed = time.perf_counter() - self.first_text_at
            if elapsed > 0:
                DECODE_RATE.observe((self.completion_tokens - 1) / elapsed)


def local_routing(served: ServedModel, tenant_id: str, settings: Settings) -> dict[str, Any]:
    """A generation request's models for the embedded worker (local paths), whose turn it
    takes, and how long it may wait for its base model to load."""
    adapter = None if served.adapter_path is None else ModelRef(id=served.id, path=served.adapter_path)
    return {"base": ModelRef(id=served.base.id, path=served.base.path), "adapter": adapter, "tenant": tenant_id,
            "load_wait_s": min(settings.inference_load_wait_s, settings.inference_timeout_s)}


def endpoint_name(kind: Kind) -> str:
    return "chat.completions" if kind == "chat" else "completions"


def token_budget(request: Request) -> TokenBudget | None:
    state = request.app.state
    limit = state.settings.inference_tokens_per_minute_per_tenant
    if limit is None:
        return None
    if getattr(state, "inference_budget", None) is None:
        state.inference_budget = TokenBudget(limit)
    return state.inference_budget


def admit(request: Request, tenant_id: str, endpoint: str) -> TenantSlots:
    """Take one of the tenant's completion slots (give it back with ``release``), or 429."""
    budget = token_budget(request)
    wait = budget.retry_after(tenant_id) if budget is not None else None
    if wait is not None:
        REQUESTS.labels(endpoint, "token_limit_exceeded").inc()
        raise APIError(429, "token_limit_exceeded",
                       f"Your organization used its {budget.limit} tokens of the last minute; retry in {wait} s.",
                       headers={"Retry-After": str(wait)})
    slots = _slots(request)
    if not slots.acquire(tenant_id):
        REQUESTS.labels(endpoint, "too_many_requests").inc()
        raise APIError(429, "too_many_requests",
                       f"Your organization already has {slots.limit} completions running; retry when one ends.",
                       headers={"Retry-After": "1"})
    return slots


def _slots(request: Request) -> TenantSlots:
    state = request.app.state
    if getattr(state, "inference_slots", None) is None:
        state.inference_slots = TenantSlots(state.settings.inference_max_concurrent_per_tenant)
    return state.inference_slots


def _client(request: Request) -> InferenceClient:
    state = request.app.state
    if getattr(state, "inference_client", None) is None:
        settings = state.settings
        state.inference_client = InferenceClient(settings.inference_url, settings.inference_secret_value(),
                                                 idle_timeout_s=settings.inference_timeout_s)
    return state.inference_client


def _api_error(exc: Exception, model: str) -> APIError:
    if isinstance(exc, TimeoutError):
        return APIError(504, "inference_timeout", f"The completion on '{model}' took too long.")
    if isinstance(exc, InferenceUnavailable):
        log.error("%s", exc)
        return APIError(503, "inference_unavailable", "The inference worker is not available; retry later.",
                        headers={"Retry-After": "5"})
    assert isinstance(exc, InferenceRejected)
    if exc.status == 401 or exc.status >= 500 and exc.code not in ("model_loading", "model_load_failed",
                                                                   "model_unavailable", "adapter_load_failed"):
        log.error("the inference worker refused a request: %s %s %s", exc.status, exc.code, exc.message)
        return APIError(503, "inference_unavailable", "The inference worker failed; retry later.",
                        headers={"Retry-After": "5"})
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return APIError(exc.status, exc.code, exc.message, param="model" if exc.status == 404 else exc.param,
                    headers=headers)


def _event_error(event: StreamEvent) -> APIError:
    """A generation's ``error`` event as the caller's error: the worker stopping (a restart)
    is worth a retry; anything else is a failed generation."""
    if event.code == "worker_stopping":
        return APIError(503, "inference_unavailable", "The inference worker restarted; retry.",
                        headers={"Retry-After": "5"})
    return APIError(500, "generation_failed", "The generation failed; retry, or report it.")


async def _next(events: AsyncIterator[StreamEvent], deadline: float) -> StreamEvent | None:
    try:
        return await asyncio.wait_for(anext(events), max(deadline - time.perf_counter(), 0.001))
    except StopAsyncIteration:
        return None


class _ClientGone(Exception):
    """The client disconnected before the worker's first event."""


async def _first_unless_gone(request: Request, events: AsyncIterator[StreamEvent],
                             deadline: float) -> StreamEvent | None:
    """The worker's first event; :class:`_ClientGone` if the client disconnects first (while
    its request waits for the model or for its turn), the worker's stream then closed."""
    first = asyncio.ensure_future(_next(events, deadline))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((first, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
    if first.cancelled():
        raise _ClientGone
    return first.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def serve_completion(request: Request, tenant_id: str, generation: GenerationRequest, *, kind: Kind,
                           model: str, stream: bool, include_usage: bool) -> Response:
    """Run ``generation`` for ``tenant_id`` and answer in OpenAI's shape (see the module doc)."""
    settings = request.app.state.settings
    endpoint = endpoint_name(kind)
    slots = admit(request, tenant_id, endpoint)
    tally = _Tally(endpoint, time.perf_counter(), token_budget(request), tenant_id)
    deadline = tally.started + settings.inference_timeout_s
    events = _client(request).generate(generation)
    try:
        first = await _first_unless_gone(request, events, deadline)
    except (TimeoutError, InferenceUnavailable, InferenceRejected) as exc:
        error = _api_error(exc, model)
        slots.release(tenant_id)
        await events.aclose()
        tally.done(error.code)
        raise error from exc
    except _ClientGone:
        slots.release(tenant_id)
        await events.aclose()
        tally.done("client_closed")
        return Response(status_code=499)  # nobody reads it: the connection is gone
    except BaseException:
        slots.release(tenant_id)
        await events.aclose()
        raise
    if first is not None:
        tally.see(first)
    chunks = _Chunks(kind, model)

    def release() -> None:
        slots.release(tenant_id)

    if stream:
        body = _sse(events, tally, chunks, deadline, include_usage=include_usage, n=generation.sampling.n)
        return SlotStreamingResponse(body, on_close=release, closing=events.aclose,
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        texts: dict[int, list[str]] = defaultdict(list)
        while (event := await _next(events, deadline)) is not None:
            tally.see(event)
            if event.type == "error":
                raise _event_error(event)
            if event.type == "text":
                texts[event.index].append(event.text or "")
    except (TimeoutError, InferenceUnavailable) as exc:
        error = _api_error(exc, model)
        tally.done(error.code)
        raise error from exc
    finally:
        release()
        await events.aclose()
    tally.done("ok")
    results = [("".join(texts[i]), tally.finish.get(i, "stop")) for i in range(generation.sampling.n)]
    return JSONResponse(chunks.complete(results, tally.usage()))


class _Chunks:
    """OpenAI's objects for one request: the final one, and the stream's chunks."""

    def __init__(self, kind: Kind, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        # No system_fingerprint: OpenAI types it as a string, and no backend one is tracked.
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def complete(self, results: list[tuple[str, str]], usage: dict[str, int]) -> dict[str, Any]:
        if self.kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": None, "finish_reason": reason} for i, (text, reason) in enumerate(results)]
            return {**self._envelope("chat.completion"), "choices": choices, "usage": usage}
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                   for i, (text, reason) in enumerate(results)]
        return {**self._envelope("text_completion"), "choices": choices, "usage": usage}

    def chunk(self, index: int, *, text: str | None = None, role: bool = False,
              finish_reason: str | None = None, usage: bool) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = {**self._envelope("text_completion"), "choices": [choice]}
        if usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(events: AsyncIterator[StreamEvent], tally: _Tally, chunks: _Chunks, deadline: float, *,
               include_usage: bool, n: int) -> AsyncIterator[str]:
    opened: set[int] = set()
    outcome = "ok"
    try:
        while True:
            try:
                event = await _next(events, deadline)
            except (TimeoutError, InferenceUnavailable) as exc:
                error = _api_error(exc, chunks.model)
                outcome = error.code
                yield _data(error.body())
                break
            if event is None:
                break
            tally.see(event)
            if event.type == "error":
                error = _event_error(event)
                outcome = error.code
                yield _data(error.body())
                break
            if event.type in ("text", "finish") and event.index not in opened and chunks.kind == "chat":
                opened.add(event.index)
                yield _data(chunks.chunk(event.index, role=True, usage=include_usage))
            if event.type == "text":
                yield _data(chunks.chunk(event.index, text=event.text, usage=include_usage))
            elif event.type == "finish":
                yield _data(chunks.chunk(event.index, finish_reason=event.finish_reason, usage=include_usage))
        if include_usage and outcome == "ok":
            yield _data(chunks.usage_chunk(tally.usage()))
        yield "data: [DONE]\n\n"
    finally:
        tally.done(outcome if len(tally.finish) == n or outcome != "ok" else "client_closed")


class SlotStreamingResponse(StreamingResponse):
    """A stream that gives the tenant's slot back and closes the worker's stream when it
    ends, however it ends (finished, failed, or the client went away)."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None],
                 closing: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close, self._closing, self._content = on_close, closing, content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._content.aclose()  # type: ignore[attr-defined]
            await self._closing()
