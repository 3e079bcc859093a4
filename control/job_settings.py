"""A job's settings as one typed, frozen value, parsed once from the job row.

A job row holds its settings as the API wrote them: JSON columns (``adapter``, ``method``,
``hyperparameters``, ``placement``, ``eval``, ``integrations``) and plain ones
(``trainer``, ``max_seq_len``, ``packing``, ``seed``). ``JobSettings.from_row`` reads them
once, rows written by earlier versions included (missing keys, nulls, the ``jax`` trainer
spelling), and resolves what the stored shapes leave implicit:

- the base's quantization, from the adapter method (``quantization_for``: NF4 for QLoRA
  unless another is named, none for LoRA);
- the trainer: ``auto``, ``jax_lora`` or ``fsdp_qlora`` (the API's ``jax`` is ``jax_lora``);
- the method: one variant per ``method.type`` (``MethodSettings``), each with its own
  settings (DPO's ``beta`` and ``sft_weight``; reinforcement's ``compute_multiplier``,
  ``eval_interval``, ``eval_samples``, ``reasoning_effort`` and our extensions, which the
  row keeps among the job's hyperparameters, where OpenAI shows them; reinforcement's
  ``grader`` and ``response_format``, which the row keeps in its ``method`` column);
- every default, taken from the trainer contract (``trainers.spec``): a setting the row
  does not hold is the value a trainer uses for it. A null in a row means "not given";
- the fine-tuned model the job continues from, if any (``ParentSettings``, the row's
  ``parent`` column): the job trains a new adapter beside that model's, frozen, on the base
  stored as the parent stored it (the adapter's quantization is the parent's).

The API builds the same value from a creation request (``JobCreate.job_settings`` in
``api.jobs.schemas``) and writes the new row from it (``JobSettings.row_columns``), so the
job it creates, the estimate it shows, the scheduler's request (``scheduling.request``) and
the trainer spec (``worker.spec_builder``) all read one value.

Hyperparameters keep OpenAI's ``"auto"`` until the training file is validated;
``control.jobs.hyperparameters`` resolves them and the row stores the result
(``JobSettings.resolved`` says whether that happened). ``row_columns`` writes back only the
fields that were read or given (pydantic's fields set): a row round-trips unchanged, and no
default is copied into one.

Pydantic, not dataclasses: the value is parsed from JSON that older versions stored
(coercion, errors that name the field), the method is a union tagged by ``type`` that
pydantic picks by its tag (a new method is one more variant class), and the trainer
contract is pydantic too, so its defaults are read from its models rather than typed
again. This module imports only the standard library, pydantic and ``trainers.spec``, so
the scheduler's pure package reads it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainers.spec import (
    DEFAULT_MAX_SEQ_LEN,
    AdapterMethod,
    AdapterSpec,
    DataSpec,
    EvalSpec,
    HyperparametersSpec,
    IntegrationSpec,
    LrScheduler,
    MethodSpec,
    MethodType,
    Quantization,
    ReinforcementSpec,
    TargetModule,
    TrainerSpec,
)

Auto = Literal["auto"]
AUTO: Auto = "auto"
TrainerChoice = Literal["auto", "jax_lora", "fsdp_qlora"]
# The API's other spellings of a trainer.
TRAINER_ALIASES = {"jax": "jax_lora"}

_ADAPTER = AdapterSpec()
_METHOD = MethodSpec()
_REINFORCEMENT = ReinforcementSpec(grader={})
# OpenAI's ``compute_multiplier`` scales how much a reinforcement job explores: here, the
# completions sampled per prompt (the group GRPO normalizes rewards over), 4 at 1.0.
SAMPLES_PER_UNIT_COMPUTE = _REINFORCEMENT.samples_per_prompt
_SAMPLES_RANGE = (2, 64)  # ``ReinforcementSpec.samples_per_prompt``'s bounds


def samples_per_prompt(compute_multiplier: float) -> int:
    """Completions sampled per prompt for OpenAI's ``compute_multiplier``:
    ``round(4 x multiplier)``, at least 2 (a group of one has no baseline) and at most 64."""
    low, high = _SAMPLES_RANGE
    return int(min(high, max(low, round(SAMPLES_PER_UNIT_COMPUTE * compute_multiplier))))


def _spec_default(model: type[BaseModel], field: str) -> Any:
    """The trainer contract's default of ``model.field`` (for models with required fields)."""
    return model.model_fields[field].default


def quantization_for(method: str | None, quantization: Quantization | None) -> Quantization:
    """How a job's frozen base is stored: the named quantization for QLoRA (NF4 when none
    is named), none for LoRA."""
    if method != "qlora":
        return "none"
    return quantization or "nf4"


def method_type_of(stored: Mapping[str, Any] | None) -> MethodType:
    """The method a row's ``method`` column names (supervised for rows from before methods)."""
    return (stored or {}).get("type") or "supervised"


def _given(stored: Mapping[str, Any]) -> Mapping[str, Any]:
    """A stored mapping without its nulls: a null in a row means "not given"."""
    if None not in stored.values():  # the common case, without a copy
        return stored
    return {key: value for key, value in stored.items() if value is not None}


class _Settings(BaseModel):
    # A row written by another version may hold keys this one does not read: ignored.
    model_config = ConfigDict(frozen=True, extra="ignore")

    def stored(self) -> dict[str, Any]:
        """The fields that were read or given, as the row's JSON holds them."""
        return self.model_dump(mode="json", exclude_unset=True)


class AdapterSettings(_Settings):
    """The adapter a job trains: LoRA, or QLoRA (LoRA on a quantized base), with the
    quantization resolved from the method once, here."""

    method: AdapterMethod = _ADAPTER.method
    r: int = _ADAPTER.r
    alpha: float = _ADAPTER.alpha
    dropout: float = _ADAPTER.dropout
    target_modules: tuple[TargetModule, ...] = _ADAPTER.target_modules
    quantization: Quantization = _ADAPTER.quantization
    double_quant: bool = _ADAPTER.double_quant
    hqq_group_size: int = _ADAPTER.hqq_group_size
    use_dora: bool = _ADAPTER.use_dora

    @model_validator(mode="before")
    @classmethod
    def _resolve_quantization(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # An empty module list never trained anything: the default modules stand for it.
        given = {key: value for key, value in data.items() if value is not None and value != []}
        given["quantization"] = quantization_for(given.get("method", _ADAPTER.method), given.get("quantization"))
        return given

    def spec(self) -> AdapterSpec:
        return AdapterSpec(**self.model_dump())


class ParentSettings(_Settings):
    """The fine-tuned model a job continues from (the job's ``model`` is then its ``ft:`` id):
    the job that made it, the checkpoint's step (None: its final adapter), and the shape of
    the adapter the job applies frozen beside its own, as the estimate counts it: its rank
    (the whole chain's: a model that itself continued another was exported as one folded
    adapter, ``trainers.common.lineage``) and the modules it adapts."""

    model: str
    job_id: str
    step: int | None = None
    r: int
    target_modules: tuple[TargetModule, ...]

    @classmethod
    def of(cls, model: str, job_id: str, step: int | None, parent: JobSettings) -> ParentSettings:
        """The parent ``model`` that job ``job_id`` (whose settings are ``parent``) made."""
        own, chain = parent.adapter, parent.parent
        modules = set(own.target_modules) | set(chain.target_modules if chain is not None else ())
        return cls(model=model, job_id=job_id, step=step, r=own.r + (chain.r if chain is not None else 0),
                   target_modules=tuple(m for m in get_args(TargetModule) if m in modules))


class HyperparameterSettings(_Settings):
    """The training hyperparameters: as requested (OpenAI's "auto", or None where the auto
    rule decides) until the training file is validated, then every one resolved."""

    n_epochs: int | Auto = AUTO
    batch_size: int | Auto = AUTO
    learning_rate_multiplier: float | Auto = AUTO
    learning_rate: float | None = None
    micro_batch_size: int | None = None
    lr_scheduler: LrScheduler = _spec_default(HyperparametersSpec, "lr_scheduler")
    warmup_steps: int | None = None
    weight_decay: float = _spec_default(HyperparametersSpec, "weight_decay")
    max_grad_norm: float | None = _spec_default(HyperparametersSpec, "max_grad_norm")
    max_steps: int | None = _spec_default(HyperparametersSpec, "max_steps")
    total_steps: int | None = None
    """Set when the hyperparameters are resolved (``control.jobs.hyperparameters``)."""

    @property
    def resolved(self) -> bool:
        return self.total_steps is not None


class _Method(_Settings):
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ()
    """The method's settings that the row keeps among the job's hyperparameters."""

    @property
    def resolved(self) -> bool:
        return True

    def spec(self) -> MethodSpec:
        raise NotImplementedError


class SupervisedMethod(_Method):
    """Supervised fine-tuning: next-token loss on the assistant's tokens."""

    type: Literal["supervised"] = "supervised"

    def spec(self) -> MethodSpec:
        return MethodSpec(type="supervised")


class DpoMethod(_Method):
    """DPO on preference pairs (``trainers.spec.MethodSpec``); ``beta`` is "auto" until the
    job's hyperparameters are resolved."""

    HYPERPARAMETERS = ("beta", "sft_weight")
    type: Literal["dpo"] = "dpo"
    beta: float | Auto = AUTO
    sft_weight: float = _METHOD.sft_weight

    @property
    def resolved(self) -> bool:
        return self.beta != AUTO

    def spec(self) -> MethodSpec:
        return MethodSpec(type="dpo", beta=self.beta, sft_weight=self.sft_weight)


class ReinforcementMethod(_Method):
    """Reinforcement fine-tuning (``trainers.spec.ReinforcementSpec``): the grader (and the
    response format) as given, OpenAI's hyperparameters "auto" until resolved
    (``control.jobs.hyperparameters``), and our extensions (``kl_coef``, ``clip_epsilon``,
    ``max_completion_tokens``)."""

    HYPERPARAMETERS = ("compute_multiplier", "eval_interval", "eval_samples", "reasoning_effort",
                       "kl_coef", "clip_epsilon", "max_completion_tokens")
    type: Literal["reinforcement"] = "reinforcement"
    grader: dict[str, Any] = Field(default_factory=dict)
    response_format: dict[str, Any] | None = None
    compute_multiplier: float | Auto = AUTO
    eval_interval: int | Auto = AUTO
    eval_samples: int | Auto = AUTO
    reasoning_effort: Literal["default", "low", "medium", "high"] = _REINFORCEMENT.reasoning_effort
    kl_coef: float = _REINFORCEMENT.kl_coef
    clip_epsilon: float = _REINFORCEMENT.clip_epsilon
    max_completion_tokens: int = _REINFORCEMENT.max_completion_tokens

    @property
    def resolved(self) -> bool:
        return AUTO not in (self.compute_multiplier, self.eval_interval, self.eval_samples)

    def spec(self) -> MethodSpec:
        if not self.resolved:
            raise ValueError("a reinforcement method's 'auto' hyperparameters must be resolved first")
        assert not isinstance(self.compute_multiplier, str)
        return MethodSpec(type="reinforcement", reinforcement=ReinforcementSpec(
            grader=self.grader, response_format=self.response_format,
            samples_per_prompt=samples_per_prompt(self.compute_multiplier),
            max_completion_tokens=self.max_completion_tokens, eval_interval=self.eval_interval,
            eval_samples=self.eval_samples, kl_coef=self.kl_coef, clip_epsilon=self.clip_epsilon,
            reasoning_effort=self.reasoning_effort,
        ))


# What a job trains for. A new method is one more variant: its class, added to this union.
MethodSettings = Annotated[SupervisedMethod | DpoMethod | ReinforcementMethod, Field(discriminator="type")]
_METHODS: dict[str, type[_Method]] = {
    variant.model_fields["type"].default: variant for variant in get_args(get_args(MethodSettings)[0])
}


class PlacementSettings(_Settings):
    """The user's pins: a pool, a GPU count, and whether to queue a job no pool fits."""

    pool: str | None = None
    gpus: int | None = None
    queue_if_unfit: bool = False


class EvalSettings(_Settings):
    every_n_steps: int | None = _spec_default(EvalSpec, "every_n_steps")
    max_batches: int | None = _spec_default(EvalSpec, "max_batches")

    def spec(self) -> EvalSpec:
        return EvalSpec(**self.model_dump())


class WandbIntegration(_Settings):
    project: str | None = None
    name: str | None = None
    entity: str | None = None
    tags: tuple[str, ...] = ()


class MlflowIntegration(_Settings):
    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None


class IntegrationSettings(_Settings):
    """An experiment tracker the trainer mirrors its metrics to, stored as the API takes it:
    ``{"type": "wandb", "wandb": {...}}`` or ``{"type": "mlflow", "mlflow": {...}}``."""

    type: Literal["wandb", "mlflow"]
    wandb: WandbIntegration | None = None
    mlflow: MlflowIntegration | None = None

    def spec(self) -> IntegrationSpec:
        if self.type == "wandb":
            run = self.wandb or WandbIntegration()
            return IntegrationSpec(type="wandb", project=run.project, name=run.name, entity=run.entity,
                                   tags=run.tags)
        mlflow = self.mlflow or MlflowIntegration()
        return IntegrationSpec(type="mlflow", tracking_uri=mlflow.tracking_uri, project=mlflow.experiment,
                               name=mlflow.run_name)


# The job row's columns that hold its settings (``from_row`` reads them, ``row_columns`` writes them).
SETTINGS_COLUMNS = ("trainer", "adapter", "method", "hyperparameters", "max_seq_len", "packing", "eval", "seed",
                    "placement", "integrations", "parent")


class StoredJob(Protocol):
    """The columns of a job row that hold its settings (an ORM ``Job``, or a selected row)."""

    @property
    def trainer(self) -> str | None: ...
    @property
    def adapter(self) -> Mapping[str, Any] | None: ...
    @property
    def method(self) -> Mapping[str, Any] | None: ...
    @property
    def hyperparameters(self) -> Mapping[str, Any] | None: ...
    @property
    def max_seq_len(self) -> int | None: ...
    @property
    def packing(self) -> bool | None: ...
    @property
    def eval(self) -> Mapping[str, Any] | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def placement(self) -> Mapping[str, Any] | None: ...
    @property
    def integrations(self) -> list[Any] | None: ...
    @property
    def parent(self) -> Mapping[str, Any] | None: ...


class JobSettings(_Settings):
    """Everything a job asks for about how it trains and where it may run."""

    trainer: TrainerChoice = "auto"
    adapter: AdapterSettings = AdapterSettings()
    method: MethodSettings = SupervisedMethod()
    hyperparameters: HyperparameterSettings = HyperparameterSettings()
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    packing: bool = _spec_default(DataSpec, "packing")
    eval: EvalSettings = EvalSettings()
    seed: int = _spec_default(TrainerSpec, "seed")
    placement: PlacementSettings = PlacementSettings()
    integrations: tuple[IntegrationSettings, ...] = ()
    parent: ParentSettings | None = None

    @field_validator("trainer", mode="before")
    @classmethod
    def _trainer_alias(cls, name: Any) -> Any:
        return TRAINER_ALIASES.get(name, name) if isinstance(name, str) else name

    @classmethod
    def from_row(cls, job: StoredJob) -> JobSettings:
        """The settings of a stored job (any object with the job row's columns)."""
        return cls.from_columns(**{name: getattr(job, name) for name in SETTINGS_COLUMNS})

    @classmethod
    def from_columns(cls, **columns: Any) -> JobSettings:
        """The settings that these row columns hold (``row_columns``' names and shapes).

        Raises:
            pydantic.ValidationError: a value of the wrong type, naming its field.
        """
        given = dict(_given(columns))
        stored_method = given.pop("method", None)
        kind = method_type_of(stored_method)
        own = _METHODS[kind].HYPERPARAMETERS if kind in _METHODS else ()
        hyperparameters = _given(given.pop("hyperparameters", None) or {})
        given["method"] = {**(stored_method or {}), "type": kind,
                           **{name: hyperparameters[name] for name in own if name in hyperparameters}}
        given["hyperparameters"] = ({k: v for k, v in hyperparameters.items() if k not in own} if own
                                    else hyperparameters)
        for name in ("placement", "eval"):
            if name in given:
                given[name] = _given(given[name])
        return cls.model_validate(given)

    def row_columns(self) -> dict[str, Any]:
        """The job row's settings columns holding this value (what ``from_columns`` reads)."""
        own = self.method.stored()
        return {
            "trainer": self.trainer,
            "adapter": self.adapter.stored(),
            "method": {"type": self.method.type,
                       **{k: v for k, v in own.items() if k not in self.method.HYPERPARAMETERS}},
            "hyperparameters": self.stored_hyperparameters(),
            "max_seq_len": self.max_seq_len,
            "packing": self.packing,
            "eval": self.eval.stored(),
            "seed": self.seed,
            "placement": self.placement.stored(),
            "integrations": [integration.stored() for integration in self.integrations],
            "parent": self.parent.stored() if self.parent is not None else None,
        }

    def stored_hyperparameters(self) -> dict[str, Any]:
        """The row's ``hyperparameters`` column: the training hyperparameters and the
        method's own (DPO's ``beta`` and ``sft_weight``, reinforcement's ``compute_multiplier``
        and the rest of ``ReinforcementMethod.HYPERPARAMETERS``), as OpenAI shows them together."""
        own = self.method.stored()
        return {**self.hyperparameters.stored(),
                **{k: v for k, v in own.items() if k in self.method.HYPERPARAMETERS}}

    @property
    def resolved(self) -> bool:
        """Whether every "auto" is resolved (the training file was validated): a trainer
        spec needs it."""
        return self.hyperparameters.resolved and self.method.resolved

    def with_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> JobSettings:
        """These settings with another ``hyperparameters`` column (e.g. the resolved one)."""
        return self.from_columns(**{**self.row_columns(), "hyperparameters": hyperparameters})
