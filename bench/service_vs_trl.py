"""The demo job through the service vs the same job as a hand-written TRL script.

What the service costs on top of the training itself: the end-to-end time from
``POST /v1/fine_tuning/jobs`` to a downloadable adapter for the demo job, against running
TRL's ``SFTTrainer`` (+ peft) by hand on the same model, data and hyperparameters.
Goal: service / TRL <= 1.1.

- Service: `tunefleet serve` with the embedded defaults (SQLite, server-less broker,
  local executor, scheduler every 3 s) in a fresh data dir; the demo model built and the
  demo data uploaded and validated before any timing (a user's service is already up).
  Timed: from the POST to ``GET .../artifacts/adapter/adapter_model.safetensors``
  answering 200 with the whole file (polled every ``--poll`` s).
- TRL by hand: this file's ``--trl`` mode, a fresh ``python`` process that does what a
  user's script would: load the demo model and tokenizer from the service's models dir
  and the same chat JSONL (read into a ``datasets.Dataset`` row by row; its cache fresh per run),
  ``SFTTrainer`` with an ``SFTConfig`` and a peft ``LoraConfig``, ``train()``, then
  ``save_model``. Timed: from starting the process to the adapter saved on disk.

Same job on both sides: the demo's body (``tunefleet.demo.start_demo``): 3 epochs, batch 8,
lr multiplier 25, LoRA r 16 / alpha 32 / dropout 0 on all seven projections,
``max_seq_len`` 64, seed 0, 400 examples (``--examples``/``--epochs`` shorten it alike).
TRL gets the hyperparameters the service resolved for the finished job (read back from
it): learning rate, cosine schedule, warmup steps, weight decay, clipping, and the
micro-batch as per-device batch with gradient accumulation up to the batch. Loss on the
assistant tokens only (``assistant_only_loss``, from the template's generation blocks:
the answer and its ``<|eot_id|>``, as the service labels them), no packing, fp32 on CPU
(``bf16``/gradient checkpointing off, as on the service's CPU pool), no evaluation, and a
checkpoint each epoch as the service keeps one (``save_strategy="epoch"``). Threads:
both get the ``OMP_NUM_THREADS`` the local executor gives a trainer.

Known differences, neither side's choice to make here: the epoch shuffles differ (the
service's numpy order vs torch's sampler), LoRA A is initialised from different random
streams, and transformers' warmup starts at lr 0 where the service's first step uses
``lr / warmup``. So the losses agree in level, not digit by digit: the bench prints both
sides' first-step loss (the base model's, LoRA B being zero), last-step loss and
last-epoch mean.

The two alternate (service, TRL, service, ...) ``--runs`` times so a shared machine's
load hits both alike; a section with per-run times, medians, ratio, losses and load
average is appended to bench/RESULTS.md.

``--real-model`` runs the real demo instead: SmolLM2-135M-Instruct (prepared once into
``--models-dir`` by ``tunefleet.real_model``) on the date-formatting task, with the real
demo's job (``tunefleet.demo.DATES_JOB``: one epoch of ``--examples`` dates, batch 8, LoRA
r 8 / alpha 16 on 7 projections, ``max_seq_len`` 96) on ``--trainer``. It adds what a user
compares two fine-tunes by: held-out exact match of each adapter (the same greedy
``transformers`` + ``peft`` decoding of 20 held-out dates for both, and for the base model
once), tokens/s over the training phase (the job's ``trained_tokens``, the same rows on
both sides, over first to last step) and peak memory (the trainer's largest reported RSS;
TRL's process peak RSS, ``ru_maxrss``).

    OMP_NUM_THREADS=2 .venv/bin/python bench/service_vs_trl.py [--runs 3] [--examples 400] [--epochs 3]
    OMP_NUM_THREADS=2 .venv/bin/python bench/service_vs_trl.py --real-model [--trainer fsdp_qlora] [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADAPTER_FILE = "adapter/adapter_model.safetensors"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def demo_job(file_id: str, model: str, epochs: int) -> dict:
    """The demo's job body (``tunefleet.demo.start_demo``) with ``epochs`` epochs."""
    return {
        "model": model, "training_file": file_id, "suffix": "demo", "seed": 0,
        "hyperparameters": {"n_epochs": epochs, "batch_size": 8, "learning_rate_multiplier": 25.0},
        "adapter": {"method": "lora", "r": 16, "alpha": 32, "target_modules": TARGETS},
        "max_seq_len": 64,
    }


# -- TRL by hand: what runs in the fresh process -------------------------------------------


def trl_by_hand(job: dict, model_dir: str, train_file: str, out_dir: str) -> dict:
    """Train the job with TRL's SFTTrainer + a peft LoraConfig and save the adapter.

    ``job`` is the service's finished job (its resolved hyperparameters and adapter).
    Returns the times (epoch seconds) and per-step losses.
    """
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    hp, adapter = job["hyperparameters"], job["adapter"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Rows as Python objects, not through pyarrow's JSON reader: that one types an answer
    # such as "1999-07-02" as a timestamp, and TRL then trains on "<datetime>".
    with open(train_file, encoding="utf-8") as f:
        data = Dataset.from_list([json.loads(line) for line in f if line.strip()])
    config = SFTConfig(
        output_dir=out_dir, num_train_epochs=hp["n_epochs"],
        per_device_train_batch_size=hp["micro_batch_size"],
        gradient_accumulation_steps=hp["batch_size"] // hp["micro_batch_size"],
        learning_rate=hp["learning_rate"], lr_scheduler_type=hp["lr_scheduler"], warmup_steps=hp["warmup_steps"],
        weight_decay=hp["weight_decay"], max_grad_norm=hp["max_grad_norm"], optim="adamw_torch",
        # Loss on the answers only: from the template's generation blocks for chat rows (the
        # tiny demo model's template has them); prompt/completion rows (the real model's
        # template has none) by TRL's completion mask.
        max_length=job["max_seq_len"], assistant_only_loss="messages" in data.column_names, packing=False,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        eval_strategy="no", save_strategy="epoch", logging_steps=1, report_to="none",
        seed=job["seed"], dataloader_num_workers=0, disable_tqdm=True,
    )
    steps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            steps.append(time.time())

    trainer = SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[StepTimes()],
        peft_config=LoraConfig(r=adapter["r"], lora_alpha=adapter["alpha"], lora_dropout=adapter.get("dropout", 0.0),
                               target_modules=adapter["target_modules"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    trainer.save_model(str(Path(out_dir) / "adapter"))
    saved = time.time()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"first_step": steps[0], "last_step": steps[-1], "saved": saved, "losses": losses, "peak_bytes": peak}


# -- the service side ----------------------------------------------------------------------


def run_service_job(http, body: dict, poll: float) -> dict:
    """POST the job; return the seconds to the adapter downloading, the finished job and
    its per-step losses and times."""
    t0 = time.time()
    created = http.post("/fine_tuning/jobs", json=body)
    created.raise_for_status()
    job_id = created.json()["id"]
    while True:
        adapter = http.get(f"/fine_tuning/jobs/{job_id}/artifacts/{ADAPTER_FILE}")
        if adapter.status_code == 200 and adapter.content:
            done = time.time()
            break
        job = http.get(f"/fine_tuning/jobs/{job_id}").json()
        if job["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"service job {job_id} {job['status']}: {job.get('error')}")
        if time.time() - t0 > 3600:
            raise TimeoutError(f"service job {job_id}")
        time.sleep(poll)
    job = http.get(f"/fine_tuning/jobs/{job_id}").json()
    rows = http.get(f"/fine_tuning/jobs/{job_id}/metrics", params={"limit": 1000}).json()["data"]
    events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    started = [e for e in events if e["message"] == "trainer started"]
    peaks = [r["memory_bytes"] for r in rows if r.get("memory_bytes")]
    return {"t0": t0, "seconds": done - t0, "job": job, "losses": [r["train_loss"] for r in rows],
            "peak_bytes": max(peaks) if peaks else None,
            "first_step": float(rows[0]["time"]), "last_step": float(rows[-1]["time"]), "done": done,
            "trainer": (started[0].get("data") or {}).get("trainer") if started else job["trainer"]}


def run_trl_process(job: dict, model_dir: Path, train_file: Path, threads: str,
                    keep_adapter: Path | None = None) -> dict:
    """This file's ``--trl`` mode in a fresh process, timed from its start; its adapter
    copied to ``keep_adapter`` when given."""
    with tempfile.TemporaryDirectory(prefix="tf-trl-") as work:
        (Path(work) / "job.json").write_text(json.dumps(job))
        # A fresh datasets cache: the service tokenizes every job anew, and so does a first run.
        env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_DATASETS_CACHE": str(Path(work) / "hf-datasets")}
        t0 = time.time()
        out = subprocess.run([sys.executable, __file__, "--trl", work, str(model_dir), str(train_file)],
                             capture_output=True, text=True, env=env, check=False)
        exited = time.time()
        if out.returncode:
            raise RuntimeError(f"the TRL script failed:\n{out.stderr[-4000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if keep_adapter is not None:
            shutil.copytree(Path(work) / "out" / "adapter", keep_adapter)
    return {**result, "t0": t0, "seconds": result["saved"] - t0, "exit_seconds": exited - t0}


def phases(run: dict) -> str:
    """Start-up (to the first step), training (first to last step) and the tail (last step
    to the adapter: export, upload, the service noticing)."""
    end = run.get("done", run.get("saved"))
    return (f"{run['first_step'] - run['t0']:.1f} + {run['last_step'] - run['first_step']:.1f} + "
            f"{end - run['last_step']:.1f}")


def loss_summary(losses: list[float], steps_per_epoch: int) -> dict[str, float]:
    return {"first": losses[0], "last": losses[-1], "last_epoch_mean": statistics.fmean(losses[-steps_per_epoch:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="service/TRL pairs, alternating")
    p.add_argument("--examples", type=int, help="training examples (the tiny demo has 400, the real one 160)")
    p.add_argument("--epochs", type=int, help="epochs (the tiny demo has 3, the real one 1)")
    p.add_argument("--poll", type=float, default=0.25, help="seconds between artifact polls")
    p.add_argument("--real-model", action="store_true",
                   help="the real demo: SmolLM2-135M-Instruct on the date task, with held-out accuracy")
    p.add_argument("--trainer", default="fsdp_qlora", help="with --real-model: the job's trainer")
    p.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "tunefleet" / "models",
                   help="with --real-model: where the real model is (or is prepared once)")
    p.add_argument("--no-record", action="store_true", help="print only; do not append to bench/RESULTS.md")
    p.add_argument("--trl", nargs=3, metavar=("WORK_DIR", "MODEL_DIR", "TRAIN_FILE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl:
        work, model_dir, train_file = args.trl
        job = json.loads((Path(work) / "job.json").read_text())
        print(json.dumps(trl_by_hand(job, model_dir, train_file, str(Path(work) / "out"))), flush=True)
        return

    sys.path.insert(0, str(REPO))
    if args.real_model:
        from tunefleet.demo import DATES_JOB, DATES_TRAIN

        args.examples = args.examples or DATES_TRAIN
        args.epochs = args.epochs or DATES_JOB["hyperparameters"]["n_epochs"]
        real_model_main(args)
        return
    args.examples, args.epochs = args.examples or 400, args.epochs or 3
    from bench.service_harness import embedded_service, upload_jsonl
    from tunefleet.demo import DEMO_MODEL_ID, demo_examples
    from worker.spec_builder import local_trainer_threads

    threads = str(local_trainer_threads())
    examples = demo_examples(args.examples)
    service_runs, trl_runs = [], []
    with embedded_service() as service:
        train_file = service.data_dir / "capitals.jsonl"
        train_file.write_text("".join(json.dumps(e) + "\n" for e in examples))
        file_id = upload_jsonl(service.http, examples, "capitals.jsonl")
        body = demo_job(file_id, DEMO_MODEL_ID, args.epochs)
        for run in range(args.runs):
            s = run_service_job(service.http, body, args.poll)
            service_runs.append(s)
            t = run_trl_process(s["job"], service.model_dir, train_file, threads)
            trl_runs.append(t)
            print(f"run {run}: service {s['seconds']:.1f} s ({phases(s)}; trainer {s['trainer']}), "
                  f"TRL {t['seconds']:.1f} s ({phases(t)}; process exit {t['exit_seconds']:.1f} s), "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    hp = service_runs[-1]["job"]["hyperparameters"]
    per_epoch = -(-args.examples // hp["batch_size"])
    med_s = statistics.median(r["seconds"] for r in service_runs)
    med_t = statistics.median(r["seconds"] for r in trl_runs)
    loss_s = loss_summary(service_runs[-1]["losses"], per_epoch)
    loss_t = loss_summary(trl_runs[-1]["losses"], per_epoch)
    load = os.getloadavg()
    print(f"median: service {med_s:.1f} s, TRL {med_t:.1f} s, service/TRL {med_s / med_t:.2f}x (goal <= 1.1x)")
    print(f"losses (first / last / last-epoch mean): service {loss_s}, TRL {loss_t}")
    print(f"steps: service {len(service_runs[-1]['losses'])}, TRL {len(trl_runs[-1]['losses'])}; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if not args.no_record:
        record(args, hp, service_runs, trl_runs, med_s, med_t, loss_s, loss_t, load, threads)


def record(args, hp, service_runs, trl_runs, med_s, med_t, loss_s, loss_t, load, threads) -> None:
    """Append this run's section to bench/RESULTS.md (append only: others edit the file too)."""
    now = dt.datetime.now(dt.UTC)
    per_run = "; ".join(f"{s['seconds']:.1f} / {t['seconds']:.1f}" for s, t in zip(service_runs, trl_runs, strict=True))
    fmt = lambda d: f"{d['first']:.3f} / {d['last']:.3f} / {d['last_epoch_mean']:.3f}"
    section = (
        f"\n## Demo job: service (POST to downloadable adapter) vs TRL by hand ({now:%Y-%m-%d %H:%M} UTC)\n\n"
        f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')} .venv/bin/python bench/service_vs_trl.py "
        f"--runs {args.runs} --examples {args.examples} --epochs {args.epochs}`; load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on 2 cores shared with other agents' work, so the "
        f"absolute times are noisy; the sides alternate so the load hits both alike. Embedded `tunefleet serve` "
        f"defaults (scheduler every 3 s), trainer {service_runs[-1]['trainer']}, {threads} threads per side; "
        f"{args.examples} examples x {args.epochs} epochs, batch {hp['batch_size']} (micro {hp['micro_batch_size']}), "
        f"lr {hp['learning_rate']:g} {hp['lr_scheduler']} with {hp['warmup_steps']} warmup steps, "
        f"LoRA r 16 / alpha 32 on 7 projections.\n\n"
        f"median service **{med_s:.1f} s**, TRL **{med_t:.1f} s**: service/TRL **{med_s / med_t:.2f}x** "
        f"(goal <= 1.1x). Per run (service / TRL, s): {per_run}. Phases of the last run, start-up to the first "
        f"step + first to last step + last step to the adapter: service {phases(service_runs[-1])}, "
        f"TRL {phases(trl_runs[-1])} s.\n\n"
        f"Train loss (first step / last step / mean of the last epoch), last run: service {fmt(loss_s)}, "
        f"TRL {fmt(loss_t)}.\n"
    )
    with (REPO / "bench" / "RESULTS.md").open("a", encoding="utf-8") as f:
        f.write(section)


# -- the real demo: SmolLM2 on the date task, with held-out accuracy ------------------------

HELD_OUT = 20
MAX_TOKENS = 16


class HeldOut:
    """Held-out exact match of the base model and of adapters on it: greedy ``transformers``
    + ``peft`` decoding, the same for every adapter, in this process."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from tunefleet.demo import date_examples

        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.examples = date_examples(HELD_OUT, seed=1)

    def prompt_text(self, example: dict) -> str:
        """The example's prompt as the chat template renders it, up to the assistant's turn."""
        return self.tokenizer.apply_chat_template(example["messages"][:-1], add_generation_prompt=True,
                                                  tokenize=False)

    def score(self, adapter_dir: Path | None = None) -> float:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        # A fresh base model each time: peft injects its layers into the model it is given,
        # and a second adapter loaded into a model that carried one is not reliably active.
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, str(adapter_dir))
        right = 0
        with torch.no_grad():
            for example in self.examples:
                ids = self.tokenizer(self.prompt_text(example), add_special_tokens=False,
                                     return_tensors="pt")["input_ids"]
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:]
                text = self.tokenizer.decode(out, skip_special_tokens=True).strip()
                right += text == example["messages"][-1]["content"]
        return right / len(self.examples)


def download_adapter(http, job_id: str, into: Path) -> Path:
    into.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        resp = http.get(f"/fine_tuning/jobs/{job_id}/artifacts/adapter/{name}")
        resp.raise_for_status()
        (into / name).write_bytes(resp.content)
    return into


def training_tokens_per_s(run: dict, tokens: int) -> float:
    """The job's trained tokens over its training phase (first to last step: the first step's
    own time is in neither side's figure)."""
    steps = len(run["losses"])
    return tokens * (steps - 1) / steps / (run["last_step"] - run["first_step"])


def real_model_main(args) -> None:
    from bench.service_harness import embedded_service, upload_jsonl
    from tunefleet.demo import DATES_JOB, date_examples
    from tunefleet.real_model import REAL_MODEL_DIRNAME, REAL_MODEL_ID, ensure_real_model
    from worker.spec_builder import local_trainer_threads

    model_dir = ensure_real_model(args.models_dir)
    threads = str(local_trainer_threads())
    examples = date_examples(args.examples, seed=0)
    held_out = HeldOut(model_dir)
    before = held_out.score()
    service_runs, trl_runs = [], []
    with (embedded_service(models={REAL_MODEL_DIRNAME: model_dir}) as service,
          tempfile.TemporaryDirectory(prefix="tf-adapters-") as adapters):
        # SmolLM2's chat template marks no generation blocks, so TRL cannot find the answers
        # in chat rows (``assistant_only_loss`` refuses the template). By hand, a user renders
        # the prompt with the template and gives the answer as the completion (TRL appends
        # the end-of-turn EOS): loss on the answer only, as the service's.
        train_file = service.data_dir / "dates-prompt-completion.jsonl"
        train_file.write_text("".join(json.dumps({"prompt": held_out.prompt_text(e),
                                                  "completion": e["messages"][-1]["content"]})
                                      + "\n" for e in examples))
        file_id = upload_jsonl(service.http, examples, "dates.jsonl")
        body = {"model": REAL_MODEL_ID, "training_file": file_id, "seed": 0, "trainer": args.trainer,
                **DATES_JOB, "hyperparameters": {**DATES_JOB["hyperparameters"], "n_epochs": args.epochs}}
        for run in range(args.runs):
            s = run_service_job(service.http, body, args.poll)
            s["accuracy"] = held_out.score(download_adapter(service.http, s["job"]["id"], Path(adapters) / f"s{run}"))
            service_runs.append(s)
            t = run_trl_process(s["job"], model_dir, train_file, threads, keep_adapter=Path(adapters) / f"t{run}")
            t["accuracy"] = held_out.score(Path(adapters) / f"t{run}")
            trl_runs.append(t)
            tokens = s["job"]["trained_tokens"]
            print(f"run {run}: service {s['seconds']:.1f} s ({phases(s)}; trainer {s['trainer']}; "
                  f"{training_tokens_per_s(s, tokens):.0f} tok/s; peak {s['peak_bytes'] / 2**30:.2f} GiB; "
                  f"exact {s['accuracy']:.0%}), TRL {t['seconds']:.1f} s ({phases(t)}; "
                  f"{training_tokens_per_s(t, tokens):.0f} tok/s; peak {t['peak_bytes'] / 2**30:.2f} GiB; "
                  f"exact {t['accuracy']:.0%}), load {os.getloadavg()[0]:.1f}", flush=True)
    tokens = service_runs[-1]["job"]["trained_tokens"]
    med = lambda runs, f: statistics.median(f(r) for r in runs)
    rows = {
        "POST to adapter, s": (med(service_runs, lambda r: r["seconds"]), med(trl_runs, lambda r: r["seconds"])),
        "training tokens/s": (med(service_runs, lambda r: training_tokens_per_s(r, tokens)),
                              med(trl_runs, lambda r: training_tokens_per_s(r, tokens))),
        "peak memory, GiB": (med(service_runs, lambda r: r["peak_bytes"] / 2**30),
                             med(trl_runs, lambda r: r["peak_bytes"] / 2**30)),
        "held-out exact match": (med(service_runs, lambda r: r["accuracy"]), med(trl_runs, lambda r: r["accuracy"])),
    }
    load = os.getloadavg()
    table = ["| median of {} runs | service ({}) | TRL SFTTrainer + peft | service / TRL |".format(
        args.runs, service_runs[-1]["trainer"]), "|---|---:|---:|---:|"]
    for name, (ours, theirs) in rows.items():
        table.append(f"| {name} | {ours:.3g} | {theirs:.3g} | {ours / theirs:.2f}x |" if theirs else
                     f"| {name} | {ours:.3g} | {theirs:.3g} | - |")
    text = "\n".join(table)
    print(f"base model held-out exact match {before:.0%}\n{text}\n"
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if not args.no_record:
        now = dt.datetime.now(dt.UTC)
        per_run = "; ".join(f"{s['seconds']:.1f} / {t['seconds']:.1f}" for s, t in zip(service_runs, trl_runs,
                                                                                      strict=True))
        section = (
            f"\n## Real model: service (POST to downloadable adapter) vs TRL by hand, SmolLM2-135M-Instruct "
            f"({now:%Y-%m-%d %H:%M} UTC)\n\n"
            f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')} .venv/bin/python bench/service_vs_trl.py "
            f"--real-model --trainer {args.trainer} --runs {args.runs} --examples {args.examples} "
            f"--epochs {args.epochs}`; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
            f"2 cores; the sides alternate. The demo's date task and job ({args.examples} dates x {args.epochs} "
            f"epoch(s), {len(service_runs[-1]['losses'])} steps, {tokens} trained tokens), {threads} threads per "
            f"side; held-out exact match on {HELD_OUT} dates by the same greedy transformers + peft decoding for "
            f"both adapters (base model: {before:.0%}). Peak memory: the trainer's largest reported RSS vs the TRL "
            f"process's ru_maxrss. Per run (service / TRL, s): {per_run}.\n\n{text}\n"
        )
        with (REPO / "bench" / "RESULTS.md").open("a", encoding="utf-8") as f:
            f.write(section)


if __name__ == "__main__":
    main()
