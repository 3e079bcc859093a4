"""Webhooks' rules shared by the API and the worker: the outbox written in a job's
transition (``events``), one signed delivery attempt (``delivery``, ``signing``), target
checks (``urls``), sealed secrets (``sealing``) and the tables (``models``). The routes
are ``api.webhooks``.
"""

from __future__ import annotations


def install_hooks() -> None:
    """Register the transition hook and the checkpoint listener; every process that changes
    a job's status (API, worker, scheduler) runs it once (it is idempotent)."""
    from control.webhooks import events

    events.install()
