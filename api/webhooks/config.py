"""Webhook settings (env prefix ``TUNEFLEET_WEBHOOK_``), separate from the core settings
because only the webhook code reads them."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WebhookSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFLEET_WEBHOOK_", extra="ignore", frozen=True)

    allow_private: bool = Field(
        default=False,
        description="Allow targets on loopback/private/link-local addresses (tests, on-prem receivers).",
    )
    max_attempts: int = Field(default=8, ge=1, le=50)
    retry_base_s: float = Field(default=10.0, gt=0, description="Delay after the first failure; doubles.")
    retry_max_s: float = Field(default=3600.0, gt=0)
    timeout_s: float = Field(default=10.0, gt=0, description="Per attempt (connect + response).")
    rotation_grace_s: int = Field(default=86400, ge=0, le=7 * 86400)


@lru_cache(maxsize=1)
def get_webhook_settings() -> WebhookSettings:
    return WebhookSettings()
