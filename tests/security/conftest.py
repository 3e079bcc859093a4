"""Security suite fixtures: the API suite's upload/job helpers on the default SQLite
``settings`` (these tests probe rules, not database backends), and the end-to-end
``service`` (API + worker + scheduler as processes, the real trainer)."""

from __future__ import annotations

from tests.api.conftest import make_job, processed_file, upload  # noqa: F401
from tests.e2e.conftest import pytest_runtest_makereport, service, tiny_model_dir  # noqa: F401
