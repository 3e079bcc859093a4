"""The trainer contract: what the worker writes and a trainer reads.

A trainer is started as ``python -m trainers --spec spec.json``. The spec is the ONLY
input a trainer gets from the service (besides the multi-host environment variables of
``jax.distributed`` / torchrun), so everything a run needs is here, fully resolved:
no ``"auto"`` values, no defaults that the service and the trainer could disagree on.

The API's job schema maps to exactly one spec (``worker`` builds it from the job row);
this module depends only on pydantic so that trainer images stay independent of the
service (``trainers`` never imports ``api`` or ``worker``).

Locations (``model.path``, ``data.train_file``, ``output_dir``, ``checkpoint.dir``) are
local paths or ``s3://bucket/key`` URIs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SPEC_VERSION = 1

TrainerName = Literal["fsdp_qlora", "jax_lora"]
DType = Literal["float32", "bfloat16", "float16"]
# Decoder families both trainers run (the ``model_type`` of the checkpoint's config.json).
Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]
TargetModule = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What a job adapts and how long its sequences are when it does not say (the API's job
# defaults, the estimate's and the spec's: one value for all of them).
DEFAULT_TARGET_MODULES: tuple[TargetModule, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_MAX_SEQ_LEN = 2048
# ``sharegpt`` is converted to chat messages on read; ``preference`` (OpenAI's DPO file
# format: input / preferred_output / non_preferred_output) is the only format a DPO job reads;
# ``reinforcement`` (prompts ending in a user turn, plus the keys a grader reads) the only
# format a reinforcement job reads.
DataFormat = Literal["chat", "prompt_completion", "alpaca", "sharegpt", "preference", "reinforcement"]
AdapterMethod = Literal["lora", "qlora"]
# How the frozen base is stored: as is, bitsandbytes NF4, or HQQ 4-bit.
Quantization = Literal["none", "nf4", "hqq4"]
LrScheduler = Literal["cosine", "linear", "constant"]
MethodType = Literal["supervised", "dpo", "reinforcement"]
# The one data format a method other than supervised trains (supervised trains the others).
METHOD_FORMATS: dict[str, str] = {"dpo": "preference", "reinforcement": "reinforcement"}


def format_trains_method(data_format: str, method: str) -> bool:
    """Whether a file in ``data_format`` trains with ``method``: DPO and reinforcement each
    train their own format only, supervised every other one. The API, the worker and the
    trainer spec all ask this."""
    own = METHOD_FORMATS.get(method)
    if own is not None:
        return data_format == own
    return data_format not in METHOD_FORMATS.values()


def trains_base(trainer: str, quantization: str, double_quant: bool = False) -> bool:
    """Whether ``trainer`` trains a base stored as ``quantization``.

    ``fsdp_qlora`` trains every base: bf16/fp32, NF4 (with or without double quantization)
    and HQQ 4-bit. ``jax_lora`` trains bf16/fp32 and bitsandbytes-layout NF4 (blocks of 64,
    one fp32 absmax each; ``trainers/jax_lora/nf4.py``): no HQQ, no double-quantized absmax.
    The trainer, the scheduler's placement and the API's check all ask this.
    """
    if trainer != "jax_lora":
        return True
    return quantization in ("none", "nf4") and not double_quant


# The trainers "auto" may place a method's job on (a method not listed: any). Both trainers
# run every method when a job names one; "auto" keeps reinforcement jobs on fsdp_qlora,
# where they ran before the JAX trainer could run them, so a pool's preference for
# jax_lora does not move them.
AUTO_METHOD_TRAINERS: dict[str, tuple[str, ...]] = {"reinforcement": ("fsdp_qlora",)}


def auto_runs_method(trainer: str, method: str) -> bool:
    """Whether trainer "auto" may place a ``method`` job on ``trainer``
    (:data:`AUTO_METHOD_TRAINERS`); the scheduler's placement asks this."""
    return trainer in AUTO_METHOD_TRAINERS.get(method, (trainer,))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParentAdapterSpec(_Strict):
    """A fine-tuned model the job continues from: its PEFT LoRA adapter over the same base.

    The trainer applies it frozen beside the adapter it trains, on the base weights stored
    as the parent stored them (``adapter.quantization``), so training starts from exactly
    the function the parent's model computes; the exported adapter folds the two into one
    (``trainers.common.lineage``)."""

    path: str = Field(description="The adapter directory (adapter_config.json + adapter_model.safetensors), "
                                  "local or s3://.")
    name: str | None = Field(default=None, description="Its model id (ft:...), for the exported model card.")


class ModelSpec(_Strict):
    """The base model: a Hugging Face-format checkpoint (config.json + safetensors + tokenizer),
    and the fine-tuned models' adapters the job continues from, if any."""

    path: str = Field(description="Local directory or s3:// prefix of the HF checkpoint.")
    architecture: Architecture = "llama"
    name: str | None = Field(
        default=None,
        description="The model's public id (e.g. meta-llama/Llama-3.1-8B): exported adapters name it as "
        "their base_model_name_or_path, so they load outside this service. None: the path.",
    )
    revision: str | None = Field(
        default=None, max_length=64,
        description="The Hub commit of the base model (a model fetched from the Hub): exported adapters "
        "record it as their revision, so they load onto the weights they were trained on.",
    )
    parent_adapters: tuple[ParentAdapterSpec, ...] = Field(
        default=(),
        description="Adapters of fine-tuned models this job continues from, frozen and summed in order "
        "(the service passes one: the parent's exported adapter, which already holds its own parents). "
        "Empty: the job trains from the base model.",
    )


class DataSpec(_Strict):
    train_file: str = Field(description="Validated JSONL training file (path or s3:// URI).")
    validation_file: str | None = None
    format: DataFormat
    max_seq_len: Annotated[int, Field(ge=8, le=1_048_576)] = DEFAULT_MAX_SEQ_LEN
    packing: bool = False
    shuffle: bool = True


class HyperparametersSpec(_Strict):
    """Resolved hyperparameters (the API turns OpenAI's "auto" into these numbers)."""

    n_epochs: Annotated[int, Field(ge=1, le=1000)]
    batch_size: Annotated[int, Field(ge=1)] = Field(description="Global examples per optimizer step.")
    micro_batch_size: Annotated[int, Field(ge=1)] = Field(
        description="Examples per forward pass per data-parallel rank; batch_size must be a "
        "multiple of micro_batch_size x data-parallel size (the rest is gradient accumulation)."
    )
    learning_rate: Annotated[float, Field(gt=0, lt=1)]
    lr_scheduler: LrScheduler = "cosine"
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0)] | None = 1.0
    max_steps: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Stop after this many optimizer steps (overrides n_epochs)."
    )


class AdapterSpec(_Strict):
    """LoRA adapter; QLoRA is LoRA with ``quantization`` set (same code path)."""

    method: AdapterMethod = "lora"
    r: Annotated[int, Field(ge=1, le=1024)] = 8
    alpha: Annotated[float, Field(gt=0)] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: tuple[TargetModule, ...] = DEFAULT_TARGET_MODULES
    quantization: Quantization = "none"
    double_quant: bool = False
    hqq_group_size: Annotated[int, Field(ge=8)] = 64
    use_dora: bool = False

    @model_validator(mode="after")
    def _quantization_matches_method(self) -> AdapterSpec:
        if self.method == "qlora" and self.quantization == "none":
            raise ValueError("adapter.method 'qlora' needs quantization 'nf4' or 'hqq4'")
        if self.method == "lora" and self.quantization != "none":
            raise ValueError("adapter.quantization needs adapter.method 'qlora'")
        if not self.target_modules:
            raise ValueError("adapter.target_modules must not be empty")
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class MeshSpec(_Strict):
    """JAX device mesh; the product must equal the number of devices."""

    data: Annotated[int, Field(ge=1)] = 1
    fsdp: Annotated[int, Field(ge=1)] = 1
    tensor: Annotated[int, Field(ge=1)] = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor


class ParallelismSpec(_Strict):
    world_size: Annotated[int, Field(ge=1)] = Field(
        default=1, description="fsdp_qlora: number of processes (GPUs) over all nodes."
    )
    nodes: Annotated[int, Field(ge=1)] = 1
    mesh: MeshSpec = MeshSpec()
    activation_checkpointing: Literal["none", "reentrant", "non_reentrant"] = "none"
    remat: Literal["none", "per_layer", "dots_saveable"] = "none"
    cpu_offload: bool = False
    planned_memory_bytes: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="Bytes per device the scheduler planned for this micro batch, remat/activation "
        "checkpointing and offload (its memory estimate); None = not planned. Informational: a "
        "trainer may log it beside its measured peak.",
    )
    device_memory_bytes: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="Memory of one device as the pool declares it (what the step was planned "
        "against). jax_lora compiles its step before the first one and, if XLA's plan does not fit "
        "this (or the device's own limit), steps down to a smaller micro batch or more "
        "rematerialization (trainers/jax_lora/step_fit.py); fsdp_qlora measures its first step's "
        "peak and, if it is over, takes that step again with a smaller micro batch or more activation "
        "checkpointing (trainers/fsdp_qlora/step_fit.py). None = the device's own limit only.",
    )
    host_devices: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="jax_lora on a CPU-only host: run on the CPU platform split into this many "
        "XLA host devices (one per core the trainer may use), the mesh spanning them. None = the "
        "platform's own devices (GPUs; or one CPU device). The worker sets it for local CPU pools.",
    )

    @model_validator(mode="after")
    def _host_devices_fill_the_mesh(self) -> ParallelismSpec:
        if self.host_devices is not None and self.host_devices * self.nodes != self.mesh.size:
            raise ValueError(
                f"parallelism.mesh ({self.mesh.size} devices) must equal host_devices "
                f"({self.host_devices}) x nodes ({self.nodes})"
            )
        return self


class PrecisionSpec(_Strict):
    base_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    adapter_dtype: DType = "float32"


class CheckpointSpec(_Strict):
    dir: str
    every_n_steps: Annotated[int, Field(ge=1)] = 50
    keep_last: Annotated[int, Field(ge=1)] = 3
    resume_from: str | None = Field(
        default=None, description="A checkpoint directory to resume from; 'latest' = newest in dir."
    )


class EvalSpec(_Strict):
    every_n_steps: Annotated[int, Field(ge=1)] | None = None
    max_batches: Annotated[int, Field(ge=1)] | None = None


class ReportSpec(_Strict):
    url: str | None = Field(
        default=None, description="The API's internal report endpoint for this job; None = local JSONL."
    )
    token: str | None = None
    spool_dir: str | None = None
    flush_interval_s: Annotated[float, Field(gt=0)] = 2.0
    first_seq: Annotated[int, Field(ge=1)] = Field(
        default=1, description="The lowest report seq this run may use: one past every seq the API has "
        "applied for the job, so a run whose spool starts empty (a new pod) never reuses a number.")


GrpoLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]


class ReinforcementSpec(_Strict):
    """Reinforcement fine-tuning (GRPO, Shao et al. 2024): per prompt, sample
    ``samples_per_prompt`` completions, score each with ``grader``, and push the policy
    toward the completions that score above their group's mean
    (``trainers.common.grpo``).

    ``grader`` is OpenAI's grader object, checked by ``trainers.common.graders.parse_grader``;
    the reference policy of the KL term is the same base with the adapter disabled.
    """

    grader: dict[str, Any] = Field(description="OpenAI's grader object (string_check, text_similarity, "
                                               "python, score_model or multi).")
    samples_per_prompt: Annotated[int, Field(ge=2, le=64)] = Field(
        default=4, description="Completions sampled per prompt: the group whose rewards are normalized.")
    max_completion_tokens: Annotated[int, Field(ge=1)] = 1024
    temperature: Annotated[float, Field(gt=0, le=2)] = 1.0
    eval_interval: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Optimizer steps between evaluations on the validation prompts.")
    eval_samples: Annotated[int, Field(ge=1)] = Field(
        default=1, description="Completions sampled per validation prompt at each evaluation.")
    kl_coef: Annotated[float, Field(ge=0)] = Field(
        default=0.0, description="Weight of the per-token KL estimate to the reference (TRL's beta); 0 = none.")
    clip_epsilon: Annotated[float, Field(gt=0, lt=1)] = 0.2
    loss_type: GrpoLossType = "grpo"
    response_format: dict[str, Any] | None = Field(
        default=None, description="OpenAI's response_format the sampled completions must follow.")
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class MethodSpec(_Strict):
    """What the loss optimizes: supervised next-token loss on assistant tokens, DPO, or
    reinforcement fine-tuning (``reinforcement``, set exactly for that type).

    DPO (sigmoid loss, Rafailov et al. 2023) compares the policy's completion log-probs on
    a preferred and a rejected answer with those of a reference policy. With LoRA the
    reference is the same base with the adapter disabled, so no second copy of the model
    is loaded. ``sft_weight`` > 0 adds that many times the supervised loss on the
    preferred answer (off by default, as OpenAI's DPO).
    """

    type: MethodType = "supervised"
    beta: Annotated[float, Field(gt=0, le=100)] = 0.1
    sft_weight: Annotated[float, Field(ge=0)] = 0.0
    reinforcement: ReinforcementSpec | None = None

    @model_validator(mode="after")
    def _reinforcement_for_its_type(self) -> MethodSpec:
        if (self.type == "reinforcement") != (self.reinforcement is not None):
            raise ValueError("method.reinforcement is set exactly when method.type is 'reinforcement'")
        return self


class IntegrationSpec(_Strict):
    type: Literal["wandb", "mlflow"]
    project: str | None = None
    name: str | None = None
    tracking_uri: str | None = None
    entity: str | None = None
    tags: tuple[str, ...] = ()


class TrainerSpec(_Strict):
    version: Literal[1] = SPEC_VERSION
    job_id: str
    trainer: TrainerName
    model: ModelSpec
    data: DataSpec
    hyperparameters: HyperparametersSpec
    adapter: AdapterSpec = AdapterSpec()
    method: MethodSpec = MethodSpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    precision: PrecisionSpec = PrecisionSpec()
    eval: EvalSpec = EvalSpec()
    output_dir: str = Field(description="Where the final adapter and manifest are written.")
    checkpoint: CheckpointSpec
    report: ReportSpec = ReportSpec()
    integrations: tuple[IntegrationSpec, ...] = ()
    seed: int = 0
    suffix: str | None = None
    termination_log: str | None = Field(
        default=None, description="Where a failing trainer writes {code, message} as JSON."
    )

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainerSpec:
        hp = self.hyperparameters
        if hp.batch_size % hp.micro_batch_size:
            raise ValueError(
                f"hyperparameters.batch_size ({hp.batch_size}) must be a multiple of "
                f"micro_batch_size ({hp.micro_batch_size})"
            )
        if not format_trains_method(self.data.format, self.method.type):
            raise ValueError(
                f"method.type {self.method.type!r} cannot train data.format {self.data.format!r}: "
                "a DPO job trains preference data and a reinforcement job reinforcement prompts, "
                "and each of those formats trains only with its method"
            )
        return self

    @classmethod
    def load(cls, path: str | Path) -> TrainerSpec:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2), encoding="utf-8")
