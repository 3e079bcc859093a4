"""Standard Webhooks signatures (https://www.standardwebhooks.com/).

The signed content is ``f"{webhook_id}.{webhook_timestamp}.{body}"``; the signature is
``v1,`` + base64(HMAC-SHA256(key, content)) where ``key`` is the base64-decoded part of a
``whsec_<base64>`` secret. Several signatures (during a secret rotation) are sent
space-separated; a verifier accepts the message if any of them matches.

Receivers verify with any Standard Webhooks library, e.g.::

    from standardwebhooks import Webhook
    event = Webhook(secret).verify(request_body, request_headers)  # raises if forged or stale

or with the official ``openai`` SDK: ``client.webhooks.unwrap(body, headers, secret=secret)``.
Verifiers reject timestamps more than 5 minutes off, so a receiver also gets replay
protection; ``webhook-id`` is stable across retries of one event (deduplicate on it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"


def generate_secret() -> str:
    """A new ``whsec_`` secret with 32 random bytes (the spec asks for 24 to 64)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def _key(secret: str) -> bytes:
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("webhook secrets start with 'whsec_'")
    return base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    """One ``v1,<base64>`` signature of ``body`` under ``secret``."""
    content = f"{msg_id}.{timestamp}.{body}".encode()
    digest = hmac.new(_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signature_headers(secrets_: list[str], msg_id: str, timestamp: int, body: str) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret in ``secrets_``."""
    if not secrets_:
        raise ValueError("at least one secret is needed")
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(s, msg_id, timestamp, body) for s in secrets_),
    }
