"""Generation for many LoRA adapters on few base models: each base loaded once, adapters
switched per request.

A base model is loaded on first use, in a background thread, while requests for it are
answered :class:`ModelLoading` (the API's 503 ``model_loading``): a multi-GB load never
holds a request open. Once loaded it stays loaded. Its adapters are PEFT adapters on one
``PeftModel`` (``load_adapter`` / ``set_adapter``), at most ``max_adapters`` per base in
least-recently-used order (``delete_adapter`` frees the oldest); a base-model request runs
with the adapters disabled. Switching adapters changes the model's state, so generations
on one base run one at a time (its lock); requests for other bases run in parallel.

Decoding is ``transformers``' own ``generate`` on the PEFT model, so greedy output is the
same as ``PeftModel.from_pretrained(base, adapter).generate(...)`` token for token.
Streaming comes from a streamer that sees each new token: it decodes the completion so
far, ends the generation at a stop string (holding back text that may be the start of
one), and hands new text to the caller through a queue.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from inference.protocol import GenerationRequest, ModelRef, Sampling, StreamEvent

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class InferenceError(Exception):
    """A request the engine cannot serve: ``status`` and a stable ``code`` for the caller."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ModelLoading(InferenceError):
    """The base model is being loaded; ask again after ``retry_after_s``."""

    def __init__(self, model_id: str, retry_after_s: int = 2) -> None:
        super().__init__(503, "model_loading", f"Model '{model_id}' is loading; retry in a few seconds.")
        self.retry_after_s = retry_after_s


@dataclass
class LoadedBase:
    model: Any  # a transformers model, wrapped in a PeftModel once it has an adapter
    tokenizer: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    adapters: OrderedDict[str, str] = field(default_factory=OrderedDict)  # cache key -> adapter name


class Engine:
    """Base models and their adapters, on one device of this process."""

    def __init__(self, *, max_adapters: int = 8, device: str | None = None) -> None:
        import torch

        if max_adapters < 1:
            raise ValueError("max_adapters must be at least 1")
        self.max_adapters = max_adapters
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # fp32 on CPU (no fast bf16 matmuls there); bf16 on GPUs.
        self.dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self._bases: dict[str, LoadedBase] = {}
        self._loading: set[str] = set()
        self._failed: dict[str, str] = {}
        self._guard = threading.Lock()

    # -- base models ---------------------------------------------------------------------

    def base(self, ref: ModelRef) -> LoadedBase:
        """The loaded base; starts loading it (and raises :class:`ModelLoading`) if needed."""
        with self._guard:
            loaded = self._bases.get(ref.path)
            if loaded is not None:
                return loaded
            if ref.path in self._failed:
                reason = self._failed.pop(ref.path)  # the next request tries again
                raise InferenceError(503, "model_load_failed", f"Model '{ref.id}' could not be loaded: {reason}")
            if ref.path not in self._loading:
                if "://" in ref.path:
                    raise InferenceError(
                        400, "model_not_local",
                        f"Model '{ref.id}' is not in a local directory ({ref.path}); the embedded "
                        "inference worker serves local models only.",
                    )
                if not os.path.isdir(ref.path):
                    raise InferenceError(503, "model_unavailable",
                                         f"Model '{ref.id}' is not on this machine (no directory {ref.path}).")
                self._loading.add(ref.path)
                threading.Thread(target=self._load, args=(ref,), name=f"load {ref.id}", daemon=True).start()
        raise ModelLoading(ref.id)

    def _load(self, ref: ModelRef) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.perf_counter()
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref.path)
            model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=self.dtype).to(self.device).eval()
        except Exception as exc:  # reported to the next request for this model
            log.exception("loading %s from %s failed", ref.id, ref.path)
            with self._guard:
                self._loading.discard(ref.path)
                self._failed[ref.path] = f"{type(exc).__name__}: {exc}"
            return
        with self._guard:
            self._bases[ref.path] = LoadedBase(model=model, tokenizer=tokenizer)
            self._loading.discard(ref.path)
        log.info("loaded %s in %.1f s", ref.id, time.perf_counter() - started)

    def status(self) -> dict[str, Any]:
        with self._guard:
            return {"loaded": sorted(self._bases), "loading": sorted(self._loading),
                    "adapters": {path: len(b.adapters) for path, b in self._bases.items()}}

    # -- adapters ------------------------------------------------------------------------

    def _activate(self, base: LoadedBase, adapter: ModelRef | None) -> contextlib.AbstractContextManager[Any]:
        """Make ``adapter`` the active one (loading it, evicting the least recently used);
        for a base-model request, a context with the adapters disabled. Call under the lock."""
        from peft import PeftModel

        if adapter is None:
            return base.model.disable_adapter() if isinstance(base.model, PeftModel) else contextlib.nullcontext()
        weights = os.path.join(adapter.path, ADAPTER_WEIGHTS)
        try:
            # The path and the weights' mtime: a checkpoint rewritten in place is reloaded.
            key = f"{adapter.path}@{os.stat(weights).st_mtime_ns}"
        except OSError as exc:
            raise InferenceError(404, "adapter_not_found", f"Adapter of '{adapter.id}' is not readable: {exc}") from exc
        name = base.adapters.get(key)
        if name is not None:
            base.adapters.move_to_end(key)
        else:
            name = "adapter_" + hashlib.sha256(key.encode()).hexdigest()[:16]
            try:
                if isinstance(base.model, PeftModel):
                    base.model.load_adapter(adapter.path, adapter_name=name)
                else:
                    base.model = PeftModel.from_pretrained(base.model, adapter.path, adapter_name=name).eval()
            except Exception as exc:
                log.exception("loading adapter %s from %s failed", adapter.id, adapter.path)
                raise InferenceError(503, "adapter_load_failed",
                                     f"Adapter of '{adapter.id}' does not load on its base model: {exc}") from exc
            base.adapters[key] = name
        base.model.set_adapter(name)
        while len(base.adapters) > self.max_adapters:
            _old_key, old_name = base.adapters.popitem(last=False)
            base.model.delete_adapter(old_name)
        return contextlib.nullcontext()

    # -- generation ----------------------------------------------------------------------

    def prompt_ids(self, base: LoadedBase, request: GenerationRequest) -> list[int]:
        """The prompt's token ids: messages through the chat template, or the text as is."""
        tok = base.tokenizer
        if request.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise InferenceError(400, "no_chat_template",
                                     f"Model '{request.base.id}' has no chat template; use /v1/completions.")
            try:
                text = tok.apply_chat_template(
                    [dict(m) for m in request.messages], tools=[dict(t) for t in request.tools or ()] or None,
                    add_generation_prompt=True, tokenize=False,
                )
            except Exception as exc:  # a template raising on these messages (jinja's raise_exception)
                raise InferenceError(400, "invalid_messages", f"The chat template refused the messages: {exc}") from exc
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(request.prompt)["input_ids"]

    def generate(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        """Stream the request's events, the first being ``start``.

        Nothing runs until the first ``next()``, which raises :class:`InferenceError` when
        the request cannot start (model loading, adapter missing, bad messages): a server
        primes the iterator before it answers, so those become HTTP errors.
        """
        base = self.base(request.base)
        ids = self.prompt_ids(base, request)
        queued = time.perf_counter()
        with base.lock:
            active = self._activate(base, request.adapter)
            yield StreamEvent(type="start", prompt_tokens=len(ids), queued_s=time.perf_counter() - queued)
            with active:
                if request.sampling.seed is not None:
                    import torch

                    torch.manual_seed(request.sampling.seed)
                for index in range(request.sampling.n):
                    yield from self._choice(base, ids, request.sampling, index)

    def _choice(self, base: LoadedBase, ids: list[int], sampling: Sampling, index: int) -> Iterator[StreamEvent]:
        import torch

        stream = _ChoiceStream(base.tokenizer, sampling.stop, index)
        input_ids = torch.tensor([ids], device=self.device)
        kwargs: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, "do_sample": sampling.temperature > 0}
        if sampling.temperature > 0:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        pad = base.tokenizer.pad_token_id
        if pad is None:
            pad = base.model.config.eos_token_id
        failure: list[Exception] = []

        def run() -> None:
            try:
                with torch.inference_mode():
                    base.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                        streamer=stream, stopping_criteria=[stream.criterion()],
                                        pad_token_id=pad, **kwargs)
            except Exception as exc:  # handed to the consumer, which reports it to the caller
                log.exception("generation failed")
                failure.append(exc)
            finally:
                stream.close()

        thread = threading.Thread(target=run, name="generate", daemon=True)
        thread.start()
        try:
            while (event := stream.events.get()) is not None:
                yield event
        finally:
            stream.cancelled = True  # the caller left: the criterion ends generate at the next token
            thread.join()
        if failure:
            yield StreamEvent(type="error", index=index, code="generation_failed", message=str(failure[0]))
            return
        eos = _eos_ids(base)
        reason = "stop" if stream.stopped or (stream.ids and stream.ids[-1] in eos) else "length"
        yield StreamEvent(type="finish", index=index, finish_reason=reason, completion_tokens=len(stream.ids))


def _eos_ids(base: LoadedBase) -> set[int]:
    eos = base.model.generation_config.eos_token_id
    if eos is None:
        eos = base.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


class _ChoiceStream:
    """A ``generate`` streamer for one choice: new text as events, stop strings honoured.

    ``generate`` calls ``put`` with the prompt first, then with each new token.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], index: int) -> None:
        self.tokenizer, self.stop, self.index = tokenizer, stop, index
        self.events: queue.Queue[StreamEvent | None] = queue.Queue()
        self.ids: list[int] = []
        self.sent = 0  # characters of the completion text already sent
        self.stopped = False  # a stop string was generated
        self.cancelled = False
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.stopped:
            return
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._send(text[:cut])
            return
        self._send(text[: len(text) - self._held_back(text)])

    def _held_back(self, text: str) -> int:
        """How many trailing characters to keep back: an incomplete UTF-8 sequence, or the
        longest tail that could still become a stop string."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        longest = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:length]):
                    longest = length
                    break
        return longest

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.events.put(StreamEvent(type="text", index=self.index, text=text[self.sent:]))
            self.sent = len(text)

    def end(self) -> None:
        """Nothing more comes: what was held back is final (an incomplete UTF-8 sequence
        stays a replacement character, as in a plain decode of the same tokens)."""
        if not self.stopped:
            self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def close(self) -> None:
        self.events.put(None)

    def criterion(self) -> Any:
        from transformers import StoppingCriteria

        stream = self

        class _Stop(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                import torch

                done = stream.stopped or stream.cancelled
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        return _Stop()
