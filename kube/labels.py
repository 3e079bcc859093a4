"""The labels and annotations on every object the Kubernetes executor creates.

They are the contract between the executor (which writes them on Jobs, Pods, ConfigMaps,
Secrets and Services, and lists its objects by them) and whoever reads those objects
back: the executor after a restart, and the API's pod-log reader.
"""

from __future__ import annotations

from typing import Any

LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_JOB = "tunefleet.io/job-id"
LABEL_POOL = "tunefleet.io/pool"
LABEL_TENANT = "tunefleet.io/tenant"
LABEL_PRIORITY = "tunefleet.io/priority"
LABEL_ATTEMPT = "tunefleet.io/attempt"
"""The launch number: a relaunch (after preemption) gets new objects with the next one."""
LABEL_RUN = "tunefleet.io/run"
"""The job's run attempt in the database (``jobs.attempt``), which each observed change names."""
ANNOTATION_STOP_REASON = "tunefleet.io/stop-reason"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
"""Kubernetes' own annotation on the pods of an Indexed Job: the pod's rank."""

MANAGED = f"{LABEL_MANAGED}=tunefleet"
"""The label selector of everything the executor created."""


def job_selector(job_id: str) -> str:
    """The label selector of one fine-tuning job's objects (every launch)."""
    return f"{MANAGED},{LABEL_JOB}={job_id}"


def attempt_of(obj: Any) -> int:
    """The launch an object belongs to (0: an object from before launches were numbered)."""
    try:
        return int((obj.metadata.labels or {}).get(LABEL_ATTEMPT, "0"))
    except ValueError:
        return 0


def completion_index(pod: Any) -> int:
    """A pod's rank in its Indexed Job (0 for a single-pod Job)."""
    ann = (pod.metadata.annotations or {}) if pod.metadata else {}
    try:
        return int(ann.get(COMPLETION_INDEX_ANNOTATION, "0"))
    except ValueError:
        return 0
