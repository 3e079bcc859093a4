"""Service configuration: one typed settings class read from ``TUNEFLEET_*`` variables.

Every process of the control plane (API, Celery worker, scheduler, CLI) builds its
configuration here and nowhere else; values are validated once, at start, and then passed
around as a ``Settings`` value.

Embedded defaults (``tunefleet serve`` with no configuration) keep everything under the
data directory::

    <data>/tunefleet.db        SQLite database
    <data>/broker.db           Celery's server-less broker (kombu sqla+sqlite)
    <data>/secret_key          generated secret key (0600)
    <data>/admin_key           the first admin API key, written once (0600)
    <data>/files/              uploaded training files (local artifact store)
    <data>/artifacts/          job outputs (local artifact store)
    <data>/jobs/<job_id>/      spec, trainer.log, checkpoints of one job
    <data>/models/             base models (the demo's tiny Llama lives here)
    <data>/tmp/                partial uploads

With ``TUNEFLEET_ENV=production`` the class refuses settings that are only safe on a
developer's machine (SQLite, a generated secret key, a server-less broker, a loopback
public URL with the Kubernetes executor, an ``http://`` public URL nobody opted into,
guessable secrets), each with a message that says what to set.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import re
import secrets
import socket
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from control.ids import key_prefix

if TYPE_CHECKING:
    from trainers.common.graders.sandbox import SandboxLimits

MiB = 1024 * 1024
# The fewest guesses (log2) a production secret must take, as zxcvbn estimates them (it
# knows words, names, dates, sequences, keyboard rows and repeats). 128-bit random tokens
# score above 90 even when they happen to hold a short pattern; typed values stay far below.
MIN_SECRET_BITS = 80


class Settings(BaseSettings):
    """All configuration of the control plane (env prefix ``TUNEFLEET_``)."""

    model_config = SettingsConfigDict(env_prefix="TUNEFLEET_", extra="ignore", frozen=True, env_ignore_empty=True)

    env: Literal["development", "test", "production"] = "development"
    data_dir: Path = Path("./.tunefleet")
    database_url: str | None = Field(default=None, description="Default: SQLite in the data dir.")
    broker_url: str | None = Field(default=None, description="Default: kombu sqla+sqlite.")
    artifact_url: str | None = Field(
        default=None, description="A directory or s3://bucket/prefix. Default: <data>/artifacts."
    )
    s3_endpoint_url: str | None = None
    secret_key: SecretStr | None = Field(default=None, description="Default: generated file.")
    admin_api_key: SecretStr | None = None
    # Bearer token Prometheus sends to GET /metrics (api/observability/metrics.py reads the
    # same variable); unset leaves /metrics open, which production refuses.
    metrics_token: SecretStr | None = None
    # Who exports the database gauges (jobs, queues, GPUs, trainers, webhook outbox): "api"
    # (every API process: right for one replica) or "scheduler" (the scheduler process alone,
    # on metrics_port: several API replicas then do not multiply every count).
    metrics_database_gauges: Literal["api", "scheduler"] = "api"
    # Port of the worker's and the scheduler's /metrics and /healthz (0: not served).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    public_url: str = "http://127.0.0.1:8000"
    # Production refuses an http:// public URL unless this says it is meant (TLS ends at an
    # ingress, or trainers report over a cluster-internal address): with it, the dashboard's
    # cookies are Secure only on requests that arrive as https.
    allow_http_public_url: bool = False
    executor: Literal["local", "kubernetes"] = "local"
    node_pools_file: Path | None = None
    base_models_file: Path | None = None
    # Hugging Face Hub repos admins may register as base models (control/models/hub.py): glob patterns
    # of org/name, comma-separated, e.g. "Qwen/Qwen3-*,meta-llama/*". Unset: the Hub is off.
    # huggingface_hub reads HF_TOKEN and HF_ENDPOINT (operator-set) from the environment.
    hub_allowed_repos: str | None = None
    # Directories under which admins may register a local checkpoint (POST /v1/models),
    # comma-separated; a source is resolved (symlinks, ``..``) before it is compared.
    # Unset: <data>/models only.
    model_roots: str | None = None
    hub_timeout_s: float = Field(default=30.0, gt=0, description="Per Hub request (metadata, read).")
    max_upload_bytes: int = Field(default=512 * MiB, ge=1)
    # Every other request body (JSON, forms, trainer reports), checked before routing.
    max_request_bytes: int = Field(default=8 * MiB, ge=1024)
    # An upload still not validated this long after it arrived (its task was lost or keeps
    # failing) is failed with validation_failed, and so are the jobs waiting for it.
    file_validation_deadline_s: float = Field(default=15 * 60, gt=0)
    # Used by the Kubernetes executor (worker/executors/kubernetes.py).
    k8s_namespace: str = "tunefleet-training"
    kueue_queue: str | None = None
    # tunefleet priority -> Kueue WorkloadPriorityClass, e.g. "low=batch-low,high=batch-high"
    # (kube/kueue.py).
    kueue_priority_classes: str | None = None
    k8s_trainer_secret: str | None = Field(
        default=None, description="Secret (training namespace) with the trainers' AWS_* credentials."
    )
    k8s_trainer_service_account: str | None = Field(
        default=None, description="ServiceAccount of trainer pods (IRSA / workload identity)."
    )
    k8s_trainer_automount_token: bool = Field(
        default=False, description="Mount that ServiceAccount's API token into trainer pods."
    )
    k8s_trainer_priority_class: str | None = Field(
        default=None, description="PriorityClass of trainer pods."
    )
    k8s_trainer_max_runtime_s: int | None = Field(
        default=None, ge=60, description="Longest a trainer Job may run (activeDeadlineSeconds)."
    )
    # Seconds between two scheduling cycles of the scheduler loop.
    schedule_interval_s: float = Field(default=3.0, gt=0)
    # Scheduling policy (worker/scheduler/loop.py ``cycle_config``).
    preemption_enabled: bool = Field(
        default=True, description="Whether a waiting job may preempt lower-priority running jobs."
    )
    preemption_min_priority_gap: int = Field(
        default=1, ge=1, description="How much lower a victim's priority must be than the preemptor's."
    )
    placement_objective: Literal["cost", "time"] = Field(
        default="cost", description="Among pools that fit: the cheapest run, or the earliest finish."
    )
    # Restarts of a lost run (crashed trainer, lost node, eviction, out of GPU memory) from
    # its latest checkpoint before the job fails, for both executors (the local one's
    # supervisor, the Kubernetes one's reconcile in DbStore); and the seconds a stopped
    # local trainer gets to checkpoint after SIGTERM before SIGKILL.
    max_restarts: int = Field(default=2, ge=0)
    stop_grace_s: float = Field(default=30.0, gt=0)
    # A lost run restarts after a pause that doubles with each restart of the job (base,
    # 2x base, 4x base ..., at most the cap): a cause that outlives one attempt (an object
    # store or a node pool down for a minute) must not use up ``max_restarts`` in seconds.
    restart_backoff_s: float = Field(default=10.0, ge=0)
    restart_backoff_max_s: float = Field(default=300.0, ge=0)
    # Tracking servers (MLflow ``tracking_uri``) a job may name although they resolve to
    # private addresses: ``host`` or ``host:port``, comma-separated. Everything else must be
    # a public http(s) address (the webhooks' rule). Trainers read the same variable.
    tracker_allowed_hosts: str | None = None
    # Rate limits on /v1/*, /internal/* and /ui/login (api/rate_limits.py), per minute.
    # Counters are shared through Redis when the broker is Redis, else kept in memory.
    rate_limit_enabled: bool | None = Field(
        default=None, description="Default: on, except with TUNEFLEET_ENV=test."
    )
    rate_limit_failed_auth_per_min: int = Field(
        default=20, ge=1, description="Failed authentications (401s) per client IP."
    )
    rate_limit_requests_per_min: int = Field(
        default=1200, ge=1, description="Requests per API key (per client IP without one)."
    )
    rate_limit_reports_per_min: int = Field(default=600, ge=1, description="Trainer reports per job.")
    # Trainer report bounds (control/reports/ingest.py). Past a report's caps: 413 report_too_large
    # (the trainers' reporter forms its batches well under them). Past a job's quota its
    # trainer's later metric and event items are dropped (checkpoints, artifacts and errors
    # still apply), so a runaway trainer cannot fill the database.
    report_max_items: int = Field(default=1000, ge=1, description="Items in one trainer report.")
    report_max_bytes: int = Field(default=1 * MiB, ge=1024, description="Bytes of one trainer report's body.")
    report_max_items_per_job: int = Field(
        default=250_000, ge=1, description="Metric and event items a job's reports may store."
    )
    report_max_bytes_per_job: int = Field(
        default=64 * MiB, ge=1024, description="Bytes (as JSON) of those items a job's reports may store."
    )
    # Peers whose X-Forwarded-For names the client (IPs or networks, comma-separated);
    # unset: the connection's peer address is the client.
    rate_limit_trusted_proxies: str | None = None
    rate_limit_key_prefix: str = Field(default="tunefleet-rate-limits", min_length=1)
    # Live job streams (GET /v1/fine_tuning/jobs/{id}/stream, api/outputs/stream.py) open at
    # once in one API process: each polls the database, so one client may not open without end.
    stream_max_per_key: int = Field(default=10, ge=1, description="Open job streams per API key.")
    stream_max_per_process: int = Field(default=100, ge=1, description="Open job streams per API process.")
    # Merged exports (POST /v1/fine_tuning/jobs/{id}/exports, control/exports.py): each
    # copies the whole base model, so a tenant has this many queued or running at once.
    export_max_concurrent_per_tenant: int = Field(
        default=2, ge=1, description="Merged exports an organization may have queued or running (more: 429)."
    )
    # Held-out evaluations (POST /v1/fine_tuning/jobs/{id}/evaluations, api/evaluations):
    # each asks the base and the fine-tuned model one completion per row, so rows and
    # evaluations under way are bounded per organization.
    evaluation_max_samples: int = Field(
        default=200, ge=1, le=10_000, description="Rows one evaluation may grade (more: 400 too_many_samples)."
    )
    evaluation_max_concurrent_per_tenant: int = Field(
        default=2, ge=1, description="Evaluations an organization may have queued or running (more: 429)."
    )
    # OpenAI completions (api/inference/routes.py) are generated by the inference worker
    # (`tunefleet inference`, started by `tunefleet serve`) at this loopback URL; requests
    # carry a shared secret (default: derived from the secret key, so both processes know it).
    inference_url: str = "http://127.0.0.1:8001"
    inference_secret: SecretStr | None = Field(default=None, description="Default: from the secret key.")
    inference_max_concurrent_per_tenant: int = Field(
        default=4, ge=1, description="Completions a tenant may have running at once (more: 429)."
    )
    inference_timeout_s: float = Field(default=300.0, gt=0, description="Longest a completion may take.")
    inference_load_wait_s: float = Field(
        default=120.0, ge=0, le=3600,
        description="How long a completion waits for its base model to load before 503 model_loading.",
    )
    inference_tokens_per_minute_per_tenant: int | None = Field(
        default=None, ge=1,
        description="Prompt + completion tokens a tenant may use per minute (more: 429). Default: no limit.",
    )
    # Webhooks (TUNEFLEET_WEBHOOK_*, api/webhooks): the routes and the worker's delivery task
    # read them from the process's settings (``get_settings``).
    webhook_allow_private: bool = Field(
        default=False,
        description="Allow targets on loopback/private/link-local addresses (tests, on-prem receivers).",
    )
    webhook_allowed_hosts: str | None = Field(
        default=None,
        description="Hosts (host or host:port, comma-separated) webhooks may target although they "
        "resolve to internal addresses: an operator's in-cluster receivers. Allowed in production, "
        "unlike webhook_allow_private; every other target must be public.",
    )
    webhook_max_attempts: int = Field(default=8, ge=1, le=50)
    webhook_retry_base_s: float = Field(default=10.0, gt=0, description="Delay after the first failure; doubles.")
    webhook_retry_max_s: float = Field(default=3600.0, gt=0)
    webhook_timeout_s: float = Field(default=10.0, gt=0, description="Per attempt (connect + response).")
    webhook_rotation_grace_s: int = Field(default=86400, ge=0, le=7 * 86400)
    # Graders (POST /v1/fine_tuning/alpha/graders/*, trainers.common.graders): a python
    # grader runs in a sandboxed process under these limits; a score_model grader asks a
    # model this service serves, or, for the models grader_external_models names, the
    # OpenAI-compatible endpoint grader_external_url (checked like a webhook target).
    grader_memory_bytes: int = Field(default=1 << 30, ge=64 << 20,
                                     description="Address space of a python grader's process.")
    grader_seconds_per_sample: float = Field(default=10.0, gt=0, le=600,
                                             description="Longest a python grader may take on one sample.")
    grader_seconds_per_call: float = Field(default=60.0, gt=0, le=3600,
                                           description="Longest one graders/run may spend in python graders.")
    grader_output_bytes: int = Field(default=65536, ge=1024,
                                     description="What a python grader may print (and answer) per sample.")
    grader_max_concurrent: int = Field(default=4, ge=1,
                                       description="Python graders running at once in one API process (more: 429).")
    grader_max_concurrent_per_tenant: int = Field(default=1, ge=1,
                                                  description="Python graders a tenant may have running at once.")
    grader_external_url: str | None = Field(default=None, description="An OpenAI-compatible /v1 base URL.")
    grader_external_models: str | None = Field(
        default=None, description="Models (comma-separated) score_model graders may ask at grader_external_url.")
    grader_external_api_key: SecretStr | None = None

    @field_validator("kueue_priority_classes")
    @classmethod
    def _kueue_priority_classes(cls, value: str | None) -> str | None:
        from kube.kueue import parse_priority_classes

        try:
            parse_priority_classes(value)
        except ValueError as exc:
            raise ValueError(f"TUNEFLEET_KUEUE_PRIORITY_CLASSES: {exc}") from exc
        return value

    @field_validator("rate_limit_trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: str | None) -> str | None:
        try:
            _networks(value)
        except ValueError as exc:
            raise ValueError(
                f"TUNEFLEET_RATE_LIMIT_TRUSTED_PROXIES: {exc} (expected IP addresses or networks, "
                "comma-separated, e.g. 10.0.0.7,10.1.0.0/16)"
            ) from exc
        return value

    @field_validator("public_url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.startswith(("postgresql://", "postgres://")):
            # psycopg 3 is the driver we ship; SQLAlchemy would pick psycopg2 otherwise.
            value = "postgresql+psycopg://" + value.split("://", 1)[1]
        if not value.startswith(("sqlite", "postgresql+psycopg://")):
            raise ValueError(
                "TUNEFLEET_DATABASE_URL must be sqlite:///<path> or postgresql+psycopg://..."
            )
        return value

    @model_validator(mode="after")
    def _refuse_unsafe_production(self) -> Settings:
        if self.env != "production":
            return self
        problems: list[str] = []
        if self.database_url is None or self.database_url.startswith("sqlite"):
            problems.append(
                "TUNEFLEET_DATABASE_URL must point to PostgreSQL in production (SQLite is "
                "the single-machine embedded default)"
            )
        problems += self._secret_problems()
        if self.broker_url is None or self.broker_url.startswith(("sqla+", "filesystem")):
            problems.append(
                "TUNEFLEET_BROKER_URL must point to Redis in production (redis://host:6379/0)"
            )
        if self.executor == "kubernetes" and _is_loopback(self.public_url):
            problems.append(
                "TUNEFLEET_PUBLIC_URL must be reachable from training pods, not "
                f"{self.public_url}"
            )
        if urlsplit(self.public_url).scheme == "http" and not self.allow_http_public_url:
            problems.append(
                f"TUNEFLEET_PUBLIC_URL is plain http ({self.public_url}): use https, or set "
                "TUNEFLEET_ALLOW_HTTP_PUBLIC_URL=true if TLS ends in front of the service (the "
                "dashboard's cookies are then Secure only on requests that arrive as https)"
            )
        if self.webhook_allow_private:
            problems.append(
                "TUNEFLEET_WEBHOOK_ALLOW_PRIVATE must not be true in production (tenants' "
                "webhooks could reach the service's own network)"
            )
        if problems:
            raise ValueError("unsafe production settings: " + "; ".join(problems))
        return self

    def _secret_problems(self) -> list[str]:
        """What is wrong with the production secrets: each must be present where required
        and hard to guess (``guessable``), whatever its length."""
        problems: list[str] = []
        generate = ("one that takes 2**80 guesses: some 25 random letters and digits, e.g. "
                    "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        secret_key = self.secret_key.get_secret_value() if self.secret_key else None
        if secret_key is None:
            problems.append(
                "TUNEFLEET_SECRET_KEY must be set in production (a generated key on one "
                "replica's disk does not work for several replicas)"
            )
        elif len(secret_key) < 32 or guessable(secret_key):
            problems.append(f"TUNEFLEET_SECRET_KEY must be a random value of at least 32 characters, {generate}")
        admin_key = self.admin_api_key.get_secret_value() if self.admin_api_key else None
        if admin_key is not None and key_prefix(admin_key) is None:
            # Only keys of this shape ever authenticate (control.auth): any other value would
            # leave the service without a working admin key.
            problems.append(
                "TUNEFLEET_ADMIN_API_KEY must look like tf_<8 characters>_<32 characters> "
                "(`tunefleet admin create-key` prints one)"
            )
        elif admin_key is not None and guessable(admin_key.rsplit("_", 1)[1]):
            problems.append(
                "TUNEFLEET_ADMIN_API_KEY's last 32 characters are guessable: use a key "
                "`tunefleet admin create-key` printed"
            )
        metrics_token = self.metrics_token.get_secret_value() if self.metrics_token else None
        if metrics_token is None or len(metrics_token) < 16 or guessable(metrics_token):
            problems.append(
                "TUNEFLEET_METRICS_TOKEN must be set in production to a random value of at least "
                f"16 characters, {generate} (/metrics names every running job)"
            )
        if self.inference_secret is not None and guessable(self.inference_secret.get_secret_value()):
            problems.append(f"TUNEFLEET_INFERENCE_SECRET must be unset or a random value, {generate}")
        return problems

    # ---- derived locations -------------------------------------------------------

    @property
    def data_path(self) -> Path:
        return resolved_dir(self.data_dir)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_path / 'tunefleet.db'}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.data_path / 'broker.db'}"

    @property
    def resolved_artifact_url(self) -> str:
        return self.artifact_url or str(self.data_path / "artifacts")

    @property
    def rate_limiting(self) -> bool:
        """Whether the rate limits apply (``rate_limit_enabled``, else not in tests)."""
        return self.env != "test" if self.rate_limit_enabled is None else self.rate_limit_enabled

    @property
    def trusted_proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return _networks(self.rate_limit_trusted_proxies)

    @property
    def rate_limit_storage_url(self) -> str:
        """The ``limits`` storage: the broker's Redis (shared by every replica), else memory."""
        broker = self.resolved_broker_url
        return f"async+{broker}" if broker.startswith(("redis://", "rediss://")) else "async+memory://"

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")

    @property
    def files_dir(self) -> Path:
        return self.data_path / "files"

    @property
    def jobs_dir(self) -> Path:
        return self.data_path / "jobs"

    @property
    def models_dir(self) -> Path:
        return self.data_path / "models"

    @property
    def tmp_dir(self) -> Path:
        return self.data_path / "tmp"

    @property
    def model_root_dirs(self) -> tuple[Path, ...]:
        """Where local checkpoints may be registered from, symlinks resolved."""
        entries = [e.strip() for e in (self.model_roots or "").split(",") if e.strip()]
        return tuple(Path(e).resolve() for e in entries) or (self.models_dir.resolve(),)

    def job_dir(self, job_id: str) -> Path:
        """``<data>/jobs/<job_id>``: the job's spec, trainer.log and local checkpoints."""
        return self.jobs_dir / job_id

    def ensure_dirs(self) -> None:
        """Create the data directory layout (idempotent)."""
        for path in (self.data_path, self.files_dir, self.jobs_dir, self.models_dir, self.tmp_dir):
            path.mkdir(parents=True, exist_ok=True)
        if self.artifact_url is None:
            Path(self.resolved_artifact_url).mkdir(parents=True, exist_ok=True)
        for database in self._sqlite_files():
            _owner_only(database)

    def _sqlite_files(self) -> list[Path]:
        """The SQLite files of the database and the broker (embedded mode): they hold every
        key hash, job token hash and task message, so only the service's user reads them."""
        urls = (self.resolved_database_url, self.resolved_broker_url)
        return [Path(url.split(":///", 1)[1]) for url in urls
                if url.startswith(("sqlite:///", "sqla+sqlite:///")) and ":memory:" not in url]

    def grader_limits(self) -> SandboxLimits:
        """The python graders' sandbox limits (``trainers.common.graders.sandbox``)."""
        from trainers.common.graders.sandbox import SandboxLimits

        return SandboxLimits(memory_bytes=self.grader_memory_bytes, seconds_per_sample=self.grader_seconds_per_sample,
                             seconds_per_call=self.grader_seconds_per_call, output_bytes=self.grader_output_bytes)

    def inference_secret_value(self) -> str:
        """What the API and the inference worker authenticate their channel with."""
        if self.inference_secret is not None:
            return self.inference_secret.get_secret_value()
        return hmac.new(self.secret_key_value().encode(), b"tunefleet inference worker", "sha256").hexdigest()

    def secret_key_value(self) -> str:
        """The secret key; in development generated once into ``<data>/secret_key`` (0600)."""
        if self.secret_key is not None:
            return self.secret_key.get_secret_value()
        path = self.data_path / "secret_key"
        if path.exists():
            return path.read_text(encoding="utf-8").strip()
        self.data_path.mkdir(parents=True, exist_ok=True)
        value = secrets.token_urlsafe(48)
        _write_private(path, value)
        return value


@lru_cache(maxsize=64)
def _owner_only(path: Path) -> None:
    """Create ``path`` (if missing) or narrow it to mode 0600; SQLite's journal and WAL
    files take the database file's mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)


def resolved_dir(path: Path) -> Path:
    """``path`` absolute with symlinks resolved. Cached: every request and every trainer
    spec asks for the data dir, and resolving costs a stat per path component; a running
    service's data dir does not move."""
    return path.expanduser().resolve()


def _is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine only (127.0.0.0/8, ::1, localhost, 0.0.0.0), in
    any spelling a resolver accepts for it (``127.1``, ``2130706433``, ``0x7f.0.0.1``)."""
    host = (urlsplit(url if "://" in url else f"http://{url}").hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _literal_address(host)
    if address is None:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def _literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` spells, if it is one: standard notation, or the classic IPv4
    forms (fewer parts, decimal, octal, hex) that ``getaddrinfo`` also takes literally."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _networks(value: str | None) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``10.0.0.7, 10.1.0.0/16`` as networks (a lone address is a /32 or /128)."""
    entries = (value or "").split(",")
    return tuple(ipaddress.ip_network(e.strip(), strict=False) for e in entries if e.strip())


def guessable(secret: str) -> bool:
    """Whether ``secret`` falls to fewer than 2**MIN_SECRET_BITS guesses by zxcvbn's estimate,
    the lower of the secret's and of its letters and digits alone: zxcvbn prices the
    punctuation between words as brute force, so ``change-me-to-a-random-token`` would
    otherwise pass. It looks at 72 characters at most (a strong start makes a strong secret)."""
    from zxcvbn import zxcvbn

    def bits(text: str) -> float:
        return zxcvbn(text[:72])["guesses_log10"] * math.log2(10) if text else 0.0

    return min(bits(secret), bits(re.sub(r"[^A-Za-z0-9]", "", secret))) < MIN_SECRET_BITS


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file readable by its owner only (no window with wider perms)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings from the environment (validated once, then cached)."""
    return Settings()
