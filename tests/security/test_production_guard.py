"""``TUNEFLEET_ENV=production`` refuses what only looks configured.

The probe: a 32-character secret of ``changeme`` four times passed, and so did a sequence
(``abcdefghijklmnopqrstuvwxyz012345``), a keyboard row, an all-``a`` admin key and a
one-word metrics token; a public URL on 127.0.0.2, or spelled ``127.1`` or ``2130706433``,
was not seen as loopback; an ``http://`` public URL passed (the dashboard's cookies then
never carry ``Secure``); ``TUNEFLEET_WEBHOOK_ALLOW_PRIVATE=true`` passed; an
admin key that is not shaped ``tf_<8>_<32>`` was accepted but could never authenticate;
``/metrics`` was open in production (no scrape token required).
"""

from __future__ import annotations

import secrets

import pytest
from pydantic import ValidationError

from control.settings import Settings

SAFE = {
    "env": "production",
    "database_url": "postgresql://tf:pw@db:5432/tunefleet",
    "broker_url": "redis://redis:6379/0",
    "secret_key": secrets.token_urlsafe(48),
    "public_url": "https://tunefleet.example.com",
    "executor": "kubernetes",
    "admin_api_key": f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}",
    "metrics_token": secrets.token_urlsafe(24),
}


@pytest.fixture(autouse=True)
def _no_webhook_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNEFLEET_WEBHOOK_ALLOW_PRIVATE", raising=False)


def test_real_production_settings_pass() -> None:
    assert Settings(_env_file=None, **SAFE).env == "production"
    Settings(_env_file=None, **{**SAFE, "secret_key": secrets.token_hex(16)})  # 128 bits as hex


@pytest.mark.parametrize(("change", "needle"), [
    ({"secret_key": "changeme" * 4}, "TUNEFLEET_SECRET_KEY"),
    ({"secret_key": "0123456789abcdef" * 2}, "TUNEFLEET_SECRET_KEY"),
    ({"secret_key": "ab" * 20}, "TUNEFLEET_SECRET_KEY"),
    ({"secret_key": "a" * 31 + "b"}, "TUNEFLEET_SECRET_KEY"),
    ({"public_url": "http://127.0.0.2:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://[::ffff:127.0.0.1]:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://api.localhost:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"admin_api_key": "x" * 40}, "TUNEFLEET_ADMIN_API_KEY"),
    ({"admin_api_key": f"tf_{secrets.token_hex(4)}_{secrets.token_hex(8)}"}, "TUNEFLEET_ADMIN_API_KEY"),
    ({"metrics_token": None}, "TUNEFLEET_METRICS_TOKEN"),  # /metrics would be open
    ({"metrics_token": "short"}, "TUNEFLEET_METRICS_TOKEN"),
    # Every loopback spelling an HTTP client connects to 127.0.0.1 (or this host) with.
    ({"public_url": "http://127.1:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://2130706433:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://0x7f.0.0.1:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://0177.0.0.1:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://0:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://[::]:8000"}, "TUNEFLEET_PUBLIC_URL"),
    ({"public_url": "http://[::ffff:7f00:1]:8000"}, "TUNEFLEET_PUBLIC_URL"),
    # Guessable although long, varied and not periodic: sequences, keyboard rows, words.
    ({"secret_key": "abcdefghijklmnopqrstuvwxyz012345"}, "TUNEFLEET_SECRET_KEY"),
    ({"secret_key": "qwertyuiopasdfghjklzxcvbnm1234567890"}, "TUNEFLEET_SECRET_KEY"),
    ({"secret_key": "Tunefleet-Production-Secret-2026!"}, "TUNEFLEET_SECRET_KEY"),
    # The placeholders of .env.example: words with punctuation between them.
    ({"secret_key": "change-me-to-48-random-characters-000000000000000"}, "TUNEFLEET_SECRET_KEY"),
    ({"metrics_token": "change-me-to-a-random-metrics-token"}, "TUNEFLEET_METRICS_TOKEN"),
    ({"admin_api_key": "tf_aaaaaaaa_" + "a" * 32}, "TUNEFLEET_ADMIN_API_KEY"),
    ({"admin_api_key": "tf_abcd1234_" + "0123456789abcdef" * 2}, "TUNEFLEET_ADMIN_API_KEY"),
    ({"metrics_token": "prometheus-scrape-token"}, "TUNEFLEET_METRICS_TOKEN"),
    ({"inference_secret": "inference-secret-inference-secret"}, "TUNEFLEET_INFERENCE_SECRET"),
    # Plain http: the dashboard's cookies could never be Secure.
    ({"public_url": "http://tunefleet.example.com"}, "TUNEFLEET_ALLOW_HTTP_PUBLIC_URL"),
])
def test_production_refuses(change: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        Settings(_env_file=None, **{**SAFE, **change})


def test_an_http_public_url_is_an_explicit_choice() -> None:
    in_cluster = {**SAFE, "public_url": "http://tunefleet-api.tunefleet.svc:8000"}
    assert Settings(_env_file=None, **in_cluster, allow_http_public_url=True).public_url == in_cluster["public_url"]
    with pytest.raises(ValidationError, match="TUNEFLEET_ALLOW_HTTP_PUBLIC_URL"):
        Settings(_env_file=None, **in_cluster)


def test_production_refuses_private_webhook_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEFLEET_WEBHOOK_ALLOW_PRIVATE", "true")
    with pytest.raises(ValidationError, match="TUNEFLEET_WEBHOOK_ALLOW_PRIVATE"):
        Settings(_env_file=None, **SAFE)
    Settings(_env_file=None, **{**SAFE, "env": "development"})  # fine on a developer's machine
