"""The fake API server speaks the protocol the official client expects (its own tests)."""

import sys

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.k8s.conftest import NAMESPACE

NS = NAMESPACE
JSON = {"Content-Type": "application/json"}


def _core(api):
    return client.CoreV1Api(api.api_client())


def _batch(api):
    return client.BatchV1Api(api.api_client())


def test_create_get_list_conflict_not_found(fake_api):
    core = _core(fake_api)
    body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="cm", labels={"a": "1"}), data={"k": "v"})
    with pytest.raises(ApiException) as e:  # like kube-apiserver: a body needs a media type
        core.create_namespaced_config_map(NS, body)
    assert e.value.status == 415
    created = core.create_namespaced_config_map(NS, body, _headers=JSON)
    assert created.metadata.uid and created.metadata.resource_version
    assert core.read_namespaced_config_map("cm", NS).data == {"k": "v"}
    assert [c.metadata.name for c in core.list_namespaced_config_map(NS, label_selector="a=1").items] == ["cm"]
    assert core.list_namespaced_config_map(NS, label_selector="a=2").items == []
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(NS, body, _headers=JSON)
    assert e.value.status == 409
    with pytest.raises(ApiException) as e:
        core.read_namespaced_config_map("nope", NS)
    assert e.value.status == 404
    nodes = core.list_node(label_selector="tunefleet.io/pool=rtx4090").items
    assert [n.status.allocatable["nvidia.com/gpu"] for n in nodes] == ["2", "2"]


def test_secret_string_data_is_encoded(fake_api):
    core = _core(fake_api)
    core.create_namespaced_secret(
        NS, client.V1Secret(metadata=client.V1ObjectMeta(name="s"), string_data={"token": "abc"}), _headers=JSON)
    assert core.read_namespaced_secret("s", NS).data == {"token": "YWJj"}


def test_watch_initial_added_then_changes_and_410(fake_api):
    core = _core(fake_api)
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="one")), _headers=JSON)
    w = watch.Watch()
    seen = []
    for ev in w.stream(core.list_namespaced_config_map, NS, timeout_seconds=1):
        seen.append((ev["type"], ev["object"].metadata.name))
    assert seen == [("ADDED", "one")]
    rv = core.list_namespaced_config_map(NS).metadata.resource_version
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="two")), _headers=JSON)
    seen = [(ev["type"], ev["object"].metadata.name)
            for ev in watch.Watch().stream(core.list_namespaced_config_map, NS, resource_version=rv, timeout_seconds=1)]
    assert seen == [("ADDED", "two")]
    fake_api.cluster.expire_history()
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(core.list_namespaced_config_map, NS, resource_version=rv, timeout_seconds=1))
    assert e.value.status == 410


def test_bookmarks_advance_resource_version(fake_api):
    core = _core(fake_api)
    rv = core.list_namespaced_config_map(NS).metadata.resource_version
    fake_api.cluster.create("secrets", NS, {"metadata": {"name": "other"}})  # bumps the global rv
    w = watch.Watch()
    events = list(w.stream(core.list_namespaced_config_map, NS, resource_version=rv, timeout_seconds=2,
                           allow_watch_bookmarks=True))
    assert any(e["type"] == "BOOKMARK" for e in events) or int(w.resource_version) > int(rv)
    assert int(w.resource_version) > int(rv)


def _job(name, command, *, pool="rtx4090", gpus=1, image="trainer:1"):
    return client.V1Job.from_dict({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": {"tunefleet.io/job-id": name}},
        "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"tunefleet.io/job-id": name}}, "spec": {
            "restartPolicy": "Never", "nodeSelector": {"tunefleet.io/pool": pool},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "c", "image": image, "command": command,
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}}})


def test_job_runs_pod_command_and_logs(fake_api):
    batch, core = _batch(fake_api), _core(fake_api)
    batch.create_namespaced_job(NS, _job("hello", [sys.executable, "-c", "print('hello from the pod')"]), _headers=JSON)
    done = fake_api.wait_for(lambda: (batch.read_namespaced_job("hello", NS).status.conditions or [None])[0])
    assert done.type == "Complete"
    pod = core.list_namespaced_pod(NS, label_selector="job-name=hello").items[0]
    assert pod.status.phase == "Succeeded" and pod.spec.node_name.startswith("rtx4090-")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0
    assert core.read_namespaced_pod_log(pod.metadata.name, NS) == "hello from the pod\n"


def test_unschedulable_and_image_pull_backoff(fake_api):
    batch, core = _batch(fake_api), _core(fake_api)
    batch.create_namespaced_job(NS, _job("toobig", ["true"], gpus=3), _headers=JSON)
    pod = fake_api.wait_for(lambda: [p for p in core.list_namespaced_pod(NS, label_selector="job-name=toobig").items
                                     if p.status.conditions])[0]
    assert pod.status.conditions[0].reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in pod.status.conditions[0].message
    fake_api.cluster.fail_image("broken:1")
    batch.create_namespaced_job(NS, _job("badimg", ["true"], image="broken:1"), _headers=JSON)
    pod = fake_api.wait_for(lambda: [p for p in core.list_namespaced_pod(NS, label_selector="job-name=badimg").items
                                     if p.status.container_statuses])[0]
    assert pod.status.container_statuses[0].state.waiting.reason == "ImagePullBackOff"


def test_foreground_delete_sends_sigterm_and_collects_pods(fake_api):
    batch, core = _batch(fake_api), _core(fake_api)
    script = ("import signal,sys,time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(12))\n"
              "print('up', flush=True)\n"
              "time.sleep(60)\n")
    batch.create_namespaced_job(NS, _job("sleeper", [sys.executable, "-c", script]), _headers=JSON)
    pod = fake_api.wait_for(lambda: [p for p in core.list_namespaced_pod(NS, label_selector="job-name=sleeper").items
                                     if p.status.phase == "Running"])[0]
    fake_api.wait_for(lambda: "up" in core.read_namespaced_pod_log(pod.metadata.name, NS))
    batch.delete_namespaced_job("sleeper", NS, propagation_policy="Foreground", _headers=JSON)
    fake_api.wait_for(lambda: not core.list_namespaced_pod(NS, label_selector="job-name=sleeper").items)
    fake_api.wait_for(lambda: not batch.list_namespaced_job(NS).items)
    ends = [o for _, r, _, t, o in fake_api.cluster.history if r == "pods" and o["status"].get("containerStatuses")
            and "terminated" in o["status"]["containerStatuses"][0]["state"]]
    assert ends[-1]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 12


def test_requests_are_recorded(fake_api):
    _core(fake_api).list_node()
    assert ("list", "nodes") in fake_api.cluster.requests


def test_patch_merges_metadata_and_is_watched(fake_api):
    batch = _batch(fake_api)
    job = {"metadata": {"name": "j", "annotations": {"keep": "1", "drop": "2"}},
           "spec": {"template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "busybox", "command": ["true"]}]}}}}
    created = batch.create_namespaced_job(NS, client.V1Job.from_dict(job), _headers=JSON)
    # A dict body goes out as a strategic-merge patch: maps merge, null deletes a key.
    patched = batch.patch_namespaced_job("j", NS, {"metadata": {"annotations": {"new": "3", "drop": None}}})
    assert patched.metadata.annotations == {"keep": "1", "new": "3"}
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    assert batch.read_namespaced_job("j", NS).metadata.annotations == {"keep": "1", "new": "3"}
    events = list(watch.Watch().stream(batch.list_namespaced_job, NS,
                                       resource_version=created.metadata.resource_version, timeout_seconds=1))
    assert any(e["type"] == "MODIFIED" and e["object"].metadata.annotations.get("new") == "3" for e in events)
    with pytest.raises(ApiException) as e:  # a list body is a JSON patch: not implemented by the fake
        batch.patch_namespaced_job("j", NS, [{"op": "add", "path": "/metadata/labels/x", "value": "y"}])
    assert e.value.status == 415
    with pytest.raises(ApiException) as e:
        batch.patch_namespaced_job("nope", NS, {"metadata": {"annotations": {"a": "b"}}})
    assert e.value.status == 404
    assert ("patch", "jobs") in fake_api.cluster.requests


def _policy_job(name, command, **spec):
    """A Job whose container is called ``trainer``, with more of the Job's ``spec``."""
    job = _job(name, command)
    job.spec.template.spec.containers[0].name = "trainer"
    body = client.ApiClient().sanitize_for_serialization(job)
    body["spec"].update(spec)
    return body


def _failed(fake_api, name):
    batch = _batch(fake_api)
    return fake_api.wait_for(lambda: [c for c in batch.read_namespaced_job(name, NS).status.conditions or []
                                      if c.type == "Failed"])[0]


def test_pod_failure_policy_fail_job_count_ignore_and_deadline(fake_api):
    from worker.executors.manifests import pod_failure_policy

    batch, core = _batch(fake_api), _core(fake_api)
    policy = pod_failure_policy()
    batch.create_namespaced_job(NS, _policy_job("usererr", [sys.executable, "-c", "raise SystemExit(10)"],
                                                podFailurePolicy=policy), _headers=JSON)
    cond = _failed(fake_api, "usererr")
    assert cond.reason == "PodFailurePolicy"
    assert "failed with exit code 10 matching FailJob rule at index 1" in cond.message
    # exit 12 (checkpointed on SIGTERM) is counted: the Job fails at backoffLimit 0 and no
    # replacement pod of the old run starts (the executor runs the next attempt)
    batch.create_namespaced_job(NS, _policy_job("preempted", [sys.executable, "-c", "raise SystemExit(12)"],
                                                podFailurePolicy=policy), _headers=JSON)
    assert _failed(fake_api, "preempted").reason == "BackoffLimitExceeded"
    assert len(core.list_namespaced_pod(NS, label_selector="job-name=preempted").items) == 1
    # an Ignore rule (as Kubernetes does it): not counted, and a new pod takes the failed one's place
    ignore = {"rules": [{"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                             "values": [12]}}]}
    batch.create_namespaced_job(NS, _policy_job("ignored", [sys.executable, "-c", "raise SystemExit(12)"],
                                                podFailurePolicy=ignore), _headers=JSON)
    fake_api.wait_for(lambda: len(core.list_namespaced_pod(NS, label_selector="job-name=ignored").items) >= 2)
    assert not [c for c in batch.read_namespaced_job("ignored", NS).status.conditions or [] if c.type == "Failed"]
    batch.delete_namespaced_job("ignored", NS, propagation_policy="Foreground", _headers=JSON)
    batch.create_namespaced_job(NS, _policy_job("slow", [sys.executable, "-c", "import time; time.sleep(60)"],
                                                activeDeadlineSeconds=1), _headers=JSON)
    assert _failed(fake_api, "slow").reason == "DeadlineExceeded"
    fake_api.wait_for(lambda: all(p.status.phase != "Running"
                                  for p in core.list_namespaced_pod(NS, label_selector="job-name=slow").items))


def test_an_evicted_pod_is_a_disruption_target(fake_api):
    batch, core = _batch(fake_api), _core(fake_api)
    batch.create_namespaced_job(NS, _policy_job("evictme", [sys.executable, "-c", "import time; time.sleep(60)"]),
                                _headers=JSON)
    pod = fake_api.wait_for(lambda: [p for p in core.list_namespaced_pod(NS, label_selector="job-name=evictme").items
                                     if p.status.phase == "Running"])[0]
    fake_api.cluster.evict(pod.metadata.name)
    failed = fake_api.wait_for(lambda: [p for p in core.list_namespaced_pod(NS, label_selector="job-name=evictme").items
                                        if p.status.phase == "Failed"])[0]
    assert [(c.type, c.reason) for c in failed.status.conditions or [] if c.type == "DisruptionTarget"] == [
        ("DisruptionTarget", "TerminationByKubelet")]
