"""Merged exports: base model + LoRA adapter folded into one Hugging Face checkpoint.

The base is loaded in float32 (a QLoRA adapter is merged onto this full-precision base,
not onto the 4-bit weights it was trained against: the caller's note on the card says so), the adapter
applied with PEFT and folded in (``merge_and_unload``: ``W + scaling * B @ A``), then the
result is cast to the asked dtype and written by ``save_pretrained`` as sharded safetensors
(``model.safetensors.index.json`` when it takes more than one shard) with the config, the
generation config, the tokenizer files and a model card. ``AutoModelForCausalLM`` loads the
directory directly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

MergeDType = Literal["float32", "bfloat16", "float16"]


def export_merged(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, *, dtype: MergeDType,
                  base_model: str, title: str, notes: Sequence[str] = (), max_shard_size: str = "5GB") -> Path:
    """Write the merged model of ``base_dir`` + ``adapter_dir`` into ``out_dir``; returns it.

    ``notes``: sentences for the model card (e.g. that the adapter was trained with QLoRA).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged = merged.to(getattr(torch, dtype))
    merged.save_pretrained(str(out), safe_serialization=True, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(str(adapter_dir) if (Path(adapter_dir) / "tokenizer_config.json").exists()
                                  else str(base_dir)).save_pretrained(str(out))
    adapter_config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))
    card = "\n".join([
        "---",
        f"base_model: {json.dumps(base_model)}",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- merged-lora",
        "- tunefleet",
        "---",
        "",
        f"# {title}",
        "",
        (f"`{base_model}` with a LoRA adapter (r={adapter_config.get('r')}, "
         f"alpha={adapter_config.get('lora_alpha')}, "
         f"modules {', '.join(adapter_config.get('target_modules') or [])}) "
         f"merged into its weights, saved as {dtype}."),
        *notes,
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/dir")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/dir")',
        "```",
        "",
    ])
    (out / "README.md").write_text(card, encoding="utf-8")
    return out
