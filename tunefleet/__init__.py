"""tunefleet: the user-facing Python SDK and the `tunefleet` command line.

    from tunefleet import Tunefleet
    client = Tunefleet()                     # base_url/api_key from env or ~/.config/tunefleet
    f = client.files.upload("train.jsonl", wait=True)
    job = client.jobs.create(model="tiny-llama", training_file=f.id)
    job = job.wait(timeout=600)
"""

from tunefleet.sdk.client import AsyncTunefleet, Tunefleet
from tunefleet.sdk.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ChecksumMismatchError,
    ConfigurationError,
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServerError,
    TunefleetError,
    WaitTimeoutError,
)
from tunefleet.version import __version__

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncTunefleet",
    "AuthenticationError",
    "BadRequestError",
    "ChecksumMismatchError",
    "ConfigurationError",
    "ConflictError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "ServerError",
    "Tunefleet",
    "TunefleetError",
    "WaitTimeoutError",
    "__version__",
]
