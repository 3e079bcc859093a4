"""Time from submitting a job over HTTP to its first training step (embedded service).

Starts `tunefleet serve` with the embedded defaults (SQLite, server-less broker, local
executor) in a fresh data dir, then submits the demo job a few times, one after the other,
and measures for each:

- create -> running: the scheduler admitted it and the local executor launched it;
- create -> first step: the trainer's first metric row (its wall-clock ``time``), which
  includes starting Python, importing torch/transformers/peft, loading the tiny model
  and tokenizing the data.

Goal: first step <= 15 s. Results go to bench/RESULTS.md.

    python bench/submit_to_first_step.py [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.service_harness import embedded_service, upload_jsonl, wait_for
from tunefleet.demo import DEMO_MODEL_ID, demo_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    results = []
    with embedded_service({"TUNEFLEET_SCHEDULE_INTERVAL_S": "0.5"}) as service:
        http = service.http
        file_id = upload_jsonl(http, demo_examples(64), "demo.jsonl")
        time.sleep(5)  # let the worker and scheduler settle after start-up
        for run in range(args.runs):
            t0 = time.time()
            job = http.post("/fine_tuning/jobs", json={
                "model": DEMO_MODEL_ID, "training_file": file_id, "seed": run,
                "hyperparameters": {"n_epochs": 1, "batch_size": 8},
                "max_seq_len": 64,
            }).json()
            job_id = job["id"]
            running = wait_for(lambda j=job_id: _status_time(http, j, "running"), 120, "running")
            first = wait_for(lambda j=job_id: _first_metric_time(http, j), 180, "first step")
            wait_for(lambda j=job_id: http.get(f"/fine_tuning/jobs/{j}").json()["status"] in
                     ("succeeded", "failed", "cancelled"), 300, "the end")
            results.append((running - t0, first - t0))
            print(f"run {run}: running after {running - t0:.2f} s, first step after {first - t0:.2f} s", flush=True)
    admit = statistics.median(r[0] for r in results)
    first = statistics.median(r[1] for r in results)
    load = os.getloadavg()[0]
    print(f"median: running after {admit:.2f} s, first step after {first:.2f} s (goal <= 15 s)")
    _record(admit, first, results, load, args.runs)


def _status_time(http: httpx.Client, job_id: str, status: str) -> float | None:
    events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 50}).json()["data"]
    for event in events:
        if (event.get("data") or {}).get("to") == status:  # a status change: from, to, actor
            return float(event["created_at"])
    return None


def _first_metric_time(http: httpx.Client, job_id: str) -> float | None:
    rows = http.get(f"/fine_tuning/jobs/{job_id}/metrics", params={"limit": 1}).json()["data"]
    return float(rows[0]["time"]) if rows and rows[0].get("time") else None


def _record(admit: float, first: float, results: list[tuple[float, float]], load: float, runs: int) -> None:
    path = REPO / "bench" / "RESULTS.md"
    heading = "## Submit to first training step"
    runs_text = ", ".join(f"{f:.1f}" for _, f in results)
    section = (
        f"{heading}\n\n"
        f"`python bench/submit_to_first_step.py --runs {runs}` ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
        f"load average {load:.1f} on 2 cores); embedded `tunefleet serve` (SQLite, kombu sqla+sqlite "
        f"broker polling 1/s, scheduler every 0.5 s), demo tiny Llama, 64 examples.\n\n"
        f"median create -> running **{admit:.1f} s**; create -> first step **{first:.1f} s** "
        f"(goal <= 15 s); per run first step: {runs_text} s. Note: `created_at` of events has 1 s "
        f"resolution.\n"
    )
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if heading in text:
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[end:] if end != -1 else "")
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
