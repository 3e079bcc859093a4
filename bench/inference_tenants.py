"""Many tenants against one embedded inference worker: the real API (uvicorn) and the real
worker (``tunefleet inference``) started from a given source tree, on the demo model.

What it prints, one line per scenario:

- the first chat on a fresh worker (nothing loaded): answered, or 503 ``model_loading``;
- another tenant's 2-token request while one tenant sends a 40 KB prompt, and while it
  runs four requests of 16 choices on a 300-byte prompt;
- four streams of ``n: 16`` abandoned after 4 s (``max_tokens`` 1,000,000, then 480):
  another tenant's 2-token request, and the abandoning tenant's next one;
- the worker's CPU time over 10 s idle (``/proc/<pid>/stat``);
- how long the worker takes to exit after SIGTERM.

    python bench/inference_tenants.py <source tree> <scratch data dir>

Run it on two trees (a checkout of an older commit, then this one) for a side-by-side.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

CLI = [sys.executable, "-c", "from tunefleet.cli import app; app()"]
MODEL = "tunefleet-tiny-llama"
HI = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Service:
    """The API and the inference worker of ``root``, on SQLite in ``data``."""

    def __init__(self, root: Path, data: Path) -> None:
        (data / "models").mkdir(parents=True, exist_ok=True)
        self.admin = f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}"
        api_port, worker_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEFLEET_")}
        env.update({"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TUNEFLEET_ENV": "test",
                    "TUNEFLEET_DATA_DIR": str(data), "TUNEFLEET_PUBLIC_URL": f"http://127.0.0.1:{api_port}",
                    "TUNEFLEET_ADMIN_API_KEY": self.admin,
                    "TUNEFLEET_INFERENCE_URL": f"http://127.0.0.1:{worker_port}",
                    "TUNEFLEET_DATABASE_URL": f"sqlite:///{data / 'db.sqlite'}",
                    "TUNEFLEET_BROKER_URL": f"sqla+sqlite:///{data / 'broker.db'}"})
        subprocess.run([sys.executable, "-c", ("from pathlib import Path; from tunefleet.demo import "
                        f"ensure_demo_model; ensure_demo_model(Path({str(data / 'models')!r}))")],
                       cwd=root, env=env, check=True)
        subprocess.run([*CLI, "db", "upgrade"], cwd=root, env=env, check=True, capture_output=True)
        subprocess.run([sys.executable, "-c", ("from control.settings import get_settings; from tunefleet.cli.operator "
                        "import ensure_admin_key; ensure_admin_key(get_settings())")],
                       cwd=root, env=env, check=True, capture_output=True)
        with (data / "api.log").open("wb") as api_log, (data / "inference.log").open("wb") as worker_log:
            self.api = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app",
                                         "--port", str(api_port), "--log-level", "warning"],
                                        cwd=root, env=env, stdout=api_log, stderr=subprocess.STDOUT)
            self.worker = subprocess.Popen([*CLI, "inference", "--threads", "1"], cwd=root, env=env,
                                           stdout=worker_log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{api_port}"
        wait_up(f"{self.base}/healthz")
        wait_up(f"http://127.0.0.1:{worker_port}/healthz")

    def tenant_key(self, name: str) -> dict[str, str]:
        with httpx.Client(base_url=f"{self.base}/v1", headers={"Authorization": f"Bearer {self.admin}"},
                          timeout=30) as http:
            tenant = http.post("/admin/tenants", json={"name": name}).json()
            key = http.post(f"/admin/tenants/{tenant['id']}/api_keys", json={}).json()["key"]
        return {"Authorization": f"Bearer {key}"}

    def chat(self, headers: dict[str, str], timeout: float = 120, **body: Any) -> tuple[Any, float, Any]:
        """(HTTP status or the error, seconds, response)."""
        started = time.monotonic()
        try:
            response = httpx.post(f"{self.base}/v1/chat/completions", headers=headers, timeout=timeout,
                                  json={"model": MODEL, "messages": HI, **body})
            return response.status_code, time.monotonic() - started, response
        except httpx.HTTPError as exc:
            return repr(exc), time.monotonic() - started, None

    def abandon(self, headers: dict[str, str], body: dict[str, Any]) -> None:
        """A stream read for 4 s, then dropped."""
        try:
            with httpx.stream("POST", f"{self.base}/v1/chat/completions", headers=headers, timeout=30,
                              json={"model": MODEL, "messages": HI, "stream": True, **body}) as response:
                if response.status_code != 200:
                    response.read()
                    print(f"    abandoned stream refused: {response.status_code} {response.text[:120]}")
                    return
                started = time.monotonic()
                for _line in response.iter_lines():
                    if time.monotonic() - started > 4:
                        break
        except httpx.HTTPError as exc:
            print(f"    abandoned stream: {exc!r}")

    def stop(self) -> None:
        for proc in (self.api, self.worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def noisy_neighbour(svc: Service, label: str, long: dict[str, str], short: dict[str, str],
                    body: dict[str, Any], count: int) -> None:
    results: list[tuple[Any, float, Any]] = []
    threads = [threading.Thread(target=lambda: results.append(svc.chat(long, timeout=300, **body)))
               for _ in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the long requests are in
    status, took, _ = svc.chat(short, max_tokens=2, timeout=300)
    for thread in threads:
        thread.join()
    print(f"[{label}] other tenant's 2-token request: HTTP {status} in {took:.1f} s; "
          f"the long tenant's: {[(s, round(t, 1)) for s, t, _ in results]}")


def main() -> None:
    root, data = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    svc = Service(root, data)
    try:
        hog, other = svc.tenant_key("hog"), svc.tenant_key("other")
        status, took, response = svc.chat(other, max_tokens=2)
        code = "answered" if status == 200 else (response.json().get("error") or {}).get("code")
        print(f"[first call] HTTP {status} after {took:.1f} s: {code}")
        while svc.chat(other, max_tokens=2)[0] != 200:
            time.sleep(1)
        noisy_neighbour(svc, "40 KB prompt", hog, other,
                        {"messages": [{"role": "user", "content": "x" * 40_000}], "max_tokens": 16}, 1)
        noisy_neighbour(svc, "4 x (300-byte prompt, n 16, max_tokens 150)", hog, other,
                        {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 150, "n": 16,
                         "temperature": 1}, 4)
        for body in ({"n": 16, "max_tokens": 1_000_000}, {"n": 16, "max_tokens": 480, "temperature": 1}):
            streams = [threading.Thread(target=svc.abandon, args=(hog, body)) for _ in range(4)]
            for thread in streams:
                thread.start()
            for thread in streams:
                thread.join()
            status, took, _ = svc.chat(other, max_tokens=2, timeout=60)
            own = svc.chat(hog, max_tokens=2, timeout=60)[0]
            print(f"[4 abandoned streams {body}] other tenant's 2-token request: HTTP {status} in {took:.1f} s; "
                  f"the abandoning tenant's next request: HTTP {own}")
        time.sleep(5)
        before = cpu_seconds(svc.worker.pid)
        time.sleep(10)
        print(f"[idle CPU] inference worker: {cpu_seconds(svc.worker.pid) - before:.2f} CPU s over 10 s")
        svc.worker.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        try:
            svc.worker.wait(30)
            print(f"[SIGTERM] the worker exited ({svc.worker.returncode}) after {time.monotonic() - signalled:.1f} s")
        except subprocess.TimeoutExpired:
            print("[SIGTERM] the worker still runs 30 s after SIGTERM")
    finally:
        svc.stop()


if __name__ == "__main__":
    main()
