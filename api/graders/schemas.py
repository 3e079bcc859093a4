"""Request and response shapes of the grader endpoints, as OpenAI's API defines them.

The grader itself stays a JSON object here: ``trainers.common.graders.parse_grader``
checks it (the trainers apply the same rules), so its errors name the grader's own fields
(``grader.operation``), not a union's branches.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any] = Field(description="A string_check, text_similarity, python, score_model or multi "
                                               "grader object.")


class GraderRunRequest(GraderValidateRequest):
    model_sample: str = Field(description="The model's output: the sample namespace (output_json when it is JSON).")
    item: dict[str, Any] | None = Field(None, description="The data row: the item namespace.")


class GraderValidateResponse(BaseModel):
    grader: dict[str, Any]


class GraderRunErrors(BaseModel):
    formula_parse_error: bool
    sample_parse_error: bool
    truncated_observation_error: bool
    unresponsive_reward_error: bool
    invalid_variable_error: bool
    other_error: bool
    python_grader_server_error: bool
    python_grader_server_error_type: str | None = Field(
        description="Why the sandbox stopped a python grader: timeout, memory_limit, output_limit, "
                    "forbidden_syscall, crashed or sandbox_unavailable.")
    python_grader_runtime_error: bool
    python_grader_runtime_error_details: str | None
    model_grader_server_error: bool
    model_grader_refusal_error: bool
    model_grader_parse_error: bool
    model_grader_server_error_details: str | None


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderRunErrors
    execution_time: float
    scores: dict[str, Any]
    token_usage: int | None
    sampled_model_name: str | None


class GraderRunResponse(BaseModel):
    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any]
    model_grader_token_usage_per_model: dict[str, Any]
