"""JAX LoRA train step vs a plain transformers + peft LoRA loop, same shape, one run.

Shape: Llama hidden 256, 4 layers, heads 8 / kv 4, ffn 1024, vocab 1024,
seq 256 x batch 4, LoRA r 8 on q/k/v/o, fp32, AdamW, one optimizer step per batch.
Both sides start from the same random weights (saved by transformers, loaded by our
loader) and train on the same token batch. Rounds alternate torch / JAX so that a
shared, noisy machine hits both alike; the ratio is of medians of per-step tokens/s.
JAX compile time (first call) is reported separately and excluded from its tokens/s.

The JAX side is the trainer's step as the local executor ships it: the spec builder's
host-device split (one XLA host device per core a local trainer may use, ``data`` mesh)
applied by the trainer's own ``use_host_devices``. Both sides run in one process with
the environment the executor gives the JAX trainer (``--malloc trainer``: glibc's malloc
tunable; the bench re-executes itself with it, since glibc reads it at start-up), and
torch uses ``OMP_NUM_THREADS`` threads, the cores the JAX side splits into.
``--malloc default`` runs both without the tunable (to measure what it is worth).

``--quantization nf4`` makes both sides QLoRA: torch loads the base with
``BitsAndBytesConfig`` (NF4, fp32 compute, as the fsdp_qlora trainer's CPU tests do), JAX
quantizes it while loading (``trainers/jax_lora/nf4.py``); same codes on both sides.

    OMP_NUM_THREADS=2 python bench/jax_lora_cpu.py --steps 8 --rounds 5 [--quantization nf4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 8, 4, 1024, 1024
SEQ, BATCH, RANK = 256, 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def torch_loop(path: Path, tokens, threads: int, quantization: str = "none"):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    quant = {} if quantization == "none" else {"device_map": "cpu", "quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32)}
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **quant)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, target_modules=list(TARGETS)))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.tensor(tokens, dtype=torch.long)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def jax_loop(path: Path, tokens, parallelism, quantization: str = "none"):
    """The trainer's jitted step on ``parallelism`` (a spec's ParallelismSpec)."""
    from trainers.jax_lora.host_devices import use_host_devices

    use_host_devices(parallelism.host_devices)  # as the trainer does, before anything touches a device
    import jax
    import numpy as np

    from bench.harness import jax_lora_step
    from trainers.jax_lora.sharding import make_mesh
    from trainers.jax_lora.step import batch_sharding

    m = parallelism.mesh
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices=jax.devices()[: m.size])
    train_step, first_state, params = jax_lora_step(path, mesh, quantization, targets=TARGETS, rank=RANK, alpha=16.0,
                                                    learning_rate=1e-4, max_grad_norm=None)
    state = {"s": first_state}
    ids = np.asarray(tokens, np.int32)[None]
    batch = {
        "input_ids": ids, "labels": ids,
        "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), ids.shape).copy(),
        "segment_ids": np.ones_like(ids),
    }
    batch = {k: jax.device_put(v, batch_sharding(mesh, v.shape)) for k, v in batch.items()}

    def step() -> float:
        state["s"], out = train_step(state["s"], params, batch)
        return float(out["loss"])

    return step


def _exec_with_malloc_env(mode: str) -> None:
    """Re-run this script with the malloc environment of ``mode`` unless it has it already."""
    from worker.executors.local.process import trainer_env

    want = trainer_env("jax_lora", {}) if mode == "trainer" else {"GLIBC_TUNABLES": ""}
    if all(os.environ.get(k, "") == v for k, v in want.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **want})


def timed(step, n: int) -> list[float]:
    rates = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        rates.append(SEQ * BATCH / (time.perf_counter() - t))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--malloc", choices=("trainer", "default"), default="trainer",
                    help="trainer: the JAX trainer's malloc tunable for both sides; default: none")
    ap.add_argument("--host-devices", type=int, default=None,
                    help="XLA host devices (default: what the spec builder gives a local job)")
    ap.add_argument("--quantization", choices=("none", "nf4"), default="none", help="nf4: QLoRA on both sides")
    args = ap.parse_args()
    _exec_with_malloc_env(args.malloc)
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    from trainers.spec import ParallelismSpec
    from worker.spec_builder import cpu_host_devices, cpu_host_mesh, local_trainer_cores

    # What build_spec writes for a 1-slot jax job with this batch on the local pool.
    host_devices = args.host_devices or cpu_host_devices(local_trainer_cores(1), BATCH)
    parallelism = ParallelismSpec(mesh=cpu_host_mesh(host_devices), host_devices=host_devices)
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_model(path)
        t_step = torch_loop(path, tokens, threads, args.quantization)
        j_step = jax_loop(path, tokens, parallelism, args.quantization)
        t0 = time.perf_counter()
        j_step()
        compile_s = time.perf_counter() - t0
        t_step()  # warm-up
        j_step()
        torch_rates, jax_rates = [], []
        for _ in range(args.rounds):
            torch_rates.append(statistics.median(timed(t_step, args.steps)))
            jax_rates.append(statistics.median(timed(j_step, args.steps)))
    t_med, j_med = statistics.median(torch_rates), statistics.median(jax_rates)
    print(json.dumps({
        "torch_peft_tokens_per_s": round(t_med, 1), "jax_tokens_per_s": round(j_med, 1),
        "ratio_jax_over_torch": round(j_med / t_med, 3), "jax_compile_s": round(compile_s, 2),
        "rounds_torch": [round(x) for x in torch_rates], "rounds_jax": [round(x) for x in jax_rates],
        "quantization": args.quantization, "jax_host_devices": host_devices, "torch_threads": threads,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "load_average": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
