"""Chat completions the service asks for itself: a ``score_model`` grader's call
(``api.graders.model_chat``) and a held-out evaluation's answers (``api.evaluations``).

They take the completion path of ``POST /v1/chat/completions``: the embedded worker
(``completions.serve_completion``) or, for a base model with an ``inference_url``, its
server (``proxy.proxy_completion``), so the tenant's admission and token limits, the
timeout and the worker's errors (``APIError``) apply exactly as to a client's request.

A background evaluation has no client request: :func:`detached_request` gives it one that
carries the app (its settings, worker client and tenant slots) and never reports a
disconnect, since there is no client that could leave.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import Message

from api.inference.completions import local_routing, serve_completion
from api.inference.proxy import proxy_completion
from api.inference.served_models import ServedModel
from inference.client import GenerationRequest
from inference.protocol import Sampling

CHAT_PATH = "/v1/chat/completions"


def detached_request(app: FastAPI) -> Request:
    """A request of the service itself on ``app`` (see the module doc)."""

    async def receive() -> Message:
        await asyncio.Event().wait()  # nobody disconnects: the caller cancels its own task instead
        raise AssertionError("unreachable")

    scope = {"type": "http", "app": app, "method": "POST", "path": CHAT_PATH, "headers": [], "query_string": b""}
    return Request(scope, receive)


async def chat_completion(request: Request, tenant_id: str, served: ServedModel, messages: Sequence[dict[str, Any]],
                          sampling: Sampling, *, tools: Sequence[dict[str, Any]] | None = None,
                          response_format: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``chat.completion`` object ``served`` answers for ``tenant_id``; raises the
    ``APIError`` a client would get (429, 503 ``model_loading``, 400 ``context_length_exceeded``...)."""
    if served.base.inference_url is not None:
        payload: dict[str, Any] = {"model": served.id, "messages": list(messages),
                                   "temperature": sampling.temperature, "top_p": sampling.top_p}
        optional = {"seed": sampling.seed, "response_format": response_format, "tools": list(tools or []) or None,
                    "max_completion_tokens": None if sampling.fit_context else sampling.max_tokens}
        payload.update({key: value for key, value in optional.items() if value is not None})
        response = await proxy_completion(request, tenant_id, served, payload, path=CHAT_PATH,
                                          endpoint="chat.completions", stream=False)
    else:
        settings = request.app.state.settings
        # The embedded worker cannot hold a model to a JSON schema (response_format): a grader
        # parses a bare number or the JSON its prompt asks for alike (model_grader.parse_score).
        generation = GenerationRequest(**local_routing(served, tenant_id, settings), messages=tuple(messages),
                                       tools=tuple(tools) if tools else None, sampling=sampling)
        response = await serve_completion(request, tenant_id, generation, kind="chat", model=served.id,
                                          stream=False, include_usage=False)
    return json.loads(bytes(response.body))
