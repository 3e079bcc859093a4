"""Generated preference data in OpenAI's DPO file format: the correct sum over a slip.

Line ``i`` asks ``What is a plus b?`` for the ``i``-th of the 91 pairs ``10 <= a, b < 20``
whose sum is not a palindrome (in one fixed shuffled order); ``preferred_output`` is the
sum, ``non_preferred_output`` the sum with its digits transposed (``12 plus 15`` -> ``72``),
a slip of the same length. Lines ``start .. start + n``: sets with disjoint ranges share
no question, so one can be held out from another.
"""

from __future__ import annotations

import json
import random

PAIRS = [(a, b) for a in range(10, 20) for b in range(10, 20) if (a + b) % 11]
random.Random(0).shuffle(PAIRS)


def sum_preference_rows(n: int, *, start: int = 0) -> list[dict]:
    if start + n > len(PAIRS):
        raise ValueError(f"only {len(PAIRS)} distinct questions")
    return [
        {
            "input": {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}]},
            "preferred_output": [{"role": "assistant", "content": str(a + b)}],
            "non_preferred_output": [{"role": "assistant", "content": str(a + b)[::-1]}],
        }
        for a, b in PAIRS[start:start + n]
    ]


def sum_preference_lines(n: int = 12, *, start: int = 0) -> bytes:
    """Lines ``start .. start + n`` as JSONL bytes (see the module docstring)."""
    return "".join(json.dumps(r) + "\n" for r in sum_preference_rows(n, start=start)).encode()
