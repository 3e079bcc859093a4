"""The error envelope every failed request answers with (OpenAI's shape).

``control.errors.APIError.body()`` writes it; this model documents it in ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorObject(BaseModel):
    message: str = Field(description="What went wrong and what to do about it.")
    type: str = Field(description="The error class, e.g. invalid_request_error, "
                      "authentication_error, permission_error, conflict_error, api_error.")
    param: str | None = Field(description="The request field at fault (a dotted path), if any.")
    code: str = Field(description="A stable code clients may switch on, e.g. invalid_request.")
    details: dict[str, Any] | None = Field(
        None, description="Extra structured context for some codes (e.g. per-line file errors)."
    )


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorObject
