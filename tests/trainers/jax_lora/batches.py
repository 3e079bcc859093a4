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
