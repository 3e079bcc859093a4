"""``POST /v1/chat/completions`` and ``POST /v1/completions`` on base and fine-tuned models.

``model`` is a base model id, or a fine-tuned model or checkpoint id of the caller's
organization (``api.inference.served_models``); the embedded inference worker generates
(``api.inference.completions``), or, for a base model with an ``inference_url``, that server does
(``api.inference.proxy``). Chat messages are rendered with the model's chat template (tools
included); tool calls in the output are returned as text, not parsed.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlalchemy.orm import Session

from api.deps import BaseModelsDep, CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.inference.completions import local_routing, serve_completion
from api.inference.proxy import proxy_completion
from api.inference.schemas import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletion,
    ChatCompletionCreate,
    Completion,
    CompletionCreate,
)
from api.inference.served_models import ServedModel, resolve_served_model
from control.errors import APIError
from control.settings import Settings
from inference.client import GenerationRequest
from inference.protocol import Sampling

router = APIRouter(prefix="/v1", tags=["inference"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "The completion; with `stream: true`, OpenAI's chunks as Server-Sent Events "
                         "ending `data: [DONE]`."},
    **error_responses(400, 404, 429, 503),
    504: {"description": "The completion took longer than TUNEFLEET_INFERENCE_TIMEOUT_S."},
}


def _unsupported(body: ChatCompletionCreate | CompletionCreate) -> None:
    name = body.unsupported()
    if name is not None:
        raise APIError(400, "unsupported_parameter", f"'{name}' is not supported by this service; leave it unset.",
                       param=name)


def _sampling(body: ChatCompletionCreate | CompletionCreate, asked: int | None, default: int) -> Sampling:
    """What to sample; a ``max_tokens`` the caller did not give is a default the worker
    shortens to the room the prompt leaves in the model's context."""
    return Sampling(max_tokens=asked or default, fit_context=asked is None,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                    stop=body.stop_sequences(), n=body.n or 1)


async def _resolve(session: Session, tenant_id: str, settings: Settings, base_models: BaseModelsDep,
                   model: str) -> ServedModel:
    """The served model, with the session closed: a completion may run for minutes and must
    not hold a database connection meanwhile."""
    try:
        return await run_in_threadpool(resolve_served_model, session, tenant_id, settings, base_models, model)
    finally:
        await run_in_threadpool(session.close)


def _text_content(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI's content parts (``[{"type": "text", "text": ...}]``) joined into the string a
    chat template expects; other part types (images, audio) are refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "unsupported_content", "Only text content parts are supported.",
                           param=f"messages.{index}.content")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


@router.post("/chat/completions", response_model=ChatCompletion, responses=_RESPONSES)
async def create_chat_completion(body: ChatCompletionCreate, request: Request, session: SessionDep,
                                 tenant: CurrentTenant, settings: SettingsDep,
                                 base_models: BaseModelsDep) -> Response:
    """A chat completion (OpenAI's ``chat.completions.create``)."""
    _unsupported(body)
    for index, message in enumerate(body.messages):
        if not isinstance(message.get("role"), str):
            raise APIError(400, "invalid_request", "Every message needs a 'role'.", param=f"messages.{index}.role")
    served = await _resolve(session, tenant.id, settings, base_models, body.model)
    if served.base.inference_url is not None:
        return await proxy_completion(request, tenant.id, served, body.model_dump(exclude_unset=True),
                                      path="/v1/chat/completions", endpoint="chat.completions",
                                      stream=bool(body.stream))
    tools = tuple(body.tools) if body.tools and body.tool_choice != "none" else None
    generation = GenerationRequest(
        **local_routing(served, tenant.id, settings), tools=tools,
        messages=tuple(_text_content(m, i) for i, m in enumerate(body.messages)),
        sampling=_sampling(body, body.max_completion_tokens or body.max_tokens, DEFAULT_CHAT_MAX_TOKENS),
    )
    return await serve_completion(request, tenant.id, generation, kind="chat", model=body.model,
                                  stream=bool(body.stream),
                                  include_usage=bool(body.stream_options and body.stream_options.include_usage))


@router.post("/completions", response_model=Completion, responses=_RESPONSES)
async def create_completion(body: CompletionCreate, request: Request, session: SessionDep,
                            tenant: CurrentTenant, settings: SettingsDep,
                            base_models: BaseModelsDep) -> Response:
    """A text completion of one prompt (OpenAI's ``completions.create``)."""
    _unsupported(body)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise APIError(400, "invalid_request", "Send one prompt per request.", param="prompt")
    served = await _resolve(session, tenant.id, settings, base_models, body.model)
    if served.base.inference_url is not None:
        return await proxy_completion(request, tenant.id, served, body.model_dump(exclude_unset=True),
                                      path="/v1/completions", endpoint="completions", stream=bool(body.stream))
    generation = GenerationRequest(**local_routing(served, tenant.id, settings), prompt=prompts[0],
                                   sampling=_sampling(body, body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS))
    return await serve_completion(request, tenant.id, generation, kind="text", model=body.model,
                                  stream=bool(body.stream),
                                  include_usage=bool(body.stream_options and body.stream_options.include_usage))
