"""The trainer log of a job, read from its pod through the Kubernetes pod log API.

``GET /v1/fine_tuning/jobs/{id}/logs`` (``api.outputs.logs``) and the executor's ``logs`` both
read here. The caller brings the client (``kubernetes.client.CoreV1Api``); reading needs ``list`` on pods
and ``get`` on pods/log in the training namespace, nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kube.labels import attempt_of, completion_index, job_selector

if TYPE_CHECKING:
    from kubernetes import client


def trainer_pod(pods: list[Any]) -> Any | None:
    """The pod whose log is the job's log: rank 0 of the newest launch (None: no pods)."""
    if not pods:
        return None
    return min(pods, key=lambda p: (-attempt_of(p), completion_index(p), p.metadata.creation_timestamp or ""))


def read_pod_log(core: client.CoreV1Api, namespace: str, job_id: str, tail_lines: int | None = 200) -> str | None:
    """The trainer log of a job's newest launch, rank 0 (None: the job has no pods)."""
    pods = core.list_namespaced_pod(namespace, label_selector=job_selector(job_id)).items
    pod = trainer_pod(pods)
    if pod is None:
        return None
    return core.read_namespaced_pod_log(pod.metadata.name, namespace, container="trainer",
                                        tail_lines=tail_lines)
