"""The local channel between the API and the inference worker: request, stream events, auth.

The API resolves what a caller may use (a base model of the registry, a fine-tuned
model or checkpoint of the caller's tenant) into local paths, and sends the worker one
:class:`GenerationRequest` per completion request over HTTP on the loopback interface::

    POST /v1/generate      X-Tunefleet-Inference-Secret: <shared secret>
    -> 200 application/x-ndjson, one StreamEvent per line, as tokens are produced
    -> 503 {"code": "model_loading", ...} with Retry-After when the base model is still
       loading after the request's ``load_wait_s``
    -> 4xx/5xx {"code", "message", "param"} otherwise
    POST /v1/preload       a ModelRef: load that base now if the worker is idle
    -> 202 {"status": "loaded" | "loading" | "busy" | "unavailable"}
    GET  /healthz          -> 200, or 503 {"status": "stalled"} when a generation holds a
       model without producing a token for longer than the worker's stall limit

Closing the response stream cancels the generation at its next token.

The worker knows nothing of jobs or the database: it only loads what it is told, so the
API stays the single place that decides who may read which adapter. The request's
``tenant`` is an opaque key the worker shares each model's turns by. The shared
secret keeps other local users and processes from using the worker (and reading models
through it); the loopback address keeps it off the network.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SECRET_HEADER = "X-Tunefleet-Inference-Secret"
GENERATE_PATH = "/v1/generate"
PRELOAD_PATH = "/v1/preload"
HEALTH_PATH = "/healthz"
MAX_N = 16  # choices per request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Strict):
    """A model directory and the name it is cached under (the base's id, the adapter's id)."""

    id: str = Field(min_length=1)
    path: str = Field(min_length=1, description="Local directory in Hugging Face / PEFT format.")


class Sampling(_Strict):
    max_tokens: int = Field(ge=1, le=1_000_000)
    fit_context: bool = Field(default=False, description=(
        "max_tokens is a default, not the caller's: shorten it to the room the prompt leaves in the "
        "model's context instead of refusing the request."))
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = Field(default=1, ge=1, le=MAX_N)


class GenerationRequest(_Strict):
    """What to generate: exactly one of ``messages`` (rendered with the chat template) or
    ``prompt`` (plain text, tokenized as is)."""

    base: ModelRef
    adapter: ModelRef | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    sampling: Sampling
    tenant: str = Field(default="", max_length=256, description="Whose request: turns on a model rotate over these.")
    load_wait_s: float = Field(default=0.0, ge=0.0, le=3600.0,
                               description="How long to wait for a base model that is loading before 503.")

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of messages and prompt")
        return self


class StreamEvent(_Strict):
    """One line of the worker's answer.

    ``start``: the prompt is tokenized (``prompt_tokens``) and the generation begins after
    ``queued_s`` waiting for the model; ``text``: new text of choice
    ``index``; ``finish``: choice ``index`` ended (``finish_reason`` stop | length,
    ``completion_tokens``); ``error``: the generation failed (``code``, ``message``).
    """

    type: Literal["start", "text", "finish", "error"]
    index: int = 0
    text: str | None = None
    prompt_tokens: int | None = None
    queued_s: float | None = None
    completion_tokens: int | None = None
    finish_reason: Literal["stop", "length"] | None = None
    code: str | None = None
    message: str | None = None
