"""LoRA fine-tuning recipe (PyTorch, transformers + peft): single process, fp32/bf16.

Reads top to bottom like the run it performs:

    setup -> model -> LoRA -> data -> optimizer -> (resume) -> train loop -> export

The train loop does, per optimizer step: read ``batch_size / micro_batch_size``
micro-batches at the data cursor, back-propagate each with
``sum(token losses) / label tokens of the whole step`` (so the update does not depend on
how the step is split into micro-batches), clip, AdamW-update the LoRA parameters with
the shared schedule's learning rate, report metrics, evaluate and checkpoint on their
cadence, and stop cleanly on SIGTERM (checkpoint, report, ``Preempted``).

Determinism: with a fixed seed a resumed run reproduces the uninterrupted one bit for
bit on CPU: the data order comes from the saved cursor, and the checkpoint holds the
adapter, AdamW state, and the torch/python/numpy RNG states (LoRA dropout draws from
torch's generator).

Extension points for the multi-process FSDP / 4-bit path (same loop, same LoRA path
with a quantized base): :func:`load_base_model`, :func:`apply_lora`,
:func:`adapter_state_dict` (the gather before export) and :func:`save_recipe_checkpoint`
are the functions that change; ``parallelism.world_size > 1`` and quantized adapters are
refused here with ``invalid_parallelism`` / ``unsupported_quantization`` until then.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainers.common.checkpointing import (
    TrainerState,
    capture_host_rng,
    latest_checkpoint,
    load_trainer_state,
    restore_host_rng,
    save_checkpoint,
)
from trainers.common.data import IGNORE_INDEX, Batch, DataCursor, TrainingData, block_causal_mask
from trainers.common.job_data import (
    check_inputs_exist,
    load_job_data,
    load_tokenizer,
    total_optimizer_steps,
)
from trainers.common.memory import peak_rss_bytes
from trainers.common.outputs import ADAPTER_DIR, MetricsLog, finalize_outputs, write_training_config
from trainers.common.peft_export import write_peft_adapter
from trainers.common.reporter import Reporter
from trainers.common.schedules import learning_rate_at
from trainers.common.signals import StopFlag
from trainers.errors import Preempted, UserError
from trainers.spec import TrainerSpec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZER_FILE = "optimizer.pt"


@dataclass
class RunResult:
    """What a finished run leaves in memory (used by tests; the entry point ignores it)."""

    model: nn.Module
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None


# ---- model -------------------------------------------------------------------------------


def load_base_model(spec: TrainerSpec, device: torch.device) -> nn.Module:
    """The Hugging Face causal LM in ``precision.base_dtype``, frozen.

    Raises:
        UserError: ``unsupported_architecture`` (not a Llama), ``corrupt_model``
            (unreadable config or weights, or tensors missing/unexpected/mis-shaped).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(spec.model.path)
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot read {model_dir}/config.json: {exc}", code="corrupt_model") from exc
    if config.model_type != spec.model.architecture:
        raise UserError(
            f"model_type {config.model_type!r} is not supported (expected {spec.model.architecture!r})",
            code="unsupported_architecture",
        )
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[spec.precision.base_dtype], output_loading_info=True
        )
    except Exception as exc:  # safetensors/transformers raise many types for a broken file
        raise UserError(f"cannot load the weights in {model_dir}: {exc}", code="corrupt_model") from exc
    # transformers only warns about missing weights (and initializes them randomly):
    # training on that would silently produce garbage, so refuse.
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise UserError(f"the checkpoint in {model_dir} does not match its config: {problems}", code="corrupt_model")
    model.requires_grad_(False)
    return model.to(device)


def apply_lora(model: nn.Module, spec: TrainerSpec) -> nn.Module:
    """Wrap the base in peft LoRA (trainable adapters only) and put it in train mode.

    The LoRA init draws from torch's global generator, seeded by the recipe, so the
    initial adapter is a function of ``spec.seed``.
    """
    from peft import LoraConfig, get_peft_model

    a = spec.adapter
    config = LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        target_modules=list(a.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=a.use_dora,
    )
    peft_model = get_peft_model(model, config)
    if spec.precision.adapter_dtype != "float32":
        for p in peft_model.parameters():
            if p.requires_grad:
                p.data = p.data.to(DTYPES[spec.precision.adapter_dtype])
    # model.train(): dropout on, and (for 4-bit bases) the CPU layout pitfall in FACTS.md.
    peft_model.train()
    return peft_model


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter with PEFT's saved key names (``...q_proj.lora_A.weight``), on CPU, fp32."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in get_peft_model_state_dict(model).items()}


def export_adapter(model: nn.Module, spec: TrainerSpec, out_dir: Path) -> Path:
    """Write the adapter through the shared exporter (which validates PEFT key names)."""
    a = spec.adapter
    return write_peft_adapter(
        out_dir,
        {k: v.numpy() for k, v in adapter_state_dict(model).items()},
        r=a.r,
        alpha=a.alpha,
        dropout=a.dropout,
        target_modules=a.target_modules,
        base_model_name_or_path=spec.model.path,
    )


# ---- checkpoints -------------------------------------------------------------------------


def _encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode_rng(encoded: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(encoded), dtype=np.uint8).copy())


def _torch_rng_states() -> dict[str, Any]:
    """torch's CPU generator and, on GPU, every CUDA generator (dropout draws there)."""
    states: dict[str, Any] = {"torch": _encode_rng(torch.get_rng_state())}
    if torch.cuda.is_available():
        states["cuda"] = [_encode_rng(s) for s in torch.cuda.get_rng_state_all()]
    return states


def _set_torch_rng_states(states: dict[str, Any]) -> None:
    if "torch" in states:
        torch.set_rng_state(_decode_rng(states["torch"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode_rng(s) for s in states["cuda"]])


def save_recipe_checkpoint(
    spec: TrainerSpec, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState
) -> Path:
    """``step-N/``: PEFT adapter + AdamW state + trainer_state.json (cursor, RNG, metrics)."""
    state.rng = {**capture_host_rng(), "framework": _torch_rng_states()}

    def write_tensors(tmp: Path) -> None:
        export_adapter(model, spec, tmp / ADAPTER_DIR)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)

    return save_checkpoint(spec.checkpoint.dir, state, write_tensors, keep_last=spec.checkpoint.keep_last)


def resolve_resume(spec: TrainerSpec) -> Path | None:
    """The checkpoint to resume from: None, the newest in ``checkpoint.dir`` ('latest'),
    or an explicit directory (UserError ``checkpoint_not_found`` if it is not one)."""
    wanted = spec.checkpoint.resume_from
    if wanted is None:
        return None
    if wanted == "latest":
        return latest_checkpoint(spec.checkpoint.dir)
    path = Path(wanted)
    if not (path / "trainer_state.json").is_file():
        raise UserError(f"no checkpoint at {wanted}", code="checkpoint_not_found")
    return path


def load_recipe_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore adapter, AdamW state and RNG states; returns the trainer state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(path / ADAPTER_DIR / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"checkpoint {path} does not match this adapter: {unexpected[:3]}", code="corrupt_checkpoint")
    optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
    state = load_trainer_state(path)
    restore_host_rng(state.rng)
    _set_torch_rng_states(state.rng.get("framework", {}))
    return state


# ---- one step ----------------------------------------------------------------------------


def model_inputs(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors for the HF model. Packed rows get the 4-D block-diagonal causal mask (True =
    may attend) so packed examples never see each other; unpacked rows the padding mask."""
    inputs = {
        "input_ids": torch.from_numpy(batch.input_ids).to(device),
        "position_ids": torch.from_numpy(batch.position_ids).to(device),
    }
    if int(batch.segment_ids.max(initial=0)) > 1:
        inputs["attention_mask"] = torch.from_numpy(block_causal_mask(batch.segment_ids)).to(device)
    else:
        inputs["attention_mask"] = torch.from_numpy(batch.attention_mask).to(device)
    return inputs


def token_losses(model: nn.Module, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropy over label tokens, correct predictions, label count)."""
    logits = model(**model_inputs(batch, device)).logits[:, :-1, :].float()
    labels = torch.from_numpy(batch.labels[:, 1:]).to(device)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    mask = labels != IGNORE_INDEX
    correct = ((logits.argmax(-1) == labels) & mask).sum()
    return loss_sum, correct, mask.sum()


@torch.no_grad()
def evaluate(model: nn.Module, data: TrainingData, device: torch.device, max_batches: int | None) -> dict[str, float]:
    """Mean token loss and next-token accuracy over the validation batches (eval mode)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    batches = data.micro_batches()
    for _ in range(min(data.micro_batches_per_epoch(0), max_batches or 1 << 30)):
        ls, c, n = token_losses(model, next(batches), device)
        loss_sum, correct, count = loss_sum + float(ls), correct + int(c), count + int(n)
    model.train()
    return {"valid_loss": loss_sum / max(count, 1), "token_accuracy": correct / max(count, 1)}


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def _take(batches: Iterator[Batch], n: int) -> list[Batch]:
    return [next(batches) for _ in range(n)]


# ---- the recipe --------------------------------------------------------------------------


def run(spec: TrainerSpec, *, reporter: Reporter, stop: StopFlag) -> RunResult:
    """Train the LoRA adapter described by ``spec``; see the module docstring."""
    # -- setup: refuse what this path cannot do, fail fast on missing inputs --------------
    if spec.parallelism.world_size != 1 or spec.adapter.quantization != "none":
        # N processes (FSDP2) and/or a 4-bit base: the same loop with the low-memory
        # loader, sharded step and DCP checkpoints (trainers.fsdp_qlora.distributed_recipe).
        from trainers.fsdp_qlora.distributed_recipe import run as run_distributed

        return run_distributed(spec, reporter=reporter, stop=stop)
    check_inputs_exist(spec)
    hp = spec.hyperparameters
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(spec.seed)
    np.random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    output_dir = Path(spec.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    reporter.event("trainer started", data={"trainer": "fsdp_qlora", "device": str(device)})

    # -- model + LoRA --------------------------------------------------------------------
    tokenizer = load_tokenizer(spec.model.path)
    model = apply_lora(load_base_model(spec, device), spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)

    # -- data ----------------------------------------------------------------------------
    data = load_job_data(spec, tokenizer)
    total_steps = total_optimizer_steps(spec, data.train)
    micro_per_step = hp.batch_size // hp.micro_batch_size
    reporter.event("data ready", data={**data.stats(), "total_steps": total_steps, "trainable_params": n_trainable})
    if data.train.dataset.n_truncated:
        reporter.event(f"{data.train.dataset.n_truncated} example(s) truncated to max_seq_len={spec.data.max_seq_len}",
                       level="warning")

    # -- optimizer (LoRA params only; the frozen base carries no state) -------------------
    optimizer = torch.optim.AdamW(trainable, lr=hp.learning_rate, weight_decay=hp.weight_decay)

    # -- resume --------------------------------------------------------------------------
    step, cursor, tokens_seen = 0, DataCursor(), 0
    last_metrics: dict[str, float | None] = {"train_loss": None, "valid_loss": None, "token_accuracy": None}
    resume_path = resolve_resume(spec)
    if resume_path is not None:
        state = load_recipe_checkpoint(resume_path, model, optimizer)
        step, cursor = state.step, state.cursor
        tokens_seen = int(state.extra.get("tokens_seen", 0))
        last_metrics.update(state.metrics)
        reporter.event(f"resumed from {resume_path.name}", data={"step": step, "cursor": cursor.to_dict()})
    metrics_log = MetricsLog(output_dir, resume_step=step if resume_path is not None else None)
    batches = data.train.micro_batches(cursor)
    losses: dict[int, float] = {}
    autocast = (
        torch.autocast(device.type, dtype=DTYPES[spec.precision.compute_dtype])
        if spec.precision.compute_dtype != spec.precision.base_dtype
        else nullcontext()
    )

    def checkpoint_now() -> Path:
        state = TrainerState(step=step, epoch=cursor.epoch, cursor=cursor, metrics=dict(last_metrics),
                             extra={"tokens_seen": tokens_seen})
        path = save_recipe_checkpoint(spec, model, optimizer, state)
        reporter.checkpoint(step, str(path), dict(last_metrics))
        return path

    # -- train loop ----------------------------------------------------------------------
    while step < total_steps:
        if stop.requested:
            if step == 0:
                raise Preempted(f"{stop.signal_name} before the first step; nothing to checkpoint")
            path = checkpoint_now()
            raise Preempted(f"{stop.signal_name} at step {step}; checkpoint {path}")
        started = time.perf_counter()
        micro = _take(batches, micro_per_step)
        n_labels = sum(b.n_label_tokens for b in micro)
        lr = learning_rate_at(step, base_lr=hp.learning_rate, total_steps=total_steps,
                              warmup_steps=hp.warmup_steps, kind=hp.lr_scheduler)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = 0.0
        for batch in micro:
            with autocast:
                loss_sum, _, _ = token_losses(model, batch, device)
            if not torch.isfinite(loss_sum):
                raise UserError(
                    f"the loss is {float(loss_sum.detach())} at step {step + 1}; lower the learning rate or check the "
                    "model and data", code="nan_loss")
            (loss_sum / n_labels).backward()
            step_loss += float(loss_sum.detach())
        if hp.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, hp.max_grad_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None]))
        if not np.isfinite(grad_norm):
            raise UserError(f"the gradient norm is {grad_norm} at step {step + 1}", code="nan_loss")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        cursor = micro[-1].cursor_after
        step_tokens = sum(b.n_tokens for b in micro)
        tokens_seen += step_tokens
        elapsed = time.perf_counter() - started
        train_loss = step_loss / n_labels
        losses[step] = train_loss
        last_metrics["train_loss"] = train_loss
        row: dict[str, Any] = {
            "step": step, "total_steps": total_steps, "epoch": cursor.epoch if cursor.position else cursor.epoch - 1,
            "train_loss": train_loss, "learning_rate": lr, "grad_norm": grad_norm,
            "tokens_per_s": step_tokens / elapsed if elapsed > 0 else None, "tokens_seen": tokens_seen,
            "memory_bytes": memory_bytes(device), "valid_loss": None, "token_accuracy": None,
        }
        if data.validation is not None and spec.eval.every_n_steps and (
            step % spec.eval.every_n_steps == 0 or step == total_steps
        ):
            row.update(evaluate(model, data.validation, device, spec.eval.max_batches))
            last_metrics.update(valid_loss=row["valid_loss"], token_accuracy=row["token_accuracy"])
        metrics_log.append({**row, "time": time.time()})
        reporter.metric(**row)
        if step % spec.checkpoint.every_n_steps == 0 and step < total_steps:
            checkpoint_now()

    # -- export --------------------------------------------------------------------------
    checkpoint_now()  # the final state, so a lost export can be redone without training
    export_adapter(model, spec, output_dir / ADAPTER_DIR)
    write_training_config(output_dir, spec)
    (output_dir / "data_stats.json").write_text(json.dumps(data.stats(), indent=2), encoding="utf-8")
    files = finalize_outputs(output_dir)
    reporter.artifacts(str(output_dir), files)
    reporter.event("training finished", data={"step": step, "train_loss": last_metrics["train_loss"]})
    return RunResult(model=model, final_step=step, losses=losses, output_dir=output_dir)
