"""Synthetic packed batches in the layout of ``trainers.common.data`` (numpy only)."""

from __future__ import annotations

import numpy as np

IGNORE = -100


def packed_batch(seed: int, accum: int, rows: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """(accum, rows, seq) arrays: 1-3 segments per row, a prompt part and padding masked.

    Like ``trainers.common.data``: positions restart per segment, segment ids 1.. (0 =
    padding), the first token of each segment and prompt tokens are labelled -100.
    """
    rng = np.random.default_rng(seed)
    shape = (accum, rows, seq)
    ids = rng.integers(0, vocab, shape)
    labels = np.full(shape, IGNORE)
    positions = np.zeros(shape, dtype=np.int64)
    segments = np.zeros(shape, dtype=np.int64)
    for a in range(accum):
        for r in range(rows):
            t = 0
            for seg in range(1, rng.integers(1, 4) + 1):
                n = int(rng.integers(4, seq // 2))
                if t + n > seq:
                    break
                positions[a, r, t : t + n] = np.arange(n)
                segments[a, r, t : t + n] = seg
                prompt = int(rng.integers(1, n - 1))
                labels[a, r, t + prompt : t + n] = ids[a, r, t + prompt : t + n]
                t += n
            positions[a, r, t:] = (positions[a, r, t - 1] + 1 if t else 0) + np.arange(seq - t)
    return {
        "input_ids": ids.astype(np.int32),
        "labels": labels.astype(np.int32),
        "positions": positions.astype(np.int32),
        "segment_ids": segments.astype(np.int32),
    }


def random_lora(shapes: dict, seed: int, scale: float = 0.05) -> dict:
    """LoRA factors with non-zero B (PEFT init has B = 0, which would zero A's gradient)."""
    rng = np.random.default_rng(seed)
    return {
        name: {k: (scale * rng.standard_normal(s.shape)).astype(np.float32) for k, s in pair.items()}
        for name, pair in shapes.items()
    }


def torch_model_with_lora(model_dir, quantization: str, peft_lora: dict, *, r: int, alpha: float, targets):
    """The torch trainer's model (one CPU process) with its LoRA factors set to ``peft_lora``
    (PEFT names, as ``trainers.jax_lora.export.to_peft_weights`` gives them), for parity
    tests of a JAX objective against the torch trainer's; returns ``(model, DistContext)``."""
    import torch

    from trainers.fsdp_qlora.distributed import DistContext
    from trainers.fsdp_qlora.loading import ModelOptions, build_model, is_lora_name

    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    model, _ = build_model(ModelOptions(model_dir=model_dir, quantization=quantization, lora_r=r, lora_alpha=alpha,
                                        target_modules=targets), cpu)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_lora_name(name):
                p.copy_(torch.from_numpy(peft_lora[name.replace(".default.", ".")]))
    return model, cpu


def lora_grads(model) -> dict:
    """The torch model's LoRA gradients under their PEFT names (numpy)."""
    from trainers.fsdp_qlora.loading import is_lora_name

    return {n.replace(".default.", "."): p.grad.numpy() for n, p in model.named_parameters() if is_lora_name(n)}
