"""Tiny training files for the trainer tests (and the golden-value script), written offline."""

from __future__ import annotations

import json
from pathlib import Path


def chat_lines(n: int) -> list[dict]:
    """A learnable toy task: answer with the word after the given one in a fixed list."""
    words = ["red", "green", "blue", "cyan", "pink", "gold", "gray", "teal"]
    rows = []
    for i in range(n):
        w = words[i % len(words)]
        nxt = words[(i + 1) % len(words)]
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "One word."},
                    {"role": "user", "content": f"after {w}?"},
                    {"role": "assistant", "content": nxt},
                ]
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_tiny_datasets(d: Path) -> dict[str, Path]:
    """Chat train (32 rows) / validation (8 rows), prompt/completion and alpaca files in ``d``."""
    return {
        "chat_train": write_jsonl(d / "chat_train.jsonl", chat_lines(32)),
        "chat_valid": write_jsonl(d / "chat_valid.jsonl", chat_lines(8)),
        "prompt_completion": write_jsonl(
            d / "pc.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(16)]
        ),
        "alpaca": write_jsonl(
            d / "alpaca.jsonl",
            [{"instruction": "Repeat", "input": f"w{i}", "output": f"w{i}"} for i in range(16)],
        ),
    }
