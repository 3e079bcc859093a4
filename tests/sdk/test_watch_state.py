"""What `jobs watch` shows, computed from stream messages (no terminal needed)."""

from __future__ import annotations

from tunefleet.cli.watch import WatchState
from tunefleet.sdk.types import StreamEvent


def metric(step: int, loss: float) -> StreamEvent:
    return StreamEvent(event="metric", data={"step": step, "total_steps": 10, "train_loss": loss,
                                             "tokens_per_s": 2000.0})


def test_eta_uses_the_average_step_rate_and_ignores_replayed_rows() -> None:
    state = WatchState()
    state.apply(StreamEvent(event="job", data={"status": "running"}), now=100.0)
    state.apply(metric(2, 2.0), now=100.0)
    state.apply(metric(4, 1.5), now=104.0)  # 2 steps in 4 s -> 2 s per step
    assert state.eta_seconds() == 12.0  # 6 steps left
    state.apply(metric(3, 9.9), now=105.0)  # an older row replayed after a reconnect
    assert state.step == 4 and state.train_loss == 1.5
    fields = state.fields()
    assert fields["steps"] == "4/10" and fields["speed"] == "2,000 tok/s" and fields["eta"] == "0:12"
    assert fields["loss"] == "1.5000"


def test_status_and_events_come_from_their_own_messages() -> None:
    state = WatchState()
    assert state.eta_seconds() is None and state.fields()["eta"] == "-"
    state.apply(StreamEvent(event="event", data={"level": "warn", "message": "slow disk"}), now=0)
    state.apply(StreamEvent(event="status", data={"message": "Job failed", "level": "error", "status": "failed",
                                                  "data": {"from": "running", "to": "failed"}}), now=0)
    assert state.new_events == ["[warn] slow disk", "[error] Job failed"]
    assert state.status == "failed" and state.finished
