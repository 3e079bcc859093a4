"""Where the suite's time goes: sums the per-test lines that `make test` writes with
TUNEFLEET_TEST_CPU_LOG=<dir> (tests/conftest.py) per test file, most CPU first.

    make test TEST_CPU_LOG=/tmp/cpu && python scripts/suite_cpu.py /tmp/cpu [--tests 20]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--files", type=int, default=30, help="how many files to list")
    parser.add_argument("--tests", type=int, default=0, help="also list this many single tests")
    args = parser.parse_args()

    rows = []
    for log in sorted(args.log_dir.glob("*.tsv")):
        for line in log.read_text().splitlines():
            nodeid, wall, own, children = line.split("\t")
            rows.append((nodeid, float(wall), float(own), float(children)))
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for nodeid, wall, own, children in rows:
        totals = per_file[nodeid.split("::", 1)[0]]
        totals[0] += wall
        totals[1] += own
        totals[2] += children
        totals[3] += 1
    wall = sum(r[1] for r in rows)
    own, children = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"{len(rows)} tests: {wall / 60:.1f} test-minutes of wall time, {(own + children) / 60:.1f} CPU-minutes "
          f"({own / 60:.1f} in the test processes, {children / 60:.1f} in their subprocesses)")
    print(f"{'CPU s':>8} {'own':>7} {'subproc':>8} {'wall s':>8} {'tests':>6}  file")
    ranked = sorted(per_file.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    for path, (w, own, children, n) in ranked[: args.files]:
        print(f"{own + children:8.1f} {own:7.1f} {children:8.1f} {w:8.1f} {n:6d}  {path}")
    if args.tests:
        print()
        for nodeid, w, own, children in sorted(rows, key=lambda r: -(r[2] + r[3]))[: args.tests]:
            print(f"{own + children:8.1f} {w:8.1f}  {nodeid}")


if __name__ == "__main__":
    main()
