"""Fixtures of the dashboard's browser tests: the real service and Debian's Chromium.

``service`` runs ``tunefleet serve`` (API + Celery worker + scheduler, embedded
defaults: SQLite, server-less broker, local executor) as a subprocess on a free port with
its own data directory, after building the demo's tiny Llama there (hidden 64, 2 layers)
so jobs really train, plus a registered but broken model (config only) whose jobs fail
in the trainer. It creates a second tenant with its own key for isolation tests.

``browser`` launches /usr/bin/chromium through Playwright's driver (never ``playwright
install``); ``page_for(key)`` gives a logged-in page. Screenshots go to
``test-output/screenshots/`` (``TUNEFLEET_TEST_OUTPUT`` overrides the root).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = Path(os.environ.get("TUNEFLEET_TEST_OUTPUT", REPO / "test-output")) / "screenshots"


@dataclass
class Service:
    """A running ``tunefleet serve`` and the keys to talk to it."""

    url: str
    data_dir: Path
    admin_key: str
    other_key: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def api(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {key or self.admin_key}"},
            timeout=30.0,
        )

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tunefleet serve exited early:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"tunefleet serve did not answer in {timeout_s}s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="package")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser-deps` (apt-get install chromium)")
    from trainers.common.tiny_model import build_tiny_llama

    data_dir = tmp_path_factory.mktemp("tunefleet-ui")
    models = data_dir / "models"
    models_file = data_dir / "base_models.yaml"
    models_file.write_text(
        "models:\n"
        f"  - {{id: tunefleet-tiny-llama, path: '{models / 'tiny-llama'}', params_b: 0.0001, max_seq_len: 512}}\n"
        f"  - {{id: broken-llama, path: '{models / 'broken-llama'}', params_b: 0.0001, max_seq_len: 512}}\n"
    )
    # Three trainer slots on this machine, so a long job, a failing one and the submitted
    # one can run side by side (the embedded default has one).
    pools_file = data_dir / "node_pools.yaml"
    pools_file.write_text(
        "pools:\n"
        "  - {name: local, accelerator: cpu, gpu_memory_gib: 16, gpus_per_node: 3,\n"
        "     trainers: [fsdp_qlora, jax_lora], peak_tflops: 0.5, nodes: 1}\n"
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "TUNEFLEET_DATA_DIR": str(data_dir),
        "TUNEFLEET_PUBLIC_URL": url,
        "TUNEFLEET_ENV": "test",
        "TUNEFLEET_BASE_MODELS_FILE": str(models_file),
        "TUNEFLEET_NODE_POOLS_FILE": str(pools_file),
        # serve's default (the API's port + 1) may be taken: the inference worker gets its own.
        "TUNEFLEET_INFERENCE_URL": f"http://127.0.0.1:{_free_port()}",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = data_dir / "serve.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-c", "from tunefleet.cli import app; app()", "serve",
         "--port", str(port), "--data-dir", str(data_dir), "--worker-concurrency", "2"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        # The checkpoints are only read when a job trains: build them while serve boots.
        build_tiny_llama(models / "tiny-llama", hidden_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)
        # A registered model whose checkpoint has a config but no weights or tokenizer: the
        # trainer refuses it with a stable error code (the failed-job page shows it).
        (models / "broken-llama").mkdir()
        shutil.copy(models / "tiny-llama" / "config.json", models / "broken-llama" / "config.json")
        _wait_healthy(url, process, log_path, timeout_s=60)
        admin_key = (data_dir / "admin_key").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}) as api:
            tenant = api.post("/v1/admin/tenants", json={"name": "other-org"}).json()
            other_key = api.post(f"/v1/admin/tenants/{tenant['id']}/api_keys", json={}).json()["key"]
        yield Service(url, data_dir, admin_key, other_key, process, log_path)
    finally:
        # serve stops its worker and scheduler on SIGTERM; the group kill is the backstop.
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        log.close()


@pytest.fixture(scope="package")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="package")
def screenshots() -> Path:
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture()
def page_for(browser, service: Service) -> Iterator[Callable[[str], object]]:
    """``page_for(key)``: a fresh browser context logged in to the dashboard with ``key``."""
    contexts = []

    def login(key: str) -> object:
        # bypass_csp: Playwright evaluates the tests' wait_for_function expressions inside
        # the page, which the dashboard's script-src 'self' forbids; the policy itself is
        # checked in tests/security/test_dashboard.py.
        context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True,
                                      bypass_csp=True)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(15_000)
        page.goto(f"{service.url}/ui/")
        page.wait_for_url("**/ui/login**")
        page.fill("input[name=api_key]", key)
        page.click("button[type=submit]")
        page.wait_for_url(f"{service.url}/ui/")
        return page

    yield login
    for context in contexts:
        context.close()
