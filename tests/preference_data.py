"""Generated preference data in OpenAI's DPO file format: the correct sum over a wrong one.

Line ``i`` asks ``What is a plus b?`` for the ``i``-th of the 400 pairs ``a, b < 20`` (in
one fixed shuffled order); ``preferred_output`` answers the sum, ``non_preferred_output``
the sum off by 1 or 2. Lines ``start .. start + n``: sets with disjoint ranges share no
question, so one can be held out from another.
"""

from __future__ import annotations

import json
import random

PAIRS = [(a, b) for a in range(20) for b in range(20)]
random.Random(0).shuffle(PAIRS)


def sum_preference_rows(n: int, *, start: int = 0) -> list[dict]:
    if start + n > len(PAIRS):
        raise ValueError(f"only {len(PAIRS)} distinct questions")
    rows = []
    for i in range(start, start + n):
        a, b = PAIRS[i]
        wrong = a + b + random.Random(i).choice((-2, -1, 1, 2))
        rows.append({
            "input": {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}]},
            "preferred_output": [{"role": "assistant", "content": str(a + b)}],
            "non_preferred_output": [{"role": "assistant", "content": str(wrong)}],
        })
    return rows


def sum_preference_lines(n: int = 12, *, start: int = 0) -> bytes:
    """Lines ``start .. start + n`` as JSONL bytes (see the module docstring)."""
    return "".join(json.dumps(r) + "\n" for r in sum_preference_rows(n, start=start)).encode()
