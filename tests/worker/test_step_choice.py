"""scheduling/step_choice.py: the fastest micro batch and rematerialization that fit.

Table tests on the pure function, against the estimator it plans with: a job that fits
without recomputation runs without it; one that does not gets the least recomputation
that fits; the micro batch grows with the device's memory; the global batch is never
changed (every micro batch divides it); and the choice is the fastest fitting one in the
documented speed order.
"""

from __future__ import annotations

import pytest

from scheduling.estimator import HEADROOM, KNOWN_MODELS, TrainingShape, memory_per_gpu
from scheduling.pools import GIB
from scheduling.step_choice import (
    REMAT_ORDER,
    StepChoice,
    choose_step,
    kept_step,
    micro_batch_options,
    remat_options,
    shape_for,
    step_candidates,
)
from trainers.common.step_fit import fallback_steps
from trainers.fsdp_qlora.step_fit import CHECKPOINTING_ORDER
from trainers.jax_lora.step_fit import REMAT_ORDER as JAX_REMAT_ORDER

M8B = KNOWN_MODELS["llama-3.1-8b"]
M70B = KNOWN_MODELS["llama-3.1-70b"]
QLORA = TrainingShape(method="qlora", quantization="nf4")


DEFAULT = TrainingShape()


def _choose(m=M8B, t=DEFAULT, *, gib=80, trainer="jax_lora", gpus=1, batch=32, dp=1, accel="nvidia-h100",
            offload=False) -> StepChoice:
    return choose_step(m, t, accelerator=accel, device_bytes=gib * GIB, gpus=gpus, trainer=trainer,
                       batch_size=batch, data_parallel=dp, offload_allowed=offload)


def _fits(m, t, *, micro, remat, gib, trainer, gpus=1, accel="nvidia-h100", offload=False) -> bool:
    shape = shape_for(t, micro_batch=micro, remat=remat, accelerator=accel)
    return memory_per_gpu(m, shape, gpus, accelerator=accel, offload=offload, trainer=trainer).total \
        <= int(gib * GIB * HEADROOM)


# (model, training, device GiB, trainer, batch) -> (micro batch, remat): pinned rows of the
# table; the invariants below hold for every row.
TABLE = [
    # short rows on a large device: no recomputation, the largest micro batch that fits
    (M8B, TrainingShape(seq_len=390), 80, "jax_lora", 32, 16, "none"),
    (M8B, TrainingShape(seq_len=390), 80, "fsdp_qlora", 32, 8, "none"),
    # the context's worth per row: still no recomputation, a smaller micro batch
    (M8B, TrainingShape(seq_len=2048), 80, "jax_lora", 32, 2, "none"),
    (M8B, TrainingShape(seq_len=2048), 80, "fsdp_qlora", 32, 2, "none"),
    # long rows: no micro batch fits without recomputation; jax_lora keeps the matmuls'
    # outputs (dots_saveable), the torch trainer recomputes whole layers
    (M8B, TrainingShape(seq_len=8192), 80, "jax_lora", 32, 1, "dots_saveable"),
    (M8B, TrainingShape(seq_len=8192), 80, "fsdp_qlora", 32, 2, "per_layer"),
    # ... and on a smaller device jax_lora too
    (M8B, TrainingShape(seq_len=8192), 40, "jax_lora", 32, 1, "per_layer"),
    # a 70B QLoRA job on one 80 GiB device: per-layer recomputation at micro batch 1
    (M70B, QLORA, 80, "fsdp_qlora", 16, 2, "per_layer"),
]


@pytest.mark.parametrize(("m", "t", "gib", "trainer", "batch", "micro", "remat"), TABLE)
def test_table(m, t, gib, trainer, batch, micro, remat):
    choice = _choose(m, t, gib=gib, trainer=trainer, batch=batch)
    assert (choice.micro_batch, choice.remat) == (micro, remat)
    assert choice.fits and choice.planned_bytes <= gib * GIB * HEADROOM
    assert batch % choice.micro_batch == 0  # the global batch is kept: accumulation makes up the rest


@pytest.mark.parametrize(("m", "t", "gib", "trainer", "batch", "micro", "remat"), TABLE)
def test_the_choice_is_the_least_recomputation_that_fits(m, t, gib, trainer, batch, micro, remat):
    options = remat_options(trainer, "nvidia-h100")
    level = options.index(remat)
    for lighter in options[:level]:  # no micro batch fits with less recomputation
        assert not any(_fits(m, t, micro=mb, remat=lighter, gib=gib, trainer=trainer)
                       for mb in micro_batch_options(batch))


@pytest.mark.parametrize(("m", "t", "gib", "trainer", "batch", "micro", "remat"), TABLE)
def test_the_choice_is_the_largest_micro_batch_that_fits_at_its_recomputation(m, t, gib, trainer, batch, micro,
                                                                              remat):
    assert not any(_fits(m, t, micro=mb, remat=remat, gib=gib, trainer=trainer)
                   for mb in micro_batch_options(batch) if mb > micro)


@pytest.mark.parametrize("trainer", ["jax_lora", "fsdp_qlora"])
def test_the_micro_batch_grows_with_free_memory(trainer):
    t = TrainingShape(seq_len=1024)
    choices = [_choose(t=t, gib=gib, trainer=trainer, batch=64) for gib in (40, 80, 141, 192)]
    micros = [c.micro_batch for c in choices]
    assert {c.remat for c in choices} == {"none"}
    assert micros == sorted(micros) and micros[-1] > micros[0], micros
    # and across devices: more memory never means more recomputation
    levels = [REMAT_ORDER.index(_choose(t=TrainingShape(seq_len=8192), gib=gib, trainer=trainer, batch=64).remat)
              for gib in (16, 24, 40, 80, 141, 192)]
    assert levels == sorted(levels, reverse=True) and levels[0] > levels[-1], levels


def test_a_job_that_fits_without_recomputation_runs_without_it():
    for trainer in ("jax_lora", "fsdp_qlora"):
        assert _choose(t=TrainingShape(seq_len=512), trainer=trainer).remat == "none"


def test_dots_saveable_is_chosen_when_it_fits_and_no_remat_does_not():
    # Find a device between what dots_saveable and what no remat need at micro batch 1.
    t, batch = TrainingShape(seq_len=2048), 1
    need = {r: memory_per_gpu(M8B, shape_for(t, micro_batch=1, remat=r, accelerator="nvidia-h100"), 1,
                              accelerator="nvidia-h100", trainer="jax_lora").total for r in REMAT_ORDER}
    assert need["per_layer"] < need["dots_saveable"] < need["none"]
    gib = (need["dots_saveable"] + need["none"]) / 2 / HEADROOM / GIB
    choice = _choose(t=t, gib=gib, batch=batch)
    assert (choice.micro_batch, choice.remat) == (1, "dots_saveable")
    # the torch trainer has no such policy: it checkpoints whole layers
    torch_choice = _choose(t=t, gib=gib, batch=batch, trainer="fsdp_qlora")
    assert torch_choice.remat == "per_layer" and torch_choice.activation_checkpointing == "non_reentrant"


@pytest.mark.parametrize(("batch", "dp", "options"), [
    (32, 1, [1, 2, 4, 8, 16, 32]), (12, 2, [1, 2, 3, 6]), (6, 4, [1]), (1, 1, [1]), (128, 1, [1, 2, 4, 8, 16, 32, 64]),
])
def test_micro_batches_split_the_global_batch_evenly(batch, dp, options):
    assert micro_batch_options(batch, dp) == options
    assert all(batch % (mb * dp) == 0 for mb in options if dp <= batch and batch % dp == 0)


def test_data_parallel_ranks_divide_the_micro_batches():
    choice = _choose(t=TrainingShape(seq_len=390), trainer="fsdp_qlora", gpus=4, dp=4, batch=32)
    assert 32 % (choice.micro_batch * 4) == 0


def test_cpu_pools_never_rematerialize_and_grow_the_micro_batch():
    m = KNOWN_MODELS["llama-2-7b"]
    small = _choose(m, TrainingShape(seq_len=256), gib=16, accel="cpu", trainer="fsdp_qlora", batch=16)
    large = _choose(m, TrainingShape(seq_len=256), gib=128, accel="cpu", trainer="fsdp_qlora", batch=16)
    assert small.remat == large.remat == "none"
    assert large.micro_batch >= small.micro_batch


def test_offload_only_when_the_placement_allowed_it_and_nothing_else_fits():
    # 70B QLoRA on 2x 24 GiB: does not fit without offload at all
    t = QLORA
    without = _choose(M70B, t, gib=24, gpus=2, dp=2, trainer="fsdp_qlora", batch=8)
    assert not without.fits and not without.cpu_offload
    with_offload = _choose(M70B, t, gib=24, gpus=2, dp=2, trainer="fsdp_qlora", batch=8, offload=True)
    assert with_offload.fits and with_offload.cpu_offload
    # a job that fits on the device keeps its weights there although offload is allowed
    assert not _choose(t=TrainingShape(seq_len=390), trainer="fsdp_qlora", offload=True).cpu_offload


def test_nothing_fits_gives_the_smallest_choice_marked_unfit():
    choice = _choose(M70B, TrainingShape(seq_len=8192), gib=16, trainer="jax_lora")
    assert not choice.fits and choice.micro_batch == 1 and choice.remat == "per_layer"


def test_a_resumed_job_keeps_its_choice_replanned_on_its_new_gang():
    first = _choose(t=TrainingShape(seq_len=2048), trainer="jax_lora")
    kept = kept_step(first.to_dict(), M8B, TrainingShape(seq_len=2048), accelerator="nvidia-h100",
                     device_bytes=141 * GIB, gpus=1, trainer="jax_lora")
    assert kept is not None and (kept.micro_batch, kept.remat) == (first.micro_batch, first.remat)
    assert kept.device_bytes == 141 * GIB
    # dots_saveable does not exist in the torch trainer: chosen again there
    dots = StepChoice(1, "dots_saveable", False, 0, 80 * GIB)
    assert kept_step(dots.to_dict(), M8B, TrainingShape(), accelerator="nvidia-h100", device_bytes=80 * GIB,
                     gpus=1, trainer="fsdp_qlora") is None
    assert kept_step(None, M8B, TrainingShape(), accelerator="cpu", device_bytes=GIB, gpus=1,
                     trainer="jax_lora") is None


def test_the_event_words():
    choice = StepChoice(8, "none", False, int(61 * GIB), 80 * GIB)
    assert choice.describe() == "micro-batch 8, no remat: 61.0 GiB of 80 planned (84% usable)"
    assert StepChoice.from_dict(choice.to_dict()) == choice


def test_a_cpu_host_mesh_plans_every_devices_rows_in_one_process():
    m, t = KNOWN_MODELS["llama-2-7b"], TrainingShape(seq_len=256)
    one = _choose(m, t, gib=64, accel="cpu", trainer="jax_lora", batch=16)
    four = choose_step(m, t, accelerator="cpu", device_bytes=64 * GIB, gpus=1, trainer="jax_lora", batch_size=16,
                       data_parallel=4, devices_per_process=4)
    # 64 GiB holds 8 rows: one device takes all 8, four devices 2 each
    assert (one.micro_batch, four.micro_batch) == (8, 2)
    assert four.planned_bytes == one.planned_bytes


@pytest.mark.parametrize(("m", "t", "gib", "trainer", "batch", "micro", "remat"), TABLE)
def test_the_choice_is_the_first_candidate_that_fits_and_the_trainers_step_down_in_the_same_order(
        m, t, gib, trainer, batch, micro, remat):
    candidates = step_candidates(m, t, accelerator="nvidia-h100", device_bytes=gib * GIB, gpus=1, trainer=trainer,
                                 batch_size=batch)
    assert len(candidates) == len(micro_batch_options(batch)) * len(remat_options(trainer, "nvidia-h100"))
    first = next(c for c in candidates if c.fits)
    assert first == _choose(m, t, gib=gib, trainer=trainer, batch=batch)
    assert all(c.fits == (c.planned_bytes <= int(gib * GIB * HEADROOM)) for c in candidates)
    # What a trainer tries after the planned step, when its device disagrees, is what
    # follows it here (the torch trainer spells per_layer non_reentrant).
    spelled = (lambda r: r) if trainer == "jax_lora" else (lambda r: {"none": "none"}.get(r, "non_reentrant"))
    order = JAX_REMAT_ORDER if trainer == "jax_lora" else CHECKPOINTING_ORDER
    after = [(c.micro_batch, spelled(c.remat)) for c in candidates[candidates.index(first) + 1:]]
    assert fallback_steps(batch, first.micro_batch, spelled(first.remat), order) == after
