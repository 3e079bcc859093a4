"""One process of a 2-process CPU "cluster" running the recipe (see test_multihost.py).

``python -m tests.trainers.jax_lora.multihost_worker SPEC_JSON``; the JAX_* variables
and XLA_FLAGS (2 fake devices per process) come from the parent.
"""

from __future__ import annotations

import sys

from trainers.jax_lora.recipe import run
from trainers.spec import TrainerSpec

if __name__ == "__main__":
    run(TrainerSpec.load(sys.argv[1]))
