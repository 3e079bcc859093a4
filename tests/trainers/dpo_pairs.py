"""Hand-made preference pairs and files for the DPO tests (no dependency on a chat template).

Each pair shares a prompt; the answers differ in content and length, so chosen and
rejected rows pad differently. Labels cover the answer tokens and the end-of-text token.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainers.common.data import IGNORE_INDEX, PreferenceDataset, TokenizedExample
from trainers.common.preference import PreferenceData

TERMS = ((2, 3), (7, 1), (4, 4), (1, 5), (6, 2), (3, 3))


def _sequence(tokenizer, prompt: str, answer: str) -> TokenizedExample:
    head = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
    tail = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    return TokenizedExample(tuple(head + tail), tuple([IGNORE_INDEX] * len(head) + tail))


def sum_pairs(tokenizer, n: int = 6) -> list[tuple[TokenizedExample, TokenizedExample]]:
    """``n`` pairs "a+b=" -> the right sum (chosen) vs a wrong, longer one (rejected)."""
    out = []
    for i in range(n):
        a, b = TERMS[i % len(TERMS)]
        prompt, right = f"{a}+{b}=", a + b
        out.append((_sequence(tokenizer, prompt, str(right)), _sequence(tokenizer, prompt, f"{right + 11} ok")))
    return out


def pair_data(tokenizer, n: int = 6, *, micro_batch_size: int = 3, pad_to: int | None = None) -> PreferenceData:
    return PreferenceData(PreferenceDataset(sum_pairs(tokenizer, n)), max_seq_len=64,
                          micro_batch_size=micro_batch_size, seed=0, shuffle=False,
                          pad_id=tokenizer.pad_token_id, pad_to=pad_to)


def preference_lines(n: int) -> list[dict]:
    """OpenAI preference-format lines of the same toy task (right sum preferred)."""
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append({
            "input": {"messages": [{"role": "user", "content": f"{a}+{b}="}]},
            "preferred_output": [{"role": "assistant", "content": str(a + b)}],
            "non_preferred_output": [{"role": "assistant", "content": str(a + b + 3)}],
        })
    return rows


def write_preference_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in preference_lines(n)), encoding="utf-8")
    return path
