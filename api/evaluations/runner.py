"""Held-out evaluations run in the background of the API process that accepted them.

They run here, not in a Celery worker, because the answers must come through the
completion path of ``/v1/chat/completions`` (``api.inference``), which only the API has
(the worker never imports it). One run (:meth:`EvaluationRunner.run`):

1. claim: take the evaluation (``commands.claim``: only if its holder is still the one
   read), then plan it: the job's base and fine-tuned models as the job's organization
   may use them, the grader, the file's first ``max_samples`` rows (``rows``). What
   cannot be planned (the file deleted, the adapter gone) fails the evaluation;
2. answer: every row, the base model first, then the fine-tuned one, one completion at a
   time, greedy (temperature 0), as the job's organization
   (``api.inference.internal.chat_completion``): its completion slots and token budget
   apply as to its own requests. A 429 or 503 (``model_loading``) is retried after its
   ``Retry-After`` for up to ``ANSWER_PATIENCE_S``; a 400 (a prompt over the model's
   context) leaves the row unanswered; anything else fails the evaluation;
3. grade: ``grade_batch`` in a worker thread, ``GRADE_BATCH`` rows per call (a python
   grader waits for a sandbox slot of the organization);
4. finish: each model's score, the first rows side by side, the job's event.

While it runs, the runner renews its claim every ``HEARTBEAT_S`` with the progress. No
evaluation stays ``running`` after its process stopped: a process that stops cleanly
gives its evaluations back (``queued``, unheld), and every API process takes over, at
startup and every ``SWEEP_S``, an evaluation under way that is unheld, whose heartbeat
is older than ``STALE_S``, or whose runner was a process of this host that is gone (a
crash or ``kill -9``: found at the next start). A run restarts from the first row; an
evaluation interrupted ``MAX_ATTEMPTS`` times fails ``evaluation_interrupted``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from api.evaluations import commands
from api.evaluations.queries import Claim, claims_under_way, read_claim
from api.evaluations.results import Answer, model_score, samples
from api.evaluations.rows import EvaluationRow, evaluation_rows
from api.graders.model_chat import ModelChat, resolve_grader_models
from api.graders.running import checked_grader, python_slots, runs_python
from api.inference.internal import chat_completion, detached_request
from api.inference.served_models import ServedModel, resolve_served_model
from control.db.base import utcnow
from control.db.models import Evaluation, File, Job
from control.errors import APIError
from inference.protocol import Sampling
from trainers.common.formats import FormatError
from trainers.common.graders import GradeResult, GradingContext, grade_batch, sample_namespace

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
STALE_S = 60.0
SWEEP_S = 20.0
MAX_ATTEMPTS = 3
ANSWER_PATIENCE_S = 600.0  # how long one answer is retried while the organization's slots are busy
GRADE_BATCH = 16
GRADER_WAIT_S = 2.0
RETRIED_STATUSES = (429, 503)
FILE_CHUNK = 64 * 1024

# The runners open in this process: a runner name of this host and pid not among them
# belongs to an earlier process that had this pid (a container's pid 1 restarted).
_OPEN: set[str] = set()


def runner_name() -> str:
    """``<host>:<pid>:<token>``: which process holds an evaluation."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def runner_gone(runner: str) -> bool:
    """Whether ``runner`` was a process of this host that no longer runs."""
    host, pid, _token = (runner.rsplit(":", 2) + ["", ""])[:3]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return runner not in _OPEN
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive
        return False
    return False


def claimable(claim: Claim, runner: str, now: dt.datetime, stale_s: float) -> bool:
    """Whether ``runner`` may take the evaluation ``claim`` describes (see the module doc)."""
    if claim.runner is None or claim.runner == runner or claim.heartbeat_at is None:
        return True
    return (now - claim.heartbeat_at).total_seconds() > stale_s or runner_gone(claim.runner)


class EvaluationFailed(Exception):
    """An evaluation that cannot go on: its ``{code, message}``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Plan:
    """What one run asks and grades."""

    evaluation_id: str
    tenant_id: str
    rows: Sequence[EvaluationRow]
    models: dict[str, ServedModel]  # "base", "fine_tuned"
    grader: Any
    grader_models: dict[str, ServedModel]
    max_tokens: int


class EvaluationRunner:
    """The evaluations of one API process (see the module doc); ``app.state.evaluations``."""

    def __init__(self, app: FastAPI, *, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S,
                 sweep_s: float = SWEEP_S) -> None:
        self.app = app
        self.name = runner_name()
        self.heartbeat_s, self.stale_s, self.sweep_s = heartbeat_s, stale_s, sweep_s
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.answered: dict[str, int] = {}
        # One sweeper per event loop serving the app: an app may be served by more than one
        # loop at a time (a second test client on the same app), and each loop's lifespan
        # must end only the tasks of its own loop -- another loop's cannot be awaited here.
        self._sweepers: list[asyncio.Task[None]] = []

    # ---- lifecycle -----------------------------------------------------------------------

    async def open(self) -> None:
        """Take over what an earlier process left, then keep looking every ``sweep_s``."""
        _OPEN.add(self.name)
        await self.sweep()
        self._sweepers.append(asyncio.get_running_loop().create_task(self._sweep_forever(), name="evaluation sweep"))

    async def close(self) -> None:
        """Stop every run of this event loop; once no loop serves the app any more, give the
        evaluations under way back for the next process."""
        loop = asyncio.get_running_loop()
        running = [task for task in (*self._sweepers, *self.tasks.values()) if task.get_loop() is loop]
        self._sweepers = [task for task in self._sweepers if task.get_loop() is not loop]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if self._sweepers:
            return
        try:
            released = await run_in_threadpool(self._write, commands.release, self.name)
            if released:
                log.info("gave back %d evaluation(s) under way for the next API process", released)
        except SQLAlchemyError as exc:  # the next process takes them over once their heartbeat is stale
            log.warning("evaluations under way not given back: %s", exc)
        _OPEN.discard(self.name)

    def start(self, evaluation_id: str) -> None:
        """Run ``evaluation_id`` in the background (once per process at a time)."""
        if evaluation_id in self.tasks:
            return
        task = asyncio.get_running_loop().create_task(self.run(evaluation_id), name=f"evaluation {evaluation_id}")
        self.tasks[evaluation_id] = task
        task.add_done_callback(lambda _done: self.tasks.pop(evaluation_id, None))

    async def sweep(self) -> None:
        """Start every evaluation under way that this process may take over."""
        try:
            claims = await run_in_threadpool(self._read, claims_under_way)
        except SQLAlchemyError as exc:  # the database is not there yet: the next sweep
            log.warning("evaluations under way not read: %s", exc)
            return
        now = utcnow()
        for claim in claims:
            if claim.evaluation_id not in self.tasks and claimable(claim, self.name, now, self.stale_s):
                self.start(claim.evaluation_id)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            await self.sweep()

    # ---- one run -------------------------------------------------------------------------

    async def run(self, evaluation_id: str) -> None:
        """Claim, plan, answer, grade and record ``evaluation_id`` (see the module doc)."""
        try:
            plan = await run_in_threadpool(self._claim_and_plan, evaluation_id)
            if plan is None:
                return
            beat = asyncio.get_running_loop().create_task(self._heartbeat(evaluation_id, asyncio.current_task()))
            try:
                results, shown = await self._evaluate(plan)
                outcome: dict[str, Any] = {"results": results, "samples": shown}
            except EvaluationFailed as exc:
                outcome = {"error": {"code": exc.code, "message": exc.message}}
            finally:
                beat.cancel()
            await run_in_threadpool(self._write, commands.finish, evaluation_id, self.name, **outcome)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: recorded, not retried by every process in turn
            log.exception("evaluation %s failed", evaluation_id)
            error = {"code": "internal_error", "message": "The evaluation failed; start it again, or report it."}
            try:
                await run_in_threadpool(self._write, commands.finish, evaluation_id, self.name, error=error)
            except SQLAlchemyError:  # its heartbeat stops: another process takes it over
                log.exception("evaluation %s: the failure was not recorded", evaluation_id)
        finally:
            self.answered.pop(evaluation_id, None)

    def _claim_and_plan(self, evaluation_id: str) -> Plan | None:
        with self._session() as session:
            seen = read_claim(session, evaluation_id)
            if seen is None or not claimable(seen, self.name, utcnow(), self.stale_s):
                return None
            if not commands.claim(session, seen, self.name, utcnow()):
                return None  # another process took it first
            session.commit()
            row = session.get_one(Evaluation, evaluation_id)
            try:
                if row.attempts > MAX_ATTEMPTS:
                    raise EvaluationFailed("evaluation_interrupted", f"The evaluation was interrupted {MAX_ATTEMPTS} "
                                           "times (the API process running it stopped); start a new one.")
                plan = self._plan(session, row)
            except EvaluationFailed as exc:
                commands.fail(session, row, exc.code, exc.message)
                session.commit()
                return None
            row.rows_total = 2 * len(plan.rows)
            session.commit()
            log.info("evaluation %s: %d rows, attempt %d", evaluation_id, len(plan.rows), row.attempts)
            return plan

    def _plan(self, session: Session, row: Evaluation) -> Plan:
        state = self.app.state
        job = session.get_one(Job, row.job_id)
        file = session.get(File, row.file_id)
        if job.status != "succeeded" or not job.fine_tuned_model:
            raise EvaluationFailed("job_not_succeeded", f"Job '{job.id}' is {job.status}.")
        if file is None or file.deleted_at is not None:
            raise EvaluationFailed("file_not_found", f"File '{row.file_id}' was deleted before it was evaluated.")
        try:
            models = {"base": resolve_served_model(session, job.tenant_id, state.settings, state.base_models,
                                                   job.model),
                      "fine_tuned": resolve_served_model(session, job.tenant_id, state.settings, state.base_models,
                                                         job.fine_tuned_model)}
            grader = checked_grader(row.grader)
            grader_models = resolve_grader_models(session, job.tenant_id, state.settings, state.base_models, grader)
            chunks = state.file_store.iter_bytes(file.location, chunk_size=FILE_CHUNK)
            rows = evaluation_rows(chunks, (file.validation or {}).get("format") or "", row.max_samples)
        except APIError as exc:
            raise EvaluationFailed(exc.code, exc.message) from exc
        except FormatError as exc:
            raise EvaluationFailed("invalid_file", f"File '{file.id}': {exc}") from exc
        except FileNotFoundError as exc:
            raise EvaluationFailed("file_not_found", f"File '{file.id}' is no longer stored.") from exc
        if not rows:
            raise EvaluationFailed("invalid_file", f"File '{file.id}' has no rows.")
        return Plan(row.id, job.tenant_id, rows, models, grader, grader_models, row.max_tokens)

    async def _evaluate(self, plan: Plan) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        request = detached_request(self.app)
        sampling = Sampling(max_tokens=plan.max_tokens, temperature=0.0, top_p=1.0)
        answers: dict[str, list[Answer]] = {}
        for key, served in plan.models.items():
            answers[key] = []
            for row in plan.rows:
                answers[key].append(await self._answer(request, plan, served, row, sampling))
                self.answered[plan.evaluation_id] = self.answered.get(plan.evaluation_id, 0) + 1
        grades = {key: await self._grade(request, plan, answers[key]) for key in answers}
        results = {key: model_score(plan.models[key].id, answers[key], grades[key]) for key in answers}
        return results, samples(plan.rows, answers, grades)

    async def _answer(self, request: Request, plan: Plan, served: ServedModel, row: EvaluationRow,
                      sampling: Sampling) -> Answer:
        deadline = time.monotonic() + ANSWER_PATIENCE_S
        while True:
            try:
                body = await chat_completion(request, plan.tenant_id, served, row.messages, sampling,
                                             tools=row.tools or None)
            except APIError as exc:
                if exc.status in RETRIED_STATUSES and time.monotonic() < deadline:
                    await asyncio.sleep(_retry_after(exc))
                    continue
                if exc.status == 400:
                    return Answer(None, error=f"{exc.code}: {exc.message}")
                raise EvaluationFailed(exc.code, f"'{served.id}' did not answer line {row.line}: "
                                                 f"{exc.message}") from exc
            choice = body["choices"][0]
            return Answer(choice["message"].get("content") or "", choice.get("finish_reason"))

    async def _grade(self, request: Request, plan: Plan, answers: Sequence[Answer]) -> list[GradeResult | None]:
        context = GradingContext(chat=ModelChat(request, plan.tenant_id, plan.grader_models),
                                 sandbox=self.app.state.settings.grader_limits())
        answered = [index for index, answer in enumerate(answers) if answer.text is not None]
        grades: list[GradeResult | None] = [None] * len(answers)
        for start in range(0, len(answered), GRADE_BATCH):
            batch = answered[start:start + GRADE_BATCH]
            sampled = [sample_namespace(answers[i].text or "", finish_reason=answers[i].finish_reason or "stop")
                       for i in batch]
            graded = await self._grade_batch(request, plan, sampled, [plan.rows[i].item for i in batch], context)
            for index, result in zip(batch, graded, strict=True):
                grades[index] = result
        return grades

    async def _grade_batch(self, request: Request, plan: Plan, sampled: list[dict[str, Any]],
                           items: list[dict[str, Any]], context: GradingContext) -> list[GradeResult]:
        while True:
            try:
                slot = python_slots(request).hold(plan.tenant_id) if runs_python(plan.grader) else nullcontext()
                with slot:
                    return await run_in_threadpool(grade_batch, plan.grader, sampled, items, context)
            except APIError as exc:  # graders_busy: the organization's python graders run already
                if exc.code != "graders_busy":
                    raise
            await asyncio.sleep(GRADER_WAIT_S)

    async def _heartbeat(self, evaluation_id: str, run: asyncio.Task[Any] | None) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            answered = self.answered.get(evaluation_id, 0)
            try:
                held = await run_in_threadpool(self._write, commands.heartbeat, evaluation_id, self.name, answered,
                                               utcnow())
            except SQLAlchemyError as exc:
                log.warning("evaluation %s: heartbeat not written: %s", evaluation_id, exc)
                continue
            if not held and run is not None:
                log.warning("evaluation %s was taken over by another API process; this run stops", evaluation_id)
                run.cancel()
                return

    # ---- database --------------------------------------------------------------------------

    def _session(self) -> Session:
        return self.app.state.session_factory()

    def _read(self, query: Any, *args: Any) -> Any:
        with self._session() as session:
            return query(session, *args)

    def _write(self, command: Any, *args: Any, **kwargs: Any) -> Any:
        with self._session() as session:
            done = command(session, *args, **kwargs)
            session.commit()
            return done


def _retry_after(exc: APIError) -> float:
    try:
        seconds = float((exc.headers or {}).get("Retry-After", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.5), 30.0)


@asynccontextmanager
async def running_evaluations(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan: its runner takes over what is under way, and gives back its own."""
    runner: EvaluationRunner = app.state.evaluations
    await runner.open()
    try:
        yield
    finally:
        await runner.close()
