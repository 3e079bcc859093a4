"""A stand-in trainer for executor tests: behaves per ``FAKE_TRAINER_MODE``.

It reads the spec the executor mounted (must exist, must not hold the token), checks the
token arrived through the Secret, prints its distributed environment as JSON, then:
``succeed`` (exit 0), ``user_error`` (termination message + exit 10), ``sleep`` (wait
for SIGTERM, "checkpoint" -- taking ``FAKE_TRAINER_STOP_DELAY_S`` seconds -- exit 12),
``crash`` (exit 1), ``oom_on_one_gpu`` (out of GPU memory, termination message + exit 11,
when its gang is one GPU; else ``succeed``), ``unreported`` (writes the outputs of an
8-step run -- ``metrics.jsonl`` and a checkpoint every 4 steps, as the real trainer lays
them out -- reports none of it, as when the API was down and the spool died with the
pod, and exits 0), ``unreported_then_hang`` (the same up to the step-4 checkpoint, then
waits to be killed).
"""

import json
import os
import signal
import sys
import time

mode = os.environ.get("FAKE_TRAINER_MODE", "succeed")
if mode == "sleep":
    def on_term(*_):
        time.sleep(float(os.environ.get("FAKE_TRAINER_STOP_DELAY_S", "0")))
        print("SIGTERM: checkpoint written", flush=True)
        sys.exit(12)
    signal.signal(signal.SIGTERM, on_term)  # before the first line: "running" means ready to stop

spec_path = sys.argv[sys.argv.index("--spec") + 1]
with open(spec_path) as f:
    spec = json.load(f)
assert spec["report"]["token"] is None, "token leaked into the ConfigMap"
env = {k: os.environ.get(k) for k in (
    "TUNEFLEET_REPORT_TOKEN", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
    "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "TUNEFLEET_JOB_ID")}
print(json.dumps({"env": env, "job_id": spec["job_id"]}), flush=True)
if mode == "user_error":
    with open(spec["termination_log"], "w") as f:
        json.dump({"code": "invalid_dataset", "message": "line 3: messages must be a list"}, f)
    sys.exit(10)
if mode == "crash":
    sys.exit(1)
if mode == "oom_on_one_gpu" and int(env["NPROC_PER_NODE"] or 1) * int(env["NNODES"] or 1) == 1:
    with open(spec["termination_log"], "w") as f:
        json.dump({"code": "out_of_memory", "message": "out of memory: CUDA out of memory"}, f)
    sys.exit(11)
if mode.startswith("unreported"):
    last = 4 if mode == "unreported_then_hang" else 8
    os.makedirs(spec["output_dir"], exist_ok=True)
    with open(os.path.join(spec["output_dir"], "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "total_steps": 8, "train_loss": 2.0 / s, "time": 1.0}) + "\n"
                     for s in range(1, last + 1))
    for step in range(4, last + 1, 4):
        folder = os.path.join(spec["checkpoint"]["dir"], f"step-{step}")
        os.makedirs(os.path.join(folder, "adapter"), exist_ok=True)
        with open(os.path.join(folder, "adapter", "adapter_model.safetensors"), "wb") as f:
            f.write(b"weights")
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:  # written last: complete
            json.dump({"step": step, "metrics": {"train_loss": 2.0 / step}}, f)
    print("outputs written", flush=True)
if mode in ("sleep", "unreported_then_hang"):
    while True:
        time.sleep(0.1)
sys.exit(0)
