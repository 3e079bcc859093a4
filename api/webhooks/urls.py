"""Target URL checks: webhooks must not become a way to reach the service's own network.

A URL is refused unless it is http(s) with a host, and every address the host resolves
to is public (not loopback, private, link-local, multicast, reserved or unspecified),
unless ``TUNEFLEET_WEBHOOK_ALLOW_PRIVATE=true``. The check runs when an endpoint is saved
and again before each delivery (a DNS answer may change in between).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


class TargetURLError(ValueError):
    """A refused target URL; ``code`` is the stable API error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _is_internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address.is_loopback or address.is_private or address.is_link_local or address.is_multicast
        or address.is_reserved or address.is_unspecified
    )


def resolve_host(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TargetURLError("webhook_url_unresolvable", f"cannot resolve host '{host}': {exc}") from exc
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def check_target_url(url: str, *, allow_private: bool) -> str:
    """Return ``url`` if it may receive webhooks, else raise ``TargetURLError``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetURLError("invalid_webhook_url", "webhook URLs must be http(s)://host/...")
    if parts.username or parts.password:
        raise TargetURLError("invalid_webhook_url", "webhook URLs must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise TargetURLError("invalid_webhook_url", f"invalid port: {exc}") from exc
    if allow_private:
        return url
    host = parts.hostname.rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        raise TargetURLError("webhook_url_not_public", "webhook URLs must not point at localhost")
    for address in resolve_host(host, port):
        if _is_internal(address):
            raise TargetURLError(
                "webhook_url_not_public",
                f"'{host}' resolves to the internal address {address}; internal targets are refused "
                "(an operator may allow them with TUNEFLEET_WEBHOOK_ALLOW_PRIVATE=true)",
            )
    return url
