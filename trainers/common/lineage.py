"""A job that continues a fine-tuned model: the parent's LoRA, frozen, beside the one it trains.

Stacked, not merged. The parent's adapter stays a LoRA of its own, frozen, on the same base
weights the parent trained on (quantized or not, exactly as the parent stored them), so the
child starts from exactly the function the parent computed; its new adapter (B zero at
init) trains on top. Merging the parent into the base instead would round ``W + s B A`` to
the base dtype (bf16 on GPUs), and on a 4-bit base, quantizing the merged weight is not
the function the parent trained against.

At export the chain is folded into ONE ordinary PEFT adapter over the original base::

    W + s1 B1 A1 + s2 B2 A2 = W + [s1 B1 | s2 B2] @ [A1 ; A2]

a LoRA of rank r1 + r2 with ``lora_alpha`` = rank (scale 1) and each adapter's scale
folded into its ``lora_B`` columns: exact, and it loads in plain transformers + peft, so
serving, downloads and merged exports treat it like any adapter. A module only one side
targets contributes zero rows (A) and columns (B) on the other side, so the folded adapter
targets the union of both sides' modules. A parent that itself continued a model was
exported folded, so one frozen adapter always carries the whole chain; its rank is the
chain's total.

The same fold serves both trainers: the frozen adapter a recipe applies is the fold of its
parents (:func:`read_parent_adapters`, scale 1), and every adapter a recipe writes, final or
checkpoint, is the fold of that and its own (:func:`write_job_adapter`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainers.common.outputs import finish_adapter
from trainers.common.peft_export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    lora_key,
    read_peft_adapter,
    validate_adapter_weights,
    write_peft_adapter,
)
from trainers.errors import UserError

# PEFT's saved key of one factor: (layer, module, "A" | "B").
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$")
# The order the folded adapter lists its modules in (and the trainers' projection order).
MODULE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraWeights:
    """A LoRA adapter as PEFT saves it: ``delta W = scaling * B @ A`` for each (layer, module)
    of ``weights`` (PEFT keys, ``lora_A`` (r, in) and ``lora_B`` (out, r))."""

    r: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: Mapping[str, np.ndarray]


def _factors(adapter: LoraWeights) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in adapter.weights.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"not a PEFT LoRA key: {key!r}")
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = value
    return pairs


def fold(adapters: Sequence[LoraWeights]) -> LoraWeights:
    """One LoRA equal to the sum of ``adapters`` (module docstring): rank the sum of theirs,
    scale 1, the union of their modules; float32."""
    if not adapters:
        raise ValueError("nothing to fold")
    sides = [_factors(a) for a in adapters]
    pairs = sorted(set().union(*sides), key=lambda p: (p[0], MODULE_ORDER.index(p[1])))
    weights: dict[str, np.ndarray] = {}
    for layer, module in pairs:
        # The module's shape from a side that has it: (in,) of A and (out,) of B.
        known = next(side[(layer, module)] for side in sides if (layer, module) in side)
        n_in, n_out = known["A"].shape[1], known["B"].shape[0]
        a_blocks, b_blocks = [], []
        for adapter, side in zip(adapters, sides, strict=True):
            pair = side.get((layer, module))
            if pair is None:
                a_blocks.append(np.zeros((adapter.r, n_in), np.float32))
                b_blocks.append(np.zeros((n_out, adapter.r), np.float32))
            else:
                a_blocks.append(np.asarray(pair["A"], np.float32))
                b_blocks.append(np.asarray(pair["B"], np.float32) * np.float32(adapter.scaling))
        weights[lora_key(layer, module, "A")] = np.concatenate(a_blocks, axis=0)
        weights[lora_key(layer, module, "B")] = np.concatenate(b_blocks, axis=1)
    modules = set().union(*(a.target_modules for a in adapters))
    return LoraWeights(r=sum(a.r for a in adapters), scaling=1.0,
                       target_modules=tuple(m for m in MODULE_ORDER if m in modules), weights=weights)


def read_adapter(adapter_dir: str | Path) -> tuple[LoraWeights, dict[str, Any]]:
    """A PEFT LoRA adapter directory as :class:`LoraWeights`, and its config.

    Raises:
        UserError: ``parent_adapter_not_found`` (no adapter there), ``invalid_parent_adapter``
            (not a plain LoRA of the decoder's projections: DoRA, rsLoRA, per-module ranks
            or scales, other modules, inconsistent shapes).
    """
    d = Path(adapter_dir)
    if not (d / ADAPTER_CONFIG).is_file() or not (d / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"no PEFT adapter at {adapter_dir} ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})",
                        code="parent_adapter_not_found")
    try:
        config, weights = read_peft_adapter(d)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read the adapter at {adapter_dir}: {exc}", code="invalid_parent_adapter") from exc
    plain = (config.get("peft_type") == "LORA" and not config.get("use_dora") and not config.get("use_rslora")
             and not config.get("rank_pattern") and not config.get("alpha_pattern")
             and isinstance(config.get("r"), int) and config["r"] > 0)
    modules = config.get("target_modules") or []
    if not plain or not isinstance(modules, list) or not set(modules) <= set(MODULE_ORDER):
        raise UserError(
            f"the adapter at {adapter_dir} is not a plain LoRA of the decoder's projections (one r and "
            f"lora_alpha, no DoRA or rsLoRA, target_modules among {', '.join(MODULE_ORDER)})",
            code="invalid_parent_adapter")
    try:
        validate_adapter_weights(weights, r=config["r"], target_modules=modules)
    except ValueError as exc:
        raise UserError(f"the adapter at {adapter_dir}: {exc}", code="invalid_parent_adapter") from exc
    return LoraWeights(r=config["r"], scaling=float(config["lora_alpha"]) / config["r"],
                       target_modules=tuple(m for m in MODULE_ORDER if m in modules), weights=weights), config


def read_parent_adapters(spec: Any) -> LoraWeights | None:
    """The frozen adapter a recipe applies for ``spec.model.parent_adapters``: their fold
    (scale 1: its ``lora_B`` already holds each parent's scale), or None for a job that
    trains from the base model.

    Raises:
        UserError: what :func:`read_adapter` raises, and ``parent_adapter_mismatch`` for an
            adapter that names another base model than the job's.
    """
    if not spec.model.parent_adapters:
        return None
    base = spec.model.name or spec.model.path
    adapters = []
    for parent in spec.model.parent_adapters:
        adapter, config = read_adapter(parent.path)
        named = config.get("base_model_name_or_path")
        if named and named not in (base, spec.model.path):
            raise UserError(
                f"the adapter of {parent.name or parent.path} was trained on '{named}', this job trains "
                f"'{base}': a job continues a fine-tuned model of its own base model only",
                code="parent_adapter_mismatch")
        adapters.append(adapter)
    return fold(adapters)


def write_job_adapter(out_dir: str | Path, weights: Mapping[str, np.ndarray], spec: Any,
                      parent: LoraWeights | None) -> Path:
    """Write the adapter a job's model is (final output or checkpoint) into ``out_dir``:
    the trained LoRA ``weights`` (PEFT keys and orientation, ``spec.adapter``'s r and alpha),
    folded with the frozen ``parent`` when the job continues a fine-tuned model, then
    completed for use outside the service (``trainers.common.outputs.finish_adapter``)."""
    a = spec.adapter
    own = LoraWeights(r=a.r, scaling=a.alpha / a.r, target_modules=tuple(a.target_modules), weights=weights)
    written = own if parent is None else fold([parent, own])
    alpha = a.alpha if parent is None else float(written.r)
    write_peft_adapter(out_dir, written.weights, r=written.r, alpha=alpha, dropout=a.dropout,
                       target_modules=written.target_modules, base_model_name_or_path=spec.model.path,
                       dtype="float32")
    notes = []
    if parent is not None:
        names = ", ".join(f"`{p.name or p.path}`" for p in spec.model.parent_adapters)
        notes.append(
            f"Continues the fine-tuned model {names}: its adapter (rank {parent.r}) was frozen while this job "
            f"trained its own (rank {a.r}, lora_alpha {a.alpha:g}); the two are folded into this one LoRA of "
            f"rank {written.r} with lora_alpha {written.r} (scale 1, each adapter's scale folded into its "
            "lora_B columns), exactly their sum.")
    finish_adapter(out_dir, spec, notes=notes)
    return Path(out_dir)
