"""Production inference: completions proxied to the base model's OpenAI-compatible server.

A registry entry with ``inference_url`` (e.g. vLLM started with ``--enable-lora``,
``--served-model-name <registry id>`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) is
served there instead of by the embedded worker. For a fine-tuned model or checkpoint the
adapter is first made known to the server under the model's own id::

    POST {inference_url}/v1/load_lora_adapter {"lora_name": "<ft:... id>", "lora_path": "<adapter dir>"}

(the adapter's location in the shared storage both see: a shared volume path, or an
``s3://`` URI for servers that resolve those), then the request goes there with the same
body and ``model`` = that id, and the answer (a JSON object, or the SSE stream) passes
through unchanged (a proxied stream's tokens are not counted against the per-minute
token limit: only answers with ``usage`` are). Loaded adapters are remembered per server; a server that forgot one
(it restarted: 404 for the model) gets it loaded again and the request once more. The
tenant check (``api.inference.served_models``), admission and the request timeout are the same as
for the embedded worker.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from api.inference.completions import REQUESTS, TOKENS, SlotStreamingResponse, admit, token_budget
from api.inference.served_models import ServedModel
from control.errors import APIError

log = logging.getLogger(__name__)

LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"


def _loaded(request: Request) -> set[tuple[str, str, str]]:
    """(server, adapter name, adapter path) triples this API process has loaded."""
    state = request.app.state
    if getattr(state, "proxy_adapters", None) is None:
        state.proxy_adapters = set()
    return state.proxy_adapters


async def _load_adapter(http: httpx.AsyncClient, server: str, name: str, path: str) -> None:
    response = await http.post(f"{server}{LOAD_ADAPTER_PATH}", json={"lora_name": name, "lora_path": path})
    if response.status_code == 200 or (response.status_code == 400 and "already" in response.text.lower()):
        return
    log.error("%s refused to load adapter %s from %s: %s %s", server, name, path, response.status_code,
              response.text[:500])
    raise APIError(503, "adapter_load_failed",
                   f"The inference server for this model could not load '{name}'; retry later.",
                   headers={"Retry-After": "5"})


async def _send(http: httpx.AsyncClient, server: str, path: str, payload: dict[str, Any]) -> httpx.Response:
    return await http.send(http.build_request("POST", f"{server}{path}", json=payload), stream=True)


async def _backend_error(response: httpx.Response) -> APIError:
    body = await response.aread()
    await response.aclose()
    try:
        error = httpx.Response(response.status_code, content=body).json().get("error") or {}
        message = str(error.get("message") or body[:500].decode(errors="replace"))
    except (ValueError, AttributeError):
        message = body[:500].decode(errors="replace")
    if response.status_code >= 500:
        log.error("inference server error %s: %s", response.status_code, message)
        return APIError(503, "inference_unavailable", "The inference server failed; retry later.",
                        headers={"Retry-After": "5"})
    return APIError(response.status_code, "inference_backend_error", f"The inference server refused: {message}")


async def proxy_completion(request: Request, tenant_id: str, served: ServedModel, payload: dict[str, Any], *,
                           path: str, endpoint: str, stream: bool) -> Response:
    """Answer the request with ``served.base.inference_url``'s answer (see the module doc)."""
    assert served.base.inference_url is not None
    settings = request.app.state.settings
    server = served.base.inference_url.rstrip("/")
    name = served.id if served.adapter_path is not None else served.base.id
    payload = {**payload, "model": name}
    slots = admit(request, tenant_id, endpoint)
    http = httpx.AsyncClient(timeout=httpx.Timeout(settings.inference_timeout_s, connect=5.0))
    loaded = _loaded(request)
    adapter = (server, name, served.adapter_path) if served.adapter_path is not None else None

    async def close() -> None:
        slots.release(tenant_id)
        await http.aclose()

    try:
        if adapter is not None and adapter not in loaded:
            await _load_adapter(http, server, name, adapter[2])
            loaded.add(adapter)
        response = await _send(http, server, path, payload)
        if response.status_code == 404 and adapter is not None:  # the server restarted and forgot it
            await response.aclose()
            await _load_adapter(http, server, name, adapter[2])
            response = await _send(http, server, path, payload)
        if response.status_code != 200:
            raise await _backend_error(response)
    except httpx.TimeoutException as exc:
        await close()
        REQUESTS.labels(endpoint, "inference_timeout").inc()
        raise APIError(504, "inference_timeout", f"The completion on '{served.id}' took too long.") from exc
    except httpx.HTTPError as exc:
        await close()
        log.error("inference server %s unreachable: %s", server, exc)
        REQUESTS.labels(endpoint, "inference_unavailable").inc()
        raise APIError(503, "inference_unavailable", "The inference server for this model is not available.",
                       headers={"Retry-After": "5"}) from exc
    except BaseException:
        await close()
        raise
    REQUESTS.labels(endpoint, "ok").inc()
    if stream:
        async def close_stream() -> None:
            await response.aclose()
            await close()

        return SlotStreamingResponse(response.aiter_raw(), on_close=lambda: None, closing=close_stream,
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        body = await response.aread()
    finally:
        await close()
    try:
        usage = httpx.Response(200, content=body).json().get("usage") or {}
        TOKENS.labels("prompt").inc(int(usage.get("prompt_tokens") or 0))
        TOKENS.labels("completion").inc(int(usage.get("completion_tokens") or 0))
        budget = token_budget(request)
        if budget is not None:
            budget.spend(tenant_id, int(usage.get("total_tokens") or 0))
    except (ValueError, AttributeError, TypeError):
        pass  # an answer without usage counts no tokens
    return Response(body, media_type="application/json")
