"""Run every CPU benchmark of bench/ one after the other (`make bench`).

Each script measures side by side in one run and records its own section in
bench/RESULTS.md. Run them on an otherwise idle machine: the figures are only as quiet
as the machine. GPU benchmarks (bench/gpu_*.sh) need an accelerator and are not run here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = [
    ["api_bench.py", "--duration", "10", "--connections", "8"],
    ["submit_to_first_step.py", "--runs", "3"],
    ["trainer_torch_vs_peft.py"],
    ["jax_lora_cpu.py"],
    ["fsdp_qlora_memory.py"],
    ["fsdp_qlora_throughput.py"],
    ["scheduler_cycle.py"],
    ["sim_trace.py"],
    ["scheduler_estimator_cpu.py"],
]


def main() -> int:
    failed = []
    for script, *args in SCRIPTS:
        started = time.monotonic()
        print(f"== {script} {' '.join(args)}", flush=True)
        rc = subprocess.call([sys.executable, str(BENCH / script), *args], cwd=BENCH.parent)
        print(f"== {script}: exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
        if rc:
            failed.append(script)
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
