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
3. rank 0 streams the checkpoint tensor by tensor (``safetensors.safe_open``, a single
   file or a sharded index), quantizes each linear weight as it arrives, and *scatters*
   it: every rank receives just its slice of each parameter; the (small, unsharded)
   quantization statistics are broadcast.

Rank 0's peak is its shard + one dense matrix + one quantized matrix; other ranks never
hold more than their shard plus one slice in flight. LoRA weights are initialized from
``seed`` on rank 0 in module order and scattered the same way, so the initial adapter
is identical for any world size.

Everything that can be checked without reading weights (architecture, quantization
options, the checkpoint's tensor names and shapes) is checked first, on every rank, and
raises :class:`UserError` with a stable code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainers.common.hf_checkpoint import read_checkpoint_index, read_config_json
from trainers.common.memory import peak_rss_bytes
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
    max_seq_len: int | None = None  # with packing: checked against a sliding window
    packing: bool = False

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
    """Map a :class:`trainers.spec.TrainerSpec` to :class:`ModelOptions`.

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


def open_safetensors(path: Path, **kwargs: Any) -> Any:
    """``safetensors.safe_open`` of ``path``; a file it cannot parse is a ``corrupt_model``."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", **kwargs)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"cannot read {path}: {exc}", code="corrupt_model") from exc


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
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


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
    adapter_dtype = _DTYPES[opts.adapter_dtype]
    for name, param in model.named_parameters():
        if is_lora_name(name):
            param.data = param.data.to(adapter_dtype)
    return model


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
    files = {name: loc.file for name, loc in tensors.items()}

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

    quantized = _stream_weights(model, config, files, opts, ctx)
    _init_lora(model, opts.seed, ctx)
    local_bytes = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    report = LoadReport(
        seconds=time.monotonic() - started,
        peak_rss_bytes=peak_rss_bytes(),
        local_param_bytes=int(local_bytes),
        quantized_layers=quantized,
        checkpoint_files=len(set(files.values())),
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
    model: nn.Module, config: Any, files: dict[str, Path], opts: ModelOptions, ctx: DistContext
) -> int:
    """Fill every base parameter (and quantization statistics) from the checkpoint."""
    qcfg = opts.quant_config()
    base_dtype = _DTYPES[opts.base_dtype]
    params = {canonical_name(n): p for n, p in model.named_parameters() if not is_lora_name(n)}
    quant_modules = {
        canonical_name(n): m for n, m in model.named_modules() if is_quantized_linear(m)
    }
    quantized = 0
    with ExitStack() as stack:
        reader = _TensorReader(files, stack) if ctx.is_main else None
        # Quantized layers: one checkpoint tensor -> packed weight + statistics.
        for mod_name, module in quant_modules.items():
            value_params: dict[str, torch.Tensor] = {}
            stats: dict[str, torch.Tensor] = {}
            if reader is not None:
                # Quantize on the compute device (GPU kernels are ~100x faster than CPU
                # ones for an 8B model); only the packed result is kept.
                dense = reader.get(f"{mod_name}.weight").to(device=ctx.device, dtype=base_dtype)
                out_f, in_f = dense.shape
                with torch.device("meta"):
                    linear = nn.Linear(in_f, out_f, bias=False)
                linear.weight = nn.Parameter(dense, requires_grad=False)
                qlayer = quantize_linear(linear, qcfg)
                del linear, dense
                value_params = {n: p.data for n, p in qlayer.named_parameters()}
                stats = quant_state_tensors(qlayer)
            for pname, param in module.named_parameters(recurse=False):
                value = value_params.get(pname)
                if pname == "bias" and reader is not None:  # biases stay unquantized
                    value = reader.get(f"{mod_name}.bias").to(param.dtype)
                _fill(param, value, ctx)
            template = quant_state_tensors(module)
            received = {
                k: _broadcast(stats.get(k), t.shape, t.dtype, ctx) for k, t in template.items()
            }
            replace_quant_state_tensors(module, received)
            quantized += 1
        # Everything else (embeddings, norms, lm_head): cast and scatter.
        for name, param in params.items():
            owner = name.rsplit(".", 1)[0]
            if owner in quant_modules:
                continue
            value = reader.get(name).to(param.dtype) if reader is not None else None
            _fill(param, value, ctx)
    return quantized


class _TensorReader:
    """Reads one tensor at a time from (possibly several) safetensors files."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self._files = files
        self._open = {}
        self._stack = stack

    def get(self, name: str) -> torch.Tensor:
        path = self._files.get(name)
        if path is None:
            raise UserError(f"tensor {name!r} not in the checkpoint", code="corrupt_model")
        handle = self._open.get(path)
        if handle is None:
            # pread, not mmap: an mmapped shard stays resident (and counted in RSS) while
            # open; pread copies exactly one tensor, so host memory is what we hold.
            handle = self._stack.enter_context(open_safetensors(path, backend="pread"))
            self._open[path] = handle
        from safetensors import SafetensorError

        try:
            return handle.get_tensor(name)
        except SafetensorError as exc:  # e.g. a truncated shard: the header promised more bytes
            raise UserError(f"cannot read tensor {name!r} from {path}: {exc}", code="corrupt_model") from exc


def _fill(param: torch.Tensor, full: torch.Tensor | None, ctx: DistContext) -> None:
    """Write rank 0's full value of ``param`` into every rank's shard of it.

    For an FSDP2 (DTensor, ``Shard(0)``) parameter each rank receives only its slice
    through one ``scatter``; a plain parameter (single process) is copied directly.
    """
    local = _local(param)
    if not ctx.distributed or not hasattr(param, "to_local"):
        if full is None:
            raise RuntimeError("single-process load needs the full value")
        with torch.no_grad():
            local.copy_(full.reshape(local.shape).to(local.dtype))
        return
    import torch.distributed as dist

    world, dim0 = ctx.world_size, param.shape[0]
    rows = math.ceil(dim0 / world)  # torch.chunk sizes: FSDP2's Shard(0) layout
    chunk_shape = (rows, *param.shape[1:])
    buf = torch.empty(chunk_shape, dtype=local.dtype, device=local.device)
    scatter_list = None
    if ctx.is_main:
        assert full is not None
        full = full.to(device=local.device, dtype=local.dtype).reshape(param.shape)
        scatter_list = []
        for r in range(world):
            piece = torch.zeros(chunk_shape, dtype=local.dtype, device=local.device)
            lo, hi = min(r * rows, dim0), min((r + 1) * rows, dim0)
            piece[: hi - lo].copy_(full[lo:hi])
            scatter_list.append(piece)
    dist.scatter(buf, scatter_list, src=0)
    with torch.no_grad():
        local.copy_(buf[: local.shape[0]])


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


def _init_lora(model: nn.Module, seed: int, ctx: DistContext) -> None:
    """Initialize LoRA as peft does (A: Kaiming-uniform(a=sqrt 5), B: zeros), from ``seed``.

    Drawn on rank 0 from one generator in module order and scattered, so the initial
    adapter does not depend on the world size (peft's own init would draw on every rank
    from its global RNG, on shards).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_lora_name(name):
            continue
        value = None
        if ctx.is_main:
            value = torch.empty(param.shape, dtype=torch.float32)
            if ".lora_A." in name:
                nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
            else:
                value.zero_()
        _fill(param, value, ctx)


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every trainable LoRA weight, in module order."""
    for name, param in model.named_parameters():
        if is_lora_name(name):
            yield canonical_name(name), param
