"""Webhook signing secrets at rest: sealed with a key derived from the service secret key.

The service must be able to read a signing secret back (it signs every delivery), so it
cannot store a hash; it stores the secret encrypted with Fernet (AES-128-CBC +
HMAC-SHA256, from ``cryptography``) under a key derived from ``TUNEFLEET_SECRET_KEY``.
A leaked database dump alone then yields no secrets. Changing the service secret key
makes existing webhook secrets unreadable: rotate them afterwards (deliveries fail with
``webhook_secret_unreadable`` until then).
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken

_PREFIX = "fernet1:"
_CONTEXT = b"tunefleet/webhook-secrets/v1"


class SecretUnreadable(ValueError):
    """A sealed secret that the current service key cannot open."""


def _fernet(service_key: str) -> Fernet:
    digest = hashlib.sha256(_CONTEXT + b"\0" + service_key.encode("utf-8")).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def seal(secret: str, service_key: str) -> str:
    return _PREFIX + _fernet(service_key).encrypt(secret.encode("utf-8")).decode("ascii")


def unseal(sealed: str, service_key: str) -> str:
    if not sealed.startswith(_PREFIX):
        raise SecretUnreadable("not a sealed webhook secret")
    try:
        return _fernet(service_key).decrypt(sealed[len(_PREFIX):].encode("ascii")).decode("utf-8")
    except InvalidToken as exc:
        raise SecretUnreadable("the webhook secret was sealed with another service secret key") from exc
