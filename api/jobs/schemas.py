"""Fine-tuning job schemas: OpenAI's request/response shapes plus our extensions.

``JobCreate`` accepts OpenAI's body (``model``, ``training_file``, ``validation_file``,
``hyperparameters``, ``method``, ``suffix``, ``seed``, ``metadata``, ``integrations``)
and, in the same body (the SDK's ``extra_body``), our extensions: ``adapter``,
``trainer``, ``placement``, ``priority``, ``max_seq_len``, ``packing``, ``eval``.
Unknown fields are refused with their path in ``param``.

``method`` is OpenAI's: ``{"type": "supervised", "supervised": {"hyperparameters": ...}}``
or ``{"type": "dpo", "dpo": {"hyperparameters": {"beta", "batch_size",
"learning_rate_multiplier", "n_epochs"}}}`` (each a value or "auto"; resolved as
``control.jobs.hyperparameters`` says), or ``{"type": "reinforcement", "reinforcement":
{"grader": {...}, "hyperparameters": {"n_epochs", "batch_size", "learning_rate_multiplier",
"eval_interval", "eval_samples", "compute_multiplier", "reasoning_effort"}, "response_format":
{...}}}``. A DPO job trains on a file in OpenAI's preference format, a reinforcement job on
reinforcement prompts, a supervised job on any other format.

Reinforcement: the grader is checked as ``POST /v1/fine_tuning/alpha/graders/validate``
checks it (400 with the grader's code and field, e.g. ``method.reinforcement.grader.operation``);
``compute_multiplier`` is the number of completions sampled per prompt, 4 x the multiplier
(``control.job_settings.samples_per_prompt``). Both trainers run it on one GPU (``auto``
picks fsdp_qlora; ``trainer`` ``jax``/``jax_lora`` runs it on the JAX trainer); more than one
pinned GPU and a ``score_model`` grader are refused with 400 ``invalid_request``
(``api.jobs.commands.reinforcement_unavailable``).

``model`` is a base model, or (as OpenAI's) a fine-tuned model or checkpoint the job
continues (``api.jobs.lineage``); the job object keeps it as given and adds ``base_model``.

``suffix`` follows OpenAI's rule: 1 to 64 characters. It is shown as given in
``user_provided_suffix`` and names the model ``ft:<base>:<org>:<suffix>:<job id>``; in that
name every character other than a letter, digit, ``.``, ``_`` or ``-`` becomes ``-`` (a
``:`` would split the name, a ``/`` or a space would need escaping in model URLs).

Priority: ``low`` = 25, ``normal`` = 50 (default), ``high`` = 75, or an integer 0-100;
higher runs first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import to_json

from api.schemas.common import AcceptWholeFloats, ListPublic, Strict
from control.db.base import to_unix
from control.db.models import Checkpoint, Job, JobEvent
from control.job_settings import JobSettings, method_type_of, quantization_for
from control.jobs.naming import checkpoint_model_id
from scheduling.priorities import priority_value
from trainers.spec import DEFAULT_TARGET_MODULES, MethodType

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Auto = Literal["auto"]
PositiveInt = Annotated[int, Field(strict=True, ge=1), AcceptWholeFloats]


class Hyperparameters(Strict):
    """OpenAI's three (each a value or "auto") plus optional expert settings."""

    n_epochs: Auto | Annotated[int, Field(strict=True, ge=1, le=50), AcceptWholeFloats] = "auto"
    batch_size: Auto | Annotated[int, Field(strict=True, ge=1, le=256), AcceptWholeFloats] = "auto"  # OpenAI's cap
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=50)] = "auto"
    learning_rate: Annotated[float, Field(gt=0, lt=1)] | None = None
    micro_batch_size: PositiveInt | None = None
    lr_scheduler: Literal["cosine", "linear", "constant"] | None = None
    warmup_steps: Annotated[int, Field(strict=True, ge=0), AcceptWholeFloats] | None = None
    weight_decay: Annotated[float, Field(ge=0, le=1)] | None = None
    max_grad_norm: Annotated[float, Field(gt=0)] | None = None
    max_steps: PositiveInt | None = None

    @model_validator(mode="after")
    def _micro_divides(self) -> Hyperparameters:
        if (
            self.micro_batch_size is not None
            and isinstance(self.batch_size, int)
            and self.batch_size % self.micro_batch_size
        ):
            raise ValueError("micro_batch_size must divide batch_size")
        return self


class DpoHyperparameters(Hyperparameters):
    """OpenAI's DPO hyperparameters (``beta`` besides the three), plus our expert settings.

    ``beta`` (OpenAI's range, 0 < beta <= 2) weighs how far the policy may move from the
    reference; ``sft_weight`` (an extension) adds that many times the supervised loss on
    the preferred answer (off by default, as OpenAI's DPO).
    """

    beta: Auto | Annotated[float, Field(gt=0, le=2)] = "auto"
    sft_weight: Annotated[float, Field(ge=0, le=100)] | None = None


class ReinforcementHyperparameters(Hyperparameters):
    """OpenAI's reinforcement hyperparameters (each a value or "auto"), plus our expert settings.

    ``compute_multiplier`` scales the completions sampled per prompt (4 x the multiplier,
    between 2 and 64); ``eval_interval`` is the optimizer steps between evaluations and
    ``eval_samples`` the completions sampled per validation prompt at each;
    ``reasoning_effort`` is recorded and passed to the trainer. Extensions: ``kl_coef``
    weighs a KL penalty to the base model (0 = none, the default), ``clip_epsilon`` bounds
    the policy ratio (0.2), ``max_completion_tokens`` caps each sampled completion (1024).
    """

    compute_multiplier: Auto | Annotated[float, Field(gt=0, le=16)] = "auto"
    eval_interval: Auto | PositiveInt = "auto"
    eval_samples: Auto | Annotated[int, Field(strict=True, ge=1, le=64), AcceptWholeFloats] = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = None
    kl_coef: Annotated[float, Field(ge=0, le=10)] | None = None
    clip_epsilon: Annotated[float, Field(gt=0, lt=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1, le=131_072), AcceptWholeFloats] | None = None


class JsonSchemaFormat(Strict):
    name: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class ResponseFormat(Strict):
    """The form of the sampled completions: text, or JSON following ``json_schema``."""

    type: Literal["text", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format of type 'json_schema' needs a json_schema object, "
                             "and only that type takes one")
        return self


class SupervisedMethod(Strict):
    hyperparameters: Hyperparameters = Hyperparameters()


class DpoMethod(Strict):
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


class ReinforcementMethod(Strict):
    """OpenAI's ``method.reinforcement``: the grader stays a JSON object here and is checked
    by ``trainers.common.graders.parse_grader`` (``api.jobs.routes``), so its errors name the
    grader's own fields."""

    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()
    response_format: ResponseFormat | None = None


METHOD_TYPES: tuple[MethodType, ...] = ("supervised", "dpo", "reinforcement")


class Method(Strict):
    type: MethodType
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None

    @model_validator(mode="after")
    def _settings_for_type(self) -> Method:
        for other in METHOD_TYPES:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method of type '{self.type}' takes its settings in "
                                 f"method.{self.type}, not method.{other}")
        if self.type == "reinforcement" and self.reinforcement is None:
            raise ValueError("method of type 'reinforcement' needs method.reinforcement with its grader")
        return self

    def hyperparameters(self) -> Hyperparameters | None:
        """The hyperparameters given inside the method, if any."""
        settings = getattr(self, self.type)
        return settings.hyperparameters if settings is not None else None

    def stored(self) -> dict[str, Any]:
        """The job row's ``method`` column: the type, and reinforcement's grader and
        response format (its hyperparameters live in the ``hyperparameters`` column)."""
        if self.reinforcement is None:
            return {"type": self.type}
        given = self.reinforcement
        return {"type": self.type, "grader": given.grader,
                **({"response_format": given.response_format.model_dump(by_alias=True, exclude_none=True)}
                   if given.response_format is not None else {})}


class Adapter(Strict):
    """LoRA adapter; QLoRA = LoRA on a 4-bit base (``quantization`` nf4 or hqq4; left out:
    nf4, resolved by ``control.job_settings.quantization_for``)."""

    method: Literal["lora", "qlora"] = "lora"
    r: Annotated[int, Field(strict=True, ge=1, le=1024), AcceptWholeFloats] = 8
    alpha: Annotated[float, Field(gt=0, le=4096)] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[Literal[TARGET_MODULES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(DEFAULT_TARGET_MODULES), min_length=1
    )
    quantization: Literal["none", "nf4", "hqq4"] | None = None
    double_quant: StrictBool = Field(
        default=False,
        description="NF4 only: quantize the block scales too (~0.37 bit/param less); "
        "trained by fsdp_qlora only.",
    )

    @model_validator(mode="after")
    def _method_matches_quantization(self) -> Adapter:
        if self.method == "qlora" and self.quantization == "none":
            raise ValueError("method 'qlora' needs quantization 'nf4' or 'hqq4'")
        if self.method == "lora" and self.quantization not in (None, "none"):
            raise ValueError("quantization needs method 'qlora'")
        if self.double_quant and quantization_for(self.method, self.quantization) != "nf4":
            raise ValueError("double_quant applies to quantization 'nf4' only")
        self.target_modules = list(dict.fromkeys(self.target_modules))
        return self


class Placement(Strict):
    pool: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    gpus: Annotated[int, Field(strict=True, ge=1, le=4096), AcceptWholeFloats] | None = None
    queue_if_unfit: StrictBool = Field(
        default=False,
        description="Queue the job although no node pool can hold it even when idle (a pool "
        "that is being added or grown); otherwise creation answers 400 no_pool_fits and a "
        "queued job that no pool fits any more fails with that code.",
    )


class EvalSettings(Strict):
    every_n_steps: PositiveInt | None = None
    max_batches: PositiveInt | None = None


class WandbSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    name: str | None = None
    entity: str | None = None
    tags: list[str] = Field(default_factory=list, max_length=20)


class MlflowSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tracking_uri: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    experiment: str | None = None
    run_name: str | None = None


class Integration(Strict):
    type: Literal["wandb", "mlflow"]
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None

    @model_validator(mode="after")
    def _settings_for_type(self) -> Integration:
        if getattr(self, self.type) is None:
            raise ValueError(f"integration of type '{self.type}' needs a '{self.type}' object")
        return self


MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class JobCreate(Strict):
    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    training_file: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    validation_file: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, le=2**31 - 1), AcceptWholeFloats] | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    integrations: list[Integration] | None = Field(default=None, max_length=5)
    # extensions
    adapter: Adapter = Adapter()
    trainer: Literal["auto", "jax", "jax_lora", "fsdp_qlora"] = "auto"
    placement: Placement = Placement()
    priority: Literal["low", "normal", "high"] | Annotated[int, Field(strict=True, ge=0, le=100), AcceptWholeFloats] = (
        "normal"
    )
    max_seq_len: Annotated[int, Field(strict=True, ge=8, le=1_048_576), AcceptWholeFloats] | None = None
    packing: Annotated[bool, Field(strict=True)] = False
    eval: EvalSettings = EvalSettings()

    @field_validator("method")
    @classmethod
    def _one_hyperparameter_source(cls, method: Method | None, info: ValidationInfo) -> Method | None:
        top = info.data.get("hyperparameters")
        if method is None or top in (None, Hyperparameters()):
            return method
        if method.type != "supervised":
            name = "DPO" if method.type == "dpo" else "reinforcement"
            raise ValueError(f"a {name} job takes its hyperparameters in method.{method.type}.hyperparameters; "
                             "the top-level hyperparameters are for supervised jobs")
        given = method.hyperparameters()
        if given is not None and given != Hyperparameters():
            raise ValueError(
                "give hyperparameters either at the top level or in method.supervised, not both"
            )
        return method

    @field_validator("packing")
    @classmethod
    def _no_packing_for_preference_pairs(cls, packing: bool, info: ValidationInfo) -> bool:
        # A DPO micro-batch holds each pair's chosen and rejected rows side by side, one
        # sequence a row, so there is nothing to pack; the trainers refuse it too.
        method = info.data.get("method")
        if packing and method is not None and method.type == "dpo":
            raise ValueError("packing does not apply to a DPO job (each preference pair is two rows)")
        # A reinforcement step scores whole sampled completions, one sequence a row.
        if packing and method is not None and method.type == "reinforcement":
            raise ValueError("packing does not apply to a reinforcement job (each sampled completion is a row)")
        return packing

    @property
    def method_type(self) -> MethodType:
        return self.method.type if self.method is not None else "supervised"

    def requested_hyperparameters(self) -> Hyperparameters:
        """The hyperparameters the job asks for: its method's, else the top-level ones."""
        given = self.method.hyperparameters() if self.method is not None else None
        if self.method_type == "dpo":
            return given or DpoHyperparameters()
        if self.method_type == "reinforcement":
            return given or ReinforcementHyperparameters()
        if given is not None and given != Hyperparameters():
            return given
        return self.hyperparameters or Hyperparameters()

    @property
    def priority_value(self) -> int:
        return priority_value(self.priority)

    def job_settings(self, *, max_seq_len: int, seed: int | None = None,
                     hyperparameters: Mapping[str, Any] | None = None) -> JobSettings:
        """The settings of the job this body creates, as its row will store them.

        Args:
            max_seq_len: the sequence length checked against the base model (the body's, or
                the default ``api.jobs.commands.base_model_and_settings`` chose).
            seed: the seed the job gets (default: the body's, else the trainer's default).
            hyperparameters: hyperparameters as a row stores them, e.g. resolved for an
                estimate that knows the example count (default: the requested ones).
        """
        if hyperparameters is None:
            hyperparameters = self.requested_hyperparameters().model_dump(exclude_none=True)
        return JobSettings.from_columns(
            trainer=self.trainer, adapter=self.adapter.model_dump(exclude_none=True),
            method=self.method.stored() if self.method is not None else {"type": self.method_type},
            hyperparameters=hyperparameters,
            max_seq_len=max_seq_len, packing=self.packing, eval=self.eval.model_dump(exclude_none=True),
            seed=seed if seed is not None else self.seed,
            placement=self.placement.model_dump(exclude_defaults=True),
            integrations=[i.model_dump(exclude_none=True) for i in self.integrations or []],
        )


# ---- responses -------------------------------------------------------------------


def _public_hyperparameters(hp: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's three first, then our resolved extras (the SDK keeps unknown keys)."""
    out = {
        "n_epochs": hp.get("n_epochs", "auto"),
        "batch_size": hp.get("batch_size", "auto"),
        "learning_rate_multiplier": hp.get("learning_rate_multiplier", "auto"),
    }
    out.update({k: v for k, v in hp.items() if k not in out and v is not None})
    return out


def public_method(method: dict[str, Any] | None, hp: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``method`` object: the type the job trains with and its hyperparameters (a
    reinforcement job's grader and response format too, as given)."""
    kind = method_type_of(method)
    if kind != "reinforcement":
        return {"type": kind, kind: {"hyperparameters": hp}}
    stored = method or {}
    settings: dict[str, Any] = {"grader": stored.get("grader") or {}, "hyperparameters": hp}
    if stored.get("response_format") is not None:
        settings["response_format"] = stored["response_format"]
    return {"type": kind, kind: settings}


class JobPublic(BaseModel):
    """``fine_tuning.job`` (every field the openai SDK requires) plus extensions."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: dict[str, Any] | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None
    integrations: list[dict[str, Any]] | None
    metadata: dict[str, str] | None
    method: dict[str, Any]
    user_provided_suffix: str | None
    # extensions
    base_model: str = Field(description="The base model the job trains on: ``model``, or, when ``model`` is a "
                            "fine-tuned model (or checkpoint) the job continues, the base at the root of its lineage.")
    adapter: dict[str, Any]
    trainer: str
    placement: dict[str, Any]
    priority: int
    max_seq_len: int
    packing: bool
    eval: dict[str, Any]
    pool: str | None
    gpus: int | None
    retry_placement: dict[str, Any] | None = Field(
        None, description="After the trainer ran out of GPU memory on a GPU count the scheduler "
        "chose: the pool and larger GPU count it is retried with."
    )
    queue_reason: str | None
    queue_position: int | None = Field(
        None, description="Place among the waiting jobs in the scheduler's last cycle (1 = next)."
    )
    started_at: int | None
    total_steps: int | None
    current_step: int | None
    resume_from: str | None
    restarts: int
    estimate: dict[str, Any] | None
    usage: dict[str, Any] | None
    report_gaps: dict[str, Any] | None = Field(
        None, description="Set when a run ended with metrics or checkpoints that neither its trainer's "
        "reports nor its outputs supplied: `missing_metric_steps` (e.g. `\"3-4,7\"`) and "
        "`missing_checkpoints` (steps). Null: the records are complete."
    )
    mean_tokens_per_s: float | None = Field(
        None, description="Mean tokens/s over the job's training steps (its metrics' `tokens_per_s`)."
    )
    mean_mfu: float | None = Field(
        None, description="Mean model FLOP utilisation over its steps, a fraction (its metrics' `mfu`); "
        "null when no step has one."
    )

    @classmethod
    def of(cls, job: Job) -> JobPublic:
        return cls(**public_job_fields(job))


def public_job_fields(job: Job) -> dict[str, Any]:
    """The fields of ``JobPublic`` for ``job``, as plain JSON-ready values.

    ``JobPublic.of`` validates them into the model; the list route serializes them
    directly (``jobs_page_json``), which is several times cheaper for a page of jobs and
    yields the same JSON (a test compares the two).
    """
    hp = _public_hyperparameters(job.hyperparameters or {})
    return {
        "id": job.id, "object": "fine_tuning.job", "created_at": to_unix(job.created_at) or 0,
        "error": job.error,
        "fine_tuned_model": job.fine_tuned_model, "finished_at": to_unix(job.finished_at),
        "hyperparameters": hp, "model": job.model, "organization_id": job.tenant_id,
        "result_files": list(job.result_files or []), "seed": job.seed, "status": job.status,
        "trained_tokens": job.trained_tokens, "training_file": job.training_file,
        "validation_file": job.validation_file, "estimated_finish": to_unix(job.estimated_finish),
        "integrations": job.integrations or None, "metadata": job.metadata_,
        "method": public_method(job.method, hp),
        "user_provided_suffix": job.suffix, "base_model": job.base_model, "adapter": job.adapter,
        "trainer": job.trainer,
        "placement": job.placement or {}, "priority": job.priority, "max_seq_len": job.max_seq_len,
        "packing": job.packing, "eval": job.eval or {}, "pool": job.pool, "gpus": job.gpus,
        "retry_placement": job.retry_placement, "queue_reason": job.queue_reason, "queue_position": job.queue_position,
        "started_at": to_unix(job.started_at),
        "total_steps": job.total_steps, "current_step": job.current_step,
        "resume_from": job.resume_from, "restarts": job.restarts, "estimate": job.estimate,
        "usage": job.usage, "report_gaps": job.report_gaps,
        "mean_tokens_per_s": job.mean_tokens_per_s, "mean_mfu": job.mean_mfu,
    }


JobsPublic = ListPublic[JobPublic]


def jobs_page_json(jobs: list[Job], *, has_more: bool) -> bytes:
    """A ``JobsPublic`` list envelope as JSON bytes, without building the models."""
    data = [public_job_fields(job) for job in jobs]
    return to_json({
        "object": "list", "data": data, "has_more": has_more,
        "first_id": data[0]["id"] if data else "", "last_id": data[-1]["id"] if data else "",
    })


class JobEventPublic(BaseModel):
    """OpenAI's ``fine_tuning.job.event``: a status change is a ``message`` whose ``data``
    holds ``from``, ``to`` and ``actor``; a ``metrics`` event holds a step's metrics."""

    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] = Field(default_factory=dict, description="The event's data; {} when it has none.")

    @classmethod
    def of(cls, event: JobEvent) -> JobEventPublic:
        return cls(
            id=event.id, created_at=to_unix(event.created_at) or 0,
            level=event.level,  # type: ignore[arg-type]
            message=event.message, type="metrics" if event.type == "metrics" else "message", data=event.data or {},
        )


JobEventsPublic = ListPublic[JobEventPublic]

CHECKPOINT_METRIC_KEYS = (
    "step", "train_loss", "train_mean_token_accuracy", "valid_loss",
    "valid_mean_token_accuracy", "full_valid_loss", "full_valid_mean_token_accuracy",
)


class CheckpointPublic(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, float] = Field(description="The step's metrics; one not measured (no validation "
                                      "set, say) is left out, as OpenAI types each as a number.")
    step_number: int

    @classmethod
    def of(cls, checkpoint: Checkpoint, job: Job) -> CheckpointPublic:
        return cls(
            id=checkpoint.id, created_at=to_unix(checkpoint.created_at) or 0,
            fine_tuned_model_checkpoint=checkpoint_model_id(job, checkpoint.step),
            fine_tuning_job_id=job.id,
            metrics={name: value for name, value in (checkpoint.metrics or {}).items() if value is not None},
            step_number=checkpoint.step,
        )


CheckpointsPublic = ListPublic[CheckpointPublic]



