"""Integration tests reuse the SDK suite's live-service fixtures."""

from tests.sdk.conftest import isolated_config, service  # noqa: F401 (fixtures)
