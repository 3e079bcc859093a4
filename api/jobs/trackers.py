"""The trackers a job mirrors to: a tenant-named MLflow ``tracking_uri`` must be a public
http(s) server (``trainers.common.target_urls``, the webhooks' rule) or a host the operator
allowed (``TUNEFLEET_TRACKER_ALLOWED_HOSTS``).

Checked when the job is created, and again by the trainer right before it connects. A
tracking URI is a place the trainer connects to with the service's network position, so
``sqlite:``/``file:`` (writes on the trainer's disk) and internal addresses are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from control.errors import APIError
from control.settings import Settings
from trainers.common.target_urls import TargetURLError, check_target, split_hosts

CODES = {
    "invalid": "invalid_tracking_uri",
    "not_public": "tracking_uri_not_public",
    "unresolvable": "tracking_uri_unresolvable",
}


def check_tracking_uris(integrations: Sequence[Any] | None, settings: Settings) -> None:
    """400 (``param`` = the field) for the first MLflow integration whose URI is refused."""
    for index, integration in enumerate(integrations or ()):
        mlflow = getattr(integration, "mlflow", None)
        if getattr(integration, "type", None) != "mlflow" or mlflow is None:
            continue
        try:
            check_target(mlflow.tracking_uri, allowed_hosts=split_hosts(settings.tracker_allowed_hosts),
                         noun="tracking_uri")
        except TargetURLError as exc:
            raise APIError(400, CODES[exc.reason], f"Invalid MLflow tracking_uri: {exc.message}.",
                           param=f"integrations[{index}].mlflow.tracking_uri") from exc
