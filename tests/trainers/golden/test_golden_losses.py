"""Golden values: the real entry point, the golden job (``job.py``), hard-coded losses.

The values were produced by ``make_golden.py`` (which also checked that two runs of each
trainer agree exactly, so the runs are deterministic on CPU with one thread). The
reference-model tests (transformers, peft) catch a trainer that drifts from its
reference; these catch a change that moves the numbers of a pipeline and its reference
together (data, tokenization, loss normalization, schedule, init). If a change is meant
to move them, rerun the script and say why in the commit. 1e-5 leaves room for another
CPU's float summation order, far below what any real change to the run moves.
"""

from __future__ import annotations

import pytest

from tests.trainers.golden.job import TRAINERS
from trainers.exit_codes import ExitCode

GOLDEN = {
    "fsdp_qlora": {
        "train_loss": [5.593229293823242, 5.523415374755859, 5.3498588562011715, 5.290916824340821],
        "valid_loss": 5.2506156921386715,
    },
    "jax_lora": {
        "train_loss": [5.593229293823242, 5.4999494552612305, 5.3085103034973145, 5.267721176147461],
        "valid_loss": 5.234011840820313,
    },
}
TOLERANCE = 1e-5


@pytest.mark.parametrize("trainer", TRAINERS)
def test_step_losses_match_the_golden_values(trainer, golden_runs):
    run = golden_runs[trainer]
    assert run.returncode == ExitCode.SUCCESS, run.output[-3000:]
    losses = [row["train_loss"] for row in run.metrics]
    assert losses == pytest.approx(GOLDEN[trainer]["train_loss"], abs=TOLERANCE)
    assert run.metrics[-1]["valid_loss"] == pytest.approx(GOLDEN[trainer]["valid_loss"], abs=TOLERANCE)
