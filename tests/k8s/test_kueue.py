"""tunefleet priorities onto Kueue WorkloadPriorityClasses (``kube.kueue``)."""

import pytest

from kube.kueue import parse_priority_classes, priority_class_for
from tests.worker.builders import rtx4090
from trainers.spec import TrainerSpec
from worker.executors.manifests import ManifestOptions, launch_manifests

CLASSES = parse_priority_classes("high=batch-high, low=batch-low,60=batch-plus,normal=batch")


def test_names_and_numbers_become_sorted_thresholds():
    assert CLASSES == ((25, "batch-low"), (50, "batch"), (60, "batch-plus"), (75, "batch-high"))
    assert parse_priority_classes(None) == parse_priority_classes("") == ()


@pytest.mark.parametrize(("priority", "expected"), [
    (0, None), (24, None), (25, "batch-low"), (50, "batch"), (59, "batch"), (60, "batch-plus"),
    (75, "batch-high"), (100, "batch-high"),
])
def test_a_job_gets_the_class_of_the_highest_priority_not_above_its_own(priority, expected):
    assert priority_class_for(priority, CLASSES) == expected


@pytest.mark.parametrize(("text", "mentions"), [
    ("high", "expected priority=WorkloadPriorityClass"),
    ("urgent=batch", "unknown priority 'urgent'"),
    ("101=batch", "0-100"),
    ("high=Batch_High", "not a Kubernetes object name"),
    ("high=a,75=b", "mapped twice"),
])
def test_bad_mappings_say_which_entry_and_why(text, mentions):
    with pytest.raises(ValueError, match=mentions):
        parse_priority_classes(text)


def test_the_settings_refuse_a_bad_mapping_at_start():
    from control.settings import Settings

    with pytest.raises(ValueError, match="TUNEFLEET_KUEUE_PRIORITY_CLASSES: 'urgent=batch'"):
        Settings(_env_file=None, kueue_priority_classes="urgent=batch")


def _job(priority: int, **opts) -> dict:
    spec = TrainerSpec.model_validate({
        "job_id": "ftjob-k", "trainer": "fsdp_qlora", "model": {"path": "/models/tiny"},
        "data": {"train_file": "/data/train.jsonl", "format": "chat"},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-4},
        "output_dir": "/out", "checkpoint": {"dir": "/ckpt"}, "report": {"url": "http://api/r", "token": "t"}})
    return launch_manifests(spec, tenant="org-1", priority=priority, pool=rtx4090(), trainer="fsdp_qlora", nodes=1,
                            gpus_per_node=1, opts=ManifestOptions(**opts), attempt=1, run=1).job


def test_the_job_names_its_workload_priority_class_in_kueue_mode_only():
    job = _job(80, kueue_queue="gpu-jobs", kueue_priority_classes=CLASSES)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "batch-high"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-jobs"
    assert "kueue.x-k8s.io/priority-class" not in _job(10, kueue_queue="gpu-jobs", kueue_priority_classes=CLASSES)[
        "metadata"]["labels"]
    assert "kueue.x-k8s.io/priority-class" not in _job(80, kueue_priority_classes=CLASSES)["metadata"]["labels"]
