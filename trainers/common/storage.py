"""s3:// locations for trainers: stage inputs into a local cache, publish outputs to S3.

Recipes read and write local paths only. When a spec names ``s3://bucket/key``
locations (the Kubernetes path: the base model and the validated files live in the
artifact bucket, and checkpoints/adapters must land there), the entry point
(``trainers.__main__``) uses :class:`S3Staging` so that no recipe needs to know:

1. :meth:`S3Staging.__init__` (pure) decides a local place for every s3:// location
   under the cache dir (``TUNEFLEET_CACHE_DIR``, default ``/tmp/tunefleet-cache``) and
   builds :attr:`S3Staging.local_spec`, a copy of the spec whose locations are local.
2. :meth:`S3Staging.stage_inputs` downloads the model prefix, the adapters of the
   fine-tuned models a job continues (``model.parent_adapters``) and the data files (each
   file streamed to disk by boto3's ``download_file``, never held in memory). The model
   cache is keyed by the URI and remembers each object's ETag, so a restarted pod whose
   cache survived downloads only what changed. With ``resume_from: latest`` the newest
   complete checkpoint under the s3 checkpoint prefix is downloaded first (a newer one
   left in the cache by a pod whose upload failed is dropped), and so is the output prefix
   (its ``metrics.jsonl`` carries the rows before that checkpoint).
3. :meth:`S3Staging.wrap_reporter` returns a reporter whose ``checkpoint`` and
   ``artifacts`` items are rewritten on their way to the API: the local directory is
   uploaded first and the item carries the ``s3://`` location (for a checkpoint, the
   output's metrics log goes up before it, so the log in the bucket always reaches the
   newest complete checkpoint). Uploads are synchronous,
   so an item the API registers always points at a complete object set, and a SIGTERM
   checkpoint is in the bucket before the process exits.

Completeness on S3 (which has no atomic rename): a checkpoint's ``trainer_state.json``
is deleted first and uploaded last, so ``step-N/`` counts as complete (the same rule as
``trainers.common.checkpointing.list_checkpoints``) only once every other file is there.
The output's ``manifest.json`` is uploaded last for the same reason.

Errors: a missing object is a :class:`~trainers.errors.UserError` with the caller's code
(``model_not_found``, ``parent_adapter_not_found``, ``dataset_not_found``, ``checkpoint_not_found``;
``bucket_not_found``
for an output/checkpoint bucket that does not exist); refused
credentials are ``storage_access_denied`` (user error: retrying cannot help); an
unreachable endpoint is ``storage_unreachable`` (internal error, so the executor retries).

Endpoint: ``TUNEFLEET_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL`` (path-style addressing,
which every S3-compatible server understands); credentials, region and retry settings
come from the standard ``AWS_*`` environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainers.common.checkpointing import TRAINER_STATE, list_checkpoints
from trainers.errors import TrainerError, UserError
from trainers.exit_codes import ExitCode

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"
CACHE_DIR_ENV = "TUNEFLEET_CACHE_DIR"
DEFAULT_CACHE_DIR = "/tmp/tunefleet-cache"
ENDPOINT_ENVS = ("TUNEFLEET_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")
ETAGS_FILE = ".tunefleet-etags.json"
MANIFEST = "manifest.json"
# Weight formats the loaders never read: HF repos often ship them next to the
# safetensors (Meta's "original/consolidated.*.pth" alone is the model's size again).
SKIPPED_MODEL_SUFFIXES = (".pth", ".pt", ".bin", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "InvalidToken", "InvalidClientTokenId", "AllAccessDisabled"}


class StorageUnreachable(TrainerError):
    """The S3 endpoint could not be reached (network, DNS, wrong URL); may be transient."""

    exit_code = ExitCode.INTERNAL_ERROR
    code = "storage_unreachable"


class StorageAccessDenied(TrainerError):
    """Credentials missing or refused: the deployment's S3 settings must be fixed."""

    exit_code = ExitCode.USER_ERROR
    code = "storage_access_denied"


def is_s3(location: str | None) -> bool:
    return location is not None and location.startswith(S3_SCHEME)


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/key``; ``key`` has no leading or trailing '/' (it may be empty)."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not is_s3(uri):
            raise UserError(f"not an s3:// URI: {uri!r}", code="invalid_spec")
        bucket, _, key = uri[len(S3_SCHEME):].partition("/")
        key = key.strip("/")
        if not bucket or ".." in PurePosixPath(key).parts:
            raise UserError(f"malformed s3 URI {uri!r} (expected s3://bucket/key)", code="invalid_spec")
        return cls(bucket, key)

    @property
    def uri(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}" if self.key else f"{S3_SCHEME}{self.bucket}"

    @property
    def prefix(self) -> str:
        """The key as a folder prefix for listings ('' for the bucket root)."""
        return f"{self.key}/" if self.key else ""

    def child(self, relative: str) -> S3Location:
        return S3Location(self.bucket, f"{self.prefix}{relative.strip('/')}")


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str


def endpoint_url() -> str | None:
    for name in ENDPOINT_ENVS:
        value = os.environ.get(name)
        if value:
            return value
    return None


def make_s3_client() -> Any:
    """A boto3 S3 client for the configured endpoint (path-style; AWS_* env for the rest)."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url()
    try:
        # A session of its own: boto3's default session caches the credentials it found first.
        session = boto3.session.Session()
        return session.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
    except ValueError as exc:  # botocore's InvalidEndpoint etc. are ValueErrors
        raise StorageUnreachable(f"invalid S3 endpoint {endpoint!r}: {exc}") from exc


class S3Storage:
    """The few S3 operations staging needs, with botocore errors turned into TrainerErrors."""

    def __init__(self, client: Any | None = None) -> None:
        self._client = client if client is not None else make_s3_client()

    @contextmanager
    def _errors(self, location: str, *, what: str, missing_code: str | None) -> Iterator[None]:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        try:
            yield
        except ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if missing_code is not None and (code in _NOT_FOUND or status == "404"):
                raise UserError(f"{what} not found: {location} ({code or status})", code=missing_code) from exc
            if code == "NoSuchBucket":
                raise UserError(f"the bucket of {location} does not exist", code="bucket_not_found") from exc
            if code in _DENIED or status == "403":
                raise StorageAccessDenied(
                    f"S3 refused access to {location} ({code}: {err.get('Message', '')}); check the trainer's "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy"
                ) from exc
            raise StorageUnreachable(f"S3 error on {location}: {code or status} {err.get('Message', '')}") from exc
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StorageAccessDenied(
                f"no S3 credentials for {location} ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from exc
        except (EndpointConnectionError, ConnectTimeoutError) as exc:
            raise StorageUnreachable(
                f"cannot reach the S3 endpoint {endpoint_url() or '(AWS default)'} for {location}: {exc}"
            ) from exc
        except BotoCoreError as exc:
            raise StorageUnreachable(f"S3 transfer of {location} failed: {exc}") from exc

    def list(self, loc: S3Location, *, what: str, missing_code: str | None = None) -> list[S3Object]:
        """Every object under ``loc`` as a folder (an empty list if there is none)."""
        found: list[S3Object] = []
        with self._errors(loc.uri, what=what, missing_code=missing_code):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    found.append(S3Object(obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"')))
        return found

    def head(self, loc: S3Location, *, what: str, missing_code: str) -> S3Object:
        with self._errors(loc.uri, what=what, missing_code=missing_code):
            meta = self._client.head_object(Bucket=loc.bucket, Key=loc.key)
        return S3Object(loc.key, int(meta["ContentLength"]), str(meta.get("ETag", "")).strip('"'))

    def download(self, loc: S3Location, dest: Path, *, what: str, missing_code: str) -> None:
        """Stream one object to ``dest`` (boto3 writes a temporary file and renames it)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self._errors(loc.uri, what=what, missing_code=missing_code):
            self._client.download_file(loc.bucket, loc.key, str(dest))

    def upload(self, source: Path, loc: S3Location) -> None:
        with self._errors(loc.uri, what="upload", missing_code=None):
            self._client.upload_file(str(source), loc.bucket, loc.key)

    def delete(self, bucket: str, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            chunk = keys[start:start + 1000]
            with self._errors(f"s3://{bucket}", what="delete", missing_code=None):
                self._client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in chunk]})


# ---- local cache ---------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def _uri_slot(uri: str) -> str:
    """A short, stable folder name for a URI (the URI itself may be long or odd)."""
    return hashlib.sha256(uri.encode("utf-8")).hexdigest()[:24]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (two jobs on one node staging the same model)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_etags(folder: Path) -> dict[str, str]:
    try:
        return json.loads((folder / ETAGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_etags(folder: Path, etags: dict[str, str]) -> None:
    tmp = folder / (ETAGS_FILE + ".tmp")
    tmp.write_text(json.dumps(etags, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, folder / ETAGS_FILE)


def sync_down(
    storage: S3Storage,
    objects: list[tuple[S3Object, str]],
    dest: Path,
    *,
    bucket: str,
    what: str,
    missing_code: str,
) -> int:
    """Make ``dest`` hold exactly ``objects`` (``(object, relative name)``), downloading only
    those whose ETag/size differ from what the cache recorded. Returns bytes downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    etags = _read_etags(dest)
    wanted = {rel for _, rel in objects}
    for rel in list(etags):  # files the source no longer has
        if rel not in wanted:
            (dest / rel).unlink(missing_ok=True)
            del etags[rel]
    fetched = 0
    for obj, rel in objects:
        target = dest / rel
        if etags.get(rel) == obj.etag and target.is_file() and target.stat().st_size == obj.size:
            continue
        etags.pop(rel, None)
        _write_etags(dest, etags)  # a crash mid-download must not leave a stale "valid" entry
        storage.download(S3Location(bucket, obj.key), target, what=what, missing_code=missing_code)
        etags[rel] = obj.etag
        _write_etags(dest, etags)
        fetched += obj.size
    return fetched


def upload_tree(storage: S3Storage, source: Path, dest: S3Location, *, last: tuple[str, ...] = ()) -> list[str]:
    """Upload every file under ``source`` to ``dest/<relative path>``; the names in ``last``
    go after all others. Remote objects under ``dest`` that ``source`` lacks are deleted.
    Returns the uploaded relative names."""
    names = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    ordered = [n for n in names if n not in last] + [n for n in last if n in names]
    remote = storage.list(dest, what="upload target")
    stale = [o.key for o in remote if o.key[len(dest.prefix):] not in names]
    # Stale first: with `last` deleted too, the folder is visibly incomplete until the end.
    doomed = stale + [dest.child(n).key for n in last if n in names and any(o.key == dest.child(n).key for o in remote)]
    if doomed:
        storage.delete(dest.bucket, doomed)
    for name in ordered:
        storage.upload(source / name, dest.child(name))
    return ordered


# ---- checkpoints on S3 ---------------------------------------------------------------------


def remote_checkpoints(storage: S3Storage, root: S3Location) -> list[tuple[int, S3Location]]:
    """Complete ``step-<N>/`` checkpoints under ``root`` (with trainer_state.json), oldest first."""
    steps: list[tuple[int, S3Location]] = []
    for obj in storage.list(root, what="checkpoint directory"):
        parts = obj.key[len(root.prefix):].split("/")
        if len(parts) == 2 and parts[1] == TRAINER_STATE and parts[0].startswith("step-") and parts[0][5:].isdigit():
            steps.append((int(parts[0][5:]), root.child(parts[0])))
    return sorted(steps, key=lambda s: s[0])


def download_checkpoint(storage: S3Storage, source: S3Location, dest: Path) -> Path:
    """Download one checkpoint folder to ``dest`` atomically (tmp folder + rename)."""
    objects = storage.list(source, what="checkpoint", missing_code="checkpoint_not_found")
    if not any(o.key == source.child(TRAINER_STATE).key for o in objects):
        raise UserError(f"no complete checkpoint at {source.uri} (no {TRAINER_STATE})", code="checkpoint_not_found")
    tmp = dest.parent / f".download-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for obj in objects:
        storage.download(S3Location(source.bucket, obj.key), tmp / obj.key[len(source.prefix):],
                         what="checkpoint", missing_code="checkpoint_not_found")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def prune_remote_checkpoints(storage: S3Storage, root: S3Location, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete ones
    older than the newest kept (left by a crash mid-upload). Returns the deleted step folders."""
    complete = remote_checkpoints(storage, root)
    if not complete:
        return []
    kept = {step for step, _ in complete[-keep_last:]}
    newest = complete[-1][0]
    doomed_keys, doomed_steps = [], set()
    for obj in storage.list(root, what="checkpoint directory"):
        head = obj.key[len(root.prefix):].split("/")[0]
        if head.startswith("step-") and head[5:].isdigit():
            step = int(head[5:])
            if step not in kept and step < newest:
                doomed_keys.append(obj.key)
                doomed_steps.add(head)
    if doomed_keys:
        storage.delete(root.bucket, doomed_keys)
    return sorted(doomed_steps)


# ---- staging a job -------------------------------------------------------------------------


def uses_s3(spec: Any) -> bool:
    return any(is_s3(x) for x in (spec.model.path, spec.data.train_file, spec.data.validation_file,
                                  spec.output_dir, spec.checkpoint.dir, spec.checkpoint.resume_from,
                                  *(parent.path for parent in spec.model.parent_adapters)))


def _nested(a: S3Location, b: S3Location) -> bool:
    return a.bucket == b.bucket and (a.prefix.startswith(b.prefix) or b.prefix.startswith(a.prefix))


def _data_file_name(loc: S3Location) -> str:
    return PurePosixPath(loc.key).name or "data.jsonl"


class S3Staging:
    """Local places for a spec's s3:// locations, the downloads, and the uploads (module doc).

    Args:
        spec: the job's TrainerSpec as the service wrote it.
        root: the cache dir (default: ``TUNEFLEET_CACHE_DIR`` or ``/tmp/tunefleet-cache``).
        storage: an :class:`S3Storage`; created on first use (so building the local spec
            needs neither boto3 nor credentials).
    """

    def __init__(self, spec: Any, *, root: str | Path | None = None, storage: S3Storage | None = None) -> None:
        self.spec = spec
        self.root = Path(root) if root is not None else cache_dir()
        self._storage = storage
        job = self.root / "jobs" / spec.job_id
        self.model_uri = S3Location.parse(spec.model.path) if is_s3(spec.model.path) else None
        self.output_uri = S3Location.parse(spec.output_dir) if is_s3(spec.output_dir) else None
        self.checkpoint_uri = S3Location.parse(spec.checkpoint.dir) if is_s3(spec.checkpoint.dir) else None
        if self.output_uri and self.checkpoint_uri and _nested(self.output_uri, self.checkpoint_uri):
            # Each folder is synced as a whole (stale objects deleted): nesting would make
            # one upload delete the other's objects.
            raise UserError(f"output_dir {spec.output_dir} and checkpoint.dir {spec.checkpoint.dir} must not "
                            "contain one another", code="invalid_spec")
        resume = spec.checkpoint.resume_from
        self.resume_uri = S3Location.parse(resume) if is_s3(resume) else None
        self.data_uris: dict[str, S3Location] = {}
        for field in ("train_file", "validation_file"):
            value = getattr(spec.data, field)
            if is_s3(value):
                self.data_uris[field] = S3Location.parse(value)

        self.model_dir = self.root / "models" / _uri_slot(self.model_uri.uri) if self.model_uri else None
        # Each s3:// parent adapter: its URI and local folder (None: a local path, kept).
        self.parent_uris = [S3Location.parse(p.path) if is_s3(p.path) else None for p in spec.model.parent_adapters]
        self.parent_dirs = [self.root / "adapters" / _uri_slot(u.uri) if u else None for u in self.parent_uris]
        self.data_paths = {f: self.root / "data" / _uri_slot(u.uri) / _data_file_name(u)
                           for f, u in self.data_uris.items()}
        self.output_dir = job / "output" if self.output_uri else Path(spec.output_dir)
        self.checkpoint_dir = job / "checkpoints" if self.checkpoint_uri else Path(spec.checkpoint.dir)
        self.resume_dir = job / "resume" / PurePosixPath(self.resume_uri.key).name if self.resume_uri else None
        # The newest checkpoint in the bucket, staged to resume from (local folder, its URI).
        self._staged_resume: tuple[Path, S3Location] | None = None

        checkpoint = {"dir": str(self.checkpoint_dir)}
        if self.resume_dir is not None:
            checkpoint["resume_from"] = str(self.resume_dir)
        self.local_spec = spec.model_copy(update={
            "model": spec.model.model_copy(update={
                "path": str(self.model_dir or spec.model.path),
                "parent_adapters": tuple(p.model_copy(update={"path": str(d or p.path)})
                                         for p, d in zip(spec.model.parent_adapters, self.parent_dirs, strict=True)),
            }),
            "data": spec.data.model_copy(update={f: str(p) for f, p in self.data_paths.items()}),
            "output_dir": str(self.output_dir),
            "checkpoint": spec.checkpoint.model_copy(update=checkpoint),
        })

    @property
    def storage(self) -> S3Storage:
        if self._storage is None:
            self._storage = S3Storage()
        return self._storage

    # -- inputs ------------------------------------------------------------------------------

    def stage_inputs(self) -> dict[str, int]:
        """Download what the recipe will read; returns bytes downloaded per kind."""
        stats = {"model_bytes": 0, "data_bytes": 0, "checkpoint_bytes": 0}
        for field, loc in self.data_uris.items():
            stats["data_bytes"] += self._stage_data_file(loc, self.data_paths[field])
        if self.model_uri is not None:
            stats["model_bytes"] += self._stage_folder(self.model_uri, self.model_dir, what="model",
                                                       marker="config.json", missing_code="model_not_found")
        for loc, dest in zip(self.parent_uris, self.parent_dirs, strict=True):
            if loc is not None:
                stats["model_bytes"] += self._stage_folder(loc, dest, what="parent adapter",
                                                           marker="adapter_config.json",
                                                           missing_code="parent_adapter_not_found")
        stats["checkpoint_bytes"] += self._stage_resume()
        return stats

    def _stage_data_file(self, loc: S3Location, dest: Path) -> int:
        obj = self.storage.head(loc, what="dataset file", missing_code="dataset_not_found")
        with _locked(dest.parent.with_suffix(".lock")):
            return sync_down(self.storage, [(obj, dest.name)], dest.parent, bucket=loc.bucket,
                             what="dataset file", missing_code="dataset_not_found")

    def _stage_folder(self, loc: S3Location, dest: Path, *, what: str, marker: str, missing_code: str) -> int:
        """Download the top-level files of a model (or adapter) prefix that must hold ``marker``."""
        listing = self.storage.list(loc, what=what, missing_code=missing_code)
        objects: list[tuple[S3Object, str]] = []
        for obj in listing:
            rel = obj.key[len(loc.prefix):]
            # Top-level files only: the HF (and PEFT) layout keeps config, weights and tokenizer there.
            if not rel or "/" in rel or rel.endswith(SKIPPED_MODEL_SUFFIXES):
                continue
            objects.append((obj, rel))
        if not any(rel == marker for _, rel in objects):
            raise UserError(f"no {what} at {loc.uri}: {marker} not found under that prefix", code=missing_code)
        with _locked(dest.with_suffix(".lock")):
            fetched = sync_down(self.storage, objects, dest, bucket=loc.bucket, what=f"{what} file",
                                missing_code=missing_code)
        log.info("%s %s staged in %s (%d bytes downloaded)", what, loc.uri, dest, fetched)
        return fetched

    def _stage_resume(self) -> int:
        if self.resume_uri is not None:
            path = download_checkpoint(self.storage, self.resume_uri, self.resume_dir)
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if self.spec.checkpoint.resume_from != "latest" or self.checkpoint_uri is None:
            return 0
        if self.output_uri is not None:
            # metrics.jsonl of the interrupted run (synced at each checkpoint): the recipe
            # keeps its rows up to the resumed step.
            outputs = [(o, o.key[len(self.output_uri.prefix):]) for o in self.storage.list(
                self.output_uri, what="output directory")]
            self.output_dir.mkdir(parents=True, exist_ok=True)
            for obj, rel in outputs:
                self.storage.download(S3Location(self.output_uri.bucket, obj.key), self.output_dir / rel,
                                      what="output file", missing_code="checkpoint_not_found")
        found = remote_checkpoints(self.storage, self.checkpoint_uri)
        # The bucket decides where the run resumes. A disk that outlived its pod may keep a
        # checkpoint whose upload failed: newer than anything the job knows of (the metrics
        # log just restored from the bucket ends before it), so resuming from it would
        # leave its steps out of the job's outputs.
        newest = found[-1][0] if found else 0
        for local_step, path in list_checkpoints(self.checkpoint_dir):
            if local_step > newest:
                shutil.rmtree(path)
        if not found:
            return 0  # a first start: nothing to resume, like an empty local dir
        step, loc = found[-1]
        local = self.checkpoint_dir / f"step-{step}"
        self._staged_resume = (local, loc)
        if (local / TRAINER_STATE).is_file():
            return 0  # this pod's disk already has it
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        download_checkpoint(self.storage, loc, local)
        return sum(p.stat().st_size for p in local.rglob("*") if p.is_file())

    # -- outputs -----------------------------------------------------------------------------

    def publish_checkpoint(self, location: str) -> str:
        """Upload a local checkpoint folder the recipe reported; returns its s3:// URI."""
        if self.checkpoint_uri is None:
            return location
        local = Path(location)
        staged, self._staged_resume = self._staged_resume, None
        if staged is not None and local.resolve() == staged[0].resolve():
            return staged[1].uri  # the resumed run lists it again: it came from the bucket whole
        try:
            rel = local.resolve().relative_to(self.checkpoint_dir.resolve()).as_posix()
        except ValueError:
            return location  # not under the staged dir: nothing of ours
        dest = self.checkpoint_uri.child(rel)
        if self.output_uri is not None and self.output_dir.is_dir():
            # metrics.jsonl so far, so a resumed pod continues the log (see _stage_resume).
            # Before the checkpoint: once its trainer_state.json is in the bucket a new pod
            # may resume from it, and the log there must already reach its step (rows past
            # the resumed step are dropped on resume, so a log that is ahead does no harm).
            # A pod killed between the two uploads otherwise left the steps since the
            # previous checkpoint out of the job's metrics.jsonl for good.
            upload_tree(self.storage, self.output_dir, self.output_uri, last=(MANIFEST,))
        upload_tree(self.storage, local, dest, last=(TRAINER_STATE,))
        prune_remote_checkpoints(self.storage, self.checkpoint_uri, self.spec.checkpoint.keep_last)
        log.info("checkpoint %s uploaded to %s", local, dest.uri)
        return dest.uri

    def publish_outputs(self, location: str, files: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        """Upload the output dir the recipe reported; returns (s3:// URI, manifest entries).

        The recipe wrote the local spec's paths into ``training_config.json`` and the
        adapter's ``base_model_name_or_path``; those are rewritten to the job's own
        locations first (a cache path means nothing outside this pod), and the manifest is
        rebuilt so its sha256s match what is uploaded.
        """
        if self.output_uri is None or Path(location).resolve() != self.output_dir.resolve():
            return location, files
        from trainers.common.outputs import (
            ADAPTER_DIR,
            TRAINING_CONFIG,
            finalize_outputs,
            write_training_config,
        )

        if (self.output_dir / TRAINING_CONFIG).exists():
            write_training_config(self.output_dir, self.spec)
        adapter_config = self.output_dir / ADAPTER_DIR / "adapter_config.json"
        if adapter_config.exists() and self.model_uri is not None:
            config = json.loads(adapter_config.read_text(encoding="utf-8"))
            if config.get("base_model_name_or_path") == str(self.model_dir):
                config["base_model_name_or_path"] = self.spec.model.path
                adapter_config.write_text(json.dumps(config, indent=2), encoding="utf-8")
        files = finalize_outputs(self.output_dir)
        upload_tree(self.storage, self.output_dir, self.output_uri, last=(MANIFEST,))
        log.info("outputs %s uploaded to %s", self.output_dir, self.output_uri.uri)
        return self.output_uri.uri, files

    def wrap_reporter(self, reporter: Any) -> PublishingReporter:
        return PublishingReporter(reporter, self)


class PublishingReporter:
    """A reporter proxy: ``checkpoint`` and ``artifacts`` items are uploaded first and carry
    their s3:// location; everything else passes through unchanged.

    Items are intercepted in :meth:`add`, so reports relayed from rank processes (the
    FSDP launcher re-adds rank 0's items) are published the same way.
    """

    def __init__(self, inner: Any, staging: S3Staging) -> None:
        self._inner = inner
        self._staging = staging
        self.failure: TrainerError | None = None

    def add(self, item: dict[str, Any]) -> None:
        """Publish, then pass on. A failed upload raises (the recipe stops) and is also kept
        in :attr:`failure`: items relayed by a launcher thread raise there, not in the
        recipe, so the entry point checks it after the recipe returns."""
        self._inner.add(self._published(item))

    def checkpoint(self, step: int, location: str, metrics: dict[str, Any]) -> None:
        """Upload, then report (spooled before this returns, as the inner reporter does)."""
        item = self._published({"type": "checkpoint", "step": step, "location": location, "metrics": metrics})
        self._inner.checkpoint(step, item["location"], metrics)

    def _published(self, item: dict[str, Any]) -> dict[str, Any]:
        kind = item.get("type")
        try:
            if kind == "checkpoint" and isinstance(item.get("location"), str):
                return {**item, "location": self._staging.publish_checkpoint(item["location"])}
            if kind == "artifacts" and isinstance(item.get("location"), str):
                location, files = self._staging.publish_outputs(item["location"], list(item.get("files", [])))
                return {**item, "location": location, "files": files}
        except TrainerError as exc:
            if self.failure is None:
                self.failure = exc
            raise
        return item

    def artifacts(self, location: str, files: list[dict[str, Any]]) -> None:
        self.add({"type": "artifacts", "location": location, "files": files})

    def __getattr__(self, name: str) -> Any:  # metric, event, error, flush, close, mirror, ...
        return getattr(self._inner, name)
