"""Generation for many LoRA adapters on few base models: each base loaded once, adapters
switched per turn, turns shared fairly between tenants.

A base model is loaded on first use, in a background thread. A request for a base that
is still loading waits for it up to its ``load_wait_s`` (the API's
``TUNEFLEET_INFERENCE_LOAD_WAIT_S``), then is answered :class:`ModelLoading` (the API's
503 ``model_loading``); :meth:`Engine.preload` starts a load ahead of the first request.
Once loaded a base stays loaded. Its adapters are PEFT adapters on one ``PeftModel``
(``load_adapter`` / ``set_adapter``), at most ``max_adapters`` per base in
least-recently-used order (``delete_adapter`` frees the oldest one no running generation
uses); a base-model request runs with the adapters disabled.

Each request is a :class:`Generation` on a thread of its own. Switching adapters changes
the model's state, so on one base one generation computes at a time: it holds the model
for a *turn* (``inference.turns``: round robin over tenants, a token budget per turn),
then hands it on and waits for its next turn with its KV cache kept, so no tenant's long
request stalls another's short one. A request is bounded by the model: prompt tokens +
``max_tokens`` must fit ``max_position_embeddings`` (else 400
``context_length_exceeded``, OpenAI's answer).

Decoding is ``transformers``' own ``generate`` on the PEFT model, so greedy output is the
same as ``PeftModel.from_pretrained(base, adapter).generate(...)`` token for token, and a
seeded sampling the same as ``torch.manual_seed(seed)`` + ``generate`` (the generation's
random state is set aside while others take their turns). One stopping criterion sees
every new token: it decodes the completion so far, ends the generation at a stop string
(holding back text that may be the start of one), hands new text to the caller, and
passes the turn on. :meth:`Generation.cancel` (the caller went away) ends the generation
at its next token, or at once while it waits for a turn or a load.

CPU threads wait passively (:func:`passive_cpu_threads`, applied by the worker before it
loads torch). Decoding one token is hundreds of tiny parallel kernels (one attention
call per layer on a single query row), and torch's OpenMP threads by default spin after
each one; on a machine whose cores are shared (the API, the Celery worker, a training
job) the spinning threads and the waits for a descheduled one made a 16-token answer of
SmolLM2-135M take 7-10 s instead of under 2 s (``bench/inference_real_model.py``).
Waiting threads that sleep cost nothing there, and the arithmetic is the same: the same
threads split the same work, so the tokens do not change.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from inference.protocol import GenerationRequest, ModelRef, StreamEvent
from inference.turns import FairTurns, Seat, TurnCancelled

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_TURN_TOKENS = 16

# What a generation hands its caller: events, an InferenceError before it started, None at the end.
Sink = Callable[["StreamEvent | InferenceError | None"], None]


def passive_cpu_threads() -> bool:
    """Make torch's OpenMP threads sleep, not spin, between parallel regions
    (``OMP_WAIT_POLICY=PASSIVE``; see the module doc). OpenMP reads it once, when torch is
    first imported: returns False (and changes nothing) once torch is loaded, or when
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` already say how to wait."""
    if "torch" in sys.modules:
        return False
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


class InferenceError(Exception):
    """A request the engine cannot serve: ``status``, a stable ``code`` and the request
    field at fault (``param``) for the caller."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


class ModelLoading(InferenceError):
    """The base model is being loaded; ask again after ``retry_after_s``."""

    def __init__(self, model_id: str, retry_after_s: int = 2) -> None:
        super().__init__(503, "model_loading", f"Model '{model_id}' is loading; retry in a few seconds.")
        self.retry_after_s = retry_after_s


class _Cancelled(Exception):
    """The caller cancelled the generation before it produced anything."""


@dataclass
class LoadedBase:
    model: Any  # a transformers model, wrapped in a PeftModel once it has an adapter
    tokenizer: Any
    turns: FairTurns
    context: int | None  # max_position_embeddings: prompt + completion tokens
    adapters: OrderedDict[str, str] = field(default_factory=OrderedDict)  # cache key -> adapter name
    pins: Counter[str] = field(default_factory=Counter)  # adapter name -> generations using it


class Engine:
    """Base models and their adapters, on one device of this process."""

    def __init__(self, *, max_adapters: int = 8, device: str | None = None,
                 turn_tokens: int = DEFAULT_TURN_TOKENS) -> None:
        import torch

        if max_adapters < 1:
            raise ValueError("max_adapters must be at least 1")
        self.max_adapters = max_adapters
        self.turn_tokens = turn_tokens
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # fp32 on CPU (no fast bf16 matmuls there); bf16 on GPUs.
        self.dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self._bases: dict[str, LoadedBase] = {}
        self._loading: set[str] = set()
        self._failed: dict[str, str] = {}
        self._generations: set[Generation] = set()
        # Guards the state above; loads and turns are waited for on it, cancels wake it.
        self._changed = threading.Condition()

    # -- base models ---------------------------------------------------------------------

    def base(self, ref: ModelRef) -> LoadedBase:
        """The loaded base; starts loading it (and raises :class:`ModelLoading`) if needed."""
        with self._changed:
            return self._base(ref, report_failure_once=True)

    def wait_for_base(self, ref: ModelRef, timeout_s: float, cancelled: Callable[[], bool]) -> LoadedBase:
        """The loaded base, waiting up to ``timeout_s`` while it loads (:class:`ModelLoading` past that)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            waited = False
            while True:
                try:
                    return self._base(ref, report_failure_once=not waited)
                except ModelLoading:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    if cancelled():
                        raise _Cancelled from None
                    waited = True
                    self._changed.wait(left)

    def _base(self, ref: ModelRef, *, report_failure_once: bool) -> LoadedBase:
        loaded = self._bases.get(ref.path)
        if loaded is not None:
            return loaded
        if ref.path in self._failed:
            # A fresh request takes the failure (the next one tries again); one that waited
            # for this very load only reads it.
            reason = self._failed.pop(ref.path) if report_failure_once else self._failed[ref.path]
            raise InferenceError(503, "model_load_failed", f"Model '{ref.id}' could not be loaded: {reason}")
        if ref.path not in self._loading:
            self._start_load(ref)
        raise ModelLoading(ref.id)

    def _start_load(self, ref: ModelRef) -> None:
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

    def preload(self, ref: ModelRef) -> str:
        """Start loading ``ref`` if this engine is idle: ``loaded``, ``loading`` (now or
        already), ``busy`` (generations or another load run: not now) or ``unavailable``."""
        with self._changed:
            if ref.path in self._bases:
                return "loaded"
            if ref.path in self._loading:
                return "loading"
            if self._generations or self._loading:
                return "busy"
            try:
                self._start_load(ref)
            except InferenceError as exc:
                log.info("not preloading %s: %s", ref.id, exc.message)
                return "unavailable"
            return "loading"

    def _load(self, ref: ModelRef) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.perf_counter()
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref.path)
            model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=self.dtype).to(self.device).eval()
        except Exception as exc:  # reported to the requests for this model
            log.exception("loading %s from %s failed", ref.id, ref.path)
            with self._changed:
                self._loading.discard(ref.path)
                self._failed[ref.path] = f"{type(exc).__name__}: {exc}"
                self._changed.notify_all()
            return
        context = getattr(model.config, "max_position_embeddings", None)
        with self._changed:
            self._bases[ref.path] = LoadedBase(model=model, tokenizer=tokenizer,
                                               turns=FairTurns(self.turn_tokens, self._changed),
                                               context=context if isinstance(context, int) else None)
            self._loading.discard(ref.path)
            self._changed.notify_all()
        log.info("loaded %s in %.1f s", ref.id, time.perf_counter() - started)

    def status(self) -> dict[str, Any]:
        with self._changed:
            return {"loaded": sorted(self._bases), "loading": sorted(self._loading),
                    "adapters": {path: len(b.adapters) for path, b in self._bases.items()},
                    "generations": len(self._generations)}

    def stalled_s(self) -> float:
        """The longest time a base's turn holder has gone without a token (0 when all idle)."""
        with self._changed:
            return max((b.turns.stalled_s() for b in self._bases.values()), default=0.0)

    # -- generations ---------------------------------------------------------------------

    def start(self, request: GenerationRequest, sink: Sink) -> Generation:
        """Start ``request`` on a thread of its own; its events go to ``sink`` (see :class:`Generation`)."""
        generation = Generation(self, request, sink)
        with self._changed:
            self._generations.add(generation)
        generation.thread.start()
        return generation

    def generate(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        """``request``'s events, the first being ``start``; a request that cannot start
        raises its :class:`InferenceError` on the first ``next``. Closing the iterator
        cancels the generation and waits for its thread to end."""
        events: queue.SimpleQueue[StreamEvent | InferenceError | None] = queue.SimpleQueue()
        generation = self.start(request, events.put)
        try:
            while (item := events.get()) is not None:
                if isinstance(item, InferenceError):
                    raise item
                yield item
        finally:
            generation.cancel()
            generation.thread.join()

    def cancel_all(self, reason: InferenceError | None = None) -> None:
        """Cancel every generation (the worker is shutting down), telling their callers ``reason``."""
        with self._changed:
            running = list(self._generations)
        for generation in running:
            generation.cancel(reason)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _forget(self, generation: Generation) -> None:
        with self._changed:
            self._generations.discard(generation)

    # -- adapters ------------------------------------------------------------------------

    def _use_adapter(self, base: LoadedBase, adapter: ModelRef) -> str:
        """Load ``adapter`` if needed and pin it (unpin with ``base.pins``); evicts the least
        recently used adapters no generation uses. Call while holding a turn."""
        from peft import PeftModel

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
        base.pins[name] += 1
        for old_key, old_name in list(base.adapters.items()):
            if len(base.adapters) <= self.max_adapters:
                break
            if base.pins[old_name] == 0:
                del base.adapters[old_key]
                base.model.delete_adapter(old_name)
        return name

    @staticmethod
    def _activate(base: LoadedBase, name: str | None) -> contextlib.AbstractContextManager[Any]:
        """Make adapter ``name`` the active one, or (None) disable the adapters, for one turn."""
        from peft import PeftModel

        if name is None:
            return base.model.disable_adapter() if isinstance(base.model, PeftModel) else contextlib.nullcontext()
        base.model.set_adapter(name)
        return contextlib.nullcontext()

    # -- prompts -------------------------------------------------------------------------

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


def completion_budget(context: int | None, request: GenerationRequest, prompt_tokens: int) -> int:
    """The completion tokens ``request`` may have: its ``max_tokens`` when prompt + that fits
    ``context``; a default ``max_tokens`` (``fit_context``) shortened to the room left.
    Else 400 ``context_length_exceeded`` with OpenAI's message."""
    wanted = request.sampling.max_tokens
    if context is None:
        return wanted
    room = context - prompt_tokens
    if request.sampling.fit_context and room >= 1:
        return min(wanted, room)
    if prompt_tokens + wanted <= context:
        return wanted
    asked = 1 if request.sampling.fit_context else wanted
    where, param = ("the messages", "messages") if request.messages is not None else ("the prompt", "prompt")
    raise InferenceError(
        400, "context_length_exceeded",
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt_tokens + asked} tokens ({prompt_tokens} in {where}, {asked} in the completion). "
        f"Please reduce the length of {where} or completion.", param=param,
    )


class Generation:
    """One request on its own thread: waits for its base (up to ``load_wait_s``), then for
    a turn, then streams each choice's events to ``sink``: ``start`` first, ``text`` and
    ``finish`` per choice, or ``error``; an :class:`InferenceError` instead of ``start``
    when it cannot start; ``None`` last, always."""

    def __init__(self, engine: Engine, request: GenerationRequest, sink: Sink) -> None:
        self.engine, self.request, self._sink = engine, request, sink
        self.thread = threading.Thread(target=self._run, name="generate", daemon=True)
        self._cancelled = threading.Event()
        self._reason: InferenceError | None = None
        self._started = False
        self._base: LoadedBase | None = None
        self._seat = Seat(request.tenant)
        self._adapter: str | None = None
        self._turn: contextlib.ExitStack | None = None
        self._rng: tuple[Any, Any] | None = None

    def cancel(self, reason: InferenceError | None = None) -> None:
        """End the generation at its next token (at once while it waits). With a
        ``reason``, a caller still listening gets it as an ``error`` event."""
        if reason is not None and not self._cancelled.is_set():
            self._reason = reason
        self._cancelled.set()
        self.engine._wake()

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _run(self) -> None:
        try:
            self._serve()
            if self.cancelled() and self._reason is not None:
                self._fail(self._reason)
        except (_Cancelled, TurnCancelled):
            if self._reason is not None:
                self._fail(self._reason)
        except InferenceError as exc:
            self._fail(exc)
        except Exception as exc:
            log.exception("generation failed")
            self._fail(InferenceError(500, "generation_failed", str(exc)))
        finally:
            self._sink(None)
            self.engine._forget(self)

    def _fail(self, exc: InferenceError) -> None:
        if self._started:
            self._sink(StreamEvent(type="error", code=exc.code, message=exc.message))
        else:
            self._sink(exc)

    def _serve(self) -> None:
        request = self.request
        base = self._base = self.engine.wait_for_base(request.base, request.load_wait_s, self.cancelled)
        ids = self.engine.prompt_ids(base, request)
        max_tokens = completion_budget(base.context, request, len(ids))
        queued = time.perf_counter()
        base.turns.acquire(self._seat, self.cancelled)
        try:
            if request.adapter is not None:
                self._adapter = self.engine._use_adapter(base, request.adapter)
            self._begin_turn(first=True)
            self._started = True
            self._sink(StreamEvent(type="start", prompt_tokens=len(ids), queued_s=time.perf_counter() - queued))
            for index in range(request.sampling.n):
                if self.cancelled():
                    return
                self._choice(base, ids, max_tokens, index)
        finally:
            self._end_turn()
            if self._adapter is not None:
                base.pins[self._adapter] -= 1
            base.turns.release(self._seat)

    # -- turns ---------------------------------------------------------------------------

    def _begin_turn(self, *, first: bool = False) -> None:
        import torch

        assert self._base is not None
        self._turn = contextlib.ExitStack()
        self._turn.enter_context(self.engine._activate(self._base, self._adapter))
        seed = self.request.sampling.seed
        if seed is None:
            return
        if first:
            torch.manual_seed(seed)
        elif self._rng is not None:
            cpu, device = self._rng
            torch.set_rng_state(cpu)
            if device is not None:
                torch.cuda.set_rng_state(device, self.engine.device)

    def _end_turn(self) -> None:
        import torch

        if self._turn is None:
            return
        if self.request.sampling.seed is not None:  # set aside while other generations sample
            device = torch.cuda.get_rng_state(self.engine.device) if self.engine.device.startswith("cuda") else None
            self._rng = (torch.get_rng_state(), device)
        self._turn.close()
        self._turn = None

    def after_tokens(self, tokens: int) -> None:
        """Count ``tokens`` of work; past the turn's budget, hand the model on and wait for
        the next turn (:class:`TurnCancelled` if cancelled meanwhile)."""
        assert self._base is not None
        if self._base.turns.spend(self._seat, tokens):
            self._end_turn()
            self._base.turns.pass_on(self._seat, self.cancelled)
            self._begin_turn()

    # -- one choice ----------------------------------------------------------------------

    def _choice(self, base: LoadedBase, ids: list[int], max_tokens: int, index: int) -> None:
        import torch

        sampling = self.request.sampling
        stream = _ChoiceStream(base.tokenizer, sampling.stop, index, self._sink)
        input_ids = torch.tensor([ids], device=self.engine.device)
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": sampling.temperature > 0}
        if sampling.temperature > 0:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        pad = base.tokenizer.pad_token_id
        if pad is None:
            pad = base.model.config.eos_token_id
        eos = _eos_ids(base)
        try:
            with torch.inference_mode():
                base.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    stopping_criteria=[_step_criterion(self, stream, prompt_tokens=len(ids),
                                                                       max_tokens=max_tokens, eos=eos)],
                                    pad_token_id=pad, **kwargs)
        except TurnCancelled:
            raise
        except Exception as exc:  # reported to the caller as an error event
            log.exception("generation failed")
            self._sink(StreamEvent(type="error", index=index, code="generation_failed", message=str(exc)))
            return
        if self.cancelled():
            return
        stream.end()
        reason = "stop" if stream.stopped or (stream.ids and stream.ids[-1] in eos) else "length"
        self._sink(StreamEvent(type="finish", index=index, finish_reason=reason, completion_tokens=len(stream.ids)))


def _eos_ids(base: LoadedBase) -> set[int]:
    eos = base.model.generation_config.eos_token_id
    if eos is None:
        eos = base.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _step_criterion(generation: Generation, stream: _ChoiceStream, *, prompt_tokens: int, max_tokens: int,
                    eos: set[int]) -> Any:
    """The hook ``generate`` calls after every new token (before the next forward pass):
    stream the token, honour stop strings and cancellation, take turns. The first call
    also counts the prompt's prefill against the turn."""
    from transformers import StoppingCriteria

    class _Step(StoppingCriteria):
        def __init__(self) -> None:
            self.prefill = prompt_tokens

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            import torch

            token = int(input_ids[0, -1])
            stream.add(token)
            last = len(stream.ids) >= max_tokens or token in eos  # generate ends here by itself
            if not (last or stream.stopped or generation.cancelled()):
                generation.after_tokens(1 + self.prefill)
                self.prefill = 0
            done = stream.stopped or generation.cancelled()
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return _Step()


class _ChoiceStream:
    """One choice's completion: new text as events, stop strings honoured."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], index: int, sink: Sink) -> None:
        self.tokenizer, self.stop, self.index, self._sink = tokenizer, stop, index, sink
        self.ids: list[int] = []
        self.sent = 0  # characters of the completion text already sent
        self.stopped = False  # a stop string was generated

    def add(self, token: int) -> None:
        if self.stopped:
            return
        self.ids.append(token)
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
            self._sink(StreamEvent(type="text", index=self.index, text=text[self.sent:]))
            self.sent = len(text)

    def end(self) -> None:
        """Nothing more comes: what was held back is final (an incomplete UTF-8 sequence
        stays a replacement character, as in a plain decode of the same tokens)."""
        if not self.stopped:
            self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True))
