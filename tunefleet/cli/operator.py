"""Operator commands of the `tunefleet` CLI: serve, worker, scheduler, inference.

``tunefleet serve`` is the embedded all-in-one: it migrates the SQLite database, makes
sure an admin key exists (printed once, and written to ``<data>/admin_key`` with 0600
permissions), builds the files of the demo model the default registry lists, then runs
the API (uvicorn, in this process), a Celery worker, the
scheduler loop and the inference worker (subprocesses) together, restarts a child that
exits or (the inference worker) stops answering (``tunefleet.cli.supervise``), and stops
them all on Ctrl-C or SIGTERM. The production roles run the same code one per process/pod:
``tunefleet db upgrade`` (``tunefleet.cli.admin``), ``uvicorn --factory api.main:create_app``,
``tunefleet worker``, ``tunefleet scheduler``, ``tunefleet inference``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from tunefleet.cli.options import JsonOpt, load_settings


def _cli_command(*args: str) -> list[str]:
    """This CLI as a child of ``serve`` (works without the console script on PATH); the child
    first asks to die with ``serve`` (``tunefleet.cli.supervise.die_with_parent``)."""
    code = ("from tunefleet.cli.supervise import die_with_parent; die_with_parent(); "
            "from tunefleet.cli import app; app()")
    return [sys.executable, "-c", code, *args]


def worker(
    pool: Annotated[str, typer.Option(help="Celery pool: threads, prefork or solo.")] = "threads",
    concurrency: Annotated[int, typer.Option(help="Tasks run at once.")] = 4,
    loglevel: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Run a Celery worker (validation, scheduling, local jobs, webhooks)."""
    settings = load_settings()
    from worker.celery_app import app as celery_app
    from worker.metrics import start_worker_metrics

    start_worker_metrics(settings)  # /metrics and /healthz on TUNEFLEET_METRICS_PORT, if set

    celery_app.worker_main(
        ["worker", f"--pool={pool}", f"--concurrency={concurrency}", f"--loglevel={loglevel}",
         "--without-gossip", "--without-mingle"]
    )


def scheduler() -> None:
    """Run the scheduling loop (one active scheduler at a time; see worker/scheduler)."""
    settings = load_settings()
    try:
        from worker.scheduler.loop import run_forever
    except ImportError as exc:
        typer.echo(f"the scheduler loop is not available in this build ({exc}); jobs stay "
                   "queued until a `tunefleet.schedule` task runs", err=True)
        raise typer.Exit(1) from exc
    from worker.metrics import start_scheduler_metrics

    start_scheduler_metrics(settings)  # /metrics and /healthz on TUNEFLEET_METRICS_PORT, if set
    run_forever(settings)


def inference(
    port: Annotated[int | None, typer.Option(help="Default: the port of TUNEFLEET_INFERENCE_URL.")] = None,
    max_adapters: Annotated[int, typer.Option(help="LoRA adapters kept loaded per base model.")] = 8,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 ... (default: cuda if present).")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads.")] = None,
    turn_tokens: Annotated[int | None, typer.Option(
        help="Tokens a generation computes per turn before another tenant's gets the model (default 16).")] = None,
    stall_limit_s: Annotated[float | None, typer.Option(
        help="/healthz answers 503 once a generation holds a model this long without a token (default 300).")] = None,
    fd: Annotated[int | None, typer.Option(help="Serve on this inherited listening socket (set by serve).",
                                           hidden=True)] = None,
) -> None:
    """Run the inference worker that /v1/chat/completions and /v1/completions use (loopback only)."""
    from urllib.parse import urlsplit

    from inference.__main__ import SECRET_ENV, main

    settings = load_settings()
    os.environ[SECRET_ENV] = settings.inference_secret_value()
    args = ["--port", str(port or urlsplit(settings.inference_url).port or 8001),
            "--max-adapters", str(max_adapters)]
    args += ["--device", device] if device else []
    args += ["--threads", str(threads)] if threads else []
    args += ["--turn-tokens", str(turn_tokens)] if turn_tokens else []
    args += ["--stall-limit-s", str(stall_limit_s)] if stall_limit_s else []
    args += ["--fd", str(fd)] if fd is not None else []
    raise typer.Exit(main(args))


def start_demo(settings, base_url: str, admin_key: str) -> None:
    """``serve --demo``: submit the demo job once the API answers (``tunefleet.demo``)."""
    try:
        from tunefleet.demo import start_demo as submit
    except ImportError:
        typer.echo("--demo: the demo module (tunefleet.demo) is not part of this build", err=True)
        return
    submit(settings, base_url, admin_key)


def ensure_listed_models(settings, *, real_model: bool = False) -> None:
    """Build the demo model's files when the registry lists it (no
    ``TUNEFLEET_BASE_MODELS_FILE``): ``serve`` lists ``tunefleet-tiny-llama``, so its files
    are there for jobs to train and chats to load. A few MB, built once into the data dir
    (``tunefleet.demo.ensure_demo_model``). With ``real_model`` (``serve --demo``) it also
    prepares SmolLM2-135M-Instruct (``tunefleet.real_model``: a 93 MB download and a
    conversion of about a minute, once), which the registry then lists too."""
    if settings.base_models_file is not None:
        return
    try:
        from tunefleet.demo import ensure_demo_model

        path = ensure_demo_model(settings.models_dir)
    except ImportError as exc:  # a server-only install: no torch/transformers to build it with
        typer.echo(f"  demo model tunefleet-tiny-llama not built ({exc}); install the torch extra "
                   "to train on this machine", err=True)
        return
    typer.echo(f"  base model tunefleet-tiny-llama: {path}")
    if real_model:
        prepare_real_model(settings)


def prepare_real_model(settings) -> bool:
    """Prepare ``smollm2-135m-instruct`` into the data dir; False (and why, on stderr) if not."""
    from tunefleet.real_model import (
        REAL_MODEL_ID,
        RealModelUnavailable,
        ensure_real_model,
        is_prepared,
        real_model_dir,
    )

    if not is_prepared(real_model_dir(settings.models_dir)):
        typer.echo(f"  base model {REAL_MODEL_ID}: preparing (once: a 93 MB download, a minute "
                   "or two of conversion) ...")
    try:
        path = ensure_real_model(settings.models_dir)
    except RealModelUnavailable as exc:
        typer.echo(f"  base model {REAL_MODEL_ID} not prepared: {exc}", err=True)
        return False
    typer.echo(f"  base model {REAL_MODEL_ID}: {path}")
    return True


def prepare_model(
    data_dir: Annotated[Path | None, typer.Option(help="Data directory (TUNEFLEET_DATA_DIR).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Prepare the real pretrained base model smollm2-135m-instruct into the data dir."""
    from tunefleet.cli.render import print_json, report_error
    from tunefleet.real_model import REAL_MODEL_ID, RealModelUnavailable, ensure_real_model

    if data_dir is not None:
        os.environ["TUNEFLEET_DATA_DIR"] = str(data_dir)
    from control.settings import get_settings

    get_settings.cache_clear()
    settings = load_settings()
    settings.ensure_dirs()
    try:
        path = ensure_real_model(settings.models_dir)
    except RealModelUnavailable as exc:
        report_error({"message": str(exc), "code": "model_unavailable"}, json_out)
        raise typer.Exit(1) from None
    if json_out:
        print_json({"object": "model", "id": REAL_MODEL_ID, "path": str(path)})
    else:
        typer.echo(f"base model {REAL_MODEL_ID}: {path}")


def _wait_until_up(url: str, timeout_s: float = 60.0) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def _listen_on_loopback(preferred_port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1: ``preferred_port`` when free, else any free port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", preferred_port))
    except OSError:
        listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


def _inference_probe(url: str, secret: str) -> Callable[[], bool]:
    """The inference worker's health: ``/healthz`` answers 200 within 5 s (503 when a
    generation is stalled on its model; no answer when the process is wedged)."""
    import httpx

    from inference.protocol import HEALTH_PATH, SECRET_HEADER

    def healthy() -> bool:
        try:
            return httpx.get(url + HEALTH_PATH, headers={SECRET_HEADER: secret}, timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    return healthy


def _log_restarts() -> None:
    """The supervisor's warnings (a child exited, restarts) on stderr, next to uvicorn's log."""
    from tunefleet.cli.supervise import log

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Data directory (TUNEFLEET_DATA_DIR).")] = None,
    demo: Annotated[bool, typer.Option("--demo", help="Submit the demo job that trains.")] = False,
    worker_concurrency: Annotated[int, typer.Option(help="Celery worker threads.")] = 4,
    no_scheduler: Annotated[bool, typer.Option("--no-scheduler", help="Do not start one.")] = False,
    no_inference: Annotated[bool, typer.Option("--no-inference", help="Do not start the inference worker.")] = False,
) -> None:
    """Run API + worker + scheduler + inference worker together with embedded defaults."""
    if data_dir is not None:
        os.environ["TUNEFLEET_DATA_DIR"] = str(data_dir)
    if "TUNEFLEET_PUBLIC_URL" not in os.environ:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        os.environ["TUNEFLEET_PUBLIC_URL"] = f"http://{shown}:{port}"
    inference_listener = None
    if "TUNEFLEET_INFERENCE_URL" not in os.environ:
        # Bound here, before the API starts, and handed to the inference worker as an open
        # socket: the URL the API calls is then one that is really listening. A port chosen
        # by number and bound seconds later by the worker (after its torch import) could be
        # taken by then, and the worker would exit while the API answered
        # inference_unavailable forever.
        inference_port = port + 1
        if not no_inference:
            inference_listener = _listen_on_loopback(port + 1)
            inference_port = inference_listener.getsockname()[1]
        os.environ["TUNEFLEET_INFERENCE_URL"] = f"http://127.0.0.1:{inference_port}"
    from control.settings import get_settings

    get_settings.cache_clear()
    settings = load_settings()
    settings.ensure_dirs()
    settings.secret_key_value()  # generated once into <data>/secret_key before children start
    from control.bootstrap import ensure_admin_key
    from control.db.migrate import upgrade

    upgrade(settings.resolved_database_url)
    new_key = ensure_admin_key(settings)
    url = settings.public_url
    typer.echo(f"tunefleet {url}  (data: {settings.data_path})")
    ensure_listed_models(settings, real_model=demo)
    typer.echo(f"  OpenAI-compatible API: {url}/v1   docs: {url}/docs")
    if new_key is not None:
        typer.echo(f"  admin API key (shown once; also in {settings.data_path / 'admin_key'}):")
        typer.echo(f"    {new_key}")
    else:
        typer.echo(f"  admin API key: see {settings.data_path / 'admin_key'} "
                   "(or TUNEFLEET_ADMIN_API_KEY)")

    # Kept running (restarted with a backoff when one exits or, for the inference worker,
    # stops answering its health check) and stopped with this process, even by SIGKILL.
    from tunefleet.cli.supervise import ChildSpec, Supervisor

    specs = [ChildSpec("worker", _cli_command("worker", f"--concurrency={worker_concurrency}",
                                              "--loglevel=WARNING"))]
    if not no_scheduler:
        specs.append(ChildSpec("scheduler", _cli_command("scheduler")))
    if not no_inference:
        probe = _inference_probe(settings.inference_url, settings.inference_secret_value())
        if inference_listener is None:  # TUNEFLEET_INFERENCE_URL set: the worker binds its port
            specs.append(ChildSpec("inference worker", _cli_command("inference"), healthy=probe))
        else:  # every (re)started worker serves on the same listening socket, kept open here
            specs.append(ChildSpec("inference worker",
                                   _cli_command("inference", "--fd", str(inference_listener.fileno())),
                                   pass_fds=(inference_listener.fileno(),), healthy=probe))
    _log_restarts()
    children = Supervisor(specs)
    children.start()
    if demo:
        key_file = settings.data_path / "admin_key"
        admin_key = new_key or (key_file.read_text().strip() if key_file.exists() else "")
        if settings.admin_api_key is not None:
            admin_key = settings.admin_api_key.get_secret_value()

        def _demo() -> None:
            if _wait_until_up(f"http://127.0.0.1:{port}"):
                start_demo(settings, url, admin_key)

        threading.Thread(target=_demo, name="demo", daemon=True).start()

    import uvicorn

    # uvicorn re-raises the SIGINT/SIGTERM it shut down for once it has restored the
    # previous handlers; with these (no-op) handlers in place that re-raise returns here
    # instead of killing this process before it has stopped the worker and scheduler.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: received.append(number))
    try:
        uvicorn.run("api.main:create_app", factory=True, host=host, port=port, log_level="info")
    finally:
        children.stop()
        if inference_listener is not None:
            inference_listener.close()
    if received:
        raise typer.Exit(0)
