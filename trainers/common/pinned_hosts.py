"""Host names this trainer process resolves only to the addresses a target check approved.

A tenant names its tracking server by host name. ``target_urls.check_target`` resolves the
name and approves its addresses; a tracker library then resolves the name again when it
connects, and a DNS server under the tenant's control can answer 127.0.0.1 the second time
(DNS rebinding). Webhook delivery avoids that by connecting to the checked address itself;
a tracker library (MLflow's ``requests`` sessions) owns its connections, so the trainer
pins the name instead: once ``pin(target)`` ran, every lookup of ``target.host`` in this
process answers the checked addresses and asks no DNS server. The name stays in the URL,
so the ``Host`` header, TLS server name and certificate check are the tenant's host.

The pin is process-wide on purpose: a trainer process runs one job, and every connection it
makes to a tenant-named host must go where the check looked.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from trainers.common.target_urls import IPAddress, Target

_pins: dict[str, tuple[IPAddress, ...]] = {}
_lock = threading.Lock()


def pin(target: Target) -> None:
    """Resolve ``target.host`` to ``target.addresses`` from now on in this process.

    A target checked without resolving (an operator-allowed host) has no addresses and is
    left to DNS, as the operator chose."""
    if not target.addresses:
        return
    with _lock:
        _pins[target.host] = target.addresses
        if not getattr(socket.getaddrinfo, "pins_hosts", False):
            socket.getaddrinfo = _pinning(socket.getaddrinfo)


def _pinning(resolve: Callable[..., Any]) -> Callable[..., Any]:
    def getaddrinfo(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0,
                    flags: int = 0) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        addresses = _pins.get(name.rstrip(".").lower()) if isinstance(name, str) else None
        if addresses is None:
            return resolve(host, port, family, type, proto, flags)
        return _answers(addresses, port, family, type, proto)

    getaddrinfo.pins_hosts = True  # type: ignore[attr-defined]
    return getaddrinfo


def _answers(addresses: tuple[IPAddress, ...], port: Any, family: int, type: int,
             proto: int) -> list[tuple[Any, ...]]:
    number = socket.getservbyname(port) if isinstance(port, str) and not port.isdigit() else int(port or 0)
    answers = []
    for address in addresses:
        af = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        if family not in (0, socket.AF_UNSPEC, af):
            continue
        sockaddr = (str(address), number, 0, 0) if af == socket.AF_INET6 else (str(address), number)
        answers.append((af, type or socket.SOCK_STREAM, proto or socket.IPPROTO_TCP, "", sockaddr))
    if not answers:
        raise socket.gaierror(socket.EAI_ADDRFAMILY, "no pinned address of the requested family")
    return answers
