"""``/openapi.json`` as the server really answers.

FastAPI documents a 422 on every route with inputs, but this API answers request
validation with a 400 in OpenAI's error envelope (``api.errors``), and it has no idea of
the 401/403 its authentication dependencies answer. ``install_openapi`` rewrites the
generated document (in place, idempotently: FastAPI caches it) whenever it is served:

- the 422 becomes the 400 the handlers really send (``ErrorResponse``), and FastAPI's
  ``HTTPValidationError`` schemas go;
- a route that takes a body documents the 413 of ``api.body_limit``;
- a route under the rate limits (``api.rate_limits``) documents their 429;
- a route that depends on an authenticator (``api.route_auth.AUTHENTICATORS``)
  documents the statuses that authenticator answers;
- integer bounds stay integers: FastAPI's OpenAPI models store ``maximum`` and friends
  as floats, so ``2**62`` was written ``4.611686018427388e+18``.

Route-specific errors (404, 409, 413, ...) are declared on the routes themselves with
``api.errors.error_responses``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts

from api.errors import error_responses
from api.rate_limits import is_rate_limited
from api.route_auth import AUTHENTICATORS, route_authenticators

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_RETRY_AFTER = {"description": "Seconds to wait before the next request.",
                "schema": {"type": "integer", "minimum": 1}}


def _error_statuses(route: RouteContext, operation: dict[str, Any]) -> list[int]:
    # FastAPI also counts hidden parameters (the Authorization header), which cannot fail.
    takes_input = bool(operation.get("parameters") or operation.get("requestBody"))
    statuses = {400} if "422" in operation["responses"] and takes_input else set()
    if "requestBody" in operation:
        statuses.add(413)  # api.body_limit refuses an oversized body before routing
    for check in route_authenticators(route.dependant):
        statuses.update(AUTHENTICATORS[check])
    if is_rate_limited(route.path_format):
        statuses.add(429)  # api.rate_limits, before routing
    return sorted(statuses)


def _integer_bounds(node: Any) -> None:
    """Write whole-number bounds of integer schemas as integers, in place."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for bound in _BOUNDS:
                value = node.get(bound)
                if isinstance(value, float) and value.is_integer():
                    node[bound] = int(value)
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)


def rewrite_openapi(app: FastAPI, document: dict[str, Any]) -> dict[str, Any]:
    """``document`` (FastAPI's for ``app``) with the rewrites described above."""
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for route in iter_route_contexts(app.routes):  # what app.include_router added, flattened
        if not isinstance(route.original_route, APIRoute) or not route.include_in_schema:
            continue
        path = document["paths"].get(route.path_format, {})
        for method in route.methods:
            operation = path.get(method.lower())
            if operation is None:
                continue
            statuses = _error_statuses(route, operation)
            responses = operation["responses"]
            responses.pop("422", None)
            for status, response in error_responses(*statuses).items():
                documented = responses.setdefault(str(status), {"description": response["description"]})
                if status == 429:
                    documented.setdefault("headers", {"Retry-After": _RETRY_AFTER})
            for status, response in responses.items():
                own = response.get("content", {}).get("application/json", {}).get("schema")
                if status[0] in "45" and own in (None, {}, ref):
                    # The envelope is JSON on every route; FastAPI would give a text/plain
                    # or file route's errors that route's media type.
                    response["content"] = {"application/json": {"schema": ref}}
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in _VALIDATION_SCHEMAS:
        schemas.pop(name, None)
    if "ErrorResponse" not in schemas:  # only referenced by the statuses added here
        from api.schemas.errors import ErrorObject, ErrorResponse

        defs = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.pop("$defs", None)
        schemas["ErrorResponse"] = defs
        schemas["ErrorObject"] = ErrorObject.model_json_schema()
    _integer_bounds(document)
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve FastAPI's document through ``rewrite_openapi`` at ``/openapi.json``."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        return rewrite_openapi(app, generate())

    app.openapi = openapi  # type: ignore[method-assign]
