"""The metrics every control-plane process counts, and the registry it exports them from.

Multiprocess: when ``PROMETHEUS_MULTIPROC_DIR`` is set (several uvicorn/Celery worker
processes), counters and histograms are written to that directory by every process and
:func:`process_registry` aggregates them with ``MultiProcessCollector``; the directory
must be emptied at deployment start (prometheus-client's rule). Without it, the
in-process default registry is read.
"""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter

WEBHOOK_FAILURES = Counter(
    "tunefleet_webhook_delivery_failures",
    "Failed webhook delivery attempts (non-2xx, timeout, refused target)",
)


def process_registry() -> CollectorRegistry:
    """This process's counters and histograms: every process's in multiprocess mode."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        # The in-process metrics of the default registry, without re-registering them.
        registry.register(_DefaultRegistryCollector())
    return registry


class _DefaultRegistryCollector:
    def collect(self):
        return REGISTRY.collect()
