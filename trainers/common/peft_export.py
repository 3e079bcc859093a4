"""Write a LoRA adapter in PEFT's on-disk format, and the checksum manifest of an output dir.

Both trainers export through this module, so every job's adapter has the same layout:
``adapter_config.json`` (a PEFT ``LoraConfig``, ``peft_type`` LORA) and
``adapter_model.safetensors`` whose keys are PEFT's saved names, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (no adapter name:
PEFT strips ``.default`` when saving and adds it back when loading).

Orientation follows ``torch.nn.Linear`` (what PEFT stores): ``lora_A`` is ``(r, in)`` and
``lora_B`` is ``(out, r)``; the adapter's delta is ``scaling * B @ A`` with
``scaling = alpha / r``. A JAX trainer that keeps ``x @ A`` with ``A: (in, r)`` passes
transposed arrays. numpy + safetensors only (no torch import).

An adapter leaves the service usable on its own (:func:`complete_adapter_dir`): its
``base_model_name_or_path`` is the base model's public id (what the Hub calls it, not the
storage path it was trained from), the base model's tokenizer files sit next to it, and a
model card ``README.md`` (``library_name: peft``, ``base_model:``) records how it was
trained, so ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` and
``AutoTokenizer.from_pretrained(adapter_dir)`` work wherever the base id resolves.

DoRA adapters are out of scope here: ``use_dora`` is refused until a trainer produces the
magnitude vectors PEFT needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_CARD = "README.md"
MANIFEST = "manifest.json"
# What transformers' tokenizers save (fast and slow, chat template included): the files
# copied from the base model into an exported adapter.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)

_MODULE_PARENT = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


def lora_key(layer: int, module: str, which: str) -> str:
    """PEFT's saved key for ``which`` ('A' or 'B') of ``module`` (e.g. 'q_proj') in ``layer``."""
    if module not in _MODULE_PARENT:
        raise ValueError(f"unknown LoRA target module {module!r}")
    if which not in ("A", "B"):
        raise ValueError("which must be 'A' or 'B'")
    return f"base_model.model.model.layers.{layer}.{_MODULE_PARENT[module]}.{module}.lora_{which}.weight"


def adapter_config(
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """The ``adapter_config.json`` content PEFT's ``LoraConfig`` reads back."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def validate_adapter_weights(weights: Mapping[str, np.ndarray], *, r: int, target_modules: Sequence[str]) -> None:
    """Check names, ranks and A/B pairing; raises ValueError describing the first problem."""
    seen: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in weights.items():
        m = _KEY.match(key)
        if not m:
            raise ValueError(f"not a PEFT LoRA key: {key!r}")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if m.group(2) != _MODULE_PARENT[module]:
            raise ValueError(f"{module} belongs under {_MODULE_PARENT[module]}: {key!r}")
        if module not in target_modules:
            raise ValueError(f"{key!r}: {module} is not in target_modules {list(target_modules)}")
        if value.ndim != 2:
            raise ValueError(f"{key!r} must be 2-D, got shape {value.shape}")
        if (which == "A" and value.shape[0] != r) or (which == "B" and value.shape[1] != r):
            raise ValueError(
                f"{key!r} has shape {value.shape}; expected lora_A (r={r}, in) / lora_B (out, r={r})"
            )
        seen.setdefault((layer, module), {})[which] = value
    if not seen:
        raise ValueError("no adapter weights to export")
    for (layer, module), pair in sorted(seen.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"layer {layer} {module}: lora_A and lora_B must both be present")


def write_peft_adapter(
    out_dir: str | Path,
    weights: Mapping[str, np.ndarray],
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model_name_or_path: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``out_dir``.

    Args:
        weights: PEFT key (see :func:`lora_key`) -> array in PEFT orientation.
        dtype: cast every array to this numpy dtype name (e.g. "float32"); None = keep.

    Returns:
        ``out_dir`` as a Path.
    """
    from safetensors.numpy import save_file

    validate_adapter_weights(weights, r=r, target_modules=target_modules)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: np.ascontiguousarray(v.astype(dtype) if dtype else v) for k, v in sorted(weights.items())
    }
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(
        r=r, alpha=alpha, dropout=dropout, target_modules=target_modules,
        base_model_name_or_path=base_model_name_or_path,
    )
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read back (config, weights) of an adapter directory."""
    from safetensors.numpy import load_file

    d = Path(adapter_dir)
    config = json.loads((d / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return config, load_file(str(d / ADAPTER_WEIGHTS))


def model_card(*, base_model: str, title: str, training: Mapping[str, Any], notes: Sequence[str] = ()) -> str:
    """The adapter's ``README.md``: Hub metadata front matter, how to load it, how it was trained.

    Args:
        base_model: the base model's public id (the card's ``base_model:``).
        title: the heading (e.g. the job id).
        training: the training settings to record (JSON-serializable).
        notes: extra sentences, e.g. that a QLoRA adapter was trained on a 4-bit base.
    """
    front = "\n".join([
        "---",
        f"base_model: {json.dumps(base_model)}",
        "library_name: peft",
        "pipeline_tag: text-generation",
        "tags:",
        "- lora",
        "- tunefleet",
        "---",
    ])
    body = [
        f"# {title}",
        "",
        f"A LoRA adapter for `{base_model}`, trained by tunefleet.",
        *(["", *notes] if notes else []),
        "",
        "## Use it",
        "",
        "```python",
        "from peft import AutoPeftModelForCausalLM",
        "from transformers import AutoTokenizer",
        "",
        'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/adapter")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/adapter")',
        "```",
        "",
        "## Training configuration",
        "",
        "```json",
        json.dumps(training, indent=2, sort_keys=True),
        "```",
        "",
    ]
    return front + "\n\n" + "\n".join(body)


def complete_adapter_dir(
    adapter_dir: str | Path,
    *,
    base_model: str,
    tokenizer_dir: str | Path | None,
    card: str,
    revision: str | None = None,
) -> None:
    """Make a written adapter directory stand on its own.

    Sets ``base_model_name_or_path`` in ``adapter_config.json`` to ``base_model`` (and
    ``revision``, the base's Hub commit, when known: peft loads the base at it), copies the
    tokenizer files found in ``tokenizer_dir`` (a local base model directory; None when the
    base lives elsewhere, e.g. in S3), and writes ``card`` as ``README.md``.
    """
    import shutil

    out = Path(adapter_dir)
    config_path = out / ADAPTER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_model
    if revision is not None:
        config["revision"] = revision
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / name
            if source.is_file():
                shutil.copyfile(source, out / name)
    (out / MODEL_CARD).write_text(card, encoding="utf-8")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(output_dir: str | Path) -> list[dict[str, Any]]:
    """Write ``manifest.json`` listing every file under ``output_dir`` (except itself).

    Returns:
        The file entries ``{"name", "bytes", "sha256"}`` (names relative, '/'-separated),
        sorted by name: what the trainer reports in its ``artifacts`` item.
    """
    root = Path(output_dir)
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name == MANIFEST:
            continue
        files.append({"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    return files
