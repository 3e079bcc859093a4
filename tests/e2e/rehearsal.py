"""Run the control plane the way the Helm chart deploys it, as local processes.

``Deployment`` reads a container out of the rendered chart -- its command, args, env
(values, Secret and ConfigMap references resolved from the rendered objects), envFrom
and mounted ConfigMaps/Secrets/emptyDirs -- and starts it as a process with exactly that
environment. A process is not a pod, so a few things are rewritten or given, all here:

- ``PROCESS_ENV``: what the image or the cluster gives every container and the chart does
  not write: the image's ``PATH`` (its virtualenv) and ``PYTHONUNBUFFERED``, a ``HOME``,
  and the API server's address (``KUBECONFIG`` standing in for the in-cluster service
  account, whose paths are fixed); one OpenMP thread, because the machine is shared.
  ``PYTHONPATH`` names this checkout: the image's code is the code under test, not
  whichever checkout the virtualenv's editable install points to (the ``tunefleet``
  program would import that one).
- mount paths: each mount of a container (``/etc/tunefleet``, the ``/tmp`` emptyDir) is a
  directory of its own, and the container's env values and arguments name that directory
  instead of the mount path.
- container ports: pods have a network namespace each, processes share one, so a port two
  containers declare (the worker's and the scheduler's ``metrics``, the ``http`` port of a
  second API replica) is a free port of each process: env values that are that port and
  arguments that name it name the free port instead (a URL in an env value names a
  Service, which is not rewritten).
- trainer images: the fake kubelet runs this machine's interpreter, so what the trainer
  image sets is given to it (``trainer_image_env``: the ``HOME`` of its ``USER``, its
  ``HF_HOME``), and it enforces ``readOnlyRootFilesystem`` (``read_only_root``) as a node
  does: the trainer may write to its volumes only.
- the images' programs (``tunefleet``, ``uvicorn``) are this virtualenv's.

Hosts are not rewritten: the values name this machine's (PostgreSQL, Redis, the S3
endpoint, the public URL and the API's port), as an operator names their own.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO, free_port, stop_process_group
from tests.deploy.chart import find, render

VENV_BIN = Path(sys.executable).parent
# Rendered kinds the fake API server stores (the rest -- RBAC, NetworkPolicy, Kueue's
# LocalQueue, ServiceAccounts -- has no effect there).
FAKE_CLUSTER_KINDS = {"Namespace": "namespaces", "Secret": "secrets", "ConfigMap": "configmaps"}


TRAINER_DOCKERFILE = REPO / "deploy" / "docker" / "trainer-torch-cuda.Dockerfile"


def trainer_image_env() -> dict[str, str]:
    """The environment the trainer image sets that matters to where a trainer writes: the
    home directory of the user it runs as (its working directory too) and ``HF_HOME``."""
    text = TRAINER_DOCKERFILE.read_text()
    home = re.search(r"useradd [^\n]*--home-dir (\S+)", text)
    hf_home = re.search(r"\bHF_HOME=(\S+)", text)
    assert home and hf_home, f"{TRAINER_DOCKERFILE} no longer names its user's home or HF_HOME"
    return {"HOME": home.group(1), "HF_HOME": hf_home.group(1)}


def rendered(values: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """Every object the chart renders for ``values`` (``helm template``)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render(values).items()):
        if path.endswith((".yaml", ".yml")):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def process_env(kubeconfig: Path | None, home: Path) -> dict[str, str]:
    """``PROCESS_ENV`` of the module docstring."""
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
           "HOME": str(home), "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


def _data(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "Secret":
        out = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return out | dict(obj.get("stringData") or {})
    return dict(obj.get("data") or {})


@dataclass
class Container:
    """One container of a rendered Deployment or Job, runnable as a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    root: Path
    log: Path
    proc: subprocess.Popen | None = None
    mounts: dict[str, Path] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> local port

    @classmethod
    def from_chart(cls, docs: tuple[dict[str, Any], ...], kind: str, name: str, root: Path,
                   base_env: dict[str, str], shared_ports: tuple[str, ...] = ()) -> Container:
        """The container of the rendered ``kind`` ``name``; its ports named in
        ``shared_ports`` (declared by other containers too) get free local ports."""
        (obj,) = find(docs, kind, name)
        pod = obj["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        ns = obj["metadata"]["namespace"]
        objects = {(d["kind"], d["metadata"]["name"]): d for d in docs
                   if d["kind"] in ("Secret", "ConfigMap") and d["metadata"].get("namespace") == ns}
        root.mkdir(parents=True)
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        mounts: dict[str, Path] = {}
        for m in container.get("volumeMounts") or []:
            local = root / "mnt" / m["name"]
            local.mkdir(parents=True)
            mounts[m["mountPath"]] = local
            vol = volumes[m["name"]]
            source = (("ConfigMap", vol["configMap"]["name"]) if "configMap" in vol
                      else ("Secret", vol["secret"]["secretName"]) if "secret" in vol else None)
            if source is not None:
                for key, value in _data(objects[source]).items():
                    (local / key).write_text(value)
            else:
                assert "emptyDir" in vol, f"{name}: volume {m['name']} is neither a ConfigMap, a Secret nor an emptyDir"

        ports = {p["name"]: (p["containerPort"], free_port()) for p in container.get("ports") or []
                 if p.get("name") in shared_ports}

        def rewrite(text: str, *, argument: bool = False) -> str:
            for declared, local in ports.values():
                if text == str(declared):
                    return str(local)
                if argument:
                    text = re.sub(rf"([=:]){declared}\b", rf"\g<1>{local}", text)
            for path in sorted(mounts, key=len, reverse=True):
                if text == path or text.startswith(path + "/") or f"={path}" in text:
                    return text.replace(path, str(mounts[path]), 1)
            return text

        env = dict(base_env)
        for source in container.get("envFrom") or []:
            ref = source.get("secretRef") or source.get("configMapRef")
            kind_ = "Secret" if "secretRef" in source else "ConfigMap"
            if (kind_, ref["name"]) in objects:
                env.update({source.get("prefix", "") + k: v for k, v in _data(objects[(kind_, ref["name"])]).items()})
            else:
                assert ref.get("optional"), f"{name}: envFrom {kind_} {ref['name']} is not rendered"
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = rewrite(str(item["value"]))
                continue
            source = item["valueFrom"]
            ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
            assert ref is not None, f"{name}: env {item['name']} from {source} is not supported here"
            kind_ = "Secret" if "secretKeyRef" in source else "ConfigMap"
            value = _data(objects.get((kind_, ref["name"]), {"kind": kind_})).get(ref["key"])
            if value is None:
                assert ref.get("optional"), f"{name}: env {item['name']}: {kind_} {ref['name']} has no {ref['key']}"
                continue
            env[item["name"]] = value
        argv = [rewrite(a, argument=True) for a in (container.get("command") or []) + (container.get("args") or [])]
        if argv[0] in ("tunefleet", "uvicorn"):
            argv[0] = str(VENV_BIN / argv[0])
        return cls(name=name, argv=argv, env=env, root=root, log=root / "log", mounts=mounts,
                   ports={n: local for n, (_, local) in ports.items()})

    def start(self) -> Container:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def run(self, timeout: float) -> int:
        """Run to completion (a Job's container); its exit code."""
        self.start()
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, timeout=timeout)

    def tail(self, chars: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"----- {self.name} -----\n{text[-chars:]}"


def apply_to_fake_cluster(cluster: Any, docs: tuple[dict[str, Any], ...], namespace: str) -> list[str]:
    """``helm install`` into the fake API server: the rendered Namespaces, and the Secrets and
    ConfigMaps of ``namespace`` (where trainer pods run); names of what was created."""
    created = []
    for doc in docs:
        resource = FAKE_CLUSTER_KINDS.get(doc["kind"])
        ns = doc["metadata"].get("namespace", "")
        if resource is None or (resource != "namespaces" and ns != namespace):
            continue
        obj = {k: v for k, v in doc.items() if k in ("metadata", "data", "stringData", "type")}
        code, body = cluster.create(resource, "" if resource == "namespaces" else ns, obj)
        assert code == 201, body
        created.append(f"{doc['kind']}/{doc['metadata']['name']}")
    return created
