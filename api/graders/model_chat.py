"""The chat-completion call a ``score_model`` grader makes when the API grades.

Which models a grader may name: a model this service serves to the caller (a base model,
or one of the organization's fine-tuned models or checkpoints, exactly as
``/v1/chat/completions`` resolves them), or a model the operator listed in
``TUNEFLEET_GRADER_EXTERNAL_MODELS``, answered by the OpenAI-compatible endpoint
``TUNEFLEET_GRADER_EXTERNAL_URL`` under the webhooks' target rule (public addresses only,
unless a host is allowed; the connection goes to the address that was checked).

Served models are asked through the completion path itself (``api.inference``): the
tenant's concurrency and token limits, the timeout and the worker's errors apply as to any
completion. Grading runs in a worker thread (python graders block), so :class:`ModelChat`
hands each call back to the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import anyio.from_thread
import httpx
from fastapi import Request
from sqlalchemy.orm import Session

from api.inference.internal import chat_completion
from api.inference.schemas import DEFAULT_CHAT_MAX_TOKENS
from api.inference.served_models import ServedModel, resolve_served_model
from control.errors import APIError
from control.models.base_models import BaseModelRegistry
from control.settings import Settings
from control.webhooks.urls import TargetURLError, checked_target, pinned_request
from inference.protocol import Sampling
from trainers.common.graders import ChatCompletionError, ChatReply, ChatRequest
from trainers.common.graders.models import MultiGrader, ScoreModelGrader
from trainers.common.target_urls import split_hosts

INVALID_GRADER_MODEL = "invalid_grader_model"


def score_models(grader: Any, param: str = "grader") -> Iterator[tuple[str, str]]:
    """``(model, param)`` of every ``score_model`` grader in ``grader``."""
    if isinstance(grader, ScoreModelGrader):
        yield grader.model, f"{param}.model"
    elif isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            yield from score_models(sub, f"{param}.graders.{key}")


def external_models(settings: Settings) -> set[str]:
    return set(split_hosts(settings.grader_external_models)) if settings.grader_external_url else set()


def resolve_grader_models(session: Session, tenant_id: str, settings: Settings, base_models: BaseModelRegistry,
                          grader: Any, param: str = "grader") -> dict[str, ServedModel]:
    """The served model of each ``score_model`` grader (external ones are not looked up), or
    400 ``invalid_grader_model`` naming the field (under ``param``, where the grader is)."""
    served: dict[str, ServedModel] = {}
    external = external_models(settings)
    for model, where in score_models(grader, param):
        if model in external or model in served:
            continue
        try:
            served[model] = resolve_served_model(session, tenant_id, settings, base_models, model)
        except APIError as exc:
            if exc.code != "model_not_found":
                raise
            raise APIError(400, INVALID_GRADER_MODEL, f"The grader's model '{model}' is not a model this service "
                           "serves to you.", param=where) from exc
    return served


class ModelChat:
    """``score_model``'s chat call for one request (see the module doc); call it from a worker
    thread of the request's event loop."""

    def __init__(self, request: Request, tenant_id: str, served: Mapping[str, ServedModel]) -> None:
        self.request, self.tenant_id, self.served = request, tenant_id, served
        self.settings: Settings = request.app.state.settings

    def __call__(self, chat: ChatRequest) -> ChatReply:
        return anyio.from_thread.run(self.complete, chat)

    async def complete(self, chat: ChatRequest) -> ChatReply:
        try:
            if chat.model in self.served:
                sampling = Sampling(max_tokens=chat.max_completion_tokens or DEFAULT_CHAT_MAX_TOKENS,
                                    fit_context=chat.max_completion_tokens is None,
                                    temperature=1.0 if chat.temperature is None else chat.temperature,
                                    top_p=1.0 if chat.top_p is None else chat.top_p, seed=chat.seed)
                body = await chat_completion(self.request, self.tenant_id, self.served[chat.model], chat.messages,
                                             sampling, response_format=chat.response_format)
                return _reply(body, chat.model)
            return await self._external(chat)
        except APIError as exc:
            raise ChatCompletionError(f"{exc.code}: {exc.message}") from exc
        except ValueError as exc:
            raise ChatCompletionError(f"the model's answer is not a chat completion: {exc}") from exc

    async def _external(self, chat: ChatRequest) -> ChatReply:
        settings = self.settings
        base = (settings.grader_external_url or "").rstrip("/")
        try:
            target = checked_target(f"{base}/chat/completions", allow_private=settings.webhook_allow_private,
                                    allowed_hosts=settings.webhook_allowed_hosts)
        except TargetURLError as exc:
            raise ChatCompletionError(f"the grader endpoint is refused: {exc.message}") from exc
        url, headers, extensions = pinned_request(target)
        if settings.grader_external_api_key is not None:
            headers["Authorization"] = f"Bearer {settings.grader_external_api_key.get_secret_value()}"
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(settings.inference_timeout_s, connect=5.0),
                                         follow_redirects=False) as http:
                response = await http.post(url, json=_payload(chat), headers=headers, extensions=extensions)
        except httpx.HTTPError as exc:
            raise ChatCompletionError(f"the grader endpoint did not answer: {type(exc).__name__}") from exc
        if response.status_code != 200:
            raise ChatCompletionError(f"the grader endpoint answered HTTP {response.status_code}")
        return _reply(response.json(), chat.model)


def _payload(chat: ChatRequest) -> dict[str, Any]:
    """An OpenAI chat-completion request body (a server that speaks OpenAI's API)."""
    payload: dict[str, Any] = {"model": chat.model, "messages": chat.messages, "response_format": chat.response_format}
    optional = {"temperature": chat.temperature, "top_p": chat.top_p, "seed": chat.seed,
                "max_completion_tokens": chat.max_completion_tokens}
    payload.update({key: value for key, value in optional.items() if value is not None})
    return payload


def _reply(body: Any, model: str) -> ChatReply:
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError("no choices[0].message") from exc
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    return ChatReply(content=message.get("content"), refusal=message.get("refusal"),
                     model=str(body.get("model") or model),
                     usage={key: int(value) for key, value in (usage or {}).items() if isinstance(value, int)} or None)
