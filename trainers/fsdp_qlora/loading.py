"""Low-memory loading of a Hugging Face decoder into a (quantized, LoRA-wrapped, sharded) model.

The families are transformers' own ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``, chosen by the checkpoint's ``model_type``;
nothing below depends on which (their linear layers share names, FSDP wraps each
model's own decoder layer class, rotary buffers are rebuilt by their own class).

The whole model never exists densely in any process:

1. every rank builds the model skeleton on the ``meta`` device (no memory), replaces the
   decoder's linear layers by quantized ones (still meta: shapes only), injects peft LoRA
   and shards it with FSDP2 (``fully_shard`` works on meta);
2. ``to_empty`` allocates each rank's *shard* only;
3. rank 0 streams the checkpoint tensor by tensor, each in row blocks read straight from
   its file (a single file or a sharded index; byte ranges from the safetensors headers),
   quantizes each linear weight as it arrives, and *scatters* it block by block: every
   rank receives just its slice of each parameter; the (small, unsharded) quantization
   statistics are broadcast.

Rank 0's peak is its shard + one dense decoder matrix (what the quantizer needs whole) +
its packed form + one block round (``ModelOptions.load_block_bytes``, all ranks' pieces
together); other ranks hold their shard plus one block piece in flight. So an 8B
model's 1 GiB embedding and LM head never exist whole in any process. LoRA weights are
initialized from ``seed`` on rank 0 in module order and scattered the same way, so the
initial adapter is identical for any world size.

A job that continues a fine-tuned model (``spec.model.parent_adapters``) gets the parent's
adapter as a second peft adapter (``PARENT_ADAPTER``) beside the trained one
(``TRAINED_ADAPTER``, peft's "default"): frozen, no dropout, scale 1 (the fold of
``trainers.common.lineage``), sharded and filled like every other parameter, and active
in every forward together with the trained one, so the model computes the parent's
function plus the new adapter's delta.

Everything that can be checked without reading weights (architecture, quantization
options, the checkpoint's tensor names and shapes) is checked first, on every rank, and
raises :class:`UserError` with a stable code.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainers.common.hf_checkpoint import TensorLocation, read_checkpoint_index, read_config_json
from trainers.common.lineage import LoraWeights, read_parent_adapters
from trainers.common.memory import peak_rss_bytes
from trainers.common.peft_export import lora_key
from trainers.errors import UserError
from trainers.fsdp_qlora.distributed import (
    DistContext,
    apply_activation_checkpointing,
    shard_model,
)
from trainers.fsdp_qlora.quantize import (
    DECODER_LINEARS,
    QuantConfig,
    is_quantized_linear,
    quant_state_tensors,
    quantize_decoder_linears,
    quantize_linear,
    replace_quant_state_tensors,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "base_layer"})
_PEFT_PREFIX = "base_model.model."
# The adapter the job trains (peft's default name) and a parent fine-tuned model's, frozen.
TRAINED_ADAPTER = "default"
PARENT_ADAPTER = "parent"
# safetensors dtype names -> torch (the ones checkpoints use).
_CHECKPOINT_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# What rank 0 holds of one tensor at a time while it streams the checkpoint: every rank's
# piece of one scatter round together (a full copy of an 8B model's embedding would be
# 1 GiB in bf16, 2.4x one decoder layer). 64 MiB keeps collectives few (an 8B embedding
# over 2 ranks: 16 rounds) while staying well under a decoder layer (416 MiB in bf16).
LOAD_BLOCK_BYTES = 64 * 2**20

# rows(lo, hi): rows [lo, hi) along dim 0 of a tensor's full value (any dtype, any device).
RowSource = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class ModelOptions:
    """What :func:`build_model` needs, resolved from the trainer spec (see :func:`options_from_spec`)."""

    model_dir: Path
    base_dtype: str = "float32"
    compute_dtype: str = "float32"
    adapter_dtype: str = "float32"
    quantization: str = "none"  # none | nf4 | hqq4
    double_quant: bool = False
    hqq_group_size: int = 64
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    use_dora: bool = False
    activation_checkpointing: str = "none"
    cpu_offload: bool = False
    seed: int = 0
    parent: LoraWeights | None = None  # the frozen adapter of the fine-tuned model(s) continued
    max_seq_len: int | None = None  # with packing: checked against a sliding window
    packing: bool = False
    load_block_bytes: int | None = None  # None: LOAD_BLOCK_BYTES

    def quant_config(self) -> QuantConfig | None:
        if self.quantization == "none":
            return None
        compute = _DTYPES[self.compute_dtype]
        # The packed weight must be stored in the dtype FSDP all-gathers in (the mixed-
        # precision param dtype = compute dtype), or the cast would scramble its bytes.
        return QuantConfig(
            method=self.quantization,  # type: ignore[arg-type]
            compute_dtype=compute,
            storage_dtype=compute,
            double_quant=self.double_quant,
            hqq_group_size=self.hqq_group_size,
        )


def options_from_spec(spec: Any, model_dir: str | Path | None = None) -> ModelOptions:
    """Map a :class:`trainers.spec.TrainerSpec` to :class:`ModelOptions` (reading the
    parent adapters it names, ``trainers.common.lineage.read_parent_adapters``).

    ``model_dir`` overrides ``spec.model.path`` (e.g. after an s3:// download).
    """
    a, p, par = spec.adapter, spec.precision, spec.parallelism
    return ModelOptions(
        model_dir=Path(model_dir or spec.model.path),
        base_dtype=p.base_dtype,
        compute_dtype=p.compute_dtype,
        adapter_dtype=p.adapter_dtype,
        quantization=a.quantization,
        double_quant=a.double_quant,
        hqq_group_size=a.hqq_group_size,
        lora_r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        target_modules=tuple(a.target_modules),
        use_dora=a.use_dora,
        activation_checkpointing=par.activation_checkpointing,
        cpu_offload=par.cpu_offload,
        seed=spec.seed,
        parent=read_parent_adapters(spec),
        max_seq_len=spec.data.max_seq_len,
        packing=spec.data.packing,
    )


@dataclass(frozen=True)
class LoadReport:
    """What loading cost, for the event log."""

    seconds: float
    peak_rss_bytes: int
    local_param_bytes: int
    quantized_layers: int
    checkpoint_files: int

    def as_event_data(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "peak_rss_bytes": self.peak_rss_bytes,
            "local_param_bytes": self.local_param_bytes,
            "quantized_layers": self.quantized_layers,
            "checkpoint_files": self.checkpoint_files,
        }


# --------------------------------------------------------------------------- checks


def read_model_config(model_dir: str | Path) -> Any:
    """Read and validate ``config.json``; returns the family's transformers config
    (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config`` or ``Qwen3Config``). No weights are read.

    Raises:
        UserError(model_not_found): no config.json in ``model_dir``.
        UserError(corrupt_model): config.json is not valid JSON (or not an object).
        UserError(unsupported_architecture): ``model_type`` is not one of ``SUPPORTED_MODEL_TYPES``.
    """
    raw = read_config_json(model_dir)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"model_type {model_type!r} is not supported by the fsdp_qlora trainer "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
            code="unsupported_architecture",
        )
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type].from_dict(raw)


def sliding_window_of(config: Any) -> int | None:
    """The attention window some layer of ``config``'s model uses, or None for none.

    Mistral windows every layer when ``sliding_window`` is set; Qwen2/Qwen3 mark their
    windowed layers in ``layer_types`` (and drop ``sliding_window`` when
    ``use_sliding_window`` is off).
    """
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if config.model_type != "mistral" and "sliding_attention" not in (layer_types or ()):
        return None
    return int(window)


def check_options(opts: ModelOptions) -> None:
    """Reject option combinations this trainer cannot run, before any weight is read."""
    if opts.quantization not in ("none", "nf4", "hqq4"):
        raise UserError(f"unknown quantization {opts.quantization!r}", code="invalid_spec")
    if opts.use_dora:
        raise UserError(
            "adapter.use_dora is not supported by the fsdp_qlora trainer yet; use plain LoRA",
            code="unsupported_option",
        )
    if opts.quantization == "nf4" and opts.compute_dtype == "float16":
        # fp16 storage would be all-gathered as fp16: fine, but bnb's CPU kernels and our
        # tests only cover fp32/bf16; refuse rather than run an unverified combination.
        raise UserError("nf4 with float16 compute is not supported; use bfloat16", code="invalid_spec")


def check_model_options(config: Any, opts: ModelOptions) -> None:
    """Options that depend on the model: LoRA targets it has, a window packing respects.

    Raises:
        UserError(invalid_target_modules): a target module the model does not have.
        UserError(sequence_exceeds_sliding_window): packed rows longer than the model's
            sliding window (the block-diagonal mask of packed rows has no window).
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
                     - {"lm_head"})
    unknown = [t for t in opts.target_modules if t not in linears]
    if unknown:
        raise UserError(
            f"adapter.target_modules {unknown} are not linear modules of this {config.model_type} model "
            f"(its decoder has {', '.join(linears)})",
            code="invalid_target_modules",
        )
    window = sliding_window_of(config)
    if window is not None and opts.packing and opts.max_seq_len is not None and opts.max_seq_len > window:
        raise UserError(
            f"the model attends over a sliding window of {window} tokens, but packed rows of up to "
            f"{opts.max_seq_len} tokens would attend past it in the fsdp_qlora trainer; set "
            f"max_seq_len <= {window}, turn packing off, or use the jax trainer (it applies the window)",
            code="sequence_exceeds_sliding_window",
        )


def check_checkpoint_matches(config: Any, found: dict[str, tuple[int, ...]]) -> None:
    """Every weight the model needs is present with the right shape, nothing unknown.

    ``found``: the checkpoint's tensor shapes (``trainers.common.hf_checkpoint``).

    Raises:
        UserError(corrupt_model): listing the first missing / unexpected / mis-shaped names.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    found = {k: v for k, v in found.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(k for k in set(found) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}")
    if wrong:
        problems.append(", ".join(f"{k}: {found[k]} != {expected[k]}" for k in wrong[:5]))
    if problems:
        raise UserError(
            "checkpoint does not match its config.json: " + "; ".join(problems), code="corrupt_model"
        )


# --------------------------------------------------------------------------- names


def canonical_name(name: str) -> str:
    """The checkpoint-style name of a parameter/module of the wrapped model.

    Strips peft's ``base_model.model.`` and ``base_layer.`` and the checkpoint/FSDP
    wrapper tokens, so ``base_model.model.model.layers.0._checkpoint_wrapped_module.
    self_attn.q_proj.base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``.
    """
    name = name.removeprefix(_PEFT_PREFIX)
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def is_lora_name(name: str) -> bool:
    """A LoRA factor of any adapter: the trained one or a frozen parent's."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def is_trained_lora_name(name: str) -> bool:
    """A LoRA factor of the adapter the job trains (not a frozen parent's)."""
    return is_lora_name(name) and f".{TRAINED_ADAPTER}." in name


# --------------------------------------------------------------------------- build


def build_meta_model(config: Any, opts: ModelOptions) -> nn.Module:
    """The peft-wrapped (and, for QLoRA, quantized) model with every tensor on ``meta``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    qcfg = opts.quant_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).to(_DTYPES[opts.base_dtype])
        if qcfg is not None:
            for layer in model.model.layers:
                quantize_decoder_linears(layer, qcfg, DECODER_LINEARS)
    lora = LoraConfig(
        r=opts.lora_r,
        lora_alpha=opts.lora_alpha,
        lora_dropout=opts.lora_dropout,
        target_modules=list(opts.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # autocast_adapter_dtype=False: the adapter dtype is ours to choose (precision.adapter_dtype).
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    if opts.parent is not None:
        _add_parent_adapter(model, opts.parent)
    adapter_dtype = _DTYPES[opts.adapter_dtype]
    for name, param in model.named_parameters():
        if is_lora_name(name):
            param.data = param.data.to(adapter_dtype)
    return model


def _add_parent_adapter(model: nn.Module, parent: LoraWeights) -> None:
    """The parent's adapter as peft adapter ``PARENT_ADAPTER``: frozen, no dropout, scale 1,
    active in every layer beside the trained one.

    The layers' active lists are set directly: ``LoraModel.set_adapter`` with a list would
    make both trainable and leave the model's own ``active_adapter`` a list, which
    ``PeftModel.forward`` cannot look a config up by.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    model.add_adapter(PARENT_ADAPTER, LoraConfig(
        r=parent.r, lora_alpha=parent.r, lora_dropout=0.0, target_modules=list(parent.target_modules),
        bias="none", task_type="CAUSAL_LM"))
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module._active_adapter = [a for a in (TRAINED_ADAPTER, PARENT_ADAPTER) if a in module.lora_A]
    for name, param in model.named_parameters():
        if is_lora_name(name) and not is_trained_lora_name(name):
            param.requires_grad_(False)


def build_model(
    opts: ModelOptions, ctx: DistContext, log: Any = None
) -> tuple[nn.Module, LoadReport]:
    """Validate, build on meta, shard, then stream weights from rank 0. Returns the
    training-ready model (``train()`` mode, only LoRA weights trainable) and a report.

    ``log``: optional callable ``log(message, **data)`` for progress events.
    """
    import peft  # noqa: F401  (first imports take seconds: keep them out of the load time)
    import transformers  # noqa: F401

    started = time.monotonic()
    check_options(opts)
    if opts.cpu_offload and ctx.device.type == "cpu":
        raise UserError(
            "parallelism.cpu_offload needs a GPU (it offloads GPU parameters to host memory); "
            "this trainer runs on CPU only: set cpu_offload to false",
            code="offload_requires_accelerator",
        )
    config = read_model_config(opts.model_dir)
    check_model_options(config, opts)
    tensors = read_checkpoint_index(opts.model_dir)  # model_not_found / corrupt_model
    check_checkpoint_matches(config, {name: loc.shape for name, loc in tensors.items()})

    model = build_meta_model(config, opts)
    # Train mode BEFORE sharding: bnb repacks eval-mode weights in place on avx512_bf16
    # CPUs (a CPU-only layout FSDP would then shard and all-gather wrongly).
    model.train()
    apply_activation_checkpointing(model, opts.activation_checkpointing)
    shard_model(model, ctx, compute_dtype=opts.compute_dtype, cpu_offload=opts.cpu_offload)
    # Allocates this rank's shards only (FSDP2 params are DTensors over the mesh).
    model.to_empty(device=torch.device("cpu") if opts.cpu_offload else ctx.device)
    _retie_embeddings(model, config)
    _rebuild_rotary_buffers(model, config, ctx.device)

    quantized = _stream_weights(model, tensors, opts, ctx)
    _init_lora(model, opts.seed, ctx, block_bytes=opts.load_block_bytes)
    if opts.parent is not None:
        _fill_parent(model, opts.parent, ctx, block_bytes=opts.load_block_bytes)
    local_bytes = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    report = LoadReport(
        seconds=time.monotonic() - started,
        peak_rss_bytes=peak_rss_bytes(),
        local_param_bytes=int(local_bytes),
        quantized_layers=quantized,
        checkpoint_files=len({loc.file for loc in tensors.values()}),
    )
    if log is not None:
        log("model loaded", **report.as_event_data())
    return model, report


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _retie_embeddings(model: nn.Module, config: Any) -> None:
    """A tied LM head is the input embedding again after ``to_empty``, which allocates
    each module's parameters apart (FSDP2 manages the shared parameter once, as
    ``fully_shard`` saw it on meta)."""
    if not getattr(config, "tie_word_embeddings", False):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.get_output_embeddings().weight = base.get_input_embeddings().weight


def _rebuild_rotary_buffers(model: nn.Module, config: Any, device: torch.device) -> None:
    """RoPE frequencies are non-persistent buffers computed at init; on meta they are
    empty, so recompute them (cheap) on the compute device, with the family's own class
    (``LlamaRotaryEmbedding``, ``Qwen3RotaryEmbedding``...)."""
    rebuilt = 0
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            rebuilt += 1
            with torch.device("cpu"):
                fresh = type(module)(config)
            for name, buf in fresh.named_buffers(recurse=False):
                module.register_buffer(name, buf.to(device), persistent=False)
            module.attention_scaling = fresh.attention_scaling
    if not rebuilt:
        raise RuntimeError(f"no rotary embedding module found in {type(model).__name__}")


def _stream_weights(
    model: nn.Module, tensors: dict[str, TensorLocation], opts: ModelOptions, ctx: DistContext
) -> int:
    """Fill every base parameter (and quantization statistics) from the checkpoint."""
    qcfg = opts.quant_config()
    base_dtype = _DTYPES[opts.base_dtype]
    block = opts.load_block_bytes or LOAD_BLOCK_BYTES
    params = {canonical_name(n): p for n, p in model.named_parameters() if not is_lora_name(n)}
    quant_modules = {
        canonical_name(n): m for n, m in model.named_modules() if is_quantized_linear(m)
    }
    quantized = 0
    with ExitStack() as stack:
        reader = _CheckpointRows(tensors, stack) if ctx.is_main else None
        # Quantized layers: one checkpoint tensor -> packed weight + statistics.
        for mod_name, module in quant_modules.items():
            value_params: dict[str, torch.Tensor] = {}
            stats: dict[str, torch.Tensor] = {}
            if reader is not None:
                # The quantizer needs the dense matrix whole. It is read block by block
                # straight into the base dtype on the compute device (quantizing there: GPU
                # kernels are ~100x faster than CPU ones for an 8B model), so neither a
                # host copy nor a second one in the checkpoint's dtype exists beside it.
                name = f"{mod_name}.weight"
                dense = torch.empty(tensors[name].shape, dtype=base_dtype, device=ctx.device)
                _copy_rows(dense, reader.rows(name), block)
                out_f, in_f = dense.shape
                with torch.device("meta"):
                    linear = nn.Linear(in_f, out_f, bias=False)
                linear.weight = nn.Parameter(dense, requires_grad=False)
                qlayer = quantize_linear(linear, qcfg)
                del linear, dense
                value_params = {n: p.data for n, p in qlayer.named_parameters()}
                stats = quant_state_tensors(qlayer)
                del qlayer
            for pname, param in module.named_parameters(recurse=False):
                rows = None
                if reader is not None:  # biases stay unquantized: straight from the checkpoint
                    rows = (reader.rows(f"{mod_name}.bias") if pname == "bias"
                            else _rows_of(value_params[pname], param.shape))
                _fill(param, rows, ctx, block)
            del value_params
            template = quant_state_tensors(module)
            received = {
                k: _broadcast(stats.get(k), t.shape, t.dtype, ctx) for k, t in template.items()
            }
            replace_quant_state_tensors(module, received)
            quantized += 1
        # Everything else (embeddings, norms, lm_head, unquantized linears): cast and
        # scatter, block by block.
        for name, param in params.items():
            owner = name.rsplit(".", 1)[0]
            if owner in quant_modules:
                continue
            _fill(param, reader.rows(name) if reader is not None else None, ctx, block)
    return quantized


class _CheckpointRows:
    """Row blocks of checkpoint tensors, read from their files with ``os.preadv``.

    Only the requested rows' bytes are read (their byte range follows from the header's
    offsets: safetensors data is row-major), into a fresh tensor: nothing is mapped, so
    host memory is exactly the blocks alive. Not ``safe_open(...).get_slice`` (measured
    with safetensors 0.8 on a 256 MiB tensor): with the ``pread`` backend every slice
    read the whole tensor first (+256 MiB peak for a 16 MiB slice), and with the default
    mmap one the resident memory grew by each slice read and stayed grown.
    """

    def __init__(self, tensors: dict[str, TensorLocation], stack: ExitStack) -> None:
        self._tensors = tensors
        self._fds: dict[Path, int] = {}
        self._stack = stack

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise UserError(f"cannot read {path}: {exc}", code="corrupt_model") from exc
            self._stack.callback(os.close, fd)
            self._fds[path] = fd
        return fd

    def rows(self, name: str) -> RowSource:
        loc = self._tensors.get(name)
        if loc is None:
            raise UserError(f"tensor {name!r} not in the checkpoint", code="corrupt_model")
        dtype = _CHECKPOINT_DTYPES.get(loc.dtype)
        if dtype is None:
            raise UserError(f"tensor {name!r} has unsupported dtype {loc.dtype}", code="corrupt_model")
        shape = _row_shape(loc.shape)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        if row_bytes * shape[0] != loc.end - loc.start:
            raise UserError(f"tensor {name!r}: {loc.end - loc.start} bytes for shape {loc.shape} "
                            f"{loc.dtype}", code="corrupt_model")
        fd = self._fd(loc.file)

        def read(lo: int, hi: int) -> torch.Tensor:
            raw = torch.empty((hi - lo) * row_bytes, dtype=torch.uint8)
            view, done = memoryview(raw.numpy()), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], loc.start + lo * row_bytes + done)
                if got <= 0:
                    raise UserError(f"cannot read tensor {name!r} from {loc.file}: the file ends early",
                                    code="corrupt_model")
                done += got
            return raw.view(dtype).reshape(hi - lo, *shape[1:])

        return read


def _row_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """``shape`` as rows along dim 0 (a scalar is one row of one value)."""
    return tuple(shape) if len(shape) else (1,)


def _rows_of(full: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> RowSource:
    """The row source of a value already in memory (viewed as ``shape``)."""
    full = full.reshape(_row_shape(shape))
    return lambda lo, hi: full[lo:hi]


def _block_rows(row_shape: tuple[int, ...], itemsize: int, budget: int, limit: int) -> int:
    """Rows per block: as many as ``budget`` bytes hold (at least 1, at most ``limit``)."""
    row_bytes = max(1, math.prod(row_shape) * itemsize)
    return max(1, min(limit, budget // row_bytes))


def _copy_rows(target: torch.Tensor, rows: RowSource, block_bytes: int) -> None:
    """Fill ``target`` (its full value) from ``rows``, one block at a time."""
    target = target.view(_row_shape(target.shape))
    n = target.shape[0]
    step = _block_rows(target.shape[1:], target.element_size(), block_bytes, n)
    with torch.no_grad():
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            target[lo:hi].copy_(rows(lo, hi))


def _fill(param: torch.Tensor, rows: RowSource | None, ctx: DistContext, block_bytes: int) -> None:
    """Write rank 0's value of ``param`` (read through ``rows``) into every rank's shard.

    An FSDP2 parameter (DTensor, ``Shard(0)``: rank r holds rows ``[r*c, (r+1)*c)`` with
    ``c = ceil(dim0 / world)``, the last ranks fewer or none) is filled in rounds: each
    round rank 0 reads the next ``step`` rows of every rank's shard, casts them and
    ``scatter``s them, so that every rank's pieces together stay within ``block_bytes``.
    A plain parameter (single process) is copied block by block.
    """
    local = _local(param)
    if not ctx.distributed or not hasattr(param, "to_local"):
        if rows is None:
            raise RuntimeError("single-process load needs the full value")
        _copy_rows(local, rows, block_bytes)
        return
    import torch.distributed as dist

    world = ctx.world_size
    shape = _row_shape(param.shape)
    dim0, tail = shape[0], shape[1:]
    per_rank = math.ceil(dim0 / world)  # torch.chunk sizes: FSDP2's Shard(0) layout
    step = _block_rows(tail, local.element_size(), block_bytes // world, per_rank)
    target = local.view(-1, *tail) if tail else local.view(-1)
    buf = torch.empty((step, *tail), dtype=local.dtype, device=local.device)
    # Scatter sends equal shapes: a rank's piece past its shard's end is zero padding.
    pieces = [torch.empty_like(buf) for _ in range(world)] if ctx.is_main else None
    with torch.no_grad():
        for first in range(0, per_rank, step):
            if pieces is not None:
                assert rows is not None
                for r, piece in enumerate(pieces):
                    lo = min(r * per_rank + first, dim0)
                    hi = min(r * per_rank + min(first + step, per_rank), dim0)
                    if hi > lo:
                        piece[: hi - lo].copy_(rows(lo, hi))
                    piece[hi - lo :].zero_()
            dist.scatter(buf, pieces, src=0)
            n = min(first + step, target.shape[0]) - first
            if n > 0:
                target[first : first + n].copy_(buf[:n])


def _broadcast(
    value: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, ctx: DistContext
) -> torch.Tensor:
    """Rank 0's tensor on every rank (quantization statistics are small and unsharded)."""
    device = ctx.device
    if not ctx.distributed:
        assert value is not None
        return value.to(device)
    import torch.distributed as dist

    out = value.to(device).contiguous() if ctx.is_main else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out, src=0)
    return out


def _init_lora(model: nn.Module, seed: int, ctx: DistContext, block_bytes: int | None = None) -> None:
    """Initialize LoRA as peft does (A: Kaiming-uniform(a=sqrt 5), B: zeros), from ``seed``.

    Drawn on rank 0 from one generator in module order and scattered, so the initial
    adapter does not depend on the world size (peft's own init would draw on every rank
    from its global RNG, on shards).
    """
    gen = torch.Generator().manual_seed(seed)
    block_bytes = block_bytes or LOAD_BLOCK_BYTES
    for name, param in model.named_parameters():
        if not is_trained_lora_name(name):
            continue
        value = None
        if ctx.is_main:
            value = torch.empty(param.shape, dtype=torch.float32)
            if ".lora_A." in name:
                nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
            else:
                value.zero_()
        _fill(param, None if value is None else _rows_of(value, param.shape), ctx, block_bytes)


def _fill_parent(model: nn.Module, parent: LoraWeights, ctx: DistContext, block_bytes: int | None = None) -> None:
    """The frozen parent adapter's factors from ``parent`` (every rank read it; rank 0's
    value is scattered as the checkpoint's is).

    Raises:
        UserError(parent_adapter_mismatch): a factor whose shape is not the model's (an
            adapter of another model).
    """
    block_bytes = block_bytes or LOAD_BLOCK_BYTES
    for name, param in model.named_parameters():
        if not is_lora_name(name) or is_trained_lora_name(name):
            continue
        # model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.parent.weight
        parts = canonical_name(name).split(".")
        value = parent.weights.get(lora_key(int(parts[2]), parts[4], parts[5][-1]))
        if value is None or tuple(value.shape) != tuple(param.shape):
            raise UserError(
                f"the parent adapter's {canonical_name(name)} has shape "
                f"{None if value is None else tuple(value.shape)}; this model's is {tuple(param.shape)}",
                code="parent_adapter_mismatch")
        rows = _rows_of(torch.from_numpy(value), param.shape) if ctx.is_main else None
        _fill(param, rows, ctx, block_bytes)


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every trainable LoRA weight, in module order."""
    for name, param in model.named_parameters():
        if is_trained_lora_name(name):
            yield canonical_name(name), param
