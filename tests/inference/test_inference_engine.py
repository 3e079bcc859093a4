"""The engine against the references: ``PeftModel.from_pretrained`` + ``generate``, one
fresh model per adapter, token for token (greedy and seeded sampling), while the engine
keeps one base loaded and switches (and evicts) adapters."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
import torch

from inference.engine import Engine, InferenceError, ModelLoading, passive_cpu_threads
from inference.protocol import GenerationRequest, ModelRef, Sampling

MESSAGES = ({"role": "user", "content": "hello there"},)


def _request(model_dir, adapter=None, *, tenant="t", messages=MESSAGES, load_wait_s=0.0,
             **sampling) -> GenerationRequest:
    return GenerationRequest(
        base=ModelRef(id="tiny", path=str(model_dir)),
        adapter=None if adapter is None else ModelRef(id=f"ft:{adapter.name}", path=str(adapter)),
        messages=messages, sampling=Sampling(**{"max_tokens": 12, "temperature": 0.0, **sampling}),
        tenant=tenant, load_wait_s=load_wait_s,
    )


def _loaded(engine: Engine, model_dir) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            engine.base(ModelRef(id="tiny", path=str(model_dir)))
            return
        except ModelLoading:
            assert time.monotonic() < deadline, "the base model never finished loading"
            time.sleep(0.1)


def _texts(events) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        if e.type == "text":
            out[e.index] = out.get(e.index, "") + e.text
    return out


def _reference(model_dir, adapter, *, seed=None, **generate):
    """What plain transformers + peft produce for the same prompt: (text, number of tokens)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(list(MESSAGES), add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **generate)[0, ids.shape[1]:]
    return tok.decode(out, skip_special_tokens=True), len(out)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(max_adapters=1, device="cpu")
    with pytest.raises(ModelLoading) as loading:  # the first request starts the load and is told to wait
        engine.base(ModelRef(id="tiny", path=str(tiny_model_dir)))
    assert loading.value.status == 503 and loading.value.code == "model_loading"
    _loaded(engine, tiny_model_dir)
    return engine


def test_greedy_equals_peft_across_adapter_switches_and_eviction(engine, tiny_model_dir, make_adapter):
    first, second = make_adapter(1), make_adapter(2)
    references = {a: _reference(tiny_model_dir, a, do_sample=False, max_new_tokens=12) for a in (None, first, second)}
    assert len({text for text, _ in references.values()}) == 3  # each adapter changes the output
    for adapter in (first, second, first, None, second):  # max_adapters=1: every switch evicts
        events = list(engine.generate(_request(tiny_model_dir, adapter, n=2)))
        text, count = references[adapter]
        assert _texts(events) == {0: text, 1: text}
        finishes = [e for e in events if e.type == "finish"]
        assert [(e.index, e.completion_tokens, e.finish_reason) for e in finishes] == [(0, count, "length"),
                                                                                       (1, count, "length")]
        assert events[0].type == "start" and events[0].prompt_tokens > 0
    assert engine.status()["adapters"] == {str(tiny_model_dir): 1}


def test_seeded_sampling_equals_transformers_with_the_same_seed(engine, tiny_model_dir, make_adapter):
    adapter = make_adapter(1)
    text, _ = _reference(tiny_model_dir, adapter, seed=7, do_sample=True, temperature=0.9, top_p=0.8, top_k=0,
                         max_new_tokens=12)
    ours = _texts(engine.generate(_request(tiny_model_dir, adapter, temperature=0.9, top_p=0.8, seed=7)))
    assert ours == {0: text}


def test_a_stop_string_ends_the_text_before_it(engine, tiny_model_dir, make_adapter):
    adapter = make_adapter(2)
    full, _ = _reference(tiny_model_dir, adapter, do_sample=False, max_new_tokens=12)
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].isprintable())
    events = list(engine.generate(_request(tiny_model_dir, adapter, stop=("\x00never", stop))))
    assert _texts(events) == {0: full[:full.find(stop)]}
    assert events[-1].finish_reason == "stop"


def test_requests_that_cannot_start_say_why(engine, tiny_model_dir, tmp_path):
    with pytest.raises(InferenceError) as missing:
        next(engine.generate(_request(tiny_model_dir, tmp_path)))  # no adapter files there
    assert (missing.value.status, missing.value.code) == (404, "adapter_not_found")
    remote = GenerationRequest(base=ModelRef(id="big", path="s3://models/big"), prompt="hi",
                               sampling=Sampling(max_tokens=2))
    with pytest.raises(InferenceError) as not_local:
        next(engine.generate(remote))
    assert (not_local.value.status, not_local.value.code) == (400, "model_not_local")


def test_closing_a_stream_stops_its_generation_and_frees_the_model(engine, tiny_model_dir, make_adapter):
    # The base model's greedy answer starts with an ASCII character: a text event comes at once.
    events = engine.generate(_request(tiny_model_dir, None, max_tokens=400))
    assert next(events).type == "start"
    assert next(events).type == "text"
    started = time.monotonic()
    events.close()  # what a caller that went away does: generate ends at the next token
    assert time.monotonic() - started < 10
    assert not any(t.name == "generate" for t in threading.enumerate())
    after = list(engine.generate(_request(tiny_model_dir, make_adapter(1))))  # the base's lock was released
    assert after[-1].type == "finish"


def test_tools_are_rendered_into_the_prompt_by_the_chat_template(engine, tiny_model_dir):
    from transformers import AutoTokenizer

    tools = ({"type": "function", "function": {"name": "get_capital", "description": "Capital of a country",
                                               "parameters": {"type": "object", "properties": {
                                                   "country": {"type": "string"}}}}},)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    expected = tok(tok.apply_chat_template(list(MESSAGES), tools=list(tools), add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
    base = engine.base(ModelRef(id="tiny", path=str(tiny_model_dir)))
    request = GenerationRequest(base=ModelRef(id="tiny", path=str(tiny_model_dir)), messages=MESSAGES, tools=tools,
                                sampling=Sampling(max_tokens=1))
    with_tools = engine.prompt_ids(base, request)
    assert with_tools == expected and "get_capital" in tok.decode(with_tools)
    assert len(with_tools) > len(engine.prompt_ids(base, _request(tiny_model_dir)))


def _forward_threads(engine: Engine, model_dir) -> tuple[list[int], threading.Event, Any]:
    """The thread of every forward pass on the base model, in order; the event is set at the
    20th. Returns (threads, event, hook handle to remove)."""
    base = engine.base(ModelRef(id="tiny", path=str(model_dir)))
    model = base.model.get_base_model() if hasattr(base.model, "get_base_model") else base.model
    threads: list[int] = []
    busy = threading.Event()

    def record(_module: Any, _args: Any) -> None:
        threads.append(threading.get_ident())
        if len(threads) >= 20:
            busy.set()

    return threads, busy, model.register_forward_pre_hook(record)


def _run(engine: Engine, request: GenerationRequest) -> tuple[int, list[Any]]:
    """Run ``request`` to its end: (the ident of its thread, its events)."""
    import queue

    items: queue.SimpleQueue = queue.SimpleQueue()
    generation = engine.start(request, items.put)
    events = []
    while (item := items.get()) is not None:
        events.append(item)
    generation.thread.join()
    return generation.thread.ident, events


def test_another_tenants_short_request_waits_one_turn_not_for_a_long_one(engine, tiny_model_dir):
    # Four long requests of one tenant (a 300-token prompt, 16 choices of up to 150 tokens:
    # minutes of work here) hold the model in turns; another tenant's 2-token request gets
    # the model after the turn in progress, not after them.
    threads, busy, hook = _forward_threads(engine, tiny_model_dir)
    long_prompt = ({"role": "user", "content": "x" * 300},)
    hogs = [engine.start(_request(tiny_model_dir, tenant="hog", messages=long_prompt, max_tokens=150, n=16,
                                  temperature=1.0), lambda _item: None) for _ in range(4)]
    try:
        assert busy.wait(60), "the long requests never started"
        asked = len(threads)
        ident, events = _run(engine, _request(tiny_model_dir, tenant="short", max_tokens=2))
    finally:
        for hog in hogs:
            hog.cancel()
        for hog in hogs:
            hog.thread.join(30)
        hook.remove()
    assert events[-1].type == "finish" and events[-1].completion_tokens == 2
    last = max(i for i, t in enumerate(threads) if t == ident)
    others = sum(1 for t in threads[asked:last] if t != ident)
    # The rest of the turn in progress, and one more while the short request's prompt
    # (over a turn's budget on its own) has been computed: at most two turns of tokens.
    assert others <= 2 * engine.turn_tokens, others
    assert not any(h.thread.is_alive() for h in hogs)
    assert engine.status()["generations"] == 0


def test_seeded_sampling_is_reproducible_while_another_tenant_takes_turns(engine, tiny_model_dir, make_adapter):
    adapter = make_adapter(1)
    text, _ = _reference(tiny_model_dir, adapter, seed=7, do_sample=True, temperature=0.9, top_p=0.8, top_k=0,
                         max_new_tokens=60)
    threads, busy, hook = _forward_threads(engine, tiny_model_dir)
    other = engine.start(_request(tiny_model_dir, tenant="other", temperature=1.0, max_tokens=400, n=4),
                         lambda _item: None)
    try:
        assert busy.wait(60)
        ident, events = _run(engine, _request(tiny_model_dir, adapter, tenant="seeded", temperature=0.9,
                                              top_p=0.8, seed=7, max_tokens=60))
    finally:
        other.cancel()
        other.thread.join(30)
        hook.remove()
    ours = [i for i, t in enumerate(threads) if t == ident]
    assert any(t != ident for t in threads[ours[0]:ours[-1]]), "the two never took turns"
    assert _texts(events) == {0: text}  # its adapter and its random state came back each turn


def test_prompt_and_max_tokens_must_fit_the_models_context(engine, tiny_model_dir):
    base = engine.base(ModelRef(id="tiny", path=str(tiny_model_dir)))
    assert base.context == 512  # the tiny model's max_position_embeddings
    prompt_tokens = len(engine.prompt_ids(base, _request(tiny_model_dir)))
    with pytest.raises(InferenceError) as chat:
        next(engine.generate(_request(tiny_model_dir, max_tokens=512 - prompt_tokens + 1)))
    assert (chat.value.status, chat.value.code, chat.value.param) == (400, "context_length_exceeded", "messages")
    assert chat.value.message.startswith(
        f"This model's maximum context length is 512 tokens. However, you requested 513 tokens "
        f"({prompt_tokens} in the messages, {512 - prompt_tokens + 1} in the completion).")
    text = GenerationRequest(base=ModelRef(id="tiny", path=str(tiny_model_dir)), prompt="y" * 600,
                             sampling=Sampling(max_tokens=1, fit_context=True))
    with pytest.raises(InferenceError) as prompt:
        next(engine.generate(text))
    assert (prompt.value.code, prompt.value.param) == ("context_length_exceeded", "prompt")
    # A default max_tokens (not the caller's) is shortened to the room the prompt leaves.
    events = engine.generate(_request(tiny_model_dir, max_tokens=512, fit_context=True))
    assert next(events).type == "start"
    events.close()


def test_a_request_waits_while_its_model_loads_and_an_idle_engine_preloads(tiny_model_dir, tmp_path):
    fresh = Engine(device="cpu")
    ref = ModelRef(id="tiny", path=str(tiny_model_dir))
    with pytest.raises(ModelLoading):  # not willing to wait: refused at once, as before
        next(fresh.generate(_request(tiny_model_dir, max_tokens=2)))
    events = list(fresh.generate(_request(tiny_model_dir, max_tokens=2, load_wait_s=60)))
    assert [events[0].type, events[-1].type] == ["start", "finish"]  # held until loaded, then answered

    idle = Engine(device="cpu")
    assert idle.preload(ref) == "loading"
    assert idle.preload(ref) == "loading"  # once
    next_one = list(idle.generate(_request(tiny_model_dir, max_tokens=2, load_wait_s=60)))
    assert next_one[-1].type == "finish" and idle.preload(ref) == "loaded"
    holding = idle.generate(_request(tiny_model_dir, max_tokens=400))
    assert next(holding).type == "start"
    assert idle.preload(ModelRef(id="other", path=str(tmp_path))) == "busy"  # a generation runs: not now
    holding.close()
    assert idle.preload(ModelRef(id="remote", path="s3://models/x")) == "unavailable"


def test_a_turn_holder_without_tokens_shows_as_stalled() -> None:
    from inference.turns import FairTurns, Seat

    now = [100.0]
    turns = FairTurns(4, threading.Condition(), clock=lambda: now[0])
    assert turns.stalled_s() == 0.0
    seat = Seat("a")
    turns.acquire(seat, lambda: False)
    now[0] += 42
    assert turns.stalled_s() == 42
    assert turns.spend(seat, 1) is False  # nobody waits: keep the turn
    assert turns.stalled_s() == 0
    turns.release(seat)
    now[0] += 1000
    assert turns.stalled_s() == 0.0


def test_cpu_threads_wait_passively_when_set_before_torch_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenMP reads its wait policy once, when torch loads: the worker sets it before that,
    never over a policy the operator chose."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert passive_cpu_threads() is False  # torch is loaded in this process: too late
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delitem(sys.modules, "torch")
    assert passive_cpu_threads() is True
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert passive_cpu_threads() is False
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert passive_cpu_threads() is False
    assert "OMP_WAIT_POLICY" not in os.environ
