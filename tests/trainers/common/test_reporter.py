"""Reporter against a real local HTTP server that goes away and comes back."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainers.common.reporter import Reporter, retry_after_s


class FakeReportAPI:
    """A tiny stand-in for the API's report endpoint: token check + dedup by seq.

    It applies a batch only once per seq (like the real endpoint's unique (job, seq))
    and records every request, so tests can check order, gaps and duplicates.
    """

    def __init__(self, port: int = 0, token: str = "tok") -> None:
        self.token = token
        self.applied: list[dict] = []  # batches applied, in arrival order
        self.requests: list[int] = []  # every seq received, duplicates included
        self.request_times: list[float] = []  # time.monotonic() of every report received
        self.refusals: list[tuple[int, dict[str, str]]] = []  # answered first, one per request
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> FakeReportAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {api.token}":
                    self._answer(401, {"error": "bad token"})
                    return
                api.requests.append(body["seq"])
                api.request_times.append(time.monotonic())
                if api.refusals:
                    code, headers = api.refusals.pop(0)
                    self._answer(code, {"error": "unavailable"}, headers)
                    return
                duplicate = any(b["seq"] == body["seq"] for b in api.applied)
                if not duplicate:
                    api.applied.append(body)
                self._answer(200, {"acked_seq": body["seq"], "duplicate": duplicate})

            def _answer(self, code, obj, headers=None):
                data = json.dumps(obj).encode()
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/internal/v1/jobs/ftjob-1/reports"

    def metric_steps(self) -> list[int]:
        return [i["step"] for b in self.applied for i in b["items"] if i["type"] == "metric"]


def test_outage_loses_nothing_and_duplicates_nothing(tmp_path):
    api = FakeReportAPI().start()
    rep = Reporter(url=api.url, token="tok", spool_dir=tmp_path / "spool", flush_interval_s=0.02, max_backoff_s=0.2)
    n = 60
    for step in range(n):
        rep.metric(step=step, train_loss=1.0)
        if step == 20:
            assert rep.flush(timeout_s=5)
            api.stop()  # the API goes away ...
        if step == 40:
            time.sleep(0.6)  # ... long enough for several failed attempts and spooled batches
            assert len(list((tmp_path / "spool").glob("*.json"))) >= 2
            api = _restart(api)
        time.sleep(0.01)
    assert rep.close(timeout_s=10)
    steps = api.metric_steps() + _restart.before  # batches acked before the outage
    assert sorted(steps) == list(range(n)) and len(steps) == n  # nothing lost, nothing twice
    seqs = [b["seq"] for b in _restart.applied_before + api.applied]
    assert seqs == list(range(1, len(seqs) + 1))  # in order, no gaps
    assert list((tmp_path / "spool").glob("*.json")) == []


def test_a_retry_after_is_honoured_within_the_backoff_cap(tmp_path):
    """A 503 saying Retry-After: 1 (the API's answer while its database is down) is not
    retried sooner; a Retry-After beyond the cap waits only the cap."""
    api = FakeReportAPI().start()
    api.refusals = [(503, {"Retry-After": "1"}), (429, {"Retry-After": "3600"})]
    rep = Reporter(url=api.url, token="tok", spool_dir=tmp_path / "spool", flush_interval_s=0.02, max_backoff_s=1.5)
    rep.metric(step=1, train_loss=1.0)
    assert rep.close(timeout_s=10)
    assert api.metric_steps() == [1]
    first, second, third = api.request_times
    assert 1.0 <= second - first < 1.5  # the server's 1 s, not the reporter's first 0.25 s backoff
    assert 1.5 <= third - second < 3.0  # an hour asked for; the cap of 1.5 s waited


@pytest.mark.parametrize(("value", "expected"), [
    (None, 0.0), ("", 0.0), ("7", 7.0), ("soon", 0.0), ("-3", 0.0),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past
    ("Wed, 21 Oct 2015 07:28:30 GMT", 30.0),
])
def test_retry_after_values(value, expected):
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert retry_after_s(value, now=now) == expected


def _restart(old: FakeReportAPI) -> FakeReportAPI:
    """Start a fresh server on the same port (state of the old one kept aside)."""
    _restart.before = old.metric_steps()
    _restart.applied_before = list(old.applied)
    return FakeReportAPI(port=old.port).start()


def test_restarted_trainer_resends_spool_first_and_never_reuses_seq(tmp_path):
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{port}/r"
    first = Reporter(url=dead, token="tok", spool_dir=tmp_path, flush_interval_s=0.02, max_backoff_s=0.05)
    first.event("one")
    time.sleep(0.1)
    first.event("two")
    assert not first.close(timeout_s=0.2)  # undeliverable: stays spooled
    spooled = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(spooled) >= 2

    api = FakeReportAPI(port=port).start()
    second = Reporter(url=api.url, token="tok", spool_dir=tmp_path, flush_interval_s=0.02)
    assert second.next_seq == len(spooled) + 1
    second.event("three")
    assert second.close(timeout_s=5)
    messages = [i["message"] for b in api.applied for i in b["items"]]
    assert messages == ["one", "two", "three"]
    assert [b["seq"] for b in api.applied] == list(range(1, len(spooled) + 2))
    api.stop()


def test_wrong_token_stops_sending_and_keeps_spool(tmp_path):
    api = FakeReportAPI(token="right").start()
    rep = Reporter(url=api.url, token="wrong", spool_dir=tmp_path, flush_interval_s=0.02)
    rep.error("nan_loss", "loss is NaN")
    assert not rep.flush(timeout_s=2)
    assert rep.rejected is not None and rep.rejected[0] == 401
    assert not rep.close(timeout_s=0.5)
    assert len(list(tmp_path.glob("*.json"))) == 1
    api.stop()


def test_local_jsonl_without_url(tmp_path):
    path = tmp_path / "reports.jsonl"
    rep = Reporter(url=None, local_path=path, flush_interval_s=0.02)
    rep.metric(step=1, train_loss=2.0)
    rep.checkpoint(1, "/ck/step-1", {"train_loss": 2.0})
    assert rep.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in rows] == ["metric", "checkpoint"] and rows[0]["seq"] == 1
    with pytest.raises(ValueError):
        Reporter(url="http://x", spool_dir=None)


def test_every_queued_item_is_mirrored_to_trackers(tmp_path):
    seen = []

    class Mirror:
        def add(self, item):
            seen.append(item["type"])

    rep = Reporter(url=None, local_path=tmp_path / "r.jsonl", flush_interval_s=0.02)
    rep.mirror = Mirror()
    rep.metric(step=1, train_loss=1.0)
    rep.artifacts("/out", [])
    rep.error("nan_loss", "x")
    assert rep.close()
    assert seen == ["metric", "artifacts", "error"]


def test_a_run_in_a_new_pod_starts_past_every_seq_the_api_applied(tmp_path):
    """A requeued job's new pod has an empty spool: it numbers from ``first_seq`` (which the
    spec builder sets past the API's last seq), so its batches are not dropped as duplicates."""
    api = FakeReportAPI().start()
    try:
        reporter = Reporter(url=api.url, token="tok", spool_dir=tmp_path / "empty", flush_interval_s=0.02,
                            first_seq=8)
        assert reporter.next_seq == 8
        reporter.event("resumed")
        assert reporter.close(timeout_s=5)
        assert [b["seq"] for b in api.applied] == [8]
        # A spool that already went further wins: seqs never go back.
        again = Reporter(url=api.url, token="tok", spool_dir=tmp_path / "empty", flush_interval_s=0.02,
                         first_seq=3)
        assert again.next_seq == 9
        assert again.close(timeout_s=5)
    finally:
        api.stop()


def test_a_disk_that_fills_between_a_batch_and_its_seq_loses_no_later_item(tmp_path, monkeypatch):
    """The disk fills after a batch file is spooled but before the next seq is: the batch
    must not stay on disk under a seq its items are sent under again from memory, or the
    API drops the second sending -- with the trainer's error in it -- as a duplicate."""
    from trainers.common import reporter as reporter_module

    write_text = Reporter._write_text
    disk = {"full": False, "refused": 0}

    def filling_write_text(path, text):
        if disk["full"] and (path.name == reporter_module.NEXT_SEQ_FILE or disk["refused"]):
            disk["refused"] += 1
            raise OSError(28, "No space left on device")
        write_text(path, text)

    monkeypatch.setattr(Reporter, "_write_text", staticmethod(filling_write_text))
    api = FakeReportAPI().start()
    try:
        rep = Reporter(url=api.url, token="tok", spool_dir=tmp_path, flush_interval_s=0.02)
        rep.metric(step=1, train_loss=1.0)
        assert rep.flush(timeout_s=5)
        disk["full"] = True
        rep.metric(step=2, train_loss=0.9)  # its batch is written, its seq is not
        deadline = time.monotonic() + 5
        while disk["refused"] < 2 and time.monotonic() < deadline:  # the thread tried twice
            time.sleep(0.01)
        assert disk["refused"] >= 2
        rep.error("disk_full", "no space left on device")
        assert rep.close(timeout_s=5)
        items = [(b["seq"], i["type"]) for b in api.applied for i in b["items"]]
        assert items == [(1, "metric"), (2, "metric"), (2, "error")]
        assert api.requests == [1, 2]  # nothing sent twice
    finally:
        api.stop()


def test_a_checkpoint_whose_listing_the_api_has_not_acknowledged_is_not_pruned(tmp_path):
    """With the API away, keep_last=1 keeps every checkpoint saved since (their listings
    wait in the spool); once the API acknowledged them, the next save prunes them."""
    from trainers.common.checkpointing import TrainerState, list_checkpoints, save_checkpoint
    from trainers.common.data import DataCursor

    api = FakeReportAPI().start()
    rep = Reporter(url=api.url, token="tok", spool_dir=tmp_path / "spool", flush_interval_s=0.02, max_backoff_s=0.1)
    root = tmp_path / "checkpoints"

    def save(step: int) -> None:
        rep.metric(step=step, train_loss=1.0)
        save_checkpoint(root, TrainerState(step=step, epoch=0, cursor=DataCursor()),
                        lambda d: (d / "weights").write_bytes(b"w"), keep_last=1, reporter=rep)

    save(1)
    assert rep.flush(timeout_s=10)
    api.stop()
    save(2)
    save(3)
    assert [step for step, _ in list_checkpoints(root)] == [2, 3]
    assert rep.unacknowledged_checkpoints() == {2, 3}

    api = FakeReportAPI(port=api.port).start()
    assert rep.flush(timeout_s=10)
    save(4)
    assert [step for step, _ in list_checkpoints(root)] == [4]
    assert rep.close(timeout_s=10)
    api.stop()
    listed = [i["step"] for b in api.applied for i in b["items"] if i["type"] == "checkpoint"]
    assert listed == [2, 3, 4] and api.metric_steps() == [2, 3, 4]
