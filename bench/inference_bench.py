"""Embedded inference vs plain transformers + peft, side by side in one run.

For each model shape (the demo's tiny Llama and a larger CPU shape), with the same random
LoRA adapter and prompt, greedy decoding of ``--tokens`` new tokens:

- ``plain``: ``PeftModel.from_pretrained(base, adapter).generate`` in this process, with a
  streamer to time the first token;
- ``engine``: ``inference.engine.Engine.generate`` in this process (adapter switching,
  stop-string streaming, the lock);
- ``worker``: the real inference worker process (``python -m inference``) over its
  loopback HTTP channel, through ``inference.client`` (what the API does per request).

Rounds alternate plain / engine / worker; medians of time to first token and decode
tokens/s (after the first) are reported with the ratios ours / plain. Then adapter
switching: 10 adapters on one base, requests cycling through them, with every adapter
cached (``max_adapters=10``) and with a cache of 2 (each switch loads from disk), against
the same requests on one adapter.

    OMP_NUM_THREADS=2 .venv/bin/python bench/inference_bench.py --rounds 5 --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inference.client import InferenceClient
from inference.engine import Engine, ModelLoading
from inference.protocol import GenerationRequest, ModelRef, Sampling
from trainers.common.tiny_model import build_tiny_llama

MESSAGES = ({"role": "user", "content": "Name three rivers of South America and say why they matter."},)
SHAPES = {
    "tiny (h64 L2)": {},
    "larger (h512 L8 ffn1408)": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                                 "intermediate_size": 1408},
}


def build_model(out: Path, shape: dict[str, Any]) -> Path:
    """A tiny Llama whose output rows of non-ASCII bytes and special tokens are zero: greedy
    decoding then emits ASCII only (a random model's bytes >= 128 seldom form valid UTF-8,
    and a stream holds back incomplete characters) and never the end token, so every run
    streams token by token for exactly ``--tokens`` tokens."""
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_llama(out, seed=0, **shape)
    weights_file = model_dir / "model.safetensors"
    weights = load_file(str(weights_file))
    weights["lm_head.weight"][128:] = 0.0
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return model_dir


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      init_lora_weights=False))
    model.save_pretrained(str(out))
    return out


class _FirstToken:
    """A generate streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls, self.first_at = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def plain_run(model: Any, tok: Any, tokens: int) -> tuple[float, float, int]:
    prompt = tok.apply_chat_template(list(MESSAGES), add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    streamer = _FirstToken()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, streamer=streamer)
    ended = time.perf_counter()
    n = out.shape[1] - ids.shape[1]
    return streamer.first_at - started, (n - 1) / (ended - streamer.first_at), n


def _request(model_dir: Path, adapter: Path, tokens: int) -> GenerationRequest:
    return GenerationRequest(base=ModelRef(id="bench", path=str(model_dir)),
                             adapter=ModelRef(id=adapter.name, path=str(adapter)), messages=MESSAGES,
                             sampling=Sampling(max_tokens=tokens, temperature=0.0))


def _timed(events: Any, started: float) -> tuple[float, float, int]:
    first = None
    n = 0
    for event in events:
        if event.type == "text" and first is None:
            first = time.perf_counter()
        if event.type == "finish":
            n = event.completion_tokens or 0
    ended = time.perf_counter()
    return first - started, (n - 1) / (ended - first), n


def engine_run(engine: Engine, request: GenerationRequest) -> tuple[float, float, int]:
    started = time.perf_counter()
    return _timed(engine.generate(request), started)


async def _worker_events(client: InferenceClient, request: GenerationRequest) -> list[tuple[float, Any]]:
    return [(time.perf_counter(), e) async for e in client.generate(request)]


def worker_run(client: InferenceClient, request: GenerationRequest) -> tuple[float, float, int]:
    started = time.perf_counter()
    events = asyncio.run(_worker_events(client, request))
    first = next(t for t, e in events if e.type == "text")
    n = next(e.completion_tokens for _, e in events if e.type == "finish")
    return first - started, (n - 1) / (events[-1][0] - first), n


def wait_loaded(engine: Engine, model_dir: Path) -> None:
    while True:
        try:
            engine.base(ModelRef(id="bench", path=str(model_dir)))
            return
        except ModelLoading:
            time.sleep(0.05)


def start_worker(threads: int | None = None, tree: Path = REPO,
                 quiet: bool = False) -> tuple[subprocess.Popen[bytes], InferenceClient]:
    """The inference worker (``python -m inference``) of the source tree ``tree``, once it
    answers its health check; ``threads`` None: torch's default threads."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = secrets.token_hex(16)
    env = {**os.environ, "TUNEFLEET_INFERENCE_SECRET": secret, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "inference", "--port", str(port)]
    if threads is not None:
        command += ["--threads", str(threads)]
    proc = subprocess.Popen(command, cwd=tree, env=env, stderr=subprocess.DEVNULL if quiet else None)
    client = InferenceClient(f"http://127.0.0.1:{port}", secret)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz",
                         headers={"X-Tunefleet-Inference-Secret": secret}).status_code == 200:
                return proc, client
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the inference worker of {tree} did not start")


def worker_ready(client: InferenceClient, request: GenerationRequest, run: Any = None) -> None:
    """Send ``request`` (with ``run``, default :func:`worker_run`) until the model is loaded."""
    from inference.client import InferenceRejected

    while True:
        try:
            (run or worker_run)(client, request)
            return
        except InferenceRejected as exc:
            if exc.code != "model_loading":
                raise
            time.sleep(0.2)


def bench_shape(name: str, shape: dict[str, Any], work: Path, args: argparse.Namespace,
                client: InferenceClient) -> dict[str, Any]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_model(work / "model", shape)
    adapter = make_adapter(model_dir, work / "adapter", seed=1)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter)).eval()
    engine = Engine(max_adapters=1, device="cpu")
    wait_loaded(engine, model_dir)
    request = _request(model_dir, adapter, args.tokens)
    worker_ready(client, request)
    engine_run(engine, request)
    plain_run(plain, tok, args.tokens)  # warm-up of each
    results: dict[str, list[tuple[float, float, int]]] = {"plain": [], "engine": [], "worker": []}
    for _ in range(args.rounds):
        results["plain"].append(plain_run(plain, tok, args.tokens))
        results["engine"].append(engine_run(engine, request))
        results["worker"].append(worker_run(client, request))
    counts = {k: {n for _, _, n in v} for k, v in results.items()}
    assert len(set().union(*counts.values())) == 1, f"different token counts: {counts}"
    summary = {k: {"ttft_ms": statistics.median(t for t, _, _ in v) * 1000,
                   "tok_s": statistics.median(r for _, r, _ in v)} for k, v in results.items()}
    print(name, json.dumps(summary), flush=True)
    return {"shape": name, "tokens": next(iter(counts["plain"])), **summary}


def bench_switching(work: Path, args: argparse.Namespace) -> dict[str, float]:
    model_dir = build_model(work / "switch-model", SHAPES["larger (h512 L8 ffn1408)"])
    adapters = [make_adapter(model_dir, work / f"switch-{i}", seed=10 + i) for i in range(10)]
    out: dict[str, float] = {}
    for label, cache, cycle in (("one adapter", 10, adapters[:1]), ("10 adapters, all cached", 10, adapters),
                                ("10 adapters, cache of 2", 2, adapters)):
        engine = Engine(max_adapters=cache, device="cpu")
        wait_loaded(engine, model_dir)
        for adapter in cycle:  # load each once before timing
            list(engine.generate(_request(model_dir, adapter, 2)))
        times = []
        for i in range(args.switches):
            started = time.perf_counter()
            list(engine.generate(_request(model_dir, cycle[i % len(cycle)], 2)))
            times.append(time.perf_counter() - started)
        out[label] = statistics.median(times) * 1000
        print(label, f"{out[label]:.1f} ms per 2-token request", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--switches", type=int, default=30)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    proc, client = start_worker(threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [bench_shape(name, shape, Path(tmp) / str(i), args, client)
                    for i, (name, shape) in enumerate(SHAPES.items())]
            switching = bench_switching(Path(tmp), args)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print()
    print(f"torch threads {threads}, load average {os.getloadavg()[0]:.1f}, {args.rounds} rounds, "
          f"greedy, {args.tokens} new tokens")
    print("| shape | tokens | plain TTFT ms | engine TTFT ms | worker TTFT ms | plain tok/s | engine tok/s | "
          "worker tok/s | engine/plain | worker/plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, e, w = r["plain"], r["engine"], r["worker"]
        print(f"| {r['shape']} | {r['tokens']} | {p['ttft_ms']:.1f} | {e['ttft_ms']:.1f} | {w['ttft_ms']:.1f} | "
              f"{p['tok_s']:.0f} | {e['tok_s']:.0f} | {w['tok_s']:.0f} | {e['tok_s'] / p['tok_s']:.2f} | "
              f"{w['tok_s'] / p['tok_s']:.2f} |")
    print()
    for label, ms in switching.items():
        print(f"- {label}: {ms:.1f} ms per 2-token request")


if __name__ == "__main__":
    main()
