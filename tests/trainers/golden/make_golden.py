"""Produce the golden values of ``test_golden_losses.py``: ``python -m tests.trainers.golden.make_golden``.

Builds the tiny model and data the tests use (same builders, same seeds), runs the golden
job (``job.py``) on both trainers through the real entry point ``--runs`` times, checks
that the runs agree exactly, and prints the values to paste into the test. Rerun it only
when a change is MEANT to move the numbers, and say why in the commit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.trainers.golden.job import TRAINERS, golden_spec, run_entry_point
from tests.trainers.tiny_datasets import write_tiny_datasets
from trainers.common.tiny_model import build_tiny_llama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per trainer; they must agree exactly")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_tiny_llama(root / "model", seed=0)
        (root / "data").mkdir()
        datasets = write_tiny_datasets(root / "data")
        golden = {}
        for trainer in TRAINERS:
            seen = []
            for i in range(args.runs):
                run_root = root / f"{trainer}-{i}"
                run = run_entry_point(golden_spec(trainer, model_dir, datasets, run_root), run_root)
                if run.returncode != 0:
                    print(run.output[-4000:], file=sys.stderr)
                    return 1
                seen.append({
                    "train_loss": [r["train_loss"] for r in run.metrics],
                    "valid_loss": run.metrics[-1]["valid_loss"],
                })
            if any(s != seen[0] for s in seen[1:]):
                print(f"{trainer} is not deterministic: {seen}", file=sys.stderr)
                return 1
            golden[trainer] = seen[0]
    print("GOLDEN = {")
    for trainer, values in golden.items():
        print(f"    {trainer!r}: {{")
        print(f"        \"train_loss\": [{', '.join(repr(x) for x in values['train_loss'])}],")
        print(f"        \"valid_loss\": {values['valid_loss']!r},")
        print("    },")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
