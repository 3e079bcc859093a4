"""The embedded inference engine on the real SmolLM2-135M-Instruct vs plain transformers (+ peft).

For the same chat prompts and greedy decoding of ``--tokens`` new tokens, each request is
timed in four ways, interleaved round by round (the machine may be shared: pairs are run
back to back and medians reported):

- ``hf``: ``AutoModelForCausalLM.generate`` on the base model;
- ``engine``: ``inference.engine.Engine.generate`` in this process, base model;
- ``hf+peft``: ``PeftModel.from_pretrained(base, adapter).generate`` with a LoRA adapter
  (r=8 on the attention and MLP projections, random nonzero A and B, saved to a temporary
  directory);
- ``engine+lora``: the engine with the same adapter.

With ``--http`` the real inference worker process (``python -m inference``) is timed as
well over its loopback HTTP channel (``inference.client``, what the API does per request),
base and adapter; with ``--baseline TREE`` the worker of another source tree as well (an
older commit, for a before/after in one run). With ``--service`` an embedded ``tunefleet serve`` (SQLite, the model in
its registry through ``TUNEFLEET_BASE_MODELS_FILE``) answers ``POST /v1/chat/completions``
for the base model, as a user's client sees it.

Per request: latency (prompt to last token), time to first token (TTFT) and tokens/s;
the ratio engine / transformers of the median latencies. Every engine answer is checked
to be the same text as transformers' greedy output for that prompt.

    PYTHONPATH=$PWD .venv/bin/python bench/inference_real_model.py --rounds 3 --tokens 16 --http --service
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from inference_bench import _FirstToken, start_worker, worker_ready  # shared with the tiny-model bench

from inference.engine import Engine, ModelLoading
from inference.protocol import GenerationRequest, ModelRef, Sampling

DEFAULT_MODEL = Path.home() / ".cache" / "tunefleet" / "models" / "smollm2-135m-instruct"
PROMPTS = (
    "What is the capital of France?",
    "Name three rivers of South America and say why they matter.",
    "Write a haiku about the sea.",
)


def make_adapter(model_dir: Path, out: Path, seed: int = 1) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"]))
    # init_lora_weights=False draws B as well as A at random; scaled down so the adapted
    # model still writes text (a full-size random B turns every answer into noise).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    model.save_pretrained(str(out))
    return out


def hf_run(model: Any, tok: Any, prompt: str, tokens: int) -> tuple[float, float, int, str]:
    """(latency s, TTFT s, new tokens, text) of one greedy generate."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    started = time.perf_counter()
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    streamer = _FirstToken()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, streamer=streamer, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:]
    answer = tok.decode(new, skip_special_tokens=True)
    ended = time.perf_counter()
    return ended - started, streamer.first_at - started, len(new), answer


def _request(model_dir: Path, adapter: Path | None, prompt: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(base=ModelRef(id="smollm2", path=str(model_dir)),
                             adapter=ModelRef(id="lora", path=str(adapter)) if adapter else None,
                             messages=({"role": "user", "content": prompt},),
                             sampling=Sampling(max_tokens=tokens, temperature=0.0))


def _timed(events: Any, started: float) -> tuple[float, float, int, str]:
    first, n, parts = 0.0, 0, []
    for event in events:
        if event.type == "text":
            first = first or time.perf_counter()
            parts.append(event.text)
        elif event.type == "finish":
            n = event.completion_tokens or 0
        elif event.type == "error":
            raise RuntimeError(f"{event.code}: {event.message}")
    return time.perf_counter() - started, first - started, n, "".join(parts)


def engine_run(engine: Engine, request: GenerationRequest) -> tuple[float, float, int, str]:
    started = time.perf_counter()
    return _timed(engine.generate(request), started)


def http_run(client: Any, request: GenerationRequest) -> tuple[float, float, int, str]:
    async def collect() -> list[Any]:
        return [e async for e in client.generate(request)]

    started = time.perf_counter()
    events = asyncio.run(collect())  # the event times are not kept: TTFT is not reported for http
    latency = time.perf_counter() - started
    n = next(e.completion_tokens for e in events if e.type == "finish")
    return latency, float("nan"), n, "".join(e.text for e in events if e.type == "text")


def service_run(http: Any, model_id: str, prompt: str, tokens: int) -> tuple[float, float, int, str]:
    started = time.perf_counter()
    response = http.post("/chat/completions", json={"model": model_id, "max_tokens": tokens, "temperature": 0,
                                                     "messages": [{"role": "user", "content": prompt}]})
    latency = time.perf_counter() - started
    response.raise_for_status()
    body = response.json()
    return latency, float("nan"), body["usage"]["completion_tokens"], body["choices"][0]["message"]["content"]


@contextlib.contextmanager
def embedded(model_dir: Path, work: Path) -> Iterator[Any]:
    """An embedded service whose registry holds ``model_dir``; yields its client once the
    model answers."""
    sys.path.insert(0, str(REPO / "bench"))
    from service_harness import embedded_service

    registry = work / "models.yaml"
    registry.write_text(f"models:\n  - id: bench-real\n    path: {model_dir}\n    params_b: 0.135\n")
    env = {"TUNEFLEET_BASE_MODELS_FILE": str(registry), "TUNEFLEET_MODEL_ROOTS": str(model_dir.parent)}
    with embedded_service(env) as service:
        service.http.timeout = 300
        service_run(service.http, "bench-real", PROMPTS[0], 2)
        yield service.http


def wait_loaded(engine: Engine, model_dir: Path) -> None:
    while True:
        try:
            engine.base(ModelRef(id="smollm2", path=str(model_dir)))
            return
        except ModelLoading:
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5, help="Rounds over all prompts, each way interleaved.")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--http", action="store_true", help="Time the inference worker process over HTTP too.")
    parser.add_argument("--service", action="store_true", help="Time an embedded service's chat completions too.")
    parser.add_argument("--busy", type=int, default=0,
                        help="Busy-loop processes run meanwhile: a machine whose cores other work shares.")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="Another source tree (e.g. `git archive` of an older commit): its worker is timed "
                             "over HTTP too, as `baseline`.")
    args = parser.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(args.model, Path(tmp) / "adapter")
        tok = AutoTokenizer.from_pretrained(str(args.model))
        hf = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
        hf_peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32), str(adapter)).eval()
        engine = Engine(max_adapters=2, device="cpu")
        wait_loaded(engine, args.model)
        ways: dict[str, Any] = {
            "hf": lambda p: hf_run(hf, tok, p, args.tokens),
            "engine": lambda p: engine_run(engine, _request(args.model, None, p, args.tokens)),
            "hf+peft": lambda p: hf_run(hf_peft, tok, p, args.tokens),
            "engine+lora": lambda p: engine_run(engine, _request(args.model, adapter, p, args.tokens)),
        }
        procs = []
        trees = ([("http", REPO)] if args.http else []) + ([("baseline", args.baseline)] if args.baseline else [])
        for label, tree in trees:
            proc, client = start_worker(tree=tree, quiet=True)
            procs.append(proc)
            worker_ready(client, _request(args.model, None, PROMPTS[0], 2), run=http_run)
            ways[label] = lambda p, c=client: http_run(c, _request(args.model, None, p, args.tokens))
            ways[f"{label}+lora"] = lambda p, c=client: http_run(c, _request(args.model, adapter, p, args.tokens))
        stack = contextlib.ExitStack()
        for _ in range(args.busy):
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            stack.callback(burner.wait)
            stack.callback(burner.kill)
        if args.service:
            http = stack.enter_context(embedded(args.model, Path(tmp)))
            ways["service"] = lambda p: service_run(http, "bench-real", p, args.tokens)
        try:
            for way in ways.values():  # warm-up: first calls, adapter loads
                way(PROMPTS[0])
            results: dict[str, list[tuple[float, float, int, str]]] = {k: [] for k in ways}
            expected: dict[tuple[bool, str], str] = {}
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    for name, way in ways.items():
                        row = way(prompt)
                        results[name].append(row)
                        key = ("lora" in name or "peft" in name, prompt)
                        if expected.setdefault(key, row[3]) != row[3]:
                            raise SystemExit(f"{name} answered {row[3]!r} to {prompt!r}, "
                                             f"transformers {expected[key]!r}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
            stack.close()
    load = os.getloadavg()
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in load)}; {args.rounds} rounds x {len(PROMPTS)} "
          f"prompts, greedy, {args.tokens} new tokens, fp32 CPU, torch threads {torch.get_num_threads()}, "
          f"{args.busy} busy-loop processes; "
          "every engine answer equal to transformers' text\n")
    medians = {k: statistics.median(r[0] for r in v) for k, v in results.items()}
    reference = {"hf": "hf", "engine": "hf", "http": "hf", "hf+peft": "hf+peft", "engine+lora": "hf+peft",
                 "http+lora": "hf+peft", "service": "hf",
                 "baseline": "hf", "baseline+lora": "hf+peft"}
    print("| way | median latency ms | median TTFT ms | tokens/s | / transformers |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        lat = medians[name]
        ttft = statistics.median(r[1] for r in rows)
        tok_s = statistics.median(r[2] / r[0] for r in rows)
        ratio = lat / medians[reference[name]]
        shown = "-" if math.isnan(ttft) else f"{ttft * 1000:.0f}"  # NaN: not measured over HTTP
        print(f"| {name} | {lat * 1000:.0f} | {shown} | {tok_s:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
