"""LR schedules against closed-form values; SIGTERM sets the stop flag."""

from __future__ import annotations

import math
import os
import signal

import pytest

from trainers.common.schedules import learning_rate_at
from trainers.common.signals import StopFlag


def test_warmup_then_cosine_linear_constant():
    kw = {"base_lr": 1.0, "total_steps": 12, "warmup_steps": 2}
    assert [learning_rate_at(s, **kw) for s in (0, 1)] == [0.5, 1.0]
    assert learning_rate_at(2, **kw) == 1.0  # decay starts at progress 0
    assert learning_rate_at(7, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate_at(12, **kw) == pytest.approx(0.0)
    assert learning_rate_at(50, **kw) == pytest.approx(0.0)  # clamped past the end
    assert learning_rate_at(7, kind="linear", **kw) == pytest.approx(0.5)
    assert learning_rate_at(11, kind="constant", **kw) == 1.0
    assert learning_rate_at(0, base_lr=3e-4, total_steps=1) == 3e-4
    with pytest.raises(ValueError):
        learning_rate_at(-1, **kw)
    with pytest.raises(ValueError):
        learning_rate_at(0, kind="step", **kw)  # type: ignore[arg-type]


def test_sigterm_sets_flag_and_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopFlag() as flag:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and flag.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before
