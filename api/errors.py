"""API errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.

Routes raise ``APIError`` with a stable ``code``; the handlers installed by
``install_error_handlers`` also translate FastAPI's request validation (422 -> 400 with
``param`` = the field path), unknown routes (404), wrong methods (405), malformed JSON,
and any unexpected exception (500 with a generic message; details go to the log only),
so every answer, good or bad, has the same shape.

Error codes used by the API (stable; clients may switch on them):

=============================  ====  =====================================================
code                           HTTP  meaning
=============================  ====  =====================================================
missing_api_key                401   no ``Authorization: Bearer`` header
invalid_api_key                401   unknown, malformed or revoked key
invalid_job_token              401   report endpoint: wrong or missing job token
job_token_expired              401   report endpoint: the job stopped running over a minute ago
permission_denied              403   an admin-only route with a tenant key; a checkpoint's
                                     permissions managed by a tenant it is shared with
not_found                      404   unknown route, or an object of another tenant
method_not_allowed             405   wrong HTTP method
invalid_json                   400   the body is not valid JSON (or not UTF-8)
invalid_request                400   a field has the wrong type/value (``param`` = path),
                                     or a value the database cannot store
invalid_cursor                 400   ``after`` does not name an object of this list
invalid_model                  400   unknown base model, or a fine-tuned model (checkpoint) this
                                     organization may not use or that is no longer stored
                                     (``param`` = ``model``)
parent_not_succeeded           400   job creation: ``model`` is a model of a job that has not succeeded
parent_base_mismatch           400   ... ``adapter.<field>`` names another base storage than the
                                     fine-tuned model continued was trained on
parent_base_unsupported        400   ... the named trainer cannot train that base (``param`` = ``trainer``)
model_exists                   409   POST /v1/models: the id is taken (YAML or a registration)
invalid_model_source           400   ... a source not a directory, s3:// prefix nor Hub id
model_source_not_allowed       400   ... a directory not under TUNEFLEET_MODEL_ROOTS (links resolved)
model_config_unreadable        400   ... a checkpoint without a readable config.json (or its sizes)
unsupported_architecture       400   ... a model_type the trainers do not train
tokenizer_missing              400   ... a checkpoint without tokenizer files
weights_missing                400   ... a checkpoint without safetensors weights
inconsistent_weights           400   ... a safetensors index that disagrees with the shards
model_source_unreadable        400   ... a source that cannot be read (S3 credentials, bucket)
hub_disabled                   400   ... a Hub id while ``TUNEFLEET_HUB_ALLOWED_REPOS`` is unset
hub_repo_not_allowed           400   ... a Hub repo that none of those patterns match
base_model_not_deletable       403   deleting a base model with a tenant key
model_declared_in_file         409   deleting a base model of ``TUNEFLEET_BASE_MODELS_FILE``
model_in_use                   409   deleting a registered base model a job still trains on, or a
                                     fine-tuned model an unfinished job continues
no_pool_fits                   400   job creation: no node pool can hold the job even when
                                     idle (``details.pools``: each pool's reason), unless
                                     ``placement.queue_if_unfit``; also the error of a
                                     queued job no pool fits any more (pools file changed)
invalid_file                   400   training/validation file missing, invalid or of
                                     another tenant (``param`` = the field)
file_not_ready                 400   the file is still being validated
file_in_use                    409   deleting a file that a live job still needs
empty_file                     400   an upload (or an upload's part) with zero bytes
not_utf8                       400   an upload that is not UTF-8 text (an upload in parts: at
                                     completion)
file_too_large                 413   an upload over ``TUNEFLEET_MAX_UPLOAD_BYTES`` (``POST
                                     /v1/uploads``: its ``bytes``), or a part over 64 MiB
upload_not_pending             409   a part, completion or cancel of an upload already
                                     completed, cancelled or expired
upload_size_mismatch           400   parts that hold more than the upload's ``bytes``, or
                                     (completion) not exactly as many
invalid_part_ids               400   completion: an id twice, one not a part of this upload
                                     (``param`` = ``part_ids[i]``), or a part left out
md5_mismatch                   400   completion: the parts in this order do not have that md5
too_many_parts                 400   an upload's 10,001st part
invalid_project_id             400   a checkpoint permission for no tenant, or for its owner
permission_conflict            409   concurrent grants of one checkpoint kept colliding
request_too_large              413   any other body over ``TUNEFLEET_MAX_REQUEST_BYTES`` (before auth)
idempotency_conflict           409   an ``Idempotency-Key`` reused with another body
invalid_state_transition       409   e.g. cancelling a succeeded job
invalid_artifact_path          400   an artifact name escaping the job's output
artifact_not_found             404   no such artifact
invalid_artifact_location      400   report endpoint: outputs or checkpoints outside the job's own
                                     output / checkpoint directory, or control characters
report_too_large               413   report endpoint: a batch over ``TUNEFLEET_REPORT_MAX_ITEMS`` items
                                     (``param`` = ``items``) or ``TUNEFLEET_REPORT_MAX_BYTES``
invalid_tracking_uri           400   an MLflow ``tracking_uri`` that is not http(s)://host
tracking_uri_not_public        400   ... that resolves to an internal address (and is not in
                                     ``TUNEFLEET_TRACKER_ALLOWED_HOSTS``)
tracking_uri_unresolvable      400   ... whose host does not resolve
invalid_session                401   dashboard JSON routes without a signed-in session
invalid_metrics_token          401   ``/metrics`` with a wrong scrape token
csrf_failed                    403   a cookie-authenticated unsafe request without the
                                     session's CSRF token (or cross-origin)
tenant_exists                  409   creating a tenant whose name is taken
rate_limited                   429   too many failed authentications from this IP, or too
                                     many requests for this key / job / IP (``Retry-After``)
too_many_streams               429   job streams: this key's (or this process's) open streams are at
                                     ``TUNEFLEET_STREAM_MAX_PER_KEY`` / ``_PER_PROCESS`` (``Retry-After``)
logs_unavailable               502   Kubernetes mode: the cluster refused the pod-log read
checkpoint_not_found           404   no such checkpoint of this job
checkpoint_not_stored          404   the checkpoint's files were pruned (only the last are kept)
job_not_succeeded              409   a merged export of a job without a final adapter (yet), or an
                                     evaluation of a job that has not succeeded
too_many_samples               400   an evaluation's ``max_samples`` over ``TUNEFLEET_EVALUATION_MAX_SAMPLES``
too_many_evaluations           429   the organization's evaluations queued or running are at
                                     ``TUNEFLEET_EVALUATION_MAX_CONCURRENT_PER_TENANT`` (``Retry-After``)
export_in_progress             409   a merged export of an adapter whose export in another dtype is
                                     still queued or running (one per adapter at a time)
too_many_exports               429   the organization's merged exports queued or running are at
                                     ``TUNEFLEET_EXPORT_MAX_CONCURRENT_PER_TENANT`` (``Retry-After``)
export_needs_local_storage     400   a merged export with outputs in S3 (local artifact store only)
model_not_found                404   completions: not a base model, nor a fine-tuned model or
                                     checkpoint of this organization (``param`` = ``model``)
unsupported_parameter          400   completions: a parameter this service does not implement
unsupported_content            400   completions: a non-text content part
generation_failed              500   completions: the model failed while generating (a stream
                                     that started gets it as an error event)
context_length_exceeded        400   completions: prompt tokens + ``max_tokens`` over the model's
                                     context (``param`` = ``messages`` or ``prompt``)
too_many_requests              429   completions: the organization's concurrent completions are
                                     running already (``Retry-After``)
token_limit_exceeded           429   completions: the organization's tokens of the last minute are
                                     used up (``Retry-After``)
model_loading                  503   completions: the base model is still loading after
                                     ``TUNEFLEET_INFERENCE_LOAD_WAIT_S`` (``Retry-After``)
model_unavailable              503   completions: the base model's files are not on this machine
model_unavailable              400   job creation, estimates: a local base model's directory or
                                     its ``config.json`` is missing (``param`` = ``model``)
inference_unavailable          503   completions: the inference worker / server is not reachable,
                                     died or restarted (mid-stream: an error event)
model_load_failed              503   completions: the base model failed to load (the next request retries)
adapter_load_failed            503   completions: the adapter does not load on its base model
adapter_not_found              404   completions: the model's adapter files are gone from storage
inference_timeout              504   completions: longer than ``TUNEFLEET_INFERENCE_TIMEOUT_S``
database_unavailable           503   the database cannot be reached right now (a restart, a
                                     failover): retry after ``Retry-After`` seconds
invalid_grader                 400   graders: a malformed grader object (``param`` = the field), e.g. an
                                     unknown type, a missing field, a multi grader inside a multi grader
invalid_grader_template        400   graders: a ``{{ }}`` template with another namespace than item and
                                     sample, an unknown sample variable, or broken syntax
invalid_grader_formula         400   graders: a multi grader's ``calculate_output`` that does not parse,
                                     names no sub-grader, or uses what the formulas do not offer
invalid_python_grader          400   graders: a python grader whose source does not compile, is over
                                     256 kB, or defines no ``grade(sample, item)``
unsupported_evaluation_metric  400   graders: ``cosine`` (evals only), or ``meteor`` without its WordNet data
invalid_grader_model           400   graders: a score_model grader's ``model`` that this service does not
                                     serve to the caller (nor allows at its external grader endpoint)
grader_item_missing            400   job creation: a reinforcement grader reads ``{{item.<key>}}`` that
                                     not every line of its training/validation file has (``param`` = the
                                     grader's field); the grader codes above apply under
                                     ``method.reinforcement.grader`` too (and, for an evaluation, under
                                     ``grader``, whose reinforcement file's lines have no ``reference``)
graders_busy                   429   graders: python graders of the organization (or of the whole
                                     service) are running already (``Retry-After``)
internal_error                 500   a bug; the message holds no details
=============================  ====  =====================================================
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.responses import error_response
from api.route_auth import authenticate_route
from api.schemas.errors import ErrorResponse
from control.errors import APIError

log = logging.getLogger(__name__)

# Seconds a client waits before retrying while the database is unreachable: a restart or
# a failover takes seconds.
DATABASE_RETRY_AFTER_S = 5


# What each error status means on any route; routes list theirs with ``error_responses``.
_MEANINGS = {
    400: "Invalid request: a parameter or the body is malformed or refused "
         "(`code` says why, `param` says where).",
    401: "Missing, malformed or revoked credentials.",
    403: "The credentials may not do this.",
    404: "No such object, or it belongs to another tenant.",
    409: "The request conflicts with the object's current state.",
    413: "The body (or upload) is larger than the service accepts.",
    429: "Too many requests (or failed authentications): retry after `Retry-After` seconds.",
    502: "An upstream service refused the request.",
    503: "A dependency of the service is unavailable.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route decorator: each status answers the error envelope."""
    return {status: {"model": ErrorResponse, "description": _MEANINGS[status]} for status in statuses}


def _param_path(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "hyperparameters", "n_epochs")`` -> ``"hyperparameters.n_epochs"``."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # Drop pydantic's union-branch tags such as "int" / "literal['auto']" / "function-after[...]".
    parts = [p for p in parts if not (p.endswith("]") or p in {"int", "float", "str", "bool"})]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, "invalid_json", "The request body is not valid JSON.")
    if first.get("type") == "model_attributes_type" or (
        first.get("loc") == ("body",) and first.get("type") in {"dict_type", "model_type"}
    ):
        return APIError(400, "invalid_request", "The request body must be a JSON object.")
    param = _param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing" and param is None:
        message = "The request body is missing; send a JSON object."
    elif first.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    elif first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: '{param}'."
    elif param:
        message = f"Invalid value for '{param}': {message}"
    more = len(errors) - 1
    if more > 0:
        message += f" ({more} more problem{'s' if more > 1 else ''} in this request)"
    return APIError(400, "invalid_request", message, param=param)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path.

    FastAPI registers one route per method, and Starlette's 405 names only the methods of
    the first route whose path matched; ``Allow`` must list them all (RFC 9110).
    """
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):
        pattern = getattr(route, "path_regex", None)
        if route.methods and pattern is not None and pattern.match(request.url.path):
            methods |= route.methods
    return sorted(methods)


def _unreadable_body(exc: StarletteHTTPException) -> bool:
    """FastAPI's 400 for a body ``json.loads`` could not even decode (not UTF-8)."""
    return exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the OpenAI error envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        await authenticate_route(request)  # a 401 comes before anything about the body
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 404:
            error = APIError(404, "not_found", "Unknown route.")
        elif exc.status_code == 405:
            error = APIError(405, "method_not_allowed", "Method not allowed for this route.")
            headers["Allow"] = ", ".join(allowed_methods(request))
        elif _unreadable_body(exc):
            await authenticate_route(request)
            error = APIError(400, "invalid_json", "The request body is not valid JSON: "
                             "it must be UTF-8 encoded.")
        else:
            error = APIError(exc.status_code, "http_error", str(exc.detail))
        error.headers = headers or None
        return error_response(error)

    @app.exception_handler(DataError)
    async def _data(_request: Request, exc: DataError) -> JSONResponse:
        # The database refused a value the schemas let through (a NUL character in a
        # string, an integer past the column's range): the input is wrong, not the server.
        log.info("database refused a request value: %s", exc.orig)
        return error_response(APIError(
            400, "invalid_request",
            "A value in the request cannot be stored (NUL character or number out of range).",
        ))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if database_unavailable(exc):
            log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
            return error_response(APIError(503, "database_unavailable", "The database is unavailable; retry shortly.",
                                           headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)}))
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal_error", "Internal server error.", type="api_error"))


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached now, not that a request is wrong:
    a refused or dropped connection, a server shutting down, no pooled connection in time."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeout):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated
