"""Tiny checkpoints for tests: one random model per decoder family, and broken copies.

``save_tiny_family`` writes a Hugging Face checkpoint (config.json + safetensors + the
shared byte-level tokenizer) of a tiny Llama, Mistral, Qwen2 or Qwen3 built by
transformers itself, with every weight random: HF initializes RMSNorm weights to 1 and
biases to 0, which would leave a norm or bias loading bug invisible, so both are drawn
too, and the weights are a little larger than HF's init so logits are far from uniform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# What each tiny family exercises beyond Llama's layout (see trainers/jax_lora/config.py).
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    # Sliding window shorter than the test sequences, so the window really masks.
    "mistral": {"sliding_window": 8},
    # Q/K/V biases (always on in Qwen2); untied like Qwen2.5-7B.
    "qwen2": {"use_sliding_window": False},
    # Q/K RMSNorm, tied embeddings as in the small Qwen3 sizes, head_dim != hidden / heads.
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True, "use_sliding_window": False},
}


def tiny_family_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny ``family`` model (hidden 64, 2 layers, vocab 264)."""
    from transformers import AutoConfig

    values: dict[str, Any] = {
        "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    }
    values.update(FAMILY_CONFIGS[family])
    values.update(overrides)
    return AutoConfig.for_model(family, **values)


def save_tiny_family(path: Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``family`` checkpoint (see the module docstring) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainers.common.tiny_model import EOT, build_tiny_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(path)
    config = tiny_family_config(
        family, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT)], **overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed + 1)
    model.save_pretrained(path)
    return path


def randomize_weights(model: Any, seed: int) -> None:
    """Every parameter drawn from ``seed``: RMSNorm weights 1 + N(0, 0.2), the rest N(0, 0.08)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))


def nan_copy(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` whose final norm has a NaN weight: every logit is NaN."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in model_dir.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(dest / "model.safetensors"))
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def install_demo_model(models_dir: Path) -> Path:
    """The registry's demo model ``tunefleet-tiny-llama`` at ``models_dir/tiny-llama``,
    built as ``tunefleet serve`` builds it (``tunefleet.demo.ensure_demo_model``).

    A service always has the files of the models it lists (``serve`` builds the demo
    model), so the estimates of jobs on it read its real ``config.json``. Built once per
    machine into a cache keyed by the builder's source (a changed builder builds anew),
    then copied: a few hundred KB per test.
    """
    import hashlib
    import os
    import shutil
    import tempfile

    from trainers.common import tiny_model
    from tunefleet import demo

    key = hashlib.sha256(
        Path(demo.__file__).read_bytes() + Path(tiny_model.__file__).read_bytes()
    ).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "tunefleet-test-models" / f"demo-{key}"
    if not (cache / "config.json").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache.parent))
        demo.ensure_demo_model(staging)
        try:
            os.rename(staging / "tiny-llama", cache)
        except OSError:  # another test process finished its build first: use that one
            pass
        shutil.rmtree(staging, ignore_errors=True)
    target = Path(models_dir) / "tiny-llama"
    if not (target / "config.json").is_file():
        shutil.copytree(cache, target, dirs_exist_ok=True)
    return target
