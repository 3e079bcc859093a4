"""Schemas of ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's shapes).

Requests accept the parameters OpenAI's SDK sends for these calls; a parameter this
service cannot honour (log probabilities, penalties, structured output, ...) is refused
with 400 ``unsupported_parameter`` rather than silently ignored. Responses and stream
chunks carry exactly OpenAI's fields, so ``openai``'s parsers read them unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4
DEFAULT_CHAT_MAX_TOKENS = 512  # when neither max_tokens nor max_completion_tokens is given
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What both endpoints share. Unknown parameters are refused (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=512,
                       description="A base model id, or a fine-tuned model / checkpoint id of your organization.")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOP} sequences that end the text.")
    n: int | None = Field(None, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    # Refused unless left at their neutral value (see _unsupported).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP} non-empty strings")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def unsupported(self) -> str | None:
        """The first parameter given a value this service does not implement, or None."""
        neutral = {"frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logprobs": (None, False, 0),
                   "logit_bias": (None, {})}
        return next((name for name, ok in neutral.items() if getattr(self, name) not in ok), None)


class ChatCompletionCreate(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1, description="OpenAI chat messages.")
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    tools: list[dict[str, Any]] | None = Field(None, description="Rendered into the prompt by the chat template.")
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def unsupported(self) -> str | None:
        if self.top_logprobs:
            return "top_logprobs"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format"
        return super().unsupported()


class CompletionCreate(_SamplingFields):
    prompt: str | list[str] = Field(description="The text to continue (one prompt per request).")
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo or self.suffix or (self.best_of not in (None, 1)):
            return "echo" if self.echo else "suffix" if self.suffix else "best_of"
        return super().unsupported()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class _Answer(BaseModel):
    """What every completion object carries besides its ``object`` and ``choices``."""

    id: str
    created: int
    model: str
    usage: Usage
    system_fingerprint: str | None = Field(None, exclude_if=lambda value: value is None,
                                           description="Not served: OpenAI types it as a string.")


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
