"""Llama-3.1-8B-shaped QLoRA on CPU: load and step memory per process, vs the estimator.

Opt-in benchmark (not part of CI): it writes a ~16 GB checkpoint and trains an 8B model
on the CPU, which takes a long time on a small machine.

1. A checkpoint with Llama-3.1-8B's shapes (bench/model_configs/llama-3.1-8b, optionally
   fewer layers with ``--layers``: same widths and vocabulary) and random bf16 weights is
   written once, shard by shard (each tensor from its own seeded torch generator, so
   only one shard is ever in memory), with ``model.safetensors.index.json`` and the
   byte-level tokenizer of ``trainers.common.tiny_model`` (the model's vocabulary is
   larger than the tokenizer's: the extra rows are never read, as in padded vocabularies).
   It is cached under ``--data-dir``; a ``complete.json`` marks a finished write.
2. Each trainer runs through its real entry point, ``python -m trainers --spec``: NF4
   QLoRA r 8 on q/k/v/o, seq 256, one row per process/device (batch 2 over 2 ranks of
   ``fsdp_qlora``, or a 2-device ``fsdp`` mesh of ``jax_lora``), 2 steps, then the final
   checkpoint and the PEFT export. Precision is what ``worker.spec_builder`` gives CPU
   pools (fp32) unless ``--precision bf16``.
3. Every process of the job (the launcher and its ranks) is sampled every 0.2 s
   (``VmRSS``/``VmHWM`` from /proc). When the trainer reports "model loaded" the peak so
   far is the load peak and the RSS then is the process's loaded share; the high-water
   mark is then reset (``clear_refs``), so the one read at the second step's metric is
   the steps' peak alone. Time to first step is the first metric's time minus the job's
   start; seconds per step come from the metrics' ``tokens_per_s``.
4. ``scheduling.estimator.memory_per_gpu(..., accelerator="cpu")`` predicts each
   process's peak for the same job; the ratio to the measured peak is printed.
5. The exported adapter is loaded by ``peft`` on the checkpoint (quantized to NF4 by
   bitsandbytes, and as plain bf16 when the memory is there) and its logits on a short
   prompt are compared with those of the trainer's own model (``build_model`` in one
   process with the adapter's weights; ``fsdp_qlora`` only).

A guard stops the job (and reports it) if the machine's used memory passes ``--max-used-gib``.

    OMP_NUM_THREADS=2 .venv/bin/python bench/scale_8b_cpu.py --layers 2       # quick check
    OMP_NUM_THREADS=2 .venv/bin/python bench/scale_8b_cpu.py --trainers fsdp_qlora
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG_8B = ROOT / "bench" / "model_configs" / "llama-3.1-8b" / "config.json"
GIB = 2**30
MIB = 2**20
SEQ = 256
STEPS = 2  # --steps
RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# A learning rate large enough that 2 steps move the logits measurably (the PEFT check
# must see an adapter that does something).
LEARNING_RATE = 1e-3
SHARD_BYTES = GIB  # what the writer holds at once
INIT_STD = 0.02  # Llama's initializer_range
PROMPT = "The quick brown fox jumps over the lazy dog."
SAMPLE_S = 0.2


# --------------------------------------------------------------------------- checkpoint


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint with ``config``'s shapes, in file order."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (v, h)))
    return out


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int,
                elem_bytes: int = 2) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group tensors in order into shards of at most ``shard_bytes`` (a larger tensor alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = elem_bytes * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> Any:
    """A bf16 tensor: norms are ones (as initialized), matrices N(0, INIT_STD^2) from a
    generator seeded by ``seed``, so each tensor can be made without the others."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.bfloat16).mul_(INIT_STD)


def model_config(layers: int) -> dict[str, Any]:
    """Llama-3.1-8B's config with ``layers`` decoder layers and the tiny tokenizer's ids."""
    from trainers.common.tiny_model import EOS, EOT, N_BYTE_TOKENS, SPECIAL_TOKENS

    config = json.loads(CONFIG_8B.read_text(encoding="utf-8"))
    special = {tok: N_BYTE_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS)}
    config.update(num_hidden_layers=layers, bos_token_id=N_BYTE_TOKENS,
                  eos_token_id=[special[EOS], special[EOT]], pad_token_id=N_BYTE_TOKENS + 2)
    return config


def write_random_checkpoint(out: Path, config: dict[str, Any], shard_bytes: int = SHARD_BYTES) -> Path:
    """Write (once) a random bf16 checkpoint of ``config`` (whose token ids must be the
    tiny tokenizer's, see :func:`model_config`); returns its directory."""
    from safetensors.torch import save_file

    from trainers.common.tiny_model import build_tiny_tokenizer

    if (out / "complete.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out)
    assert tokenizer.pad_token_id == config["pad_token_id"] and tokenizer.bos_token_id == config["bos_token_id"]
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    shards = plan_shards(tensor_shapes(config), shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    seed = 0
    started = time.perf_counter()
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            tensors[name] = random_tensor(name, shape, seed)
            seed += 1
            weight_map[name] = file
            total += 2 * _numel(shape)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
        print(f"wrote {file} ({time.perf_counter() - started:.0f} s)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    (out / "complete.json").write_text(json.dumps({"layers": config["num_hidden_layers"], "bytes": total}),
                                       encoding="utf-8")
    return out


def write_data(path: Path) -> Path:
    """Prompt/completion rows whose completion alone is longer than SEQ byte tokens, so
    every row is truncated to exactly SEQ tokens."""
    text = "Sixty zippers were quickly picked from the woven jute bag. " * (SEQ // 50 + 2)
    rows = [{"prompt": f"Row {i}:", "completion": text[i:]} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- the job


def trainer_spec(trainer: str, model_dir: Path, data: Path, run: Path, precision: str,
                 checkpointing: bool = False) -> dict[str, Any]:
    """2 processes (fsdp_qlora) or a 2-device fsdp mesh in one process (jax_lora); one
    row per rank per step; activation checkpointing off (the CPU pools' setting) unless
    ``checkpointing`` (the GPU pools' setting: non-reentrant / per-layer remat)."""
    dtype = "float32" if precision == "fp32" else "bfloat16"
    parallelism: dict[str, Any] = {"world_size": 2,
                                   "activation_checkpointing": "non_reentrant" if checkpointing else "none"}
    if trainer == "jax_lora":
        parallelism = {"host_devices": 2, "mesh": {"data": 1, "fsdp": 2, "tensor": 1},
                       "remat": "per_layer" if checkpointing else "none"}
    return {
        "job_id": f"ftjob-scale-{run.name}", "trainer": trainer, "model": {"path": str(model_dir)},
        "data": {"train_file": str(data), "format": "prompt_completion", "max_seq_len": SEQ, "shuffle": False},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 1,
                            "learning_rate": LEARNING_RATE, "max_steps": STEPS, "lr_scheduler": "constant"},
        "adapter": {"method": "qlora", "quantization": "nf4", "r": RANK, "alpha": 2.0 * RANK,
                    "target_modules": list(TARGETS)},
        "parallelism": parallelism,
        "precision": {"base_dtype": dtype, "compute_dtype": dtype, "adapter_dtype": "float32"},
        "output_dir": str(run / "output"),
        "checkpoint": {"dir": str(run / "checkpoints"), "every_n_steps": 1000, "keep_last": 1},
        "seed": 0,
    }


def predicted_bytes(trainer: str, config: dict[str, Any], precision: str, checkpointing: bool = False) -> int:
    """The estimator's CPU prediction for one process of the job of :func:`trainer_spec`.

    Per device; jax_lora's two host devices live in one process, which holds both devices'
    tensors and one framework footprint.
    """
    from scheduling.estimator import ModelShape, TrainingShape, memory_per_gpu

    training = TrainingShape(method="qlora", quantization="nf4", r=RANK, target_modules=TARGETS, seq_len=SEQ,
                             micro_batch=1, checkpointing=checkpointing, cpu_offload="never",
                             compute_bytes=4 if precision == "fp32" else 2)
    mem = memory_per_gpu(ModelShape.from_hf_config(config), training, 2, accelerator="cpu", trainer=trainer)
    devices = 2 if trainer == "jax_lora" else 1
    return devices * mem.model_bytes + mem.framework


def layer_bytes(config: dict[str, Any]) -> int:
    """One decoder layer's weights in 16 bits."""
    return 2 * sum(_numel(s) for n, s in tensor_shapes(config) if n.startswith("model.layers.0."))


def machine_used_bytes() -> int:
    """MemTotal - MemAvailable: what every process on the machine holds."""
    info: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, value = line.split(":")
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def _status_bytes(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1]) * 1024
    return out


def _reset_hwm(pid: int) -> None:
    # Writing 5 to clear_refs sets the process's peak-RSS counter to its current RSS.
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


@dataclass
class ProcessMemory:
    """What the sampler saw of one process of the job."""

    role: str
    load_peak: int = 0
    loaded_rss: int = 0
    steps_peak: int = 0
    save_peak: int = 0
    phase: str = "load"

    def as_row(self) -> dict[str, Any]:
        return {"process": self.role, "load_peak_mib": round(self.load_peak / MIB),
                "loaded_rss_mib": round(self.loaded_rss / MIB), "steps_peak_mib": round(self.steps_peak / MIB),
                "save_peak_mib": round(self.save_peak / MIB)}


@dataclass
class JobSampler:
    """Samples the job's processes and follows its report file (see the module docstring)."""

    root_pid: int
    root_role: str
    reports: Path
    max_used: int
    processes: dict[int, ProcessMemory] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    seen_at: dict[str, float] = field(default_factory=dict)
    stopped_for_memory: int | None = None
    machine_peak: int = 0
    _offset: int = 0

    def _role(self, pid: int) -> str:
        if pid == self.root_pid:
            return self.root_role
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            return f"rank {env[b'RANK'].decode()}"
        except (OSError, KeyError):
            return f"pid {pid}"

    def _pids(self) -> list[int]:
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            return [self.root_pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _read_reports(self) -> list[dict[str, Any]]:
        if not self.reports.exists():
            return []
        new = []
        with open(self.reports, encoding="utf-8") as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self._offset += len(line.encode("utf-8"))
                new.append(json.loads(line))
        self.items += new
        return new

    def _mark(self) -> str | None:
        """The phase boundary the new report items cross, if any."""
        for item in self._read_reports():
            if item.get("type") == "event" and item.get("message") == "model loaded":
                self.seen_at.setdefault("loaded", time.time())
                return "steps"
            if item.get("type") == "metric" and item.get("step") == STEPS:
                self.seen_at.setdefault("steps_done", time.time())
                return "save"
        return None

    def sample_once(self) -> None:
        boundary = self._mark()
        for pid in self._pids():
            if pid not in self.processes:
                self.processes[pid] = ProcessMemory(self._role(pid))
            mem = self.processes[pid]
            try:
                status = _status_bytes(pid)
            except OSError:
                continue
            rss, hwm = status.get("VmRSS", 0), status.get("VmHWM", 0)
            if mem.phase == "load":
                mem.load_peak = max(mem.load_peak, hwm)
            elif mem.phase == "steps":
                mem.steps_peak = max(mem.steps_peak, hwm)
            else:
                mem.save_peak = max(mem.save_peak, hwm)
            if boundary == "steps" and mem.phase == "load":
                mem.loaded_rss, mem.phase = rss, "steps"
                _reset_hwm(pid)
            elif boundary == "save" and mem.phase == "steps":
                mem.phase = "save"
                _reset_hwm(pid)
        used = machine_used_bytes()
        self.machine_peak = max(self.machine_peak, used)
        if used > self.max_used and self.stopped_for_memory is None:
            self.stopped_for_memory = used
            os.killpg(self.root_pid, signal.SIGKILL)

    def follow(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            self.sample_once()
            time.sleep(SAMPLE_S)
        self._read_reports()


def run_job(trainer: str, model_dir: Path, run: Path, precision: str, max_used: int,
            timeout_s: float, checkpointing: bool = False) -> dict[str, Any]:
    """Run one trainer job and measure it; returns the measured row."""
    from worker.executors.local.process import trainer_env

    run.mkdir(parents=True, exist_ok=True)
    spec = trainer_spec(trainer, model_dir, write_data(run / "train.jsonl"), run, precision, checkpointing)
    (run / "spec.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
    reports = run / "checkpoints" / "reports.jsonl"
    reports.unlink(missing_ok=True)
    env = {**os.environ, **trainer_env(trainer)}
    started = time.time()
    with open(run / "trainer.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainers", "--spec", str(run / "spec.json")], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = JobSampler(proc.pid, "launcher" if trainer == "fsdp_qlora" else "trainer", reports, max_used)
        timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            sampler.follow(proc)
        finally:
            timer.cancel()
    metrics = [i for i in sampler.items if i.get("type") == "metric"]
    loaded = next((i["data"] for i in sampler.items if i.get("message") == "model loaded"), {})
    step_s, seen = [], 0
    for m in metrics:
        step_s.append(round((m["tokens_seen"] - seen) / m["tokens_per_s"], 1) if m.get("tokens_per_s") else None)
        seen = m["tokens_seen"]
    return {
        "trainer": trainer, "exit_code": proc.returncode, "wall_s": round(time.time() - started),
        "load_s": loaded.get("seconds"),
        # Rank 0's own reading when it finished loading. The sampler's "loaded" RSS is read
        # when the event reaches the reports file, which can be after the first step began.
        "rank0_loaded_peak_mib": round(loaded["peak_rss_bytes"] / MIB) if loaded.get("peak_rss_bytes") else None,
        "rank0_param_mib": round(loaded["local_param_bytes"] / MIB) if loaded.get("local_param_bytes") else None,
        "time_to_first_step_s": round(metrics[0]["time"] - started, 1) if metrics else None,
        "step_s": step_s, "losses": [m["train_loss"] for m in metrics],
        "processes": [p.as_row() for p in sampler.processes.values()],
        "machine_used_peak_gib": round(sampler.machine_peak / GIB, 2),
        "stopped_for_memory_gib": None if sampler.stopped_for_memory is None
        else round(sampler.stopped_for_memory / GIB, 2),
        "errors": [i for i in sampler.items if i.get("type") == "error"],
    }


# --------------------------------------------------------------------------- PEFT check


def prompt_ids(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok(PROMPT, return_tensors="pt")["input_ids"]


def trainer_logits(model_dir: Path, adapter_dir: Path, precision: str, out: Path) -> None:
    """The fsdp_qlora trainer's own model (one process) with the exported adapter's weights."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from trainers.fsdp_qlora.checkpoint import peft_weights
    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model, lora_parameters

    dtype = "float32" if precision == "fp32" else "bfloat16"
    opts = ModelOptions(model_dir=model_dir, base_dtype=dtype, compute_dtype=dtype, quantization="nf4",
                        lora_r=RANK, lora_alpha=2.0 * RANK, target_modules=TARGETS)
    model, _ = build_model(opts, DistContext(0, 1, 0, torch.device("cpu")))
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, param in lora_parameters(model):
            (key,) = peft_weights({name: param.detach()}).keys()
            param.copy_(saved[key].to(param.dtype))
        logits = model(input_ids=prompt_ids(model_dir)).logits.float()
    np.save(out, logits.numpy())


def peft_logits(model_dir: Path, adapter_dir: Path, base: str, precision: str, out: Path) -> None:
    """``peft`` on the checkpoint as the libraries load it: NF4 by bitsandbytes (in the
    trainer's compute dtype) or plain bf16; with and without the adapter."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if base == "nf4":
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, device_map="cpu", quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                bnb_4bit_quant_storage=dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, str(adapter_dir))
    # Train mode: on CPUs with avx512_bf16 bitsandbytes repacks an eval-mode 4-bit weight
    # into another layout, which changes the numbers (dropout is 0, so nothing else moves).
    model.train()
    ids = prompt_ids(model_dir)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits.float()
        with model.disable_adapter():
            plain = model(input_ids=ids).logits.float()
    np.save(out, np.stack([adapted.numpy(), plain.numpy()]))


def compare_with_peft(model_dir: Path, run: Path, precision: str, layers: int, max_used: int,
                      timeout_s: float) -> dict[str, Any]:
    """Max |logit difference| of peft (each base) against the trainer's model."""
    import numpy as np

    adapter = run / "output" / "adapter"
    result: dict[str, Any] = {}
    steps = [("trainer", [])]
    # bf16 holds the whole model densely (2 bytes/param): only with room for it.
    dense = 2 * sum(_numel(s) for _, s in tensor_shapes(model_config(layers)))
    bases = ["nf4"] + (["bf16"] if machine_used_bytes() + dense + 2 * GIB < max_used else [])
    if "bf16" not in bases:
        result["bf16_skipped"] = f"a dense bf16 model needs {dense / GIB:.1f} GiB; not enough free memory"
    steps += [(f"peft-{b}", [b]) for b in bases]
    for name, extra in steps:
        out = run / f"logits-{name}.npy"
        proc = subprocess.Popen([sys.executable, __file__, "--logits", name, str(model_dir), str(adapter), str(out),
                                 "--precision", precision, *extra], cwd=ROOT, start_new_session=True)
        sampler = JobSampler(proc.pid, name, run / "no-reports.jsonl", max_used)
        timer = threading.Timer(timeout_s, lambda p=proc: os.killpg(p.pid, signal.SIGKILL))
        timer.start()
        try:
            sampler.follow(proc)
        finally:
            timer.cancel()
        result[f"{name}_peak_gib"] = round(max(p.load_peak for p in sampler.processes.values()) / GIB, 2)
        if proc.returncode != 0:
            result[f"{name}_failed"] = proc.returncode if sampler.stopped_for_memory is None else "memory guard"
    ours_path = run / "logits-trainer.npy"
    if not ours_path.exists():
        return result
    ours = np.load(ours_path)
    for b in bases:
        path = run / f"logits-peft-{b}.npy"
        if path.exists():
            adapted, plain = np.load(path)
            result[f"peft_{b}_vs_trainer_max_abs"] = float(np.abs(adapted - ours).max())
            result[f"peft_{b}_adapter_effect_max_abs"] = float(np.abs(adapted - plain).max())
    return result


# --------------------------------------------------------------------------- main


def main() -> None:
    global STEPS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--trainers", default="fsdp_qlora,jax_lora")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--data-dir", type=Path, default=Path.home() / ".cache" / "tunefleet-bench")
    p.add_argument("--max-used-gib", type=float, default=20.0, help="stop a job if the machine uses more")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per trainer job")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per job (the steps' peak covers all)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing on (the GPU pools' setting; CPU pools run without)")
    p.add_argument("--logits", nargs=4, metavar=("WHICH", "MODEL", "ADAPTER", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("base", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    STEPS = args.steps
    if args.logits:
        which, model_dir, adapter, out = args.logits
        if which == "trainer":
            trainer_logits(Path(model_dir), Path(adapter), args.precision, Path(out))
        else:
            peft_logits(Path(model_dir), Path(adapter), args.base, args.precision, Path(out))
        return
    name = "llama-3.1-8b-random" + ("" if args.layers == 32 else f"-{args.layers}layers")
    config = model_config(args.layers)
    model_dir = write_random_checkpoint(args.data_dir / name, config)
    max_used = int(args.max_used_gib * GIB)
    print(json.dumps({"model": str(model_dir), "layers": args.layers, "precision": args.precision,
                      "load_average": os.getloadavg()}), flush=True)
    for trainer in [t for t in args.trainers.split(",") if t]:  # --trainers "": only write the checkpoint
        run = args.data_dir / "runs" / (f"{name}-{trainer}-{args.precision}" + ("-ckpt" if args.checkpointing else ""))
        row = run_job(trainer, model_dir, run, args.precision, max_used, args.timeout_s, args.checkpointing)
        predicted = predicted_bytes(trainer, config, args.precision, args.checkpointing)
        row["predicted_per_process_mib"] = round(predicted / MIB)
        for proc_row in row["processes"]:
            if proc_row["process"] != "launcher" and proc_row["loaded_rss_mib"]:  # it finished loading
                peak = max(proc_row["load_peak_mib"], proc_row["steps_peak_mib"])
                proc_row["predicted_over_measured"] = round(predicted / MIB / peak, 3) if peak else None
                # The loader's promise: beyond its final share a process holds at most one
                # layer in 16 bits (rank 0: plus the one tensor being read, cast and sent).
                proc_row["load_transient_mib"] = proc_row["load_peak_mib"] - proc_row["loaded_rss_mib"]
        row["one_layer_bf16_mib"] = round(layer_bytes(config) / MIB)
        row["largest_tensor_bf16_mib"] = round(2 * max(_numel(s) for _, s in tensor_shapes(config)) / MIB)
        row["load_average"] = os.getloadavg()
        if trainer == "fsdp_qlora" and row["exit_code"] == 0 and not args.skip_peft:
            row["peft"] = compare_with_peft(model_dir, run, args.precision, args.layers, max_used, args.timeout_s)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
