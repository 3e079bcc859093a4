"""control/job_settings.py: a job's settings parsed once, from a row or a creation request.

Table tests on the value itself (defaults from the trainer contract, the quantization a
method implies, the trainer alias, DPO's own settings, rows in the shapes earlier versions
stored), the round trip request -> row -> value, and the one guard the spec builder adds
on it (a job whose "auto" hyperparameters are not resolved gets no trainer spec).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from control.job_settings import (
    AdapterSettings,
    DpoMethod,
    HyperparameterSettings,
    JobSettings,
    ParentSettings,
    SupervisedMethod,
    quantization_for,
)
from trainers.spec import (
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_TARGET_MODULES,
    AdapterSpec,
    EvalSpec,
    HyperparametersSpec,
    IntegrationSpec,
    MethodSpec,
    TrainerSpec,
)

# A supervised job's hyperparameters as resolution stores them (control.jobs.hyperparameters).
RESOLVED = {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 1.0, "learning_rate": 2e-4,
            "micro_batch_size": 4, "lr_scheduler": "cosine", "warmup_steps": 1, "weight_decay": 0.0,
            "max_grad_norm": 1.0, "max_steps": None, "total_steps": 6}


def row(**columns: Any) -> SimpleNamespace:
    """A job row with these settings columns (the others null, as a row may hold them)."""
    names = ("trainer", "adapter", "method", "hyperparameters", "max_seq_len", "packing", "eval", "seed",
             "placement", "integrations", "parent")
    return SimpleNamespace(**{name: columns.get(name) for name in names})


def test_a_row_that_holds_nothing_has_the_trainer_contract_s_defaults() -> None:
    settings = JobSettings.from_row(row())
    assert settings == JobSettings()
    assert settings.adapter.spec() == AdapterSpec()
    assert settings.method.spec() == MethodSpec()
    assert settings.eval.spec() == EvalSpec()
    assert (settings.trainer, settings.max_seq_len, settings.seed) == ("auto", DEFAULT_MAX_SEQ_LEN,
                                                                      TrainerSpec.model_fields["seed"].default)
    hp = settings.hyperparameters
    spec_default = {name: HyperparametersSpec.model_fields[name].default
                    for name in ("lr_scheduler", "weight_decay", "max_grad_norm", "max_steps")}
    assert {name: getattr(hp, name) for name in spec_default} == spec_default
    assert (hp.n_epochs, hp.batch_size, hp.learning_rate_multiplier) == ("auto", "auto", "auto")
    assert not settings.resolved


@pytest.mark.parametrize(
    ("adapter", "quantization"),
    [
        ({}, "none"),
        ({"method": "lora"}, "none"),
        ({"method": "qlora"}, "nf4"),
        ({"method": "qlora", "quantization": None}, "nf4"),
        ({"method": "qlora", "quantization": "hqq4"}, "hqq4"),
        ({"method": "qlora", "quantization": "nf4", "double_quant": True}, "nf4"),
        ({"method": "lora", "quantization": "nf4"}, "none"),  # a LoRA base is never quantized
    ],
)
def test_the_quantization_follows_the_method(adapter, quantization) -> None:
    assert JobSettings.from_row(row(adapter=adapter)).adapter.quantization == quantization
    assert AdapterSettings.model_validate(adapter).quantization == quantization
    assert quantization_for(adapter.get("method"), adapter.get("quantization")) == quantization


@pytest.mark.parametrize(
    ("stored", "trainer"),
    [("jax", "jax_lora"), ("jax_lora", "jax_lora"), ("fsdp_qlora", "fsdp_qlora"), ("auto", "auto"),
     (None, "auto")],
)
def test_the_trainer_alias_is_normalised(stored, trainer) -> None:
    assert JobSettings.from_row(row(trainer=stored)).trainer == trainer


def test_an_unknown_trainer_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="trainer"):
        JobSettings.from_row(row(trainer="megatron"))


@pytest.mark.parametrize(
    ("method", "hyperparameters", "expected"),
    [
        (None, RESOLVED, SupervisedMethod()),
        ({}, RESOLVED, SupervisedMethod()),
        ({"type": "supervised"}, RESOLVED, SupervisedMethod()),
        ({"type": "dpo"}, {**RESOLVED, "beta": 0.25, "sft_weight": 0.5}, DpoMethod(beta=0.25, sft_weight=0.5)),
        ({"type": "dpo"}, {"n_epochs": "auto", "beta": "auto"}, DpoMethod(beta="auto")),
    ],
)
def test_the_method_takes_its_own_settings_from_the_hyperparameters(method, hyperparameters, expected) -> None:
    settings = JobSettings.from_row(row(method=method, hyperparameters=hyperparameters))
    assert settings.method == expected
    # Training hyperparameters and the method's own are stored together, as OpenAI shows them.
    assert settings.stored_hyperparameters() == {k: v for k, v in hyperparameters.items() if v is not None}
    assert "beta" not in settings.hyperparameters.model_dump()


def test_a_resolved_dpo_job_maps_to_the_dpo_method_spec() -> None:
    settings = JobSettings.from_row(row(method={"type": "dpo"},
                                        hyperparameters={**RESOLVED, "beta": 0.25, "sft_weight": 0.5}))
    assert settings.resolved
    assert settings.method.spec() == MethodSpec(type="dpo", beta=0.25, sft_weight=0.5)


@pytest.mark.parametrize(
    ("hyperparameters", "method", "resolved"),
    [
        (RESOLVED, None, True),
        ({"n_epochs": "auto", "batch_size": 4, "learning_rate_multiplier": "auto"}, None, False),
        ({**RESOLVED, "beta": 0.1, "sft_weight": 0.0}, {"type": "dpo"}, True),
        ({**RESOLVED, "beta": "auto"}, {"type": "dpo"}, False),
    ],
)
def test_resolved_means_no_auto_is_left(hyperparameters, method, resolved) -> None:
    assert JobSettings.from_row(row(hyperparameters=hyperparameters, method=method)).resolved is resolved


# Rows in the shapes earlier versions stored: keys missing, nulls, lists for tuples, keys
# this version no longer reads. Each parses to the settings today's readers took from it.
OLD_ROWS = [
    pytest.param(
        {"adapter": {"method": "qlora", "r": 16}},
        {"method": "qlora", "r": 16, "alpha": 16.0, "dropout": 0.0, "target_modules": DEFAULT_TARGET_MODULES,
         "quantization": "nf4", "double_quant": False, "hqq_group_size": 64, "use_dora": False},
        id="adapter-with-missing-keys",
    ),
    pytest.param(
        {"adapter": {"method": "lora", "r": 8.0, "target_modules": [], "quantization": None, "double_quant": None}},
        {"method": "lora", "r": 8, "target_modules": DEFAULT_TARGET_MODULES, "quantization": "none",
         "double_quant": False},
        id="adapter-with-nulls-and-an-empty-module-list",
    ),
    pytest.param(
        {"adapter": {"method": "qlora", "quantization": "hqq4", "hqq_group_size": 32, "use_dora": True,
                     "retired_key": 1}},
        {"quantization": "hqq4", "hqq_group_size": 32, "use_dora": True},
        id="adapter-with-trainer-only-and-unknown-keys",
    ),
]


@pytest.mark.parametrize(("columns", "adapter"), OLD_ROWS)
def test_an_adapter_stored_by_an_earlier_version_parses_to_the_same_settings(columns, adapter) -> None:
    parsed = JobSettings.from_row(row(**columns)).adapter
    assert {name: getattr(parsed, name) for name in adapter} == adapter
    assert parsed.spec().model_dump() == parsed.model_dump()  # the trainer spec takes it as is


def test_hyperparameters_stored_with_nulls_take_the_defaults() -> None:
    stored = {**RESOLVED, "lr_scheduler": None, "weight_decay": None, "max_steps": None}
    hp = JobSettings.from_row(row(hyperparameters=stored)).hyperparameters
    assert (hp.lr_scheduler, hp.weight_decay, hp.max_steps) == ("cosine", 0.0, None)
    assert hp == HyperparameterSettings.model_validate({k: v for k, v in stored.items() if v is not None})


def test_the_other_columns_of_an_old_row() -> None:
    settings = JobSettings.from_row(row(
        trainer="jax", max_seq_len=512, packing=None, seed=7, eval={"every_n_steps": 10, "max_batches": None},
        placement={"pool": "rtx4090", "gpus": None}, integrations=[
            {"type": "wandb", "wandb": {"project": "p", "tags": ["a"]}},
            {"type": "mlflow", "mlflow": {"tracking_uri": "http://mlflow:5000", "experiment": "e",
                                          "run_name": "r"}}]))
    assert (settings.trainer, settings.max_seq_len, settings.packing, settings.seed) == ("jax_lora", 512, False, 7)
    assert settings.eval.spec() == EvalSpec(every_n_steps=10)
    assert (settings.placement.pool, settings.placement.gpus, settings.placement.queue_if_unfit) == (
        "rtx4090", None, False)
    assert [i.spec() for i in settings.integrations] == [
        IntegrationSpec(type="wandb", project="p", tags=("a",)),
        IntegrationSpec(type="mlflow", tracking_uri="http://mlflow:5000", project="e", name="r"),
    ]


def test_the_value_is_frozen() -> None:
    settings = JobSettings()
    with pytest.raises(ValidationError, match="frozen"):
        settings.max_seq_len = 4  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        settings.adapter.r = 4  # type: ignore[misc]


# ---- from a creation request, to a row, and back -----------------------------------------


def _body(**fields: Any):
    from api.jobs.schemas import JobCreate

    return JobCreate.model_validate({"model": "m", "training_file": "file-1", **fields})


def test_a_request_becomes_the_row_columns_creation_has_always_written() -> None:
    body = _body(
        hyperparameters={"n_epochs": 2}, seed=7, trainer="jax", max_seq_len=256, packing=True,
        adapter={"method": "qlora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "q_proj"]},
        placement={"gpus": 2, "queue_if_unfit": True}, eval={"every_n_steps": 5},
        integrations=[{"type": "wandb", "wandb": {"project": "p"}}],
    )
    columns = body.job_settings(max_seq_len=256).row_columns()
    assert columns == {
        "trainer": "jax_lora",
        "adapter": {"method": "qlora", "r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                    "quantization": "nf4", "double_quant": False},
        "method": {"type": "supervised"},
        "hyperparameters": {"n_epochs": 2, "batch_size": "auto", "learning_rate_multiplier": "auto"},
        "max_seq_len": 256, "packing": True, "eval": {"every_n_steps": 5}, "seed": 7,
        "placement": {"gpus": 2, "queue_if_unfit": True},
        "integrations": [{"type": "wandb", "wandb": {"project": "p", "tags": []}}],
        "parent": None,  # it continues no fine-tuned model
    }
    assert json.loads(json.dumps(columns)) == columns  # JSON columns hold it as is


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.3, "batch_size": 2}}}},
        {"method": {"type": "dpo"}},
        {"adapter": {"method": "qlora", "quantization": "hqq4"}, "trainer": "fsdp_qlora"},
        {"hyperparameters": {"learning_rate": 1e-4, "micro_batch_size": 1, "warmup_steps": 0}, "seed": 3},
    ],
)
def test_a_new_row_parses_back_to_the_settings_it_was_written_from(fields) -> None:
    settings = _body(**fields).job_settings(max_seq_len=128)
    columns = settings.row_columns()
    assert JobSettings.from_row(SimpleNamespace(**columns)) == settings
    assert JobSettings.from_columns(**columns).row_columns() == columns


def test_resolving_the_hyperparameters_moves_the_dpo_beta_into_the_method() -> None:
    from control.jobs.hyperparameters import resolve_settings

    settings = _body(method={"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 2}}}).job_settings(
        max_seq_len=128)
    resolved = resolve_settings(settings, 12)
    assert not settings.resolved and resolved.resolved
    assert resolved.method == DpoMethod(beta=MethodSpec().beta, sft_weight=MethodSpec().sft_weight)
    # 12 pairs: 6 steps an epoch, 9 epochs (at least 100 pairs seen).
    assert (resolved.hyperparameters.batch_size, resolved.hyperparameters.total_steps) == (2, 54)
    assert resolved.adapter == settings.adapter and resolved.max_seq_len == 128


# ---- the spec builder's guard --------------------------------------------------------------


def test_a_job_whose_hyperparameters_are_not_resolved_gets_no_spec(client, tenant_key, db_session, settings) -> None:
    from control.db.models import Job
    from worker.spec_builder import SpecError, build_spec

    headers = tenant_key().headers
    line = json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
    upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                         files={"file": ("train.jsonl", (line + "\n").encode(), "application/jsonl")})
    created = client.post("/v1/fine_tuning/jobs", headers=headers,
                          json={"model": "tunefleet-tiny-llama", "training_file": upload.json()["id"]})
    assert created.status_code == 200, created.text
    job = db_session.get(Job, created.json()["id"])
    job.hyperparameters = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}
    with pytest.raises(SpecError) as raised:
        build_spec(db_session, job, settings, pool_accelerator="cpu", pool_families=("fsdp_qlora",), gpus=1,
                   token="t")
    assert raised.value.code == "hyperparameters_not_resolved"


GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "eq"}


def test_a_reinforcement_row_keeps_its_grader_in_the_method_and_its_settings_among_the_hyperparameters() -> None:
    from control.job_settings import ReinforcementMethod, samples_per_prompt
    from trainers.spec import ReinforcementSpec

    stored = {"type": "reinforcement", "grader": GRADER}
    hyperparameters = {**RESOLVED, "compute_multiplier": 1.5, "eval_interval": 5, "eval_samples": 2,
                       "reasoning_effort": "high", "kl_coef": 0.04}
    settings = JobSettings.from_row(row(method=stored, hyperparameters=hyperparameters))
    assert settings.method == ReinforcementMethod(grader=GRADER, compute_multiplier=1.5, eval_interval=5,
                                                  eval_samples=2, reasoning_effort="high", kl_coef=0.04)
    assert settings.resolved
    assert settings.row_columns()["method"] == stored
    assert settings.stored_hyperparameters() == {k: v for k, v in hyperparameters.items() if v is not None}
    assert settings.method.spec() == MethodSpec(type="reinforcement", reinforcement=ReinforcementSpec(
        grader=GRADER, samples_per_prompt=6, eval_interval=5, eval_samples=2, kl_coef=0.04,
        reasoning_effort="high"))
    assert [samples_per_prompt(m) for m in (0.01, 0.5, 1.0, 2.0, 16.0, 100.0)] == [2, 2, 4, 8, 64, 64]

    unresolved = JobSettings.from_row(row(method=stored, hyperparameters={**RESOLVED, "eval_interval": "auto"}))
    assert not unresolved.resolved
    with pytest.raises(ValueError, match="resolved"):
        unresolved.method.spec()


def test_the_reinforcement_spec_is_set_exactly_for_its_type() -> None:
    from trainers.spec import ReinforcementSpec, format_trains_method

    with pytest.raises(ValidationError, match="exactly when"):
        MethodSpec(type="reinforcement")
    with pytest.raises(ValidationError, match="exactly when"):
        MethodSpec(type="supervised", reinforcement=ReinforcementSpec(grader=GRADER))
    assert [format_trains_method(f, "reinforcement") for f in ("reinforcement", "chat", "preference")] == [
        True, False, False]
    assert [format_trains_method(f, "supervised") for f in ("reinforcement", "chat", "preference")] == [
        False, True, False]
    assert [format_trains_method(f, "dpo") for f in ("reinforcement", "chat", "preference")] == [
        False, False, True]


def test_a_row_keeps_the_fine_tuned_model_it_continues_and_the_chain_adds_up() -> None:
    parent = ParentSettings(model="ft:base:org-1:ftjob-1:ckpt-step-2", job_id="ftjob-1", step=2, r=12,
                            target_modules=("q_proj", "v_proj"))
    settings = _body().job_settings(max_seq_len=128).model_copy(update={"parent": parent})
    assert JobSettings.from_row(SimpleNamespace(**settings.row_columns())).parent == parent
    assert JobSettings.from_row(row()).parent is None
    # A grandchild applies its parent's export: the parent's adapter and the parent's own parent, folded.
    child = JobSettings(adapter=AdapterSettings(r=4, target_modules=("o_proj", "q_proj")), parent=parent)
    folded = ParentSettings.of("ft:base:org-1:ftjob-2", "ftjob-2", None, child)
    assert (folded.r, folded.target_modules, folded.step) == (16, ("q_proj", "v_proj", "o_proj"), None)
