"""Mirror a job's metrics and adapter to experiment trackers (MLflow, Weights & Biases).

The job's ``integrations`` (``TrainerSpec.integrations``) name the trackers. The trainer
builds one ``TrackerMirror`` with ``mirror_from_spec(spec)`` and the reporter hands it
every report item it queues (``mirror.add(item)``), so the trackers see exactly what the
service sees:

- ``metric`` items -> tracker metrics at their ``step`` (loss, lr, grad norm, tokens/s, ...);
- ``artifacts`` items -> the PEFT adapter directory (``<location>/adapter``) as an
  artifact (MLflow: ``adapter/`` of the run; W&B: a ``model`` artifact);
- ``error`` items -> the run ends as failed.

Items are handed to the trackers by a background thread, so a slow tracking server
never slows the training loop; ``close()`` drains the queue before ending the runs.
A tracker is a convenience, never a reason to lose a training run: any tracker error is
logged once (with its details, in the trainer's log), turned into a warning event for the
user that names only the exception class (a tracking server's answer never reaches the
job's events), and that tracker is switched off. A tenant-named ``tracking_uri`` must pass
``trainers.common.target_urls`` (public http(s), or a host in
``TUNEFLEET_TRACKER_ALLOWED_HOSTS``) before the trainer connects to it; its name then
resolves only to the checked addresses (``trainers.common.pinned_hosts``), redirects are
refused, and the adapter goes only to the artifact store that server proxies.
The tracker libraries are imported only when a job asks for them (trainer images that
never mirror need neither). Credentials come from the environment of the trainer
(``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN`` ...), never from the spec.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from trainers.common import pinned_hosts
from trainers.common.target_urls import check_target, split_hosts
from trainers.spec import IntegrationSpec, TrainerSpec

log = logging.getLogger(__name__)

# Hosts a job's tracking_uri may name although they are private (the API's
# TUNEFLEET_TRACKER_ALLOWED_HOSTS, handed to the trainer's environment).
TRACKER_ALLOWED_HOSTS_ENV = "TUNEFLEET_TRACKER_ALLOWED_HOSTS"

# Metric fields of a report item that trackers get (ids and clocks are not metrics).
_NOT_METRICS = frozenset({"type", "step", "total_steps", "time"})


class Tracker(Protocol):
    name: str

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int | None) -> None: ...

    def log_adapter(self, adapter_dir: Path) -> None: ...

    def finish(self, failed: bool) -> None: ...


def run_params(spec: TrainerSpec) -> dict[str, Any]:
    """The hyperparameters a tracker shows next to the run (flat, short keys)."""
    hp = spec.hyperparameters
    ad = spec.adapter
    return {
        "job_id": spec.job_id, "trainer": spec.trainer, "base_model": spec.model.path,
        "n_epochs": hp.n_epochs, "batch_size": hp.batch_size, "micro_batch_size": hp.micro_batch_size,
        "learning_rate": hp.learning_rate, "lr_scheduler": hp.lr_scheduler, "warmup_steps": hp.warmup_steps,
        "max_steps": hp.max_steps, "lora_method": ad.method, "lora_r": ad.r, "lora_alpha": ad.alpha,
        "lora_dropout": ad.dropout, "target_modules": ",".join(ad.target_modules),
        "quantization": ad.quantization, "max_seq_len": spec.data.max_seq_len, "packing": spec.data.packing,
        "seed": spec.seed,
    }


class MlflowTracker:
    """One MLflow run per job, through ``MlflowClient`` (no global active-run state).

    A restarted trainer (preemption, crash recovery) continues the job's existing run,
    found by its ``tunefleet.job_id`` tag, so the loss curve stays in one place."""

    name = "mlflow"

    def __init__(self, integration: IntegrationSpec, spec: TrainerSpec) -> None:
        self.tenant_named = bool(integration.tracking_uri)
        if integration.tracking_uri:
            _guard_tenant_tracker(integration.tracking_uri)
        from mlflow import MlflowClient

        uri = integration.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ValueError("the mlflow integration needs a tracking_uri (or MLFLOW_TRACKING_URI)")
        self.client = MlflowClient(tracking_uri=uri)
        experiment_name = integration.project or "tunefleet"
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        existing = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`tunefleet.job_id` = '{spec.job_id}'", max_results=1
        )
        if existing:
            self.run_id = existing[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        tags = {"tunefleet.job_id": spec.job_id, "tunefleet.trainer": spec.trainer}
        tags.update({t: "" for t in integration.tags})
        run = self.client.create_run(experiment_id, run_name=integration.name or spec.job_id, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in run_params(spec).items() if v is not None]
        self.client.log_batch(self.run_id, params=params)

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int | None) -> None:
        from mlflow.entities import Metric

        ts = timestamp_ms if timestamp_ms is not None else 0
        batch = [Metric(key, value, ts, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_adapter(self, adapter_dir: Path) -> None:
        if not self.tenant_named:
            self.client.log_artifacts(self.run_id, str(adapter_dir), artifact_path="adapter")
            return
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        # The run's artifact location is the tenant's server's answer: the upload goes
        # through that same server or nowhere (an s3:// or file:// answer would make the
        # trainer write with the service's own credentials or on its own disk).
        location = self.client.get_run(self.run_id).info.artifact_uri
        _check_proxied_artifacts(location, self.client.tracking_uri)
        get_artifact_repository(location, tracking_uri=self.client.tracking_uri).log_artifacts(
            str(adapter_dir), "adapter")

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _guard_tenant_tracker(tracking_uri: str) -> None:
    """Check a tenant-named tracking server right before connecting (the API checked it at
    creation; a DNS answer may have changed since), pin its name to the checked addresses,
    and make MLflow refuse redirects, as webhook delivery does: a redirect would send the
    trainer to a host no check looked at."""
    target = check_target(tracking_uri, noun="tracking_uri",
                          allowed_hosts=split_hosts(os.environ.get(TRACKER_ALLOWED_HOSTS_ENV)))
    pinned_hosts.pin(target)
    os.environ["MLFLOW_ALLOW_HTTP_REDIRECTS"] = "false"


def _check_proxied_artifacts(location: str, tracking_uri: str) -> None:
    """``location`` must be ``mlflow-artifacts:`` served by the tracking server itself."""
    parts = urlsplit(location)
    if parts.scheme != "mlflow-artifacts" or parts.netloc not in ("", urlsplit(tracking_uri).netloc):
        raise ValueError(f"the tracking server's artifact location {location!r} is not served "
                         "through that server (mlflow-artifacts:); the adapter is not uploaded")


class WandbTracker:
    """One W&B run per job (run id = job id, resumed by a restarted trainer);
    ``WANDB_MODE=offline`` keeps it on local disk."""

    name = "wandb"

    def __init__(self, integration: IntegrationSpec, spec: TrainerSpec) -> None:
        import wandb

        self._wandb = wandb
        self.job_id = spec.job_id
        self.run = wandb.init(
            project=integration.project or "tunefleet",
            entity=integration.entity,
            name=integration.name or spec.job_id,
            id=spec.job_id,
            resume="allow",
            tags=list(integration.tags) or None,
            config=run_params(spec),
            dir=os.environ.get("WANDB_DIR") or None,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int | None) -> None:
        self.run.log(metrics, step=step)

    def log_adapter(self, adapter_dir: Path) -> None:
        artifact = self._wandb.Artifact(name=f"{self.job_id}-adapter", type="model",
                                        metadata={"format": "peft-lora"})
        artifact.add_dir(str(adapter_dir))
        self.run.log_artifact(artifact)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


TRACKERS: dict[str, Callable[[IntegrationSpec, TrainerSpec], Tracker]] = {
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}


class TrackerMirror:
    """Feeds report items to the trackers from a background thread; never raises into
    the training loop and never makes it wait on a tracker's network calls.

    Args:
        trackers: started trackers.
        warn: called with a user-facing message when a tracker is switched off
            (the trainer passes ``reporter.event`` with level ``warning``).
        close_timeout_s: how long ``close`` waits for queued items to reach the trackers.
    """

    _STOP = object()

    def __init__(self, trackers: list[Tracker], warn: Callable[[str], None] | None = None,
                 close_timeout_s: float = 60.0) -> None:
        self.trackers = list(trackers)
        self._warn = warn
        self._failed = False
        self._closed = False
        self._close_timeout_s = close_timeout_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tracker-mirror", daemon=True)
        self._thread.start()

    def add(self, item: dict[str, Any]) -> None:
        """Queue one report item (called by the reporter for every item it queues)."""
        if item.get("type") == "error":
            self._failed = True
        if not self._closed and self.trackers:
            self._queue.put(item)

    def close(self, failed: bool | None = None) -> None:
        """Deliver what is queued, then end every run (failed if an error item was seen
        or ``failed`` is True)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(self._STOP)
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            log.warning("trackers did not take the last items within %.0f s", self._close_timeout_s)
            return
        self._each("finish", self._failed if failed is None else failed)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            self._apply(item)

    def _apply(self, item: dict[str, Any]) -> None:
        kind = item.get("type")
        if kind == "metric":
            step = item.get("step")
            metrics = {
                k: float(v) for k, v in item.items()
                if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(float(v))
            }
            if isinstance(step, int) and metrics:
                ts = int(item["time"] * 1000) if isinstance(item.get("time"), (int, float)) else None
                self._each("log_metrics", step, metrics, ts)
        elif kind == "artifacts":
            location = item.get("location")
            adapter = Path(location) / "adapter" if isinstance(location, str) and "://" not in location else None
            if adapter is not None and adapter.is_dir():
                self._each("log_adapter", adapter)
            elif location:
                self._no_local_adapter(str(location))

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker must never stop training
                log.exception("%s tracker failed in %s; it is switched off", tracker.name, method)
                self.trackers.remove(tracker)
                if self._warn is not None:
                    self._warn(f"{tracker.name} mirroring stopped ({type(exc).__name__}); "
                               "the trainer log has the details")

    def _no_local_adapter(self, location: str) -> None:
        log.warning("adapter at %s is not a local directory; trackers get no artifact", location)
        if self._warn is not None and self.trackers:
            self._warn(f"the adapter at {location} is not local; it was not uploaded to the trackers")


def mirror_from_spec(spec: TrainerSpec, warn: Callable[[str], None] | None = None) -> TrackerMirror | None:
    """Start one tracker per ``spec.integrations`` entry; None when there are none.

    A tracker that cannot start (library missing, server unreachable) is reported through
    ``warn`` and skipped; the job trains anyway."""
    if not spec.integrations:
        return None
    trackers: list[Tracker] = []
    for integration in spec.integrations:
        try:
            trackers.append(TRACKERS[integration.type](integration, spec))
        except Exception as exc:
            log.exception("cannot start the %s integration", integration.type)
            if warn is not None:
                warn(f"{integration.type} integration not started ({type(exc).__name__}); "
                     "the trainer log has the details")
    return TrackerMirror(trackers, warn)
