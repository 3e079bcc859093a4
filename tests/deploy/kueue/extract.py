"""Extract the ``spec`` schema of Kueue's served storage version of LocalQueue from its CRD
into ``localqueue_spec.json``, for ``tests/deploy/test_helm_chart.py``.

Usage: ``python tests/deploy/kueue/extract.py <kueue.x-k8s.io_localqueues.yaml> <commit>``,
the CRD of github.com/kubernetes-sigs/kueue (``config/components/crd/bases/``, Apache-2.0)
at that commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def main(crd_path: str, commit: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage") and v.get("served")]
    out = {
        "$comment": f"kubernetes-sigs/kueue {commit}: LocalQueue {version['name']} spec (the storage version).",
        "apiVersion": f"{crd['spec']['group']}/{version['name']}",
        "spec": version["schema"]["openAPIV3Schema"]["properties"]["spec"],
    }
    target = Path(__file__).with_name("localqueue_spec.json")
    target.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"{out['apiVersion']} -> {target}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
