"""Compile the JAX trainer's real train step for Llama 3.1 8B / 70B / 405B, without weights.

XLA can partition and compile a program for a mesh of devices it only pretends to have
(``--xla_force_host_platform_device_count=N`` CPU devices) from abstract inputs, and
report the memory each device's program needs. This bench does that for the trainer's
own jitted step (``trainers.jax_lora.step.compile_steps``; no copy of the step), fed with
``jax.ShapeDtypeStruct`` parameters, LoRA factors, AdamW state and batch that carry
exactly the shardings the trainer gives them (``abstract_step_inputs`` calls the same
builders as ``trainers.jax_lora.recipe.run``, ``recipe.step_layout`` first, from the same ``TrainerSpec``;
tests/trainers/jax_lora/test_plan_aot.py checks them against a real run), so a plan
cannot drift from the trainer. Nothing is allocated: a 405B plan runs on a laptop.

The job is the one the service would run: the spec the worker writes for a GPU pool
(mesh ``data=1, fsdp=N, tensor=1``, ``remat=per_layer``, the accelerator's precision:
bf16 base and compute, fp32 LoRA), LoRA r 8 / alpha 16 on q/k/v/o. Per device it prints
XLA's arguments, outputs, temporaries, aliased (donated) bytes and their total
``arguments + outputs - aliased + temporaries`` (the peak of the step's buffers), FLOPs
per step, and the estimator's per-GPU bytes for the same job, asked the way the
scheduler asks it (``scheduling.request.training_shape`` + ``estimate_on_pool``).
``fits`` is the XLA total against the pool's GPU memory x ``scheduling.estimator.HEADROOM``.

FLOPs. ``Compiled.cost_analysis()`` counts the body of a while loop once, whatever its
trip count, so for a step whose layers run in a ``lax.scan`` it misses all layers but
one. ``hlo_matmul_flops`` walks the optimized HLO instead and counts every dot
(2 x output elements x contracted size) times the known trip count of each loop around
it: the matmul FLOPs of one device's program per step (elementwise work not counted).

What the CPU backend does differently from a GPU, and what the bench does about it.
XLA:CPU has no bfloat16 dot: it computes every bf16 op in fp32 and hoists an fp32 copy of
the stacked weights out of the layer scan, so bf16 is compiled as float16 (same bytes;
``PlanJob.bf16_standin``), and XLA:CPU's rewrite of float16 dots into fp32 ones is
switched off (``CPU_PLAN_FLAGS``). What remains CPU-specific: the LM head's
fp16 x fp16 -> fp32 dot still converts the gathered head to fp32 (an accelerator's
matmul takes 16-bit inputs with an fp32 result); the trainer's blockwise attention
(FlashAttention-style residuals, every block's scores materialized) runs 128 query rows
per block on CPU and 512 on accelerators; and a real runtime adds its context and
allocator slack (the estimator's ``framework`` and ``slack`` terms) on top of what XLA
plans. Checked against a real GPU: the 8B step at 2048 x 4 without remat peaked on one
H200 at 0.91 (bf16) / 0.89 (NF4) of this plan, and at 2048 x 2 with ``dots_saveable``
at 1.05 (bench/RESULTS.md, "jax_lora and fsdp_qlora on one H200").

    python bench/plan_aot.py --model llama-3.1-405b --devices 8 --method lora --seq 2048 --batch 1
    python bench/plan_aot.py --model llama-3.1-70b --devices 2 --method qlora --pool rtx4090 --json
    python bench/plan_aot.py --all            # the rows of bench/RESULTS.md, in one process

``--candidates`` plans the scheduler's step choice for a job of ``--global-batch`` rows on
one gang of each GPU pool of the pools file: every candidate step in the speed order
(``scheduling.step_choice.step_candidates``) with the estimator's bytes and whether they fit
the scheduler's budget (``HEADROOM``), the one it chooses, and, on a jax_lora pool, XLA's
plan of each candidate from the first to the one the trainer would run (the choice if
XLA's plan of it fits ``USABLE`` of the device, what ``trainers/jax_lora/step_fit.py``
compares before step 1, else the next one that does). A fsdp_qlora pool's candidates get
the estimator's figures only: that trainer measures its first step instead.

    python bench/plan_aot.py --candidates --model llama-3.1-8b --devices 1 --seq 8192 --global-batch 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
POOLS_FILE = ROOT / "deploy" / "pools" / "mixed.yaml"
# Fake devices the process gets; --all uses subsets of them (the 8 of one MI300X node).
HOST_DEVICES = 8
# XLA:CPU flags that make its plan the accelerator's. Buffer assignment (the memory
# analysis) is done on the HLO before LLVM sees it, and the generated code never runs, so
# LLVM's optimizations only cost time (3x here). ``change-op-data-type`` rewrites every
# float16 dot as a float32 one (XLA:CPU's matmul libraries are fp32), with a float32 copy
# of both operands: of each layer's gathered kernels and, 4 GiB at 70B, of the LM head;
# XLA:CPU computes float16 dots natively without it. See ``PlanJob.bf16_standin``.
CPU_PLAN_FLAGS = " --xla_backend_optimization_level=0 --xla_disable_hlo_passes=change-op-data-type"


def _devices_from_argv(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv) and argv[i + 1].isdigit():
            return max(HOST_DEVICES, int(argv[i + 1]))
        if arg.startswith("--devices=") and arg.split("=", 1)[1].isdigit():
            return max(HOST_DEVICES, int(arg.split("=", 1)[1]))
    return HOST_DEVICES


if __name__ == "__main__":  # XLA fixes the CPU device count when jax starts: before any import
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_devices_from_argv(sys.argv)}"
        + CPU_PLAN_FLAGS
    ).strip()

import jax
from jax.sharding import Mesh

from control.job_settings import JobSettings, quantization_for
from scheduling.estimator import HEADROOM, estimate_on_pool, flops_per_token
from scheduling.model_files import base_model_shape
from scheduling.pools import GIB, NodePool, load_pools
from scheduling.request import training_shape
from scheduling.step_choice import step_candidates
from trainers.common.step_fit import USABLE
from trainers.jax_lora.config import DecoderConfig
from trainers.jax_lora.recipe import _check_spec, step_layout
from trainers.jax_lora.step import (
    BATCH_KEYS,
    StepConfig,
    batch_sharding,
    compile_steps,
    make_optimizer,
    make_schedule,
    state_shardings,
)
from trainers.spec import DEFAULT_TARGET_MODULES, TrainerSpec
from worker.spec_builder import precision_for

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")


# --- the job --------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanJob:
    """One job to plan: model, gang size, adapter, sequence and micro batch."""

    model: str
    devices: int
    method: str = "lora"
    seq: int = 2048
    batch: int = 1
    """Rows per data-parallel rank per micro batch (``micro_batch_size``)."""
    remat: str = "per_layer"
    tensor: int = 1
    r: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    pool: str = "mi300x"
    bf16_standin: str | None = "float16"
    """XLA:CPU has no bf16 dot: its float normalization computes every bf16 op in fp32,
    and loop-invariant code motion then hoists an fp32 copy of the whole stacked weights
    out of the layer scan (+2x the base weights in temporaries, a CPU-only artefact).
    float16 has the same size and XLA:CPU computes it natively, so the plan is compiled
    with it in place of bfloat16; None compiles bfloat16 as it is."""

    @property
    def model_dir(self) -> Path:
        path = CONFIG_DIR / self.model
        return path if path.is_dir() else Path(self.model)

    @property
    def label(self) -> str:
        quant = "NF4" if self.method == "qlora" else "bf16"
        return f"{self.model} {self.method} {quant} {self.devices}x{self.pool} seq {self.seq} x {self.batch}"


def pools_by_name() -> dict[str, NodePool]:
    return {p.name: p for p in load_pools(POOLS_FILE)}


def trainer_spec(job: PlanJob, accelerator: str) -> TrainerSpec:
    """The ``TrainerSpec`` the worker would write for ``job`` on a GPU pool of ``accelerator``.

    Data paths are placeholders: nothing is read; the rest is what the spec builder sets
    for a jax_lora job on an accelerator (mesh over fsdp, remat, the accelerator's
    precision) and the spec's own defaults (optimizer, schedule, no dropout). With
    ``job.bf16_standin`` each bfloat16 of the precision is compiled as that 2-byte dtype
    (see ``PlanJob.bf16_standin``).
    """
    if job.devices % job.tensor:
        raise SystemExit(f"--tensor {job.tensor} does not divide --devices {job.devices}")
    fsdp = job.devices // job.tensor
    return TrainerSpec.model_validate({
        "job_id": "ftjob-plan",
        "trainer": "jax_lora",
        "model": {"path": str(job.model_dir)},
        "data": {"train_file": "unused.jsonl", "format": "chat", "max_seq_len": job.seq},
        "hyperparameters": {"n_epochs": 1, "batch_size": job.batch * fsdp, "micro_batch_size": job.batch,
                            "learning_rate": 1e-4, "max_steps": 1000},
        "adapter": {"method": job.method, "quantization": quantization_for(job.method, None),
                    "r": job.r, "alpha": job.alpha, "target_modules": list(job.target_modules)},
        "parallelism": {"mesh": {"data": 1, "fsdp": fsdp, "tensor": job.tensor}, "remat": job.remat},
        "precision": {k: job.bf16_standin if v == "bfloat16" and job.bf16_standin else v
                      for k, v in precision_for(accelerator).model_dump().items()},
        "output_dir": "unused-out",
        "checkpoint": {"dir": "unused-ckpt"},
    })


# --- abstract inputs with the trainer's shardings --------------------------------------


@dataclass
class StepInputs:
    """Everything the trainer hands its jitted train step, as abstract arrays."""

    step_config: StepConfig
    optimizer: Any
    mesh: Mesh
    state_shardings: dict[str, Any]
    param_shardings: Any
    state: dict[str, Any]
    params: Any
    batch: dict[str, jax.ShapeDtypeStruct]


def _with_sharding(shape: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)


def abstract_step_inputs(spec: TrainerSpec, cfg: DecoderConfig, devices: list[jax.Device] | None = None) -> StepInputs:
    """The train step's inputs for ``spec``, built by the recipe's own builders, in its order.

    Mirrors ``trainers.jax_lora.recipe.run`` up to the first ``train_step`` call, with
    ``jax.eval_shape`` where the recipe allocates (LoRA init, optimizer init, RNG key).
    """
    import jax.numpy as jnp

    _check_spec(spec)
    layout = step_layout(spec, cfg, devices)
    mesh, dp, accum = layout.mesh, layout.data_parallel, layout.accumulation
    p_abstract, p_shard = layout.param_shapes, layout.param_shardings
    l_abstract, l_shard = layout.lora_shapes, layout.lora_shardings

    hp = spec.hyperparameters
    total_steps = hp.max_steps or 1
    schedule = make_schedule(hp.lr_scheduler, base_lr=hp.learning_rate, total_steps=total_steps,
                             warmup_steps=hp.warmup_steps)
    optimizer = make_optimizer(schedule, weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm)
    shardings = state_shardings(l_shard, optimizer, l_abstract, mesh)
    state_abstract = {
        "lora": l_abstract,
        "opt_state": jax.eval_shape(optimizer.init, l_abstract),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.eval_shape(lambda: jax.random.key(spec.seed)),
    }
    sc = StepConfig(
        cfg=cfg,
        runtime=_lora_runtime(spec),
        remat=spec.parallelism.remat,
        compute_dtype=spec.precision.compute_dtype,
        packed=spec.data.packing,
    )
    rows = dp * hp.micro_batch_size
    batch_shape = (accum, rows, spec.data.max_seq_len)
    batch = {k: jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding(mesh, batch_shape))
             for k in BATCH_KEYS}
    return StepInputs(
        step_config=sc, optimizer=optimizer, mesh=mesh, state_shardings=shardings, param_shardings=p_shard,
        state=jax.tree.map(_with_sharding, state_abstract, shardings),
        params=jax.tree.map(_with_sharding, p_abstract, p_shard),
        batch=batch,
    )


def _lora_runtime(spec: TrainerSpec):
    from trainers.jax_lora.lora import lora_runtime

    return lora_runtime(spec.adapter.alpha, spec.adapter.r, spec.adapter.dropout)


# --- compile and read XLA's analysis ---------------------------------------------------


@dataclass(frozen=True)
class CompiledPlan:
    arguments: int
    outputs: int
    temps: int
    aliased: int
    generated_code: int
    xla_peak: int
    """``memory_analysis().peak_memory_in_bytes``; XLA:CPU reports the arguments only."""
    xla_flops: float
    """``cost_analysis()['flops']``: every loop body counted once."""
    matmul_flops: float
    """Dots of the optimized HLO times their loops' trip counts (``hlo_matmul_flops``)."""
    compile_s: float

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temps + self.generated_code


def jitted_train_step(inputs: StepInputs):
    """The trainer's jitted train step for these inputs (the object the recipe calls).

    ``compile_steps`` jits lazily per batch shape on the first call; tracing one call
    under ``jax.eval_shape`` creates it without running anything.
    """
    train_step, _ = compile_steps(inputs.step_config, inputs.optimizer, inputs.mesh,
                                  inputs.state_shardings, inputs.param_shardings)
    jax.eval_shape(train_step, inputs.state, inputs.params, inputs.batch)
    (jitted,) = train_step.cache.values()
    return jitted


def compile_plan(inputs: StepInputs) -> CompiledPlan:
    t0 = time.perf_counter()
    compiled = jitted_train_step(inputs).lower(inputs.state, inputs.params, inputs.batch).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return CompiledPlan(
        arguments=mem.argument_size_in_bytes, outputs=mem.output_size_in_bytes, temps=mem.temp_size_in_bytes,
        aliased=mem.alias_size_in_bytes, generated_code=mem.generated_code_size_in_bytes,
        xla_peak=int(getattr(mem, "peak_memory_in_bytes", 0)),
        xla_flops=float(cost.get("flops", 0.0)), matmul_flops=hlo_matmul_flops(compiled.as_text()),
        compile_s=seconds,
    )


_HEADER = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) \((?P<params>.*)\) -> .*\{$")
_PARAM = re.compile(r"(?P<name>[\w.\-]+): (?P<type>\w+\[[\d,]*\])")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<type>\w+\[[\d,]*\]|\(.*?\)|\w+\[\])\S* "
                    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$")
_DIMS = re.compile(r"\w+\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|branch_computations)=\{?(%?[\w.\-]+(?:, %?[\w.\-]+)*)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _dims(type_text: str) -> tuple[int, ...]:
    found = _DIMS.match(type_text)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def hlo_matmul_flops(hlo_text: str) -> float:
    """Matmul FLOPs of an optimized HLO module, with while loops counted trip-count times.

    Each ``dot`` costs 2 x (output elements) x (product of the lhs contracting dims);
    a computation costs its dots plus what it calls (fusions, calls; a ``while`` body
    times its ``known_trip_count``; the largest branch of a conditional).

    Raises:
        ValueError: a while loop without a known trip count (the count would be a guess).
    """
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group("name")
            comps[current], shapes[current] = [], {}
            if line.startswith("ENTRY"):
                entry = current
            for p in _PARAM.finditer(header.group("params")):
                shapes[current][p.group("name")] = _dims(p.group("type"))
            continue
        if current is None:
            continue
        instr = _INSTR.match(line)
        if instr:
            shapes[current][instr.group("name")] = _dims(instr.group("type"))
            comps[current].append((instr.group("name"), instr.group("op"), instr.group("args"), instr.group("attrs")))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    memo: dict[str, float] = {}

    def cost(comp: str) -> float:
        if comp in memo:
            return memo[comp]
        total = 0.0
        for name, op, args, attrs in comps.get(comp, []):
            if op == "dot":
                lhs = args.split(",")[0].strip().lstrip("%")
                contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
                lhs_dims = shapes[comp][lhs]
                k = math.prod(lhs_dims[int(d)] for d in contract.group(1).split(",") if d) if contract else 1
                total += 2.0 * math.prod(shapes[comp][name]) * k
                continue
            called = [c.strip().lstrip("%") for m in _CALLS.finditer(attrs) for c in m.group(1).split(",")]
            if op == "while":
                trip = _TRIP.search(attrs)
                if trip is None:
                    raise ValueError(f"while loop {name} in {comp} has no known trip count")
                body = re.search(r"body=%?([\w.\-]+)", attrs).group(1)
                total += int(trip.group(1)) * cost(body)
            elif op == "conditional":
                total += max((cost(c) for c in called), default=0.0)
            else:
                total += sum(cost(c) for c in called)
        memo[comp] = total
        return total

    return cost(entry)


# --- the estimator, asked as the scheduler asks ----------------------------------------


def estimator_memory(job: PlanJob, pool: NodePool):
    """The estimator's per-GPU breakdown and FLOPs per token for ``job`` on ``job.devices`` GPUs of ``pool``.

    As the scheduler: the model's shape from its ``config.json`` (``base_model_shape``),
    the training shape from the job's settings (``training_shape``),
    then ``estimate_on_pool`` with trainer jax_lora and the pinned GPU count. The scheduler
    always plans with checkpointing (the worker runs GPU jobs with ``remat=per_layer``);
    ``--remat none`` is estimated without it.
    """
    shape, _ = base_model_shape(str(job.model_dir), None, model_id=job.model)
    training = training_shape(JobSettings.from_columns(
        adapter={"method": job.method, "r": job.r, "target_modules": list(job.target_modules)},
        hyperparameters={"micro_batch_size": job.batch}, max_seq_len=job.seq))
    training = replace(training, checkpointing=job.remat != "none")
    est = estimate_on_pool(shape, training, pool, trainer="jax_lora", gpus=job.devices)
    return est.memory, flops_per_token(shape, training, "jax_lora")


# --- one row ---------------------------------------------------------------------------


def plan_row(job: PlanJob, pools: dict[str, NodePool] | None = None) -> dict[str, Any]:
    pools = pools or pools_by_name()
    pool = pools[job.pool]
    cfg = DecoderConfig.from_pretrained(job.model_dir)
    spec = trainer_spec(job, pool.accelerator)
    if len(jax.devices()) < job.devices:
        raise SystemExit(f"{job.devices} devices asked, this process has {len(jax.devices())}")
    inputs = abstract_step_inputs(spec, cfg, devices=jax.devices()[: job.devices])
    plan = compile_plan(inputs)
    est, est_flops_per_token = estimator_memory(job, pool)
    budget = int(pool.gpu_memory_bytes * HEADROOM)
    tokens = job.seq * job.batch * (job.devices // job.tensor)
    return {
        "row": job.label,
        "model": job.model, "method": job.method, "devices": job.devices, "pool": pool.name,
        "mesh": spec.parallelism.mesh.model_dump(), "remat": job.remat, "seq": job.seq, "batch": job.batch,
        "tokens_per_step": tokens,
        "per_device_bytes": plan.total,
        "per_device": {"arguments": plan.arguments, "outputs": plan.outputs, "temps": plan.temps,
                       "aliased": plan.aliased, "generated_code": plan.generated_code, "total": plan.total},
        "xla_peak_bytes": plan.xla_peak,
        "flops_per_step": plan.matmul_flops * job.devices,
        "flops_per_step_per_device": plan.matmul_flops,
        "xla_cost_analysis_flops_per_device": plan.xla_flops,
        "estimator_flops_per_step": est_flops_per_token * tokens,
        "estimator_bytes": est.total,
        "estimator_model_bytes": est.model_bytes,
        "estimator_breakdown": {k: getattr(est, k) for k in (
            "weights", "gathered_layer", "dequantized_layer", "lora_params", "lora_grads", "optimizer",
            "activations", "logits", "slack", "framework")},
        "ratio": est.total / plan.total,
        "ratio_model_bytes": est.model_bytes / plan.total,
        "gpu_memory_bytes": pool.gpu_memory_bytes,
        "budget_bytes": budget,
        "fits": plan.total <= budget,
        "compile_s": round(plan.compile_s, 1),
    }


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def print_row(row: dict[str, Any], file=None) -> None:
    """The human-readable row (to stderr when stdout carries the JSON)."""
    d = row["per_device"]
    out = file or sys.stdout
    print(f"{row['row']}  (mesh {row['mesh']}, remat {row['remat']}, compile {row['compile_s']} s)", file=out)
    print(f"  per device GiB: args {_gib(d['arguments'])} out {_gib(d['outputs'])} temps {_gib(d['temps'])} "
          f"aliased {_gib(d['aliased'])} total {_gib(d['total'])}", file=out)
    print(f"  estimator GiB {_gib(row['estimator_bytes'])} (without framework {_gib(row['estimator_model_bytes'])}) "
          f"ratio {row['ratio']:.3f} ({row['ratio_model_bytes']:.3f}); budget {_gib(row['budget_bytes'])} "
          f"-> fits {row['fits']}", file=out)
    print(f"  matmul FLOPs/step {row['flops_per_step']:.4g} (estimator {row['estimator_flops_per_step']:.4g}; "
          f"per device {row['flops_per_step_per_device']:.4g}; "
          f"XLA cost_analysis per device, loop bodies once: {row['xla_cost_analysis_flops_per_device']:.4g})",
          file=out, flush=True)


# --- --all: the recorded rows ------------------------------------------------------------


def fewest_devices(job: PlanJob, pools: dict[str, NodePool], show, counts=(1, 2, 4, 8)) -> list[dict[str, Any]]:
    """Rows for growing gang sizes until one fits; the last row is the answer."""
    rows = []
    for n in counts:
        row = plan_row(replace(job, devices=n), pools)
        rows.append(row)
        show(row)
        if row["fits"]:
            break
    return rows


def largest_fitting(job: PlanJob, pools: dict[str, NodePool], show, field: str,
                    values: list[int]) -> list[dict[str, Any]]:
    """Rows for growing ``seq`` or ``batch`` until one does not fit."""
    rows = []
    for v in values:
        row = plan_row(replace(job, **{field: v}), pools)
        rows.append(row)
        show(row)
        if not row["fits"]:
            break
    return rows


def run_all(show=print_row) -> dict[str, Any]:
    pools = pools_by_name()
    out: dict[str, Any] = {"rows": []}

    def one(job: PlanJob) -> None:
        row = plan_row(job, pools)
        show(row)
        out["rows"].append(row)

    one(PlanJob("llama-3.1-405b", 8, "lora"))
    fewest = fewest_devices(PlanJob("llama-3.1-405b", 1, "qlora"), pools, show)
    out["rows"] += fewest
    out["405b_nf4_fewest_mi300x"] = fewest[-1]["devices"] if fewest[-1]["fits"] else None
    one(PlanJob("llama-3.1-70b", 2, "qlora", pool="rtx4090"))
    one(PlanJob("llama-3.1-70b", 8, "lora"))
    one(PlanJob("llama-3.1-8b", 1, "lora"))
    one(PlanJob("llama-3.1-8b", 1, "qlora"))
    base = PlanJob("llama-3.1-405b", 8, "lora")
    seqs = largest_fitting(base, pools, show, "seq", [4096, 8192, 16384, 32768])
    batches = largest_fitting(base, pools, show, "batch", [2, 4, 8, 16])
    out["rows"] += seqs + batches
    fit_seq = [r for r in seqs if r["fits"]]
    fit_batch = [r for r in batches if r["fits"]]
    out["405b_lora_largest_seq_at_batch_1"] = fit_seq[-1]["seq"] if fit_seq else 2048
    out["405b_lora_largest_batch_at_seq_2048"] = fit_batch[-1]["batch"] if fit_batch else 1
    return out


# --- --candidates: the step choice's candidates on each GPU pool ------------------------


def candidate_rows(job: PlanJob, global_batch: int, pool: NodePool, show=print) -> dict[str, Any]:
    """The step choice for ``job`` (its micro batch and remat aside) with ``global_batch``
    rows on ``job.devices`` GPUs of ``pool``: its candidates in the speed order, the
    scheduler's choice, and on a jax_lora pool XLA's plan of each candidate up to the one
    the trainer would run (module docstring)."""
    trainer = pool.preferred_trainer()
    shape, _ = base_model_shape(str(job.model_dir), None, model_id=job.model)
    training = training_shape(JobSettings.from_columns(
        adapter={"method": job.method, "r": job.r, "target_modules": list(job.target_modules)},
        hyperparameters={"batch_size": global_batch, "micro_batch_size": 1}, max_seq_len=job.seq))
    candidates = step_candidates(shape, training, accelerator=pool.accelerator, device_bytes=pool.gpu_memory_bytes,
                                 gpus=job.devices, trainer=trainer, batch_size=global_batch)
    chosen = next((i for i, c in enumerate(candidates) if c.fits), None)
    limit = int(pool.gpu_memory_bytes * USABLE)
    show(f"{job.model} {job.method} on {job.devices}x {pool.name} ({trainer}), seq {job.seq} x global batch "
         f"{global_batch}: scheduler budget {pool.gpu_memory_bytes * HEADROOM / GIB:.1f} GiB, "
         f"trainer limit {limit / GIB:.1f} GiB per device")
    rows: list[dict[str, Any]] = []
    runs = None
    for i, c in enumerate(candidates):
        row: dict[str, Any] = {"micro_batch": c.micro_batch, "remat": c.remat, "estimator_bytes": c.planned_bytes,
                               "scheduler_fits": c.fits, "chosen": i == chosen, "xla_bytes": None,
                               "trainer_fits": None, "trainer_runs": False}
        # Compiled until the trainer's step is found; nothing where no candidate fits the
        # scheduler's budget (the job is not placed on this pool).
        if trainer == "jax_lora" and chosen is not None and runs is None:
            plan = plan_row(replace(job, batch=c.micro_batch, remat=c.remat), {pool.name: pool})
            row.update(xla_bytes=plan["per_device_bytes"], trainer_fits=plan["per_device_bytes"] <= limit,
                       compile_s=plan["compile_s"])
            if chosen is not None and i >= chosen and row["trainer_fits"]:
                row["trainer_runs"], runs = True, i
        rows.append(row)
        xla = "" if row["xla_bytes"] is None else (
            f"  XLA {row['xla_bytes'] / GIB:7.2f} GiB ({'fits' if row['trainer_fits'] else 'over'}; "
            f"estimator / XLA {c.planned_bytes / row['xla_bytes']:.3f}; compile {row['compile_s']} s)")
        marks = ("  <- scheduler" if row["chosen"] else "") + ("  <- trainer runs" if row["trainer_runs"] else "")
        show(f"  micro-batch {c.micro_batch:2d} {c.remat:13s} estimator {c.planned_bytes / GIB:7.2f} GiB "
             f"({'fits' if c.fits else 'over'}){xla}{marks}")
    return {"model": job.model, "method": job.method, "pool": pool.name, "trainer": trainer, "devices": job.devices,
            "seq": job.seq, "global_batch": global_batch, "budget_bytes": int(pool.gpu_memory_bytes * HEADROOM),
            "limit_bytes": limit, "candidates": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-405b", help=f"one of {', '.join(MODELS)} or a model dir")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--method", choices=("lora", "qlora"), default="lora")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="micro batch rows per data-parallel rank")
    parser.add_argument("--remat", choices=("none", "per_layer", "dots_saveable"), default="per_layer")
    parser.add_argument("--tensor", type=int, default=1, help="tensor axis of the mesh (fsdp = devices / tensor)")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGET_MODULES),
                        help="LoRA target modules, comma-separated")
    parser.add_argument("--pool", default="mi300x", help=f"a pool of {POOLS_FILE.relative_to(ROOT)}")
    parser.add_argument("--keep-bf16", action="store_true",
                        help="compile bfloat16 as it is (XLA:CPU then upcasts it; see PlanJob.bf16_standin)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--all", action="store_true", help="the recorded rows (ignores the job options)")
    parser.add_argument("--candidates", action="store_true",
                        help="the step choice's candidates for the job on every GPU pool (ignores --batch, --remat)")
    parser.add_argument("--global-batch", type=int, default=8, help="with --candidates: the job's batch")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    show = (lambda row: print_row(row, file=sys.stderr)) if args.json else print_row
    if args.all:
        result = run_all(show)
        result["wall_s"] = round(time.perf_counter() - started, 1)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"all rows in {result['wall_s']} s")
        return 0
    job = PlanJob(args.model, args.devices, args.method, args.seq, args.batch, args.remat, args.tensor,
                  r=args.r, target_modules=tuple(args.targets.split(",")), pool=args.pool,
                  bf16_standin=None if args.keep_bf16 else "float16")
    if args.candidates:
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else \
            (lambda line: print(line, flush=True))
        plans = [candidate_rows(replace(job, pool=pool.name), args.global_batch, pool, say)
                 for pool in pools_by_name().values() if pool.accelerator != "cpu"]
        if args.json:
            print(json.dumps({"plans": plans, "wall_s": round(time.perf_counter() - started, 1)}, indent=2))
        return 0
    row = plan_row(job)
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print_row(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
