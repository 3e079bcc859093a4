"""What sampling costs in a GRPO step, on each trainer, on the same CPU shape.

Same random Llama as ``dpo_step_time.py`` (hidden 256, 4 layers, heads 8/4, ffn 1024,
vocab 1024), LoRA r 8 on q/k/v/o, fp32, one process / one device. A step samples
PROMPTS prompts x G completions of NEW tokens each (no stop token: every row draws its
whole budget, the worst case) after a PROMPT-token prompt, then takes one GRPO update on
the PROMPTS x G rows (KL term on: a reference forward too).

Timed, alternating call by call so machine load affects all alike (median seconds):

- jax_lora: ``sampling.Sampler.sample`` (the jitted KV-cache decode loop, all rows in one
  call) and the jitted GRPO train step of ``compile_steps``; plus, once, the first call of
  each (its compile, with no persistent cache);
- fsdp_qlora: ``grpo_step.sample_group`` per prompt (its G rows in one batch, transformers'
  KV cache) and ``grpo_backward`` + the AdamW update.

Run:  OMP_NUM_THREADS=2 .venv/bin/python bench/grpo_sampling_cost.py [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.dpo_step_time import ALPHA, MODULES, SHAPE, R, jax_setup, time_rounds
from trainers.common.reinforcement import GrpoObjective, Prompt, group_advantages
from trainers.common.tiny_model import build_tiny_llama

PROMPTS, G, PROMPT, NEW = 4, 4, 64, 64
KL, TEMPERATURE, NO_STOP, PAD = 0.05, 1.0, 100_000, 0


def make_prompts() -> list[Prompt]:
    rng = np.random.default_rng(0)
    return [Prompt(tuple(int(x) for x in rng.integers(0, 256, PROMPT)), {}, NEW) for _ in range(PROMPTS)]


def objective() -> GrpoObjective:
    return GrpoObjective(grader=None, samples_per_prompt=G, temperature=TEMPERATURE, kl_coef=KL, clip_epsilon=0.2,
                         loss_type="grpo", max_completion_tokens=NEW, eval_samples=1, stop_ids=frozenset({NO_STOP}),
                         pad_id=PAD, decode=str)


def rewards() -> np.ndarray:
    return np.tile(np.array([1.0, 0.0, 0.5, 0.25], np.float32), PROMPTS)


def jax_functions(model_dir: Path) -> tuple[dict[str, callable], dict[str, float]]:
    import jax
    import jax.numpy as jnp

    from trainers.jax_lora.grpo import ReinforcementLoss, Sampled, grpo_batch
    from trainers.jax_lora.lora import init_lora, lora_runtime
    from trainers.jax_lora.sampling import DecodeConfig, Sampler, SamplingShape
    from trainers.jax_lora.step import StepConfig, compile_steps, init_state

    cfg, mesh, params, p_shard, l_shard, optimizer, shardings = jax_setup(model_dir)
    lora = init_lora(cfg, MODULES, R, jax.random.key(0))
    state = {"state": init_state(lora, optimizer, shardings, jax.random.key(1))}
    runtime = lora_runtime(ALPHA, R, 0.0)
    sc = StepConfig(cfg=cfg, runtime=runtime, packed=False,
                    reinforcement=ReinforcementLoss(kl_coef=KL, clip_epsilon=0.2, temperature=TEMPERATURE,
                                                    max_completion_tokens=NEW))
    train_step, _ = compile_steps(sc, optimizer, mesh, shardings, p_shard)
    shape = SamplingShape(rows=PROMPTS * G, prompt_len=PROMPT, new_tokens=NEW)
    sampler = Sampler(DecodeConfig(cfg=cfg, runtime=runtime, shape=shape, stop_ids=(NO_STOP,), pad_id=PAD),
                      mesh, p_shard, l_shard)
    prompts = make_prompts()

    def sample() -> list[list[int]]:
        return sampler.sample(params, state["state"]["lora"], prompts, G, seed=3, temperature=TEMPERATURE)

    t0 = time.perf_counter()
    completions = sample()
    compile_s = {"sampler": time.perf_counter() - t0}
    assert all(len(c) == NEW for c in completions)
    flat = [p for p in prompts for _ in range(G)]
    host = grpo_batch(Sampled(flat, completions, rewards()), group_advantages(rewards(), G), accumulation=1,
                      row_len=PROMPT + NEW, pad_id=PAD)
    batch = {k: jnp.asarray(v) for k, v in host.items()}

    def update() -> None:
        state["state"], out = train_step(state["state"], params, batch)
        float(out["loss"])

    t0 = time.perf_counter()
    update()
    compile_s["step"] = time.perf_counter() - t0
    return {"jax sample": sample, "jax update": update}, compile_s


def torch_functions(model_dir: Path) -> dict[str, callable]:
    import torch

    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.grpo_step import _Sampled, grpo_backward, sample_group, sampling_generator
    from trainers.fsdp_qlora.loading import ModelOptions, build_model
    from trainers.fsdp_qlora.train_step import _update, build_optimizer, evaluation_mode

    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    model, _ = build_model(ModelOptions(model_dir=model_dir, lora_r=R, lora_alpha=ALPHA, target_modules=MODULES), ctx)
    opt = build_optimizer(model, learning_rate=1e-4, weight_decay=0.0)
    prompts, obj = make_prompts(), objective()

    def sample() -> list[list[int]]:
        completions: list[list[int]] = []
        generator = sampling_generator(3, 0, ctx.device)
        with evaluation_mode(model):
            for prompt in prompts:
                completions.extend(sample_group(model, prompt, G, obj, ctx.device, generator))
        return completions

    completions = sample()
    assert all(len(c) == NEW for c in completions)
    sampled = _Sampled([p for p in prompts for _ in range(G)], completions, torch.from_numpy(rewards()))

    def update() -> None:
        grpo_backward(model, sampled, obj, ctx, micro_batch_size=PROMPTS)
        _update(model, opt, 1e-4, 1.0)

    update()  # warm up allocators and the optimizer state
    return {"torch sample": sample, "torch update": update}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "model", seed=0, **SHAPE)
        jax_fns, compile_s = jax_functions(model_dir)
        fns = {**jax_fns, **torch_functions(model_dir)}
        times = time_rounds(fns, args.steps, args.rounds)
    print(f"{PROMPTS} prompts x {G} samples, prompt {PROMPT} + {NEW} new tokens; first calls (compile): "
          f"sampler {compile_s['sampler']:.1f} s, GRPO step {compile_s['step']:.1f} s")
    print("| trainer | sampling | update (GRPO step) | sampling share | new tokens/s |")
    print("|---|---|---|---|---|")
    for name in ("jax", "torch"):
        sample, update = times[f"{name} sample"], times[f"{name} update"]
        print(f"| {'jax_lora' if name == 'jax' else 'fsdp_qlora'} | {sample * 1e3:.0f} ms | {update * 1e3:.0f} ms | "
              f"{sample / (sample + update):.0%} | {PROMPTS * G * NEW / sample:.0f} |")


if __name__ == "__main__":
    main()
