"""A small fake Kubernetes API server for tests (no real kube-apiserver can run here).

It speaks the real REST + watch protocol for what tunefleet uses, so the project's code
runs the *unmodified* official ``kubernetes`` client against it:

- resources: namespaces, nodes (cluster-scoped); pods, pods/log, services, configmaps,
  secrets (core/v1) and jobs (batch/v1), namespaced;
- verbs: get, list (labelSelector, fieldSelector ``metadata.name``), watch (one JSON
  event per line; synthetic ADDED events when no resourceVersion is given; replay from
  a resourceVersion; ``ERROR`` with a 410 ``Status`` when the version has been compacted
  away; BOOKMARK events when asked), create (409 AlreadyExists), delete (404 NotFound;
  ``propagationPolicy`` Foreground/Background/Orphan), patch (strategic-merge or merge
  patch of maps, e.g. an annotation; JSON patch is refused with 415);
- every served request is recorded as (verb, resource) in ``requests`` (the RBAC test
  compares them with the Helm chart's Role).

Behind the API sit a tiny job controller (pods for Jobs, ``Indexed`` completion
indexes, Job conditions, ``podFailurePolicy`` rules -- FailJob, Ignore with a replacement
pod, Count towards ``backoffLimit`` -- and ``activeDeadlineSeconds``), scheduler
(nodeSelector, tolerations, GPU, CPU and memory requests against node allocatable;
Unschedulable otherwise), kubelet (runs a scheduled pod's container command as a local process, with env
from values/Secrets/fieldRefs and every key of envFrom Secrets/ConfigMaps, ConfigMap volumes
written to a per-pod directory, SIGTERM + grace period on deletion, the termination message
file; an evicted or node-lost pod gets the DisruptionTarget condition) and garbage
collector (ownerReferences, ``ttlSecondsAfterFinished``).

Local processes cannot see container paths, so the kubelet maps every volume mount
path (but an emptyDir's at a writable path this machine has, such as /tmp: the paths of
the test's own files live there) and the termination message path to a directory per pod and rewrites those
paths in the command, env values and mounted ConfigMap files; pod DNS names of a
headless Service resolve to 127.0.0.1 the same way. Tests can inject failures:
``fail_image`` (ImagePullBackOff), ``oom_kill`` (OOMKilled), ``evict`` (Evicted),
``lose_node`` (node lost), and ``expire_history`` (forces 410 on old watches).

A test may also give the environment an image sets (``images``: its ``ENV``, the ``HOME``
of its ``USER``), which a container gets before its own env, and turn on
``read_only_root``: a container whose ``securityContext`` asks for
``readOnlyRootFilesystem`` may then write to its volumes only (and to ``/dev``, a mount of
every container), as on a node. A local process cannot be given a read-only root, so its
Python is: an audit hook (``sitecustomize`` on its ``PYTHONPATH``) refuses every write
outside those paths with EROFS, where the kernel would.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlparse

NAMESPACED = {"pods": ("", "v1", "Pod"), "services": ("", "v1", "Service"), "configmaps": ("", "v1", "ConfigMap"),
              "secrets": ("", "v1", "Secret"), "jobs": ("batch", "v1", "Job")}
CLUSTER = {"namespaces": ("", "v1", "Namespace"), "nodes": ("", "v1", "Node")}
HISTORY = 10_000
# The audit hook of ``read_only_root`` (module docstring): ``writable.json`` next to it
# lists the paths a container may write under.
READ_ONLY_ROOT_HOOK = """\
import errno, json, os, sys
from pathlib import Path

_WRITABLE = tuple(json.loads(Path(__file__).with_name("writable.json").read_text()))
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_ARGS = {"os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.truncate": (0,),
              "os.rename": (0, 1), "os.replace": (0, 1), "os.link": (1,), "os.symlink": (1,)}


def _refuse(path):
    if isinstance(path, int):  # a file descriptor already open
        return
    real = os.path.realpath(os.fsdecode(path))
    if not any(real == root or real.startswith(root + os.sep) for root in _WRITABLE):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))


def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if (any(c in mode for c in "wax+") if isinstance(mode, str) else flags & _WRITE_FLAGS):
            _refuse(path)
    elif event in _PATH_ARGS:
        for i in _PATH_ARGS[event]:
            _refuse(args[i])


sys.addaudithook(_hook)
"""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


_QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
                      "T": 1e12, "m": 1e-3}


def _quantity(value: str | float) -> float:
    """A Kubernetes quantity ("500m", "16Gi", "2") as a number."""
    text = str(value)
    for suffix, factor in _QUANTITY_SUFFIXES.items():
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    return float(text)


def _match_labels(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        term = term.strip()
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _match_fields(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        k, v = term.split("=", 1)
        if k == "metadata.name" and obj["metadata"]["name"] != v:
            return False
        if k == "spec.nodeName" and obj.get("spec", {}).get("nodeName") != v:
            return False
    return True


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeCluster:
    """The object store, watch history and controllers; ``FakeApiServer`` serves it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.rv = 0
        self.history: list[tuple[int, str, str, str, dict[str, Any]]] = []  # rv, resource, ns, type, obj
        self.oldest_rv = 0
        self.requests: list[tuple[str, str]] = []
        self.failing_images: set[str] = set()
        self.procs: dict[str, subprocess.Popen] = {}  # pod uid -> process
        self.pod_dirs: dict[str, Path] = {}
        self.kill_reason: dict[str, tuple[str, str, int]] = {}  # pod uid -> (reason, message, exit code)
        self.replaced: set[str] = set()  # uids of failed pods a podFailurePolicy Ignore replaced
        self.images: dict[str, dict[str, str]] = {}  # image -> the environment it sets
        self.read_only_root = False  # enforce readOnlyRootFilesystem (module docstring)

    # --- store -------------------------------------------------------------------------
    def _bump(self, resource: str, ns: str, type_: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, resource, ns, type_, copy.deepcopy(obj)))
        if len(self.history) > HISTORY:
            drop = len(self.history) - HISTORY
            self.oldest_rv = self.history[drop - 1][0]
            del self.history[:drop]
        self.changed.notify_all()

    def create(self, resource: str, ns: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            group, version, kind = NAMESPACED.get(resource) or CLUSTER[resource]
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta.get("name")
            if not name:
                return 422, _status(422, "Invalid", f"{kind}.metadata.name: Required value")
            if resource in NAMESPACED and (ns not in ("",) and ("namespaces", "", ns) not in self.objects):
                return 404, _status(404, "NotFound", f'namespaces "{ns}" not found')
            key = (resource, ns, name)
            if key in self.objects:
                return 409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
            obj["apiVersion"] = f"{group}/{version}" if group else version
            obj["kind"] = kind
            if resource in NAMESPACED:
                meta["namespace"] = ns
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta.setdefault("labels", {})
            if resource == "secrets" and "stringData" in obj:
                data = obj.setdefault("data", {})
                for k, v in obj.pop("stringData").items():
                    data[k] = base64.b64encode(v.encode()).decode()
            if resource == "jobs":
                obj.setdefault("status", {})
                spec = obj["spec"]
                spec.setdefault("completions", 1)
                spec.setdefault("parallelism", 1)
                spec.setdefault("completionMode", "NonIndexed")
                spec.setdefault("backoffLimit", 6)
                spec.setdefault("suspend", False)
            if resource == "pods":
                obj.setdefault("status", {"phase": "Pending"})
            if resource == "services":
                obj["spec"].setdefault("clusterIP", "10.0.0.1")
            self.objects[key] = obj
            self._bump(resource, ns, "ADDED", obj)
            return 201, copy.deepcopy(obj)

    def get(self, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((resource, ns, name))
            return copy.deepcopy(obj) if obj else None

    def list(self, resource: str, ns: str | None, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(o) for (r, n, _), o in sorted(self.objects.items())
                    if r == resource and (ns is None or n == ns)
                    and _match_labels(o, label_selector) and _match_fields(o, field_selector)]

    def update(self, resource: str, ns: str, obj: dict[str, Any]) -> None:
        """Controllers' writes (status changes)."""
        with self.lock:
            key = (resource, ns, obj["metadata"]["name"])
            if key in self.objects:
                self.objects[key] = obj
                self._bump(resource, ns, "MODIFIED", obj)

    def patch(self, resource: str, ns: str, name: str, patch: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A merge patch (RFC 7386): maps merge recursively, ``null`` removes a key."""
        with self.lock:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
            if any(k in patch for k in ("status",)) or set(patch.get("metadata") or {}) & {"name", "uid"}:
                return 422, _status(422, "Invalid", "the fake patches metadata and spec only")
            _merge(obj, patch)
            self._bump(resource, ns, "MODIFIED", obj)
            return 200, copy.deepcopy(obj)

    def remove(self, resource: str, ns: str, name: str) -> None:
        with self.lock:
            obj = self.objects.pop((resource, ns, name), None)
            if obj is not None:
                self._bump(resource, ns, "DELETED", obj)
                self._collect_owned(obj)

    def _collect_owned(self, owner: dict[str, Any]) -> None:
        """Garbage collector: delete dependents of a removed owner."""
        uid = owner["metadata"]["uid"]
        for (r, n, name), o in list(self.objects.items()):
            if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or []):
                if r == "pods":
                    self._delete_pod(n, name)
                else:
                    self.remove(r, n, name)

    def delete(self, resource: str, ns: str, name: str, propagation: str | None) -> tuple[int, dict[str, Any]]:
        with self.lock:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
            if resource == "pods":
                self._delete_pod(ns, name)
                return 200, copy.deepcopy(obj)
            if resource == "jobs":
                policy = propagation or "Background"
                pods = [o for (r, n, _), o in self.objects.items() if r == "pods" and n == ns
                        and any(ref.get("uid") == obj["metadata"]["uid"]
                                for ref in o["metadata"].get("ownerReferences") or [])]
                if policy == "Orphan":
                    for p in pods:
                        p["metadata"]["ownerReferences"] = []
                    self.remove(resource, ns, name)
                    return 200, _status(200, "Success", "") | {"status": "Success"}
                if policy == "Foreground" and pods:
                    obj["metadata"]["deletionTimestamp"] = _now()
                    obj["metadata"]["finalizers"] = ["foregroundDeletion"]
                    self._bump(resource, ns, "MODIFIED", obj)
                    for p in pods:
                        self._delete_pod(ns, p["metadata"]["name"])
                    return 200, copy.deepcopy(obj)
                self.remove(resource, ns, name)
                return 200, copy.deepcopy(obj)
            self.remove(resource, ns, name)
            return 200, _status(200, "Success", "") | {"status": "Success"}

    def _delete_pod(self, ns: str, name: str) -> None:
        """Graceful pod deletion: SIGTERM now, SIGKILL after the grace period, then gone."""
        pod = self.objects.get(("pods", ns, name))
        if pod is None:
            return
        uid = pod["metadata"]["uid"]
        proc = self.procs.get(uid)
        if proc is not None and proc.poll() is None:
            if "deletionTimestamp" not in pod["metadata"]:
                pod["metadata"]["deletionTimestamp"] = _now()
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
                pod["metadata"]["deletionGracePeriodSeconds"] = grace
                self._bump("pods", ns, "MODIFIED", pod)
                proc.send_signal(signal.SIGTERM)
                killer = threading.Timer(grace, lambda: proc.poll() is None and proc.kill())
                killer.daemon = True  # the test's process exits without waiting out a grace period
                killer.start()
            return  # removed by the kubelet loop once the process has exited
        self.remove("pods", ns, name)

    # --- watch -------------------------------------------------------------------------
    def events_since(self, resource: str, ns: str | None, rv: int) -> list[tuple[int, str, dict[str, Any]]] | None:
        """Events after ``rv`` (None: ``rv`` is older than the retained history -> 410)."""
        with self.lock:
            if rv < self.oldest_rv:
                return None
            return [(v, t, copy.deepcopy(o)) for v, r, n, t, o in self.history
                    if v > rv and r == resource and (ns is None or n == ns)]

    def expire_history(self) -> None:
        """Compact the event history: every watch from an older resourceVersion gets 410."""
        with self.lock:
            self.rv += 1  # like an etcd compaction at a new revision
            self.oldest_rv = self.rv
            self.history.clear()

    # --- test controls -----------------------------------------------------------------
    def add_node(self, name: str, *, labels: dict[str, str], gpus: int, resource_name: str | None,
                 taints: list[dict[str, str]] | None = None, cpu: str = "192", memory: str = "2Ti") -> None:
        """A Ready node; its CPU and memory by default those of an 8-GPU server, which hold
        the trainers of the chart's pools."""
        allocatable = {"cpu": cpu, "memory": memory, "pods": "110"}
        if resource_name:
            allocatable[resource_name] = str(gpus)
        self.create("nodes", "", {"metadata": {"name": name, "labels": dict(labels)},
                                  "spec": {"taints": taints or []},
                                  "status": {"allocatable": allocatable, "capacity": dict(allocatable),
                                             "conditions": [{"type": "Ready", "status": "True"}]}})

    def fail_image(self, image: str) -> None:
        self.failing_images.add(image)

    def _pods_of_job(self, job_name: str) -> list[dict[str, Any]]:
        return [o for (r, _, _), o in self.objects.items() if r == "pods"
                and o["metadata"].get("labels", {}).get("job-name") == job_name]

    def _kill(self, pod: dict[str, Any], reason: str, message: str, code: int) -> None:
        uid = pod["metadata"]["uid"]
        self.kill_reason[uid] = (reason, message, code)
        proc = self.procs.get(uid)
        if proc is not None and proc.poll() is None:
            proc.kill()

    def oom_kill(self, pod_name: str) -> None:
        with self.lock:
            for (r, _, n), o in self.objects.items():
                if r == "pods" and n == pod_name:
                    self._kill(o, "OOMKilled", "", 137)

    def evict(self, pod_name: str) -> None:
        with self.lock:
            for (r, _, n), o in self.objects.items():
                if r == "pods" and n == pod_name:
                    self._kill(o, "Evicted", "The node was low on resource: memory.", 137)

    def lose_node(self, node: str) -> None:
        with self.lock:
            self.remove("nodes", "", node)
            for (r, _, _), o in list(self.objects.items()):
                if r == "pods" and o["spec"].get("nodeName") == node:
                    self._kill(o, "NodeLost", f"node {node} which was running the pod is unresponsive", 137)

    def pods(self, job_id_label: str | None = None) -> list[dict[str, Any]]:
        sel = f"tunefleet.io/job-id={job_id_label}" if job_id_label else None
        return self.list("pods", None, sel)

    # --- controllers -------------------------------------------------------------------
    def tick(self) -> None:
        with self.lock:
            self._job_controller()
            self._scheduler()
            self._kubelet()
            self._ttl_controller()

    def _job_controller(self) -> None:
        for (r, ns, name), job in list(self.objects.items()):
            if r != "jobs":
                continue
            spec, status = job["spec"], job.setdefault("status", {})
            meta = job["metadata"]
            pods = self._pods_of_job(name)
            if "deletionTimestamp" in meta:
                if not pods:
                    self.remove("jobs", ns, name)
                continue
            if any(c["type"] in ("Complete", "Failed") for c in status.get("conditions", [])):
                continue
            if spec.get("suspend"):
                # Suspending a Job that runs (Kueue evicting it) deletes its active pods,
                # gracefully; the Job keeps its startTime and gets a Suspended condition.
                live = [p for p in pods if p["status"].get("phase") in ("Pending", "Running")
                        and "deletionTimestamp" not in p["metadata"]]
                for p in live:
                    self._delete_pod(ns, p["metadata"]["name"])
                if status.get("startTime") and not any(c["type"] == "Suspended" for c in status.get("conditions", [])):
                    status["conditions"] = [*status.get("conditions", []), {
                        "type": "Suspended", "status": "True", "reason": "JobSuspended",
                        "message": "Job suspended", "lastTransitionTime": _now()}]
                    status["active"] = 0
                    self._bump("jobs", ns, "MODIFIED", job)
                continue
            if any(c["type"] == "Suspended" for c in status.get("conditions", [])) and not pods:
                # resumed: a new start time, new pods
                status["conditions"] = [c for c in status["conditions"] if c["type"] != "Suspended"]
                status.pop("startTime", None)
            indexed = spec.get("completionMode") == "Indexed"
            if not status.get("startTime") and not pods:
                for i in range(spec["parallelism"]):
                    self._create_pod(job, i if indexed else None)
                status["startTime"] = _now()
                status["startedAt"] = time.time()
                status["active"] = spec["parallelism"]
                self._bump("jobs", ns, "MODIFIED", job)
                continue
            succeeded = sum(1 for p in pods if p["status"].get("phase") == "Succeeded")
            failed_pods = [p for p in pods if p["status"].get("phase") == "Failed"]
            active = len(pods) - succeeded - len(failed_pods)
            counted, fail_job = 0, None
            for p in failed_pods:
                action, message = _failure_action(spec.get("podFailurePolicy"), p)
                if action == "FailJob":
                    fail_job = fail_job or message
                elif action == "Ignore":  # not counted; the controller starts a new pod for it
                    if p["metadata"]["uid"] not in self.replaced:
                        self.replaced.add(p["metadata"]["uid"])
                        index = (p["metadata"].get("annotations") or {}).get("batch.kubernetes.io/job-completion-index")
                        self._create_pod(job, int(index) if indexed and index is not None else None)
                        active += 1
                else:
                    counted += 1
            new = {"active": active, "succeeded": succeeded, "failed": len(failed_pods)}
            cond = None
            deadline = spec.get("activeDeadlineSeconds")
            if fail_job:
                cond = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": fail_job}
            elif counted > spec.get("backoffLimit", 6):
                cond = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit"}
            elif succeeded >= spec["completions"]:
                cond = {"type": "Complete", "status": "True"}
            elif deadline is not None and time.time() - status.get("startedAt", time.time()) > deadline:
                cond = {"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                        "message": "Job was active longer than specified deadline"}
            if cond:
                cond["lastTransitionTime"] = _now()
                status["conditions"] = [cond]
                status["completionTime" if cond["type"] == "Complete" else "failedTime"] = _now()
                status["finishedAt"] = time.time()
                for p in pods:  # the rest of a failed gang is terminated
                    if p["status"].get("phase") in ("Pending", "Running"):
                        self._delete_pod(ns, p["metadata"]["name"])
            if cond or any(status.get(k) != v for k, v in new.items()):
                status.update(new)
                self._bump("jobs", ns, "MODIFIED", job)

    def _create_pod(self, job: dict[str, Any], index: int | None) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        template = copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        labels = dict(meta.get("labels") or {})
        labels["job-name"] = name
        labels["batch.kubernetes.io/job-name"] = name
        annotations = dict(meta.get("annotations") or {})
        spec = template["spec"]
        if index is not None:
            annotations["batch.kubernetes.io/job-completion-index"] = str(index)
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            spec["hostname"] = f"{name}-{index}"
        pod_name = f"{name}-{'' if index is None else f'{index}-'}{uuid.uuid4().hex[:5]}"
        self.create("pods", ns, {
            "metadata": {"name": pod_name, "labels": labels, "annotations": annotations,
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                              "uid": job["metadata"]["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": spec, "status": {"phase": "Pending"}})

    @staticmethod
    def _requests(pod: dict[str, Any]) -> dict[str, float]:
        """What the pod's containers request (a resource with a limit only requests its limit)."""
        out: dict[str, float] = {}
        for c in pod["spec"]["containers"]:
            resources = c.get("resources") or {}
            for k, v in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
                if k.endswith("/gpu") or k in ("cpu", "memory"):
                    out[k] = out.get(k, 0) + _quantity(v)
        return out

    @staticmethod
    def _tolerates(pod: dict[str, Any], taints: list[dict[str, str]]) -> bool:
        tols = pod["spec"].get("tolerations") or []
        for taint in taints:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not any((t.get("operator") == "Exists" and t.get("key") in (None, taint["key"]))
                       or (t.get("key") == taint["key"] and t.get("value") == taint.get("value"))
                       for t in tols):
                return False
        return True

    def _scheduler(self) -> None:
        nodes = [o for (r, _, _), o in self.objects.items() if r == "nodes"]
        used: dict[str, dict[str, float]] = {}
        for (r, _, _), p in self.objects.items():
            if r == "pods" and p["spec"].get("nodeName") and p["status"].get("phase") in ("Pending", "Running"):
                for k, v in self._requests(p).items():
                    used.setdefault(p["spec"]["nodeName"], {})[k] = used.get(p["spec"]["nodeName"], {}).get(k, 0) + v
        for (r, ns, name), pod in list(self.objects.items()):
            if r != "pods" or pod["spec"].get("nodeName") or pod["status"].get("phase") != "Pending":
                continue
            if "deletionTimestamp" in pod["metadata"]:
                self.remove("pods", ns, name)
                continue
            want = self._requests(pod)
            selector = pod["spec"].get("nodeSelector") or {}
            reasons = []
            chosen = None
            for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
                nl = node["metadata"].get("labels") or {}
                if any(nl.get(k) != v for k, v in selector.items()):
                    reasons.append("didn't match Pod's node affinity/selector")
                    continue
                if not self._tolerates(pod, node["spec"].get("taints") or []):
                    reasons.append("had untolerated taint")
                    continue
                alloc = node["status"]["allocatable"]
                short = [k for k, v in want.items()
                         if _quantity(alloc.get(k, 0)) - used.get(node["metadata"]["name"], {}).get(k, 0) < v]
                if short:
                    reasons.append("Insufficient " + ", ".join(short))
                    continue
                chosen = node
                break
            if chosen is None:
                counts: dict[str, int] = {}
                for reason in reasons:
                    counts[reason] = counts.get(reason, 0) + 1
                msg = f"0/{len(nodes)} nodes are available: " + ", ".join(
                    f"{n} node(s) {r}" for r, n in sorted(counts.items())) + "."
                cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}
                if pod["status"].get("conditions") != [cond]:
                    pod["status"]["conditions"] = [cond]
                    self._bump("pods", ns, "MODIFIED", pod)
                continue
            node_name = chosen["metadata"]["name"]
            pod["spec"]["nodeName"] = node_name
            for k, v in want.items():
                used.setdefault(node_name, {})[k] = used.get(node_name, {}).get(k, 0) + v
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            self._bump("pods", ns, "MODIFIED", pod)

    def _kubelet(self) -> None:
        for (r, ns, name), pod in list(self.objects.items()):
            if r != "pods" or not pod["spec"].get("nodeName"):
                continue
            uid = pod["metadata"]["uid"]
            phase = pod["status"].get("phase")
            container = pod["spec"]["containers"][0]
            if phase == "Pending" and uid not in self.procs:
                if "deletionTimestamp" in pod["metadata"]:
                    self.remove("pods", ns, name)
                    continue
                if container["image"] in self.failing_images:
                    waiting = {"reason": "ImagePullBackOff",
                               "message": f'Back-off pulling image "{container["image"]}"'}
                    statuses = [{"name": container["name"], "image": container["image"], "imageID": "",
                                 "ready": False, "restartCount": 0, "state": {"waiting": waiting}}]
                    if pod["status"].get("containerStatuses") != statuses:
                        pod["status"]["containerStatuses"] = statuses
                        self._bump("pods", ns, "MODIFIED", pod)
                    continue
                if not self._volumes_ready(pod):
                    continue  # like ContainerCreating: referenced ConfigMaps/Secrets do not exist yet
                self._start(pod)
                continue
            proc = self.procs.get(uid)
            if phase == "Running" and proc is not None and proc.poll() is not None:
                self._finish(pod, proc.returncode)
            if phase in ("Succeeded", "Failed") and "deletionTimestamp" in pod["metadata"]:
                self.remove("pods", ns, name)

    def _volumes_ready(self, pod: dict[str, Any]) -> bool:
        ns = pod["metadata"]["namespace"]
        for v in pod["spec"].get("volumes") or []:
            if "configMap" in v and ("configmaps", ns, v["configMap"]["name"]) not in self.objects:
                return False
            if "secret" in v and ("secrets", ns, v["secret"]["secretName"]) not in self.objects:
                return False
        for e in pod["spec"]["containers"][0].get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref and ("secrets", ns, ref["name"]) not in self.objects:
                return False
        for source in pod["spec"]["containers"][0].get("envFrom") or []:
            ref, resource = ((source["secretRef"], "secrets") if "secretRef" in source
                             else (source["configMapRef"], "configmaps"))
            if not ref.get("optional") and (resource, ns, ref["name"]) not in self.objects:
                return False
        return True

    def _start(self, pod: dict[str, Any]) -> None:
        ns, uid = pod["metadata"]["namespace"], pod["metadata"]["uid"]
        root = self.workdir / "pods" / uid
        root.mkdir(parents=True)
        self.pod_dirs[uid] = root
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        mapping: dict[str, str] = {}
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for m in container.get("volumeMounts") or []:
            if "emptyDir" in volumes.get(m["name"], {}) and os.access(m["mountPath"], os.W_OK):
                continue  # scratch space this machine has at that path already (/tmp, /dev/shm)
            local = root / "mnt" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            mapping[m["mountPath"]] = str(local)
        tlog = container.get("terminationMessagePath", "/dev/termination-log")
        mapping[tlog] = str(root / "termination-log")

        def rewrite(text: str) -> str:
            for src in sorted(mapping, key=len, reverse=True):
                text = text.replace(src, mapping[src])
            # pod DNS names of headless Services resolve to this machine
            return re.sub(r"\b[a-z0-9-]+\.[a-z0-9-]+\." + re.escape(ns) + r"\.svc(\.cluster\.local)?\b",
                          "127.0.0.1", text)

        for m in container.get("volumeMounts") or []:
            vol = volumes.get(m["name"], {})
            if "configMap" in vol:
                cm = self.objects.get(("configmaps", ns, vol["configMap"]["name"]))
                for key, value in ((cm or {}).get("data") or {}).items():
                    (Path(mapping[m["mountPath"]]) / key).write_text(rewrite(value))
            if "secret" in vol:
                sec = self.objects.get(("secrets", ns, vol["secret"]["secretName"]))
                for key, value in ((sec or {}).get("data") or {}).items():
                    (Path(mapping[m["mountPath"]]) / key).write_bytes(base64.b64decode(value))
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")}
        env.update({k: rewrite(v) for k, v in self.images.get(container["image"], {}).items()})
        env["OMP_NUM_THREADS"] = "1"
        env["HOSTNAME"] = spec.get("hostname") or pod["metadata"]["name"]
        for source in container.get("envFrom") or []:  # every key; env below takes precedence
            if "secretRef" in source:
                sec = self.objects.get(("secrets", ns, source["secretRef"]["name"])) or {}
                data = {k: base64.b64decode(v).decode() for k, v in (sec.get("data") or {}).items()}
            else:
                data = (self.objects.get(("configmaps", ns, source["configMapRef"]["name"])) or {}).get("data") or {}
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = rewrite(e["value"])
                continue
            src = e.get("valueFrom") or {}
            if "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                sec = self.objects.get(("secrets", ns, ref["name"]))
                env[e["name"]] = base64.b64decode(sec["data"][ref["key"]]).decode() if sec else ""
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                cm = self.objects.get(("configmaps", ns, ref["name"]))
                env[e["name"]] = (cm or {}).get("data", {}).get(ref["key"], "")
            elif "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
                if m:
                    env[e["name"]] = (pod["metadata"].get(m.group(1)) or {}).get(m.group(2), "")
                elif path == "metadata.name":
                    env[e["name"]] = pod["metadata"]["name"]
                elif path == "metadata.namespace":
                    env[e["name"]] = ns
        if self.read_only_root and (container.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            writable = [mapping.get(m["mountPath"], m["mountPath"]) for m in container.get("volumeMounts") or []
                        if not m.get("readOnly")]
            guard = root / "read-only-root"
            guard.mkdir()
            (guard / "sitecustomize.py").write_text(READ_ONLY_ROOT_HOOK)
            (guard / "writable.json").write_text(json.dumps(
                [os.path.realpath(p) for p in (*writable, mapping[tlog], "/dev")]))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(guard), env.get("PYTHONPATH"))))
        argv = [rewrite(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # every "image" runs this machine's interpreter
        log = open(root / "log", "wb")  # noqa: SIM115 - owned by the process' lifetime
        cwd = container.get("workingDir") or os.getcwd()
        self.procs[uid] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
        log.close()
        pod["status"].update({
            "phase": "Running", "startTime": _now(), "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "containerStatuses": [{"name": container["name"], "image": container["image"], "imageID": "",
                                   "ready": True, "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": _now()}}}]})
        self._bump("pods", ns, "MODIFIED", pod)

    def _finish(self, pod: dict[str, Any], returncode: int) -> None:
        ns, uid = pod["metadata"]["namespace"], pod["metadata"]["uid"]
        container = pod["spec"]["containers"][0]
        code = returncode if returncode >= 0 else 128 - returncode
        reason, message = ("Completed" if code == 0 else "Error"), ""
        tlog = self.pod_dirs[uid] / "termination-log"
        if tlog.exists():
            message = tlog.read_text()[:4096]
        elif code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = "\n".join(self.read_log(uid).splitlines()[-80:])[-2048:]
        pod_reason = pod_message = None
        if uid in self.kill_reason:
            kreason, kmessage, kcode = self.kill_reason.pop(uid)
            code = kcode
            if kreason == "OOMKilled":
                reason = "OOMKilled"
            else:  # eviction / node loss is a pod-level reason
                pod_reason, pod_message = kreason, kmessage
        terminated = {"exitCode": code, "reason": reason, "startedAt": pod["status"].get("startTime"),
                      "finishedAt": _now()}
        if message:
            terminated["message"] = message
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        if pod_reason:
            pod["status"]["reason"], pod["status"]["message"] = pod_reason, pod_message
            # what the kubelet / taint manager mark a pod they terminate with
            pod["status"].setdefault("conditions", []).append({
                "type": "DisruptionTarget", "status": "True", "lastTransitionTime": _now(),
                "reason": "TerminationByKubelet" if pod_reason == "Evicted" else "DeletionByTaintManager"})
        pod["status"]["containerStatuses"] = [{
            "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
            "restartCount": 0, "started": False, "state": {"terminated": terminated}}]
        self._bump("pods", ns, "MODIFIED", pod)

    def _ttl_controller(self) -> None:
        for (r, ns, name), job in list(self.objects.items()):
            if r != "jobs":
                continue
            ttl = job["spec"].get("ttlSecondsAfterFinished")
            finished = job.get("status", {}).get("finishedAt")
            if ttl is not None and finished and time.time() - finished >= ttl:
                self.delete("jobs", ns, name, "Background")

    def read_log(self, uid: str) -> str:
        path = self.pod_dirs.get(uid)
        if path is None or not (path / "log").exists():
            return ""
        return (path / "log").read_text(errors="replace")

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    cluster: FakeCluster
    server_version = "fake-kube-apiserver/0.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    # --- plumbing ----------------------------------------------------------------------
    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else {}

    def _route(self) -> tuple[str, str | None, str | None, str | None, dict[str, list[str]]] | None:
        """(resource, namespace, name, subresource, query) or None."""
        url = urlparse(self.path)
        q = parse_qs(url.query)
        parts = [p for p in url.path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif parts[:3] == ["apis", "batch", "v1"]:
            rest = parts[3:]
        else:
            return None
        if not rest:
            return None
        if rest[0] == "namespaces" and len(rest) >= 3:
            ns, rest2 = rest[1], rest[2:]
            return rest2[0], ns, rest2[1] if len(rest2) > 1 else None, rest2[2] if len(rest2) > 2 else None, q
        return rest[0], None, rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None, q

    # --- verbs -------------------------------------------------------------------------
    def do_GET(self) -> None:
        route = self._route()
        if route is None:
            return self._send(404, _status(404, "NotFound", "the server could not find the requested resource"))
        resource, ns, name, sub, q = route
        c = self.cluster
        if resource not in NAMESPACED and resource not in CLUSTER:
            return self._send(404, _status(404, "NotFound", f"unknown resource {resource}"))
        if name is not None:
            if sub == "log":
                c.requests.append(("get", "pods/log"))
                pod = c.get("pods", ns or "", name)
                if pod is None:
                    return self._send(404, _status(404, "NotFound", f'pods "{name}" not found'))
                text = c.read_log(pod["metadata"]["uid"])
                tail = q.get("tailLines")
                if tail:
                    text = "".join(text.splitlines(keepends=True)[-int(tail[0]):])
                return self._send(200, text, "text/plain")
            c.requests.append(("get", resource))
            obj = c.get(resource, ns or "", name)
            if obj is None:
                return self._send(404, _status(404, "NotFound", f'{resource} "{name}" not found'))
            return self._send(200, obj)
        label_sel = (q.get("labelSelector") or [None])[0]
        field_sel = (q.get("fieldSelector") or [None])[0]
        if (q.get("watch") or ["false"])[0] in ("true", "1"):
            c.requests.append(("watch", resource))
            return self._watch(resource, ns, q, label_sel, field_sel)
        c.requests.append(("list", resource))
        with c.lock:
            items = c.list(resource, ns, label_sel, field_sel)
            rv = c.rv
        group, version, kind = NAMESPACED.get(resource) or CLUSTER[resource]
        return self._send(200, {"kind": f"{kind}List", "apiVersion": f"{group}/{version}" if group else version,
                                "metadata": {"resourceVersion": str(rv)}, "items": items})

    def _watch(self, resource: str, ns: str | None, q: dict[str, list[str]], label_sel: str | None,
               field_sel: str | None) -> None:
        c = self.cluster
        timeout = float((q.get("timeoutSeconds") or ["30"])[0])
        bookmarks = (q.get("allowWatchBookmarks") or ["false"])[0] == "true"
        rv_param = (q.get("resourceVersion") or [""])[0]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(event: dict[str, Any]) -> None:
            data = (json.dumps(event) + "\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def keep(obj: dict[str, Any]) -> bool:
            return _match_labels(obj, label_sel) and _match_fields(obj, field_sel)

        deadline = time.monotonic() + timeout
        try:
            with c.lock:
                if rv_param in ("", "0"):
                    rv = c.rv
                    initial = [o for o in c.list(resource, ns, label_sel, field_sel)]
                else:
                    rv = int(rv_param)
                    initial = []
                    if c.events_since(resource, ns, rv) is None:
                        chunk({"type": "ERROR", "object": _status(
                            410, "Expired", f"too old resource version: {rv} ({c.oldest_rv})")})
                        self.wfile.write(b"0\r\n\r\n")
                        return
            for obj in initial:
                chunk({"type": "ADDED", "object": obj})
            last_bookmark = time.monotonic()
            while time.monotonic() < deadline:
                with c.lock:
                    events = c.events_since(resource, ns, rv)
                    if events is None:
                        chunk({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {rv}")})
                        break
                    if not events:
                        c.changed.wait(timeout=min(0.2, max(0.01, deadline - time.monotonic())))
                        events = c.events_since(resource, ns, rv) or []
                for v, type_, obj in events:
                    rv = v
                    if keep(obj):
                        chunk({"type": type_, "object": obj})
                if bookmarks and time.monotonic() - last_bookmark > 0.5:
                    group, version, kind = NAMESPACED.get(resource) or CLUSTER[resource]
                    chunk({"type": "BOOKMARK", "object": {
                        "kind": kind, "apiVersion": f"{group}/{version}" if group else version,
                        "metadata": {"resourceVersion": str(max(rv, c.rv))}}})
                    last_bookmark = time.monotonic()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_POST(self) -> None:
        route = self._route()
        if route is None or route[2] is not None:
            return self._send(405, _status(405, "MethodNotAllowed", "POST not allowed here"))
        resource, ns, _, _, _ = route
        if resource not in NAMESPACED and resource not in CLUSTER:
            return self._send(404, _status(404, "NotFound", f"unknown resource {resource}"))
        if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
            self._body()  # drain it: the connection is kept alive
            return self._send(415, _status(415, "UnsupportedMediaType", "expected application/json"))
        self.cluster.requests.append(("create", resource))
        code, obj = self.cluster.create(resource, ns or "", self._body())
        self._send(code, obj)

    def do_DELETE(self) -> None:
        route = self._route()
        if route is None or route[2] is None:
            return self._send(405, _status(405, "MethodNotAllowed", "DELETE needs a name"))
        resource, ns, name, _, q = route
        if int(self.headers.get("Content-Length") or 0) and \
                self.headers.get("Content-Type", "").split(";")[0] != "application/json":
            self._body()
            return self._send(415, _status(415, "UnsupportedMediaType", "expected application/json"))
        body = self._body()
        propagation = body.get("propagationPolicy") or (q.get("propagationPolicy") or [None])[0]
        self.cluster.requests.append(("delete", resource))
        code, obj = self.cluster.delete(resource, ns or "", name, propagation)
        self._send(code, obj)

    def do_PATCH(self) -> None:
        """Strategic-merge and JSON merge patches (maps merge recursively, null deletes);
        for the metadata the executor patches, both mean the same. JSON patch is refused."""
        route = self._route()
        if route is None or route[2] is None:
            return self._send(405, _status(405, "MethodNotAllowed", "PATCH needs a name"))
        resource, ns, name, sub, _ = route
        ctype = self.headers.get("Content-Type", "").split(";")[0]
        body = self._body()
        if ctype not in ("application/strategic-merge-patch+json", "application/merge-patch+json") \
                or not isinstance(body, dict) or sub is not None:
            return self._send(415, _status(415, "UnsupportedMediaType", f"the fake does not apply {ctype} here"))
        self.cluster.requests.append(("patch", resource))
        code, obj = self.cluster.patch(resource, ns or "", name, body)
        self._send(code, obj)

    def do_PUT(self) -> None:
        route = self._route()
        self.cluster.requests.append(("update", route[0] if route else "?"))
        self._send(405, _status(405, "MethodNotAllowed", "PUT is not implemented by the fake"))


class FakeApiServer:
    """``with FakeApiServer(tmp_path) as api:`` -- serves on 127.0.0.1; ``api.url``; ``api.cluster``."""

    def __init__(self, workdir: str | Path | None = None, tick_s: float = 0.05) -> None:
        self._tmp = None if workdir else tempfile.mkdtemp(prefix="fake-k8s-")
        self.cluster = FakeCluster(Path(workdir or self._tmp))
        handler = type("Handler", (_Handler,), {"cluster": self.cluster})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.tick_s = tick_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Self:
        self._threads = [threading.Thread(target=self.httpd.serve_forever, daemon=True),
                         threading.Thread(target=self._controllers, daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def _controllers(self) -> None:
        while not self._stop.is_set():
            self.cluster.tick()
            self._stop.wait(self.tick_s)

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.cluster.shutdown()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api_client(self) -> Any:
        """An official-client ``ApiClient`` pointed at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError("condition not met in time")


def two_pool_cluster(api: FakeApiServer, *, mi300x_nodes: int = 2, rtx_nodes: int = 2,
                     namespace: str = "tunefleet-training") -> None:
    """Nodes of the example pools (labels/taints as in deploy/pools/mixed.yaml) + a namespace."""
    c = api.cluster
    c.create("namespaces", "", {"metadata": {"name": namespace}})
    for i in range(mi300x_nodes):
        c.add_node(f"mi300x-{i}", labels={"tunefleet.io/pool": "mi300x"}, gpus=8, resource_name="amd.com/gpu",
                   taints=[{"key": "amd.com/gpu", "effect": "NoSchedule"}])
    for i in range(rtx_nodes):
        c.add_node(f"rtx4090-{i}", labels={"tunefleet.io/pool": "rtx4090"}, gpus=2, resource_name="nvidia.com/gpu",
                   taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])


def _failure_action(policy: dict[str, Any] | None, pod: dict[str, Any]) -> tuple[str, str | None]:
    """What a Job's ``podFailurePolicy`` does with a failed pod: (action, FailJob message).

    The rules are tried in order, the first match wins, as the Job controller does; no
    policy or no matching rule: ``Count`` (towards ``backoffLimit``).
    """
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    for i, rule in enumerate((policy or {}).get("rules") or []):
        if "onExitCodes" in rule:
            match = rule["onExitCodes"]
            for status in pod["status"].get("containerStatuses") or []:
                term = (status.get("state") or {}).get("terminated")
                if term is None or match.get("containerName") not in (None, status["name"]):
                    continue
                code = term["exitCode"]
                listed = code in match["values"]
                if code != 0 and (listed if match["operator"] == "In" else not listed):
                    return rule["action"], (f"Container {status['name']} for pod {ns}/{name} failed with exit code "
                                            f"{code} matching {rule['action']} rule at index {i}")
        for want in rule.get("onPodConditions") or []:
            if any(c["type"] == want["type"] and c.get("status") == want.get("status", "True")
                   for c in pod["status"].get("conditions") or []):
                return rule["action"], (f"Pod {ns}/{name} has condition {want['type']} "
                                        f"matching {rule['action']} rule at index {i}")
    return "Count", None
