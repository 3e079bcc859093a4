"""Command functions for fine-tuning jobs (routes call these; so do tasks); the reads are
in ``api.jobs.queries``.

Creation checks the model, files and extensions, resolves ``"auto"`` hyperparameters
(see ``control.jobs.hyperparameters``) once the training file's example count is known, and moves
the job to ``queued`` through the lifecycle; a job whose files are still being validated
waits in ``validating_files`` and is advanced by ``control.jobs.queueing``.

A file's validated format must suit the job's method: a DPO job trains on preference
files only and a supervised job on any other format (400 ``file_method_mismatch`` when
the file is already validated, else the job fails with that code once it is).

A reinforcement job (``method.type`` "reinforcement") is checked in full (its grader as
``POST /v1/fine_tuning/alpha/graders/validate`` checks it, by :func:`check_reinforcement`;
its files and their format; each ``{{item.<key>}}`` its grader reads must be a key every
line of a validated file has, else 400 ``grader_item_missing``). Both trainers run it on
one GPU (``auto`` places it on fsdp_qlora, ``trainers.spec.auto_runs_method``), so a job
that could only fail is not created (:func:`reinforcement_unavailable`): more than one
pinned GPU and a ``score_model`` grader (no model endpoint reaches a trainer) are refused
with 400 ``invalid_request``. The trainers refuse such specs too
(``reinforcement_multi_rank``, ``grader_unavailable``).

A job whose ``model`` is a fine-tuned model (or one of its checkpoints) continues it
(``api.jobs.lineage``): it is checked and recorded there, and trains on that model's base.

A job that no node pool can hold even with every GPU free (the estimate's ``unfit``
reasons) is refused with 400 ``no_pool_fits`` instead of being queued to wait forever,
unless the body asks to queue it anyway (``placement.queue_if_unfit``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.files.queries import get_file
from api.graders.model_chat import resolve_grader_models
from api.jobs.lineage import ParentModel, child_settings, resolve_parent
from api.jobs.queries import opens
from api.jobs.schemas import JobCreate
from control.db.models import ApiKey, File, IdempotencyKey, Job, Tenant
from control.errors import APIError, not_found
from control.ids import hash_secret, new_id, new_job_token
from control.job_settings import JobSettings
from control.jobs.checkpoints import latest_checkpoint
from control.jobs.lifecycle import add_event, lock_job, transition
from control.jobs.queueing import file_error, method_mismatch, queue_if_files_ready
from control.models.base_models import BaseModelEntry, BaseModelRegistry
from control.models.hub import parse_hub_id
from control.queue import SCHEDULE, TaskQueue
from control.settings import Settings
from scheduling.model_files import missing_model_files
from trainers.common.graders import GraderInvalid, parse_grader
from trainers.common.graders.models import item_references, uses_model_grader
from trainers.spec import DEFAULT_MAX_SEQ_LEN, trains_base

log = logging.getLogger(__name__)


def request_hash(body: dict[str, Any]) -> str:
    """A stable hash of a request body (key order and whitespace do not matter)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()



def _usable_file(session: Session, tenant: Tenant, file_id: str, param: str) -> File:
    try:
        file = get_file(session, tenant, file_id, param=param)
    except APIError:
        raise APIError(400, "invalid_file", f"No file found with id '{file_id}'.", param=param)
    if file.purpose != "fine-tune":
        raise APIError(400, "invalid_file", f"File '{file_id}' has purpose '{file.purpose}', "
                       "not 'fine-tune'.", param=param)
    if file.status == "error":
        raise file_error(file, param)
    return file


def check_trainer(settings: JobSettings) -> None:
    adapter = settings.adapter
    if not trains_base(settings.trainer, adapter.quantization, adapter.double_quant):
        base = f"{adapter.quantization} base" + (" with double_quant" if adapter.double_quant else "")
        raise APIError(400, "invalid_request",
                       f"The JAX trainer trains LoRA on bf16/fp32 weights or an NF4 base without "
                       f"double_quant; a {base} needs trainer 'fsdp_qlora' or 'auto'.", param="trainer")


def base_model_and_settings(
    body: JobCreate, base_models: dict[str, BaseModelEntry], *, seed: int | None = None,
    parent: ParentModel | None = None,
) -> tuple[BaseModelEntry, JobSettings]:
    """The job's base model and settings, checked as job creation and estimates both check
    them: a configured model, a trainer that trains its base, and ``max_seq_len``
    (default: the smaller of the model's and ``DEFAULT_MAX_SEQ_LEN``) within the model's.
    ``seed``: the seed creation drew for a body that names none. ``parent``: the fine-tuned
    model ``body.model`` names (``api.jobs.lineage.resolve_parent``): the job trains on its
    base, stored as it was."""
    model = parent.base if parent is not None else base_models.get(body.model)
    if model is None:
        known = ", ".join(sorted(base_models)) or "none"
        hint = (" A Hugging Face Hub id is a base model once an admin has registered it "
                "(POST /v1/models) and it is fetched." if parse_hub_id(body.model) else "")
        raise APIError(400, "invalid_model",
                       f"Unknown base model '{body.model}'. Available: {known}.{hint}", param="model")
    max_seq_len = body.max_seq_len or min(model.max_seq_len, DEFAULT_MAX_SEQ_LEN)
    settings = body.job_settings(max_seq_len=max_seq_len, seed=seed)
    if parent is not None:
        settings = child_settings(body, parent, settings)
    check_trainer(settings)
    if max_seq_len > model.max_seq_len:
        raise APIError(400, "invalid_request",
                       f"max_seq_len {max_seq_len} exceeds the model's {model.max_seq_len}.",
                       param="max_seq_len")
    return model, settings


GRADER_PARAM = "method.reinforcement.grader"


def check_reinforcement(session: Session, tenant_id: str, settings: Settings, base_models: BaseModelRegistry,
                        body: JobCreate) -> None:
    """A reinforcement job's grader, checked as the grader endpoints check it: 400 with the
    grader's stable code (``invalid_grader``, ``invalid_template``, ...) and its field under
    ``method.reinforcement.grader``; a ``score_model`` grader's model must be one the
    tenant may use. Nothing for other methods."""
    method = body.method.reinforcement if body.method is not None else None
    if method is None:
        return
    try:
        grader = parse_grader(method.grader, param=GRADER_PARAM)
    except GraderInvalid as exc:
        raise APIError(400, exc.code, exc.message, param=exc.param) from exc
    resolve_grader_models(session, tenant_id, settings, base_models, grader, GRADER_PARAM)


def grader_item_mismatch(body: JobCreate, file: File, param: str) -> APIError | None:
    """400 ``grader_item_missing`` when a reinforcement job's grader reads ``{{item.<key>}}``
    that some line of validated ``file`` lacks (the validation report's ``item_keys``: the
    keys every line has); None when each key is there, or the file is not validated yet."""
    method = body.method.reinforcement if body.method is not None else None
    keys = (file.validation or {}).get("item_keys")
    if method is None or file.status != "processed" or keys is None:
        return None
    for key, where in item_references(parse_grader(method.grader, param=GRADER_PARAM), GRADER_PARAM):
        if key not in keys:
            return APIError(
                400, "grader_item_missing",
                f"The grader reads {{{{item.{key}}}}} ({where}), but not every line of file '{file.id}' "
                f"({param}) has a '{key}' key; the keys every line has: {', '.join(keys)}.",
                param=where)
    return None


def reinforcement_unavailable(settings: JobSettings) -> APIError | None:
    """A 400 for a reinforcement job no trainer can run as asked (module doc); None otherwise."""
    method = settings.method
    if method.type != "reinforcement":
        return None
    if settings.placement.gpus is not None and settings.placement.gpus > 1:
        return APIError(
            400, "invalid_request",
            "Reinforcement fine-tuning runs on one GPU (its trainer samples on one process); "
            f"placement.gpus {settings.placement.gpus} cannot be used. Pin 1 or leave it unset.",
            param="placement.gpus")
    if uses_model_grader(method.grader):  # type: ignore[union-attr]
        return APIError(
            400, "invalid_request",
            "A score_model grader cannot grade during training here: no model endpoint reaches the trainer. "
            "Use string_check, text_similarity or python graders (graders/run still runs score_model).",
            param=GRADER_PARAM)
    return None


def require_model_files(model: BaseModelEntry) -> None:
    """400 ``model_unavailable`` for a local base model whose files are not there (its
    directory or ``config.json``): the job could never load it, and its estimate would be
    a guess. ``s3://`` models are the trainer's to find (``missing_model_files``)."""
    missing = missing_model_files(model.path, model.id)
    if missing is not None:
        raise APIError(400, "model_unavailable",
                       f"{missing}. Put the model's Hugging Face files there, or choose another "
                       "model (GET /v1/models).", param="model")


def create_job(
    session: Session,
    tenant: Tenant,
    body: JobCreate,
    *,
    raw_body: dict[str, Any],
    base_models: BaseModelRegistry,
    settings: Settings,
    queue: TaskQueue,
    idempotency_key: str | None = None,
    estimate: Callable[[Job], dict[str, Any]] | None = None,
    _retried: bool = False,
) -> Job:
    """Create a job (or return the one created earlier with the same Idempotency-Key).

    ``estimate(job)`` (``api.fleet.estimate.estimate_job``) is stored on ``job.estimate``; a
    failing estimate never fails the creation: its error is stored instead.
    """
    digest = request_hash(raw_body)
    if idempotency_key is not None:
        if not 1 <= len(idempotency_key) <= 255:
            raise APIError(400, "invalid_request", "Idempotency-Key must be 1-255 characters.",
                           param="Idempotency-Key")
        earlier = session.scalar(
            select(IdempotencyKey).where(
                IdempotencyKey.tenant_id == tenant.id, IdempotencyKey.key == idempotency_key
            )
        )
        if earlier is not None:
            if earlier.request_hash != digest:
                raise APIError(409, "idempotency_conflict",
                               "This Idempotency-Key was used with a different request body.",
                               param="Idempotency-Key")
            return session.get_one(Job, earlier.job_id)

    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    parent = resolve_parent(session, tenant.id, settings, base_models, body.model)
    model, job_settings = base_model_and_settings(body, base_models, seed=seed, parent=parent)
    require_model_files(model)
    training = _usable_file(session, tenant, body.training_file, "training_file")
    validation = (
        _usable_file(session, tenant, body.validation_file, "validation_file")
        if body.validation_file else None
    )
    for file, param in ((training, "training_file"), (validation, "validation_file")):
        mismatch = method_mismatch(file, job_settings.method.type, param) if file is not None else None
        if mismatch is None and file is not None:
            mismatch = grader_item_mismatch(body, file, param)
        if mismatch is not None:
            raise mismatch
    unavailable = reinforcement_unavailable(job_settings)
    if unavailable is not None:
        raise unavailable
    job = Job(
        id=new_id("ftjob"), tenant_id=tenant.id, model=body.model, base_model=model.id, training_file=training.id,
        validation_file=validation.id if validation else None, status="validating_files",
        priority=body.priority_value, suffix=body.suffix, metadata_=body.metadata,
        result_files=[], restarts=0, **job_settings.row_columns(),
    )
    try:
        session.add(job)
        session.flush()  # the job row first: events and the idempotency key refer to it
        if idempotency_key is not None:
            # Claimed before anything else: a concurrent twin blocks or fails right here.
            session.add(IdempotencyKey(tenant_id=tenant.id, key=idempotency_key,
                                       request_hash=digest, job_id=job.id))
            session.flush()
        add_event(session, job, f"Created fine-tuning job: {job.id}", type="message")
        queued = queue_if_files_ready(session, job)
        if estimate is not None:
            job.estimate = _estimate_or_error(estimate, job)
            refusal = no_pool_fits_error(job.estimate, queue_anyway=body.placement.queue_if_unfit)
            if refusal is not None:
                session.rollback()  # nothing of the refused job stays: row, events, key
                raise refusal
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the race: answer like a retry.
        session.rollback()
        if idempotency_key is None or _retried:
            raise
        return create_job(session, tenant, body, raw_body=raw_body, base_models=base_models, settings=settings,
                          queue=queue, idempotency_key=idempotency_key, estimate=estimate,
                          _retried=True)
    if queued:
        queue.send(SCHEDULE)
    return job


def _estimate_or_error(estimate: Callable[[Job], dict[str, Any]], job: Job) -> dict[str, Any]:
    try:
        return estimate(job)
    except Exception as exc:  # an estimate is advice: creation must not fail on it
        log.warning("estimate for %s failed: %s", job.id, exc, exc_info=True)
        code = getattr(exc, "code", None) or "estimate_failed"
        return {"object": "fine_tuning.estimate", "error": {"code": code, "message": str(exc)}}


def no_pool_fits_error(estimate: dict[str, Any], *, queue_anyway: bool) -> APIError | None:
    """400 ``no_pool_fits`` when the estimate found that no pool can hold the job even
    with every GPU free (its ``unfit`` reasons, one per pool), unless the body asked to
    queue it anyway (``placement.queue_if_unfit``). Such a job would wait forever."""
    unfit = estimate.get("unfit") or []
    if not unfit or queue_anyway:
        return None
    reasons = "; ".join(r["message"] for r in unfit)
    return APIError(
        400, "no_pool_fits",
        f"No node pool can hold this job, even with all its GPUs free ({reasons}). Use a "
        "smaller model, max_seq_len, micro batch or adapter, another trainer or pool, or set "
        "placement.queue_if_unfit to queue it for a pool that is being added or grown.",
        param="placement", details={"pools": unfit},
    )



def cancel_job(session: Session, key: ApiKey, job_id: str, *, queue: TaskQueue) -> Job:
    by = "an administrator" if actor_of(key) == "admin" else "the user"
    return _stop(session, key, job_id, "cancelled", f"Job cancelled by {by}.", queue=queue)


def pause_job(session: Session, key: ApiKey, job_id: str, *, queue: TaskQueue) -> Job:
    return _stop(session, key, job_id, "paused",
                 "Job paused; it keeps its last checkpoint and resumes from it.", queue=queue)


def _stop(session: Session, key: ApiKey, job_id: str, to: str, message: str, *,
          queue: TaskQueue) -> Job:
    """Move the caller's job to ``to`` (cancelled or paused); the scheduling cycle sent
    next stops its run."""
    job = lock_job_of(session, key, job_id)
    transition(session, job, to, actor=actor_of(key), message=message)
    session.commit()
    queue.send(SCHEDULE)
    return job


def resume_job(session: Session, key: ApiKey, job_id: str, *, queue: TaskQueue) -> Job:
    job = lock_job_of(session, key, job_id)
    actor = actor_of(key)
    checkpoint = latest_checkpoint(session, job)
    if (job.attempt or 0) > (job.exited_attempt or 0):
        # Its run is still stopping and writes one more checkpoint; the run's end names it.
        message = "Job resumed; it resumes from the checkpoint its stopping run writes."
    else:
        message = "Job resumed" + (f" from step {checkpoint.step}." if checkpoint else ".")
    transition(session, job, "queued", actor=actor, message=message,
               resume_from=checkpoint.location if checkpoint else job.resume_from)
    session.commit()
    queue.send(SCHEDULE)
    return job


def lock_job_of(session: Session, key: ApiKey, job_id: str) -> Job:
    job = lock_job(session, job_id)
    if not opens(key, job):
        raise not_found("fine-tuning job", job_id)
    return job


def actor_of(key: ApiKey) -> str:
    return "admin" if key.grants_admin else "user"


def issue_job_token(session: Session, job: Job) -> str:
    """A fresh per-job report token (the previous one stops working); the caller commits.

    Only its sha256 is stored; the raw token goes to the trainer in its spec/Secret.
    """
    token = new_job_token()
    job.job_token_hash = hash_secret(token)
    session.flush()
    return token
