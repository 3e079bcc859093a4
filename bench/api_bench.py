"""API throughput on PostgreSQL: ``GET /v1/fine_tuning/jobs`` next to a bare FastAPI hello.

One run, side by side, on this machine:

1. a fresh PostgreSQL database (Alembic-migrated) with 1,000 jobs of one tenant;
2. uvicorn (``--workers``, default 1, the same for both) serving ``api.main:create_app``
   and, separately, a bare FastAPI app with one ``async`` hello endpoint;
3. ``wrk`` against ``GET /v1/fine_tuning/jobs`` (20 jobs per page, auth, DB query,
   serialization) and against the hello endpoint: requests/s and p99 latency, and the
   ratio of the two; wrk's own CPU time is reported too (wrk shares the machine's cores:
   near 100% of one core, wrk is the bottleneck, not the server);
4. ``wrk`` POSTing ``/v1/fine_tuning/jobs`` (job creation incl. the Celery send to Redis):
   creates/s, and every non-2xx answer counted as an error.

Results are appended to ``bench/RESULTS.md``. Needs PostgreSQL and Redis on 127.0.0.1 and
``wrk`` (apt: wrk). Usage: ``python bench/api_bench.py [--duration 10] [--connections 8]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HELLO_APP = '''
from fastapi import FastAPI

app = FastAPI()


@app.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_uvicorn(target: str, port: int, env: dict[str, str], *, factory: bool, cwd: Path,
                  workers: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", "--no-access-log", "--workers", str(workers)]
    if factory:
        command.append("--factory")
    proc = subprocess.Popen(command, cwd=cwd, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"uvicorn {target} did not start")


def wrk(url: str, *, duration: int, connections: int, headers: dict[str, str],
        script: Path | None = None) -> dict[str, float]:
    command = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", url]
    for name, value in headers.items():
        command[1:1] = ["-H", f"{name}: {value}"]
    if script is not None:
        command[1:1] = ["-s", str(script)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk is the only child that ended
    wrk_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p99.group(2)]
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "p99_ms": float(p99.group(1)) * scale, "requests": total,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": socket_errors.group(1) if socket_errors else "none",
            "wrk_cpu_pct": 100 * wrk_cpu / duration}


def processed_file(session: Any, tenant: Any) -> Any:
    """A training file of ``tenant`` marked validated (500 chat examples), with no content:
    the benchmarks create jobs from it, nothing trains."""
    from control.db.models import File
    from control.files.validation import apply_validation
    from control.ids import new_id

    file = File(id=new_id("file"), tenant_id=tenant.id, filename="bench.jsonl", bytes=1,
                purpose="fine-tune", status="uploaded", location="files/none", sha256="0" * 64)
    session.add(file)
    session.flush()
    apply_validation(session, file, {"ok": True, "format": "chat", "n_examples": 500,
                                     "n_tokens_estimate": 50_000, "n_errors": 0, "errors": []})
    return file


def seed(url: str, n_jobs: int) -> tuple[str, str]:
    """A tenant with a key, one processed file and ``n_jobs`` queued jobs; returns (key, file)."""
    from api.jobs.commands import create_job
    from api.jobs.schemas import JobCreate
    from control.auth import create_api_key, create_tenant
    from control.db.session import session_scope
    from control.models.base_models import load_base_models
    from control.queue import RecordingQueue
    from control.settings import Settings

    settings = Settings(_env_file=None, database_url=url, data_dir=Path(tempfile.mkdtemp()))
    models = load_base_models(settings)
    with session_scope(url) as session:
        tenant = create_tenant(session, "bench")
        _, key = create_api_key(session, tenant)
        file = processed_file(session, tenant)
    body = JobCreate(model="tunefleet-tiny-llama", training_file=file.id)
    with session_scope(url) as session:
        from control.db.models import Tenant

        tenant = session.get_one(Tenant, tenant.id)
        for i in range(n_jobs):
            create_job(session, tenant, body, raw_body={"i": i}, base_models=models,
                       queue=RecordingQueue())
    return key, file.id


async def _asgi_get(app: Any, path: str, query: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """One GET straight through the ASGI app (no sockets, no HTTP parsing): (status, body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
        "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    sent: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            sent["status"] = message["status"]
        elif message["type"] == "http.response.body":
            sent["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return sent["status"], sent["body"]


def measure_in_process(url: str, key: str, *, requests: int, concurrency: int,
                       cached: bool = True) -> dict[str, float]:
    """Per-request wall and CPU time of the list endpoint and of a bare hello, in this process.

    The machine is shared, so wrk's numbers swing with other people's load; the CPU time a
    request costs this process (``time.process_time``, all threads) is the steadier signal.
    ``cached=False`` gives the app a page cache that stores nothing: every request builds
    its page (what a poll right after a write costs).
    """
    import asyncio

    from fastapi import FastAPI

    from api.main import create_app
    from control.queue import RecordingQueue
    from control.settings import Settings

    settings = Settings(_env_file=None, database_url=url, data_dir=Path(tempfile.mkdtemp()))
    app = create_app(settings, queue=RecordingQueue())
    if not cached:
        from api.jobs.pages import JobPageCache

        app.state.job_pages = JobPageCache(max_bytes=0)
    hello = FastAPI()

    @hello.get("/hello")
    async def hello_route() -> dict[str, str]:
        return {"hello": "world"}

    auth = {"Authorization": f"Bearer {key}"}

    async def run(target: Any, path: str, headers: dict[str, str]) -> dict[str, float]:
        for _ in range(20):  # warm-up: pool connections, caches, lazy imports
            status, _body = await _asgi_get(target, path, "", headers)
            assert status == 200, (status, _body[:300])
        per_worker = requests // concurrency

        async def worker() -> None:
            for _ in range(per_worker):
                await _asgi_get(target, path, "", headers)

        wall0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        n = per_worker * concurrency
        return {"wall_ms": (time.perf_counter() - wall0) * 1e3 / n,
                "cpu_ms": (time.process_time() - cpu0) * 1e3 / n}

    async def both() -> dict[str, float]:
        h = await run(hello, "/hello", {})
        j = await run(app, "/v1/fine_tuning/jobs", auth)
        return {"hello_wall_ms": h["wall_ms"], "hello_cpu_ms": h["cpu_ms"],
                "list_wall_ms": j["wall_ms"], "list_cpu_ms": j["cpu_ms"]}

    return asyncio.run(both())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--in-process-requests", type=int, default=400,
                        help="requests per endpoint for the in-process CPU-time measurement")
    parser.add_argument("--in-process-only", action="store_true",
                        help="measure in-process only (no uvicorn/wrk; nothing written)")
    parser.add_argument("--workers", type=int, default=1,
                        help="uvicorn worker processes, the same for the API and the hello app")
    args = parser.parse_args()

    name = f"tunefleet_bench_{os.getpid()}"
    admin = psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True)
    admin.execute(f"CREATE DATABASE {name}")
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    procs: list[subprocess.Popen] = []
    work = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    try:
        from control.db.migrate import upgrade

        upgrade(url)
        t0 = time.perf_counter()
        key, file_id = seed(url, args.jobs)
        print(f"seeded {args.jobs} jobs in {time.perf_counter() - t0:.1f}s")
        local = measure_in_process(url, key, requests=args.in_process_requests, concurrency=1)
        local8 = measure_in_process(url, key, requests=args.in_process_requests, concurrency=8)
        built = measure_in_process(url, key, requests=args.in_process_requests, concurrency=1,
                                   cached=False)
        load = os.getloadavg()[0]
        in_process = (
            f"In-process (ASGI called directly, {args.in_process_requests} requests, load average "
            f"{load:.1f}): list from the page cache **{local['list_cpu_ms']:.2f} ms CPU** / "
            f"{local['list_wall_ms']:.2f} ms wall per request sequentially, "
            f"{local8['list_cpu_ms']:.2f} ms CPU / {local8['list_wall_ms']:.2f} ms wall with 8 "
            f"concurrent; list building every page (cache storing nothing) "
            f"{built['list_cpu_ms']:.2f} ms CPU / {built['list_wall_ms']:.2f} ms wall; bare hello "
            f"{local['hello_cpu_ms']:.2f} ms CPU; CPU ratio hello/list = "
            f"**{local['hello_cpu_ms'] / local['list_cpu_ms']:.2f}** (cached), "
            f"{built['hello_cpu_ms'] / built['list_cpu_ms']:.2f} (built)."
        )
        print(in_process)
        if args.in_process_only:
            return
        env = {**os.environ, "TUNEFLEET_DATABASE_URL": url, "TUNEFLEET_DATA_DIR": str(work / "data"),
               "TUNEFLEET_BROKER_URL": "redis://127.0.0.1:6379/13", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        (work / "hello_app.py").write_text(HELLO_APP)
        api_port, hello_port = free_port(), free_port()
        procs.append(start_uvicorn("api.main:create_app", api_port, env, factory=True, cwd=REPO,
                                   workers=args.workers))
        procs.append(start_uvicorn("hello_app:app", hello_port, env, factory=False, cwd=work,
                                   workers=args.workers))
        auth = {"Authorization": f"Bearer {key}"}
        list_url = f"http://127.0.0.1:{api_port}/v1/fine_tuning/jobs"
        page = httpx.get(list_url, headers=auth).json()
        assert len(page["data"]) == 20 and page["has_more"], page

        common = {"duration": args.duration, "connections": args.connections}
        wrk(list_url, headers=auth, duration=2, connections=args.connections)  # warm-up
        hello = wrk(f"http://127.0.0.1:{hello_port}/hello", headers={}, **common)
        jobs = wrk(list_url, headers=auth, **common)
        script = work / "create.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = '{json.dumps({'model': 'tunefleet-tiny-llama', 'training_file': file_id})}'\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        creates = wrk(list_url, headers=auth, script=script, **common)
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={name}") as conn:
            n_jobs = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
        created = n_jobs - args.jobs
        # wrk counts the requests completed inside its window; a few more were in flight.
        assert created >= creates["requests"] - creates["non_2xx"], (created, creates)

        ratio = jobs["rps"] / hello["rps"]
        when = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
        how = (f"`python bench/api_bench.py --duration {args.duration} --connections "
               f"{args.connections} --workers {args.workers}`; uvicorn {args.workers} "
               f"process(es) each; wrk -t1 -c{args.connections}; {args.jobs} jobs in the table; "
               f"the list polls one page (after its first request, served from the page "
               f"cache); machine shared ({os.cpu_count()} cores), load average "
               f"{os.getloadavg()[0]:.1f} at the end.\n")
        rows = [
            ("bare FastAPI `async` hello", hello),
            ("`GET /v1/fine_tuning/jobs` (20/page, auth, Postgres)", jobs),
            ("`POST /v1/fine_tuning/jobs` (create + Celery send to Redis)", creates),
        ]
        summary = (f"Ratio list/hello = **{ratio:.2f}** (goal >= 0.5); list p99 = "
                   f"**{jobs['p99_ms']:.1f} ms** (goal < 50 ms); job creation "
                   f"**{creates['rps']:.0f}/s** with {creates['non_2xx']} errors ({created} jobs "
                   f"created; socket errors: {creates['socket_errors']}).")
        lines = [
            f"\n## API throughput on PostgreSQL ({when})\n",
            how,
            "| endpoint | req/s | p99 (ms) | non-2xx | wrk CPU (% of a core) |",
            "|---|---|---|---|---|",
            *(f"| {name} | {r['rps']:.0f} | {r['p99_ms']:.1f} | {r['non_2xx']} | "
              f"{r['wrk_cpu_pct']:.0f} |" for name, r in rows),
            "",
            summary,
            "",
            in_process,
        ]
        text = "\n".join(lines) + "\n"
        print(text)
        with (REPO / "bench" / "RESULTS.md").open("a", encoding="utf-8") as handle:
            handle.write(text)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        from control.db.session import dispose_engine

        dispose_engine(url)
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
        import redis

        redis.Redis(host="127.0.0.1", port=6379, db=13).flushdb()


if __name__ == "__main__":
    main()
