"""``tunefleet jobs watch``: a live progress bar (steps, tokens/s, loss, ETA) for one job.

The job's SSE stream (``GET .../stream``) is the source; when the service has no stream
route, or the stream drops for good, the watcher falls back to polling the job and its
metrics. ``WatchState`` is the pure part (what the bar shows, from the messages seen so
far) so it is testable without a terminal; ``watch_job`` drives rich's ``Progress``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.text import Text

from tunefleet.cli.render import fmt_duration, print_json_line, status_markup, status_text
from tunefleet.sdk.client import Tunefleet
from tunefleet.sdk.errors import APIConnectionError, NotFoundError
from tunefleet.sdk.types import TERMINAL_JOB_STATUSES, FineTuningJob, StreamEvent


@dataclass
class WatchState:
    """What the watcher knows about the job so far."""

    status: str = "unknown"
    step: int = 0
    total_steps: int | None = None
    train_loss: float | None = None
    valid_loss: float | None = None
    tokens_per_s: float | None = None
    # (monotonic time, step) of the first and latest metric: the ETA uses the average
    # step rate over the whole run, steadier than the last interval alone.
    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    job: dict[str, Any] | None = None
    new_events: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_JOB_STATUSES

    def eta_seconds(self) -> float | None:
        if self.total_steps is None or self.first is None or self.last is None:
            return None
        (t0, s0), (t1, s1) = self.first, self.last
        if s1 <= s0 or t1 <= t0:
            return None
        return (self.total_steps - self.step) * (t1 - t0) / (s1 - s0)

    def apply_metric(self, metric: dict[str, Any], now: float) -> None:
        step = metric.get("step")
        if not isinstance(step, int) or step < self.step:
            return  # an old row replayed after a reconnect
        self.step = step
        self.total_steps = metric.get("total_steps") or self.total_steps
        for key in ("train_loss", "valid_loss", "tokens_per_s"):
            if metric.get(key) is not None:
                setattr(self, key, float(metric[key]))
        if self.first is None:
            self.first = (now, step)
        self.last = (now, step)

    def apply_job(self, job: dict[str, Any]) -> None:
        self.job = job
        if job.get("status"):
            self.status = job["status"]

    def apply(self, event: StreamEvent, now: float) -> None:
        """Fold one stream message into the state.

        SSE names of ``GET .../stream``: ``metric`` (a metric row), ``status`` (a status
        event with ``status``), ``event`` (any other job event), ``end``; ``job`` is the
        watcher's own message carrying a whole job object (initial state, polling)."""
        data = event.data if isinstance(event.data, dict) else {}
        if event.event == "metric":
            self.apply_metric(data, now)
        elif event.event == "job":
            self.apply_job(data)
        elif event.event in ("status", "event"):
            if data.get("message"):
                self.new_events.append(f"[{data.get('level', 'info')}] {data['message']}")
            status = data.get("status") or (data.get("data") or {}).get("to") if event.event == "status" else None
            if status:
                self.status = status

    def fields(self) -> dict[str, str]:
        """Texts of the progress bar's columns."""
        loss = "-" if self.train_loss is None else f"{self.train_loss:.4f}"
        if self.valid_loss is not None:
            loss += f" (valid {self.valid_loss:.4f})"
        return {
            "status": status_markup(self.status),
            "steps": f"{self.step}/{self.total_steps or '?'}",
            "speed": "-" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f} tok/s",
            "loss": loss,
            "eta": fmt_duration(self.eta_seconds()),
        }


def _poll_messages(client: Tunefleet, job_id: str, interval: float) -> Any:
    """Fallback source: job and new metric rows every ``interval`` seconds, as stream events."""
    after: int | None = None
    while True:
        job = client.jobs.retrieve(job_id)
        try:
            for metric in client.jobs.metrics(job_id, after=after):
                after = metric.step
                yield StreamEvent(event="metric", data=metric.to_dict())
        except NotFoundError:
            pass  # metrics route absent or no metrics yet
        yield StreamEvent(event="job", data=job.to_dict())
        if job.is_terminal:
            return
        time.sleep(interval)


def _messages(client: Tunefleet, job_id: str, poll_interval: float) -> Any:
    # A job that already ended is streamed too: the service replays its history, so the
    # bar shows where it got to before the final status.
    yield StreamEvent(event="job", data=client.jobs.retrieve(job_id).to_dict())
    while True:
        try:
            yield from client.jobs.stream(job_id)
        except (NotFoundError, APIConnectionError):
            # No stream route, or it dropped for good: poll job and metrics instead.
            yield from _poll_messages(client, job_id, poll_interval)
            return
        # The service closed the stream; it does so when the job ends, but a proxy may
        # cut long streams too, so reconnect unless the job really is over.
        job = client.jobs.retrieve(job_id)
        yield StreamEvent(event="job", data=job.to_dict())
        if job.is_terminal:
            return
        time.sleep(poll_interval)


def watch_job(
    client: Tunefleet,
    job_id: str,
    *,
    json_lines: bool = False,
    poll_interval: float = 1.0,
    console: Console | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FineTuningJob:
    """Show the job live until it ends; returns the final job."""
    state = WatchState()
    if json_lines:
        for message in _messages(client, job_id, poll_interval):
            print_json_line(message)
            state.apply(message, clock())
        return client.jobs.retrieve(job_id)

    console = console or Console()
    columns = (
        TextColumn("{task.fields[status]}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("step {task.fields[steps]}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("ETA {task.fields[eta]}"),
    )
    with Progress(*columns, console=console, transient=False, refresh_per_second=4) as progress:
        task = progress.add_task(job_id, total=None, **state.fields())
        for message in _messages(client, job_id, poll_interval):
            state.apply(message, clock())
            for line in state.new_events:
                progress.console.print(line, markup=False, highlight=False)
            state.new_events.clear()
            progress.update(task, completed=state.step, total=state.total_steps, **state.fields())
    final = client.jobs.retrieve(job_id)
    detail = f": {final.error.message}" if final.error and final.error.message else ""
    console.print(Text.assemble(f"{job_id} ", status_text(final.status), detail))
    if final.fine_tuned_model:
        console.print(Text(f"fine-tuned model: {final.fine_tuned_model}"))
    return final
