"""``POST /internal/v1/jobs/{job_id}/reports``: where trainers send report batches."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header

from api.deps import SessionDep, SettingsDep
from api.reports.ingest import apply_report, authenticate_job
from api.reports.schemas import ReportAck, ReportBatchIn
from api.route_auth import job_token

router = APIRouter(prefix="/internal/v1/jobs", tags=["internal"])


# job_token authenticates before the batch is validated (a 401 before any 400).
@router.post("/{job_id}/reports", response_model=ReportAck, dependencies=[Depends(job_token)])
def post_reports(
    job_id: str, batch: ReportBatchIn, session: SessionDep, settings: SettingsDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> ReportAck:
    """Apply one batch (idempotent by ``seq``); authenticated by the per-job token."""
    job = authenticate_job(session, job_id, authorization)
    applied = apply_report(session, job, batch, settings)
    return ReportAck(acked_seq=batch.seq, duplicate=not applied)
