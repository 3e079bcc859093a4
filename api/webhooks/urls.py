"""Webhook target URLs: the service's one outbound rule (``trainers.common.target_urls``)
with the webhook error codes.

A URL is refused unless it is http(s) with a host and every address the host resolves to
is public (``is_global``, not multicast, no internal IPv4 inside an IPv6 address), unless
``TUNEFLEET_WEBHOOK_ALLOW_PRIVATE=true``. The check runs when an endpoint is saved and
again before each delivery (a DNS answer may change in between).
"""

from __future__ import annotations

from trainers.common import target_urls
from trainers.common.target_urls import Target

CODES = {
    "invalid": "invalid_webhook_url",
    "not_public": "webhook_url_not_public",
    "unresolvable": "webhook_url_unresolvable",
}


class TargetURLError(ValueError):
    """A refused webhook URL; ``code`` is the stable API error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def checked_target(url: str, *, allow_private: bool) -> Target:
    """``url`` checked for webhooks (``TargetURLError`` with a webhook code if refused)."""
    try:
        return target_urls.check_target(url, allow_private=allow_private, noun="webhook URLs")
    except target_urls.TargetURLError as exc:
        raise TargetURLError(CODES[exc.reason], exc.message) from exc


def check_target_url(url: str, *, allow_private: bool) -> str:
    """Return ``url`` if it may receive webhooks, else raise ``TargetURLError``."""
    return checked_target(url, allow_private=allow_private).url

