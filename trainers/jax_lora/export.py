"""Our LoRA pytree -> PEFT adapter tensors, written through the shared exporter.

Our factors are stacked over layers and keep split-out head dims: ``lora_a`` is
(layers, *in, r) and ``lora_b`` is (layers, r, *out). PEFT (``torch.nn.Linear``
orientation) wants per layer ``lora_A.weight`` (r, in_features) and ``lora_B.weight``
(out_features, r). Flattening (heads, head_dim) row-major gives HF's feature index
``head * head_dim + d``, the order transformers' q/k/v/o projections use, so a reshape
and a transpose are all it takes. The scaling ``alpha / r`` is not folded into the
weights: PEFT applies it from ``adapter_config.json``, exactly as our forward pass does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainers.common.peft_export import lora_key, write_peft_adapter


def to_peft_weights(lora: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Host numpy LoRA pytree -> ``{peft_key: array}`` in PEFT orientation."""
    out: dict[str, np.ndarray] = {}
    for module, pair in lora.items():
        a = np.asarray(pair["lora_a"])
        b = np.asarray(pair["lora_b"])
        layers, r = a.shape[0], a.shape[-1]
        for layer in range(layers):
            out[lora_key(layer, module, "A")] = a[layer].reshape(-1, r).T.copy()
            out[lora_key(layer, module, "B")] = b[layer].reshape(r, -1).T.copy()
    return out


def export_adapter(
    out_dir: str | Path,
    lora_host: Mapping[str, Mapping[str, Any]],
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (float32) to ``out_dir``."""
    return write_peft_adapter(
        out_dir,
        to_peft_weights(lora_host),
        r=r,
        alpha=alpha,
        dropout=dropout,
        target_modules=target_modules,
        base_model_name_or_path=base_model_name_or_path,
        dtype="float32",
    )
