"""Validating and running a tenant's grader in the API process.

Steps of ``run`` (:func:`run_grader`):

1. the grader is checked as the trainers check it (``trainers.common.graders.parse_grader``:
   400 with a stable code and the field), and every ``score_model`` grader's model must be
   one the tenant may use (``model_chat.resolve_grader_models``);
2. a grader with python code takes a python slot: at most
   ``TUNEFLEET_GRADER_MAX_CONCURRENT_PER_TENANT`` per organization and
   ``TUNEFLEET_GRADER_MAX_CONCURRENT`` per API process run at once; one more is 429
   ``graders_busy`` (no tenant's graders can occupy every sandbox);
3. grading runs in a worker thread (a sandboxed process is waited on, a model is asked),
   never on the event loop, and answers OpenAI's ``graders/run`` object: a failure on the
   sample (a template naming what the item lacks, a python grader that raised or was
   stopped) is reported in ``metadata.errors`` with reward 0, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from api.graders.model_chat import ModelChat, resolve_grader_models
from api.inference.completions import TenantSlots
from control.errors import APIError
from control.models.base_models import BaseModelRegistry
from control.settings import Settings
from trainers.common.graders import (
    GraderInvalid,
    GradingContext,
    grade,
    parse_grader,
    sample_namespace,
)
from trainers.common.graders.models import MultiGrader, PythonGrader


def checked_grader(data: dict[str, Any]) -> Any:
    """The parsed grader, or its 400."""
    try:
        return parse_grader(data)
    except GraderInvalid as exc:
        raise APIError(400, exc.code, exc.message, param=exc.param) from exc


def validate_grader(session: Session, tenant_id: str, settings: Settings, base_models: BaseModelRegistry,
                    data: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's validate answer: the grader as given, once every check passed."""
    grader = checked_grader(data)
    resolve_grader_models(session, tenant_id, settings, base_models, grader)
    return {"grader": data}


def runs_python(grader: Any) -> bool:
    if isinstance(grader, MultiGrader):
        return any(isinstance(sub, PythonGrader) for sub in grader.graders.values())
    return isinstance(grader, PythonGrader)


class PythonSlots:
    """Python graders running in this API process, per tenant and in all; event loop only."""

    def __init__(self, per_tenant: int, total: int) -> None:
        self.tenants = TenantSlots(per_tenant)
        self.total, self.running = total, 0

    @contextmanager
    def hold(self, tenant_id: str) -> Iterator[None]:
        if self.running >= self.total or not self.tenants.acquire(tenant_id):
            raise APIError(429, "graders_busy", "Python graders are running for your organization already (or the "
                           "service runs as many as it may); retry when one ends.", headers={"Retry-After": "2"})
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self.tenants.release(tenant_id)


def python_slots(request: Request) -> PythonSlots:
    state = request.app.state
    if getattr(state, "python_grader_slots", None) is None:
        settings = state.settings
        state.python_grader_slots = PythonSlots(settings.grader_max_concurrent_per_tenant,
                                                settings.grader_max_concurrent)
    return state.python_grader_slots


async def run_grader(request: Request, session: Session, tenant_id: str, settings: Settings,
                     base_models: BaseModelRegistry, data: dict[str, Any], model_sample: str,
                     item: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's ``graders/run`` answer for one sample (see the module doc)."""
    grader = checked_grader(data)
    served = await run_in_threadpool(resolve_grader_models, session, tenant_id, settings, base_models, grader)
    context = GradingContext(chat=ModelChat(request, tenant_id, served), sandbox=settings.grader_limits())
    slot = python_slots(request).hold(tenant_id) if runs_python(grader) else nullcontext()
    with slot:
        result = await run_in_threadpool(grade, grader, sample_namespace(model_sample), item or {}, context)
    return result.response()
