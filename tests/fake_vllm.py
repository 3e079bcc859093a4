"""A small stand-in for a vLLM server started with ``--enable-lora`` and runtime LoRA
updating: the part of its OpenAI-compatible protocol the inference proxy uses.

No real vLLM can run here (no GPU, no vllm package). What this fake does as vLLM does:
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` registers an adapter directory
(400 if the name is loaded already or the path holds no adapter); completions name a
served base model or a loaded adapter as ``model`` (404 "The model `x` does not exist."
otherwise); answers are OpenAI objects, or SSE chunks ending ``data: [DONE]``. What it
does not: generate; its text is ``"<model> says hi"`` so a test sees who answered.
``restart()`` forgets the loaded adapters, as a restarted server does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError" if status == 400 else
                                   "NotFoundError", "param": None, "code": status}}, status_code=status)


class FakeVLLM:
    def __init__(self, served: tuple[str, ...]) -> None:
        self.served = set(served)
        self.adapters: dict[str, str] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.app = self._build()

    def restart(self) -> None:
        self.adapters.clear()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Any:
            body = await request.json()
            self.calls.append(("load", body))
            name, path = body.get("lora_name"), body.get("lora_path")
            if name in self.adapters:
                return _error(400, f"The lora adapter '{name}' has already been loaded.")
            if not os.path.isfile(os.path.join(str(path), "adapter_config.json")):
                return _error(400, f"Loading lora {name} failed: No adapter found for {path}")
            self.adapters[name] = path
            return JSONResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self._complete(await request.json(), chat=True)

        @app.post("/v1/completions")
        async def text(request: Request) -> Any:
            return await self._complete(await request.json(), chat=False)

        return app

    async def _complete(self, body: dict[str, Any], *, chat: bool) -> Any:
        self.calls.append(("chat" if chat else "text", body))
        model = body.get("model")
        if model not in self.served and model not in self.adapters:
            return _error(404, f"The model `{model}` does not exist.")
        words = [model, " says", " hi"]
        usage = {"prompt_tokens": 4, "completion_tokens": len(words), "total_tokens": 4 + len(words)}
        head = {"id": "cmpl-fake", "created": 1, "model": model}
        if not body.get("stream"):
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                          "finish_reason": "stop", "logprobs": None}
                return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            choice = {"index": 0, "text": "".join(words), "finish_reason": "stop", "logprobs": None}
            return {**head, "object": "text_completion", "choices": [choice], "usage": usage}

        def chunks() -> Any:
            obj = "chat.completion.chunk" if chat else "text_completion"
            for i, word in enumerate(words):
                last = i == len(words) - 1
                choice = ({"index": 0, "delta": {"content": word, **({"role": "assistant"} if i == 0 else {})}}
                          if chat else {"index": 0, "text": word})
                choice.update(finish_reason="stop" if last else None, logprobs=None)
                yield f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")
