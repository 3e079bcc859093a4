"""``POST /internal/v1/jobs/{job_id}/reports``: where trainers send report batches."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

from api.deps import SessionDep, SettingsDep
from api.errors import error_responses
from api.route_auth import job_token
from control.reports.ingest import apply_report, authenticate_job, check_report_size
from control.reports.schemas import ReportAck, ReportBatchIn

router = APIRouter(prefix="/internal/v1/jobs", tags=["internal"])


async def body_bytes(request: Request) -> int:
    """The length of the request's body (read once already, to parse the batch)."""
    return len(await request.body())


# job_token authenticates before the batch is validated (a 401 before any 400).
@router.post("/{job_id}/reports", response_model=ReportAck, dependencies=[Depends(job_token)],
             responses=error_responses(413))
def post_reports(
    job_id: str, batch: ReportBatchIn, session: SessionDep, settings: SettingsDep,
    size: Annotated[int, Depends(body_bytes)],
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> ReportAck:
    """Apply one batch (idempotent by ``seq``); authenticated by the per-job token.

    A batch over ``TUNEFLEET_REPORT_MAX_ITEMS`` items or ``TUNEFLEET_REPORT_MAX_BYTES`` is
    refused whole (413 ``report_too_large``), before anything is written.
    """
    job = authenticate_job(session, job_id, authorization)
    check_report_size(batch, size, settings)
    applied = apply_report(session, job, batch, settings)
    return ReportAck(acked_seq=batch.seq, duplicate=not applied)
