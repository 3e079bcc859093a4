"""Outbound targets a tenant names (webhook endpoints, MLflow tracking servers): the rule
that keeps them from reaching the service's own network.

A URL passes when it is ``http(s)://host[:port]/...`` without credentials and every
address its host resolves to is public: ``ipaddress``'s ``is_global`` (so no loopback,
RFC 1918, shared 100.64.0.0/10, link-local, reserved or documentation ranges) and not
multicast; an IPv4 address carried inside an IPv6 one (IPv4-mapped, 6to4, NAT64, Teredo)
must be public as well, since the packet ends up there. The operator may lift the address
rule (``allow_private``) or name hosts that pass whatever they resolve to
(``allowed_hosts``: ``host`` or ``host:port``, e.g. an in-cluster tracking server).

``check_target`` returns the addresses it checked, so a caller can connect to exactly
those (a second DNS lookup at connect time could answer 127.0.0.1: DNS rebinding).

Pure standard library: the API (``api.webhooks``, job creation) and the trainers (right
before they connect to a tracker) share this one rule; trainers never import ``api``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Reason = Literal["invalid", "not_public", "unresolvable"]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class TargetURLError(ValueError):
    """A refused target; ``reason`` is ``invalid``, ``not_public`` or ``unresolvable``."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect. ``addresses`` is empty when the address rule was
    not applied (``allow_private``, or an allowed host): connect by name then."""

    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...] = ()


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    inner = [address.ipv4_mapped, address.sixtofour]
    if address.teredo is not None:
        inner.extend(address.teredo)
    if address in _NAT64:
        inner.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return [a for a in inner if a is not None]


def is_public_address(address: IPAddress) -> bool:
    """Whether packets to ``address`` leave for the public internet (see the module doc)."""
    if address.is_multicast or not address.is_global:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        return all(inner.is_global and not inner.is_multicast for inner in _embedded_ipv4(address))
    return True


def resolve_host(host: str, port: int) -> tuple[IPAddress, ...]:
    """Every address ``host`` resolves to (an IP literal is itself)."""
    try:
        return (ipaddress.ip_address(host.strip("[]")),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetURLError("unresolvable", f"cannot resolve host '{host}': {exc}") from exc
    return tuple(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))


def check_target(url: str, *, allow_private: bool = False, allowed_hosts: Collection[str] = (),
                 noun: str = "target URLs") -> Target:
    """``url`` as a ``Target`` if it may be connected to, else ``TargetURLError``.

    Args:
        url: the URL a tenant gave.
        allow_private: skip the address rule (an operator's choice for private networks).
        allowed_hosts: ``host`` / ``host:port`` entries that skip the address rule.
        noun: how messages name the URL (``webhook URLs``, ``tracking_uri``).
    """
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise TargetURLError("invalid", f"{noun} must not contain spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetURLError("invalid", f"{noun} must be http(s)://host/...")
    if parts.username or parts.password:
        raise TargetURLError("invalid", f"{noun} must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise TargetURLError("invalid", f"invalid port: {exc}") from exc
    host = parts.hostname.rstrip(".").lower()
    target = Target(url=url, scheme=parts.scheme, host=host, port=port)
    allowed = {entry.strip().lower() for entry in allowed_hosts if entry.strip()}
    if allow_private or host in allowed or f"{host}:{port}" in allowed:
        return target
    if host == "localhost" or host.endswith(".localhost"):
        raise TargetURLError("not_public", f"{noun} must not point at localhost")
    addresses = resolve_host(host, port)
    for address in addresses:
        if not is_public_address(address):
            raise TargetURLError(
                "not_public",
                f"'{host}' resolves to the internal address {address}; {noun} must reach public "
                "addresses (an operator may allow a host explicitly)",
            )
    return Target(url=url, scheme=parts.scheme, host=host, port=port, addresses=addresses)


def split_hosts(value: str | None) -> tuple[str, ...]:
    """``"a, b:5000"`` -> ``("a", "b:5000")``: the form of an allow-list setting."""
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())
