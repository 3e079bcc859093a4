"""Webhook target URLs: the service's one outbound rule (``trainers.common.target_urls``)
with the webhook error codes, and connections pinned to the addresses that were checked.

A URL is refused unless it is http(s) with a host and every address the host resolves to
is public (``is_global``, not multicast, no internal IPv4 inside an IPv6 address), unless
its host is one the operator allows (``TUNEFLEET_WEBHOOK_ALLOWED_HOSTS``) or
``TUNEFLEET_WEBHOOK_ALLOW_PRIVATE=true`` (never in production). The check runs when an endpoint is saved and
again before each delivery; the delivery then connects to an address of that check (with
the original ``Host`` header and TLS server name), never to a second DNS answer, so a
name that re-resolves to 127.0.0.1 between check and connect (DNS rebinding) gains nothing.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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


def checked_target(url: str, *, allow_private: bool, allowed_hosts: str | None = None) -> Target:
    """``url`` checked for webhooks (``TargetURLError`` with a webhook code if refused);
    ``allowed_hosts``: the operator's allow-list setting (``host[:port]``, comma-separated)."""
    try:
        return target_urls.check_target(url, allow_private=allow_private,
                                        allowed_hosts=target_urls.split_hosts(allowed_hosts), noun="webhook URLs")
    except target_urls.TargetURLError as exc:
        raise TargetURLError(CODES[exc.reason], exc.message) from exc


def check_target_url(url: str, *, allow_private: bool, allowed_hosts: str | None = None) -> str:
    """Return ``url`` if it may receive webhooks, else raise ``TargetURLError``."""
    return checked_target(url, allow_private=allow_private, allowed_hosts=allowed_hosts).url


def pinned_request(target: Target) -> tuple[str, dict[str, str], dict[str, Any]]:
    """(URL, headers, httpx extensions) that reach ``target`` at its first checked address.

    The URL names the address itself; ``Host`` and, for https, the TLS server name (SNI,
    also what the certificate is verified against) stay the original host. A target
    checked without resolving (private targets allowed) is reached by name.
    """
    if not target.addresses:
        return target.url, {}, {}
    address = target.addresses[0]
    literal = f"[{address}]" if isinstance(address, ipaddress.IPv6Address) else str(address)
    parts = urlsplit(target.url)
    default_port = 443 if target.scheme == "https" else 80
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    if ":" in target.host:  # an IPv6 literal host keeps its brackets in Host
        host_header = f"[{target.host}]" + ("" if target.port == default_port else f":{target.port}")
    url = urlunsplit((parts.scheme, f"{literal}:{target.port}", parts.path, parts.query, ""))
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    return url, {"host": host_header}, extensions
