"""Where a job's trainer log comes from.

The local executor writes ``<data>/jobs/<job_id>/trainer.log``; other executors register
a reader with ``register_log_reader``. Readers are tried newest first; the first that
returns text wins.

In Kubernetes mode (``TUNEFLEET_EXECUTOR=kubernetes``) ``create_app`` registers
``kubernetes_log``: the log of the trainer pod itself (rank 0 of the job's newest launch)
through the pod log API, read live on each request, so it is as current as
``kubectl logs`` and needs no copy kept anywhere. The API's service account may only
``list`` pods and ``get`` pods/log in the training namespace (the chart's Role
``<fullname>-api-logs``). Once the pod is gone (TTL after the Job finished, or a
preempted launch deleted) the route has nothing to show: the trainer's metrics, events
and artifacts are what the service keeps.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from control.db.models import Job
from control.errors import APIError
from control.settings import Settings

log = logging.getLogger(__name__)

LogReader = Callable[[Job, Settings, int], str | None]
_readers: list[LogReader] = []


def register_log_reader(reader: LogReader) -> LogReader:
    """Add ``reader(job, settings, tail_lines) -> text | None`` (usable as a decorator)."""
    if reader not in _readers:
        _readers.append(reader)
    return reader


def tail_file(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a text file, read in one pass without loading it all."""
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        return "".join(deque(handle, maxlen=lines))


def local_log(job: Job, settings: Settings, tail: int) -> str | None:
    path = settings.job_dir(job.id) / "trainer.log"
    return tail_file(path, tail) if path.is_file() else None


def read_job_log(job: Job, settings: Settings, tail: int) -> str:
    for reader in reversed(_readers):
        text = reader(job, settings, tail)
        if text is not None:
            return text
    return local_log(job, settings, tail) or ""


@lru_cache(maxsize=4)
def _core_api(kubeconfig: str | None) -> Any:
    """A CoreV1Api with the pod's service account, else the kubeconfig (``$KUBECONFIG``)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.CoreV1Api(client.ApiClient(cfg))


def kubernetes_log(job: Job, settings: Settings, tail: int) -> str | None:
    """The trainer pod's log (Kubernetes mode only; None elsewhere or when it has no pod)."""
    if settings.executor != "kubernetes":
        return None
    from kubernetes.client.exceptions import ApiException

    from kube.pod_logs import read_pod_log

    try:
        return read_pod_log(_core_api(os.environ.get("KUBECONFIG")), settings.k8s_namespace, job.id, tail)
    except ApiException as exc:
        if exc.status == 404:  # the pod went away between the list and the read
            return None
        log.warning("reading the pod log of %s failed: HTTP %s %s", job.id, exc.status, exc.reason)
        raise APIError(502, "logs_unavailable", (
            f"the Kubernetes API refused the trainer pod's log (HTTP {exc.status}); an operator "
            "should check the API's service account may list pods and get pods/log in "
            f"namespace {settings.k8s_namespace}")) from exc
