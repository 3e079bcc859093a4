"""Memory-fit estimator: bytes per GPU, GPU count, speed and cost of a LoRA/QLoRA job.

Pure arithmetic over the base model's shape (read from its Hugging Face ``config.json``
by ``scheduling.model_files``) and the job's training settings. The scheduler uses it to
decide how many GPUs of a pool a job needs (the smallest count that fits with headroom)
and to refuse pools that cannot hold it; ``POST /v1/fine_tuning/estimate`` shows the same numbers to users.

Per GPU, for a job sharded over N GPUs (FSDP in the torch trainer, the ``fsdp`` x
``tensor`` mesh in the JAX trainer)::

    base weights / N          bf16: 2 B/param; NF4: 0.5 B/param + absmax (fp32 per 64,
                              or 8-bit per 64 + fp32 per 256 blocks with double-quant);
                              HQQ 4-bit: 0.5 B/param + bf16 scale and zero per group.
                              Embeddings, lm_head, norms and biases stay bf16 (never
                              quantized). Parameter counts per family: model_shapes.py.
  + one gathered layer        FSDP all-gathers one decoder layer's weights at a time
  + one dequantized layer     jax_lora on a 4-bit base only: each projection's kernel
                              is dequantized to the compute dtype inside the step (and
                              again in the backward); about one layer's linear weights
                              in the compute dtype are live at once, unsharded (the
                              torch trainer's bitsandbytes temporaries are part of its
                              calibrated slack)
  + LoRA params / N           fp32 (the adapter dtype of both trainers)
  + frozen LoRA params / N    a job that continues a fine-tuned model: that model's adapter,
                              fp32, sharded like the trained one, without gradients or
                              optimizer state (counted with the base weights)
  + LoRA grads / N            fp32
  + Adam moments / N          2 x fp32
  + activations               saved tensors of the forward pass (per micro batch; with
                              checkpointing only each layer's input plus one layer being
                              recomputed), plus the logits and their fp32 loss copy
  + framework overhead        CUDA/ROCm context, allocator slack, runtime

Two trainer-specific corrections, both read off the trainers' own plans (bench/plan_aot.py
compiles jax_lora's real step for the real 8B/70B/405B configs and reads XLA's buffers;
bench/plan_fsdp_qlora.py counts fsdp_qlora's sharded state from its meta-device build):

- fsdp_qlora keeps the NF4 statistics (absmax and code) whole on every GPU: they belong
  to bitsandbytes' quant state, not to the parameters FSDP shards or offloads.
- jax_lora (mesh without a tensor axis) gathers the whole embedding table and LM head
  on every device and upcasts the head to fp32 in the loss's backward, but holds the
  logits of only one chunk of positions per row (``JAX_LOSS_CHUNK``); on accelerators
  the recomputed layer's attention scores grow with seq^2. XLA assigns the compiled
  step's buffers by liveness, so the loss's transients and the recomputed layer's share
  memory (only the larger counts), and the slack left for the allocator is small.

A DPO job (``objective="dpo"``) runs its preferred and its rejected answer in the same
micro batch, so its policy forward saves activations and logits for twice the tokens;
its reference forward (the same base with the adapter off, under no_grad) saves nothing
for backward, but while it runs one layer's intermediates and its logits with their fp32
log-softmax are live. Counted on top of the policy's saved tensors (TRL computes the
reference after the policy forward, whose activations are then still held), so the
estimate holds whichever order a trainer uses. Its FLOPs per planned token (``steps x
batch x seq_len``, a pair's length counted once) are two sequences' training passes plus
their reference forward.

Constants below are calibrated against published peaks (see tests/worker/
test_estimator_anchors.py) and, for the CPU-only terms (fp32 activations, the host heap's
retention, the CPU framework footprint), against measured peaks of our torch trainer on
CPU (bench/scheduler_estimator_cpu.py: a memory target, so a benchmark, not a test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from scheduling.model_shapes import KNOWN_MODELS, EstimateError, ModelShape  # noqa: F401 (re-exported)
from scheduling.pools import GIB, NodePool
from trainers.spec import DEFAULT_TARGET_MODULES

Method = Literal["lora", "qlora"]
Objective = Literal["supervised", "dpo", "reinforcement"]
Quantization = Literal["none", "nf4", "hqq4"]

# Fraction of a GPU's memory the estimate may use. Against published peaks the estimate
# was at worst 15.6 % low (tests/worker/test_estimator_anchors.py: true = 1.185x
# predicted), so 1 / 1.185 = 0.84 of the memory is all we plan for: a placement that
# OOMs costs a whole restart, an unused GiB costs little.
HEADROOM = 0.84
# Model FLOP utilisation assumed for throughput/ETA, per trainer family. Answer.AI's
# fsdp_qlora benchmarks (benchmarks_03_2024.md) imply ~0.55-0.6 on 2x4090 (7B QLoRA
# ~4.5k tok/s, 70B QLoRA+offload ~477 tok/s) and ~0.33 on 4xH100; we assume 0.5. The
# JAX trainer (jitted, sharded) is assumed a little lower until measured on MI300X.
MFU = {"fsdp_qlora": 0.50, "jax_lora": 0.40}
# CPU offload moves sharded weights/optimizer state to host RAM; the GPU keeps the
# gathered layer and activations. With full x16 PCIe lanes Answer.AI measured almost no
# slowdown (34B on 2x4090: 2,061 s vs 2,072 s); on slow lanes it is worse, so we
# assume a 10 % loss.
OFFLOAD_SLOWDOWN = 0.9
# Fixed runtime cost per process, by accelerator kind: CUDA/ROCm context + NCCL/RCCL
# buffers on GPUs; on CPU the torch trainer's resident set before its first model tensor
# (interpreter, torch, transformers, peft, bitsandbytes, tokenizer and data): 485 MiB
# measured (bench/scheduler_estimator_cpu.py; a CPU FSDP rank under torchrun holds ~470 MB).
FRAMEWORK_OVERHEAD = {"gpu": int(0.75 * GIB), "cpu": int(0.47 * GIB)}
# The JAX trainer on CPU holds more than the torch one besides its tensors (jaxlib's XLA
# compiler and CPU client, the compiled step): measured 173-323 MiB above the torch-based
# estimate on 8 configurations, 4 shapes (bench/scheduler_estimator_cpu.py --trainers jax_lora).
JAX_CPU_RUNTIME_EXTRA = 290 * 2**20
# Allocator slack on top of live tensors (caching allocator rounding, temporaries).
ALLOCATOR_SLACK = 0.08
# jax_lora's step is one compiled XLA program whose buffers XLA assigns ahead of time, so
# its temporaries are counted by the terms below (XLA's own plan of the real 8B/70B/405B
# steps, bench/plan_aot.py); what is left is the allocator's rounding and fragmentation.
JAX_ALLOCATOR_SLACK = 0.02
# jax_lora on an accelerator: what the recomputed backward of one layer holds at once.
# Bytes per (query, key) pair per attention head -- scores, probabilities and their
# gradient, about 1.25 fp32 copies -- and, in layers' worth of saved tensors
# (``activation_bytes_per_layer``), the rest of the layer's recomputed intermediates and
# their gradients. Fitted to XLA's plan of Llama-3.1-405B on 8 devices at seq 2048 / 4096
# / 8192 x 1 and 2048 x 1 / 2 / 4 / 8 (bench/plan_aot.py; beyond the saved layer inputs
# the temporaries are the larger of the loss's -- gathered embedding and LM head, the
# head's fp32 copy -- and the layer's, which grows as 0.84 s + 2.76 s^2 GiB per row, s
# in units of 2048 tokens); every row of that plan is then estimated within +10 %, none
# under by more than 3 %. XLA:CPU gathers the next layer's weights only as it needs
# them; the estimate keeps two gathered layers, as an accelerator's collective
# scheduling prefetches one. That plan used the trainer's blockwise CPU attention,
# whose blocks are all materialized; on accelerators the trainer calls
# ``jax.nn.dot_product_attention``, whose XLA implementation materializes the full (not
# causal-halved) score matrix too, and only a fused kernel would need none of it.
ATTENTION_SCORE_BYTES = 5.0
JAX_RECOMPUTED_LAYER = 1
# On CPU the tensors live on glibc's heap, which keeps what they free: once a freed
# tensor has raised the dynamic mmap threshold, later tensors below it (up to 32 MiB) come
# from the heap, and the freed memory stays resident: about four layers' worth of
# transients beyond the live ones (fitted, default malloc vs MALLOC_MMAP_THRESHOLD_=65536,
# on the torch trainer before it fixed its threshold). Replaces the GPU caching-allocator
# slack on CPU for jax_lora, which keeps glibc's default (with it, 0.955 of a 32-layer
# Llama-3.1-8B step's measured peak). The torch trainer fixes the threshold itself
# (trainers/common/memory.py: its heap grew with the layer count, to half of that step's
# peak), so its peak is its live tensors: -0.5..+4.9 % on bench/scheduler_estimator_cpu.py's
# rows and 1.01 at the 32-layer 8B step (bench/scale_8b_cpu.py) with the terms below.
CPU_HEAP_RETAINED_LAYERS = 4
# FSDP's all-gather / reduce-scatter staging buffers when the job is sharded.
FSDP_BUFFERS = int(0.5 * GIB)
# jax_lora never builds a micro batch's whole (rows, seq, vocab) logits: its loss applies
# the LM head to this many positions of every row at a time (``LOSS_CHUNK`` of
# trainers/jax_lora/loss.py, a scan whose body is recomputed in the backward pass), so
# one chunk's logits and their gradient are live at once. The torch trainer's loss holds
# the whole micro batch's.
JAX_LOSS_CHUNK = 32

_BF16 = 2
_FP32 = 4


@dataclass(frozen=True)
class TrainingShape:
    """The job settings that decide memory: adapter, precision, sequence and batch."""

    method: Method = "lora"
    quantization: Quantization = "none"
    double_quant: bool = False
    hqq_group_size: int = 64
    r: int = 8
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    seq_len: int = 2048
    micro_batch: int = 1
    checkpointing: bool = True
    saves_dots: bool = False
    """With ``checkpointing``: jax_lora's ``dots_saveable`` rematerialization, which keeps
    every matmul's output (``dots_bytes_per_layer``) and recomputes only the elementwise
    work; without it, each layer's input alone is kept and the whole layer recomputed."""
    cpu_offload: Literal["never", "auto", "always"] = "auto"
    adapter_bytes: int = _FP32
    compute_bytes: int = _BF16
    """Bytes per element of unquantized weights and activations (4 for the fp32 CPU runs)."""
    objective: Objective = "supervised"
    """``dpo``: two sequences per example and a reference forward (module docstring);
    ``reinforcement``: ``group_size`` sampled sequences per prompt and a reference forward."""
    group_size: int = 1
    """Reinforcement only: completions per prompt (``samples_per_prompt``), trained together."""
    frozen_r: int = 0
    """A job that continues a fine-tuned model: the rank of that model's adapter, applied
    frozen beside the trained one (0: none)."""
    frozen_target_modules: tuple[str, ...] = ()

    @property
    def sequences_per_example(self) -> int:
        if self.objective == "reinforcement":
            return self.group_size
        return 2 if self.objective == "dpo" else 1

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one forward holds: sequence length x micro batch x sequences per example."""
        return self.seq_len * self.micro_batch * self.sequences_per_example

    def __post_init__(self) -> None:
        if self.method == "qlora" and self.quantization == "none":
            raise EstimateError("qlora needs quantization nf4 or hqq4", "invalid_adapter")
        if self.method == "lora" and self.quantization != "none":
            raise EstimateError("quantization needs method qlora", "invalid_adapter")
        if self.seq_len < 1 or self.micro_batch < 1 or self.r < 1:
            raise EstimateError("seq_len, micro_batch and r must be >= 1", "invalid_estimate_input")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU, by component (all already divided by the shard count)."""

    weights: int
    gathered_layer: int
    dequantized_layer: int
    """jax_lora on a 4-bit base: one layer's kernels dequantized to the compute dtype."""
    lora_params: int
    lora_grads: int
    optimizer: int
    activations: int
    logits: int
    slack: int
    """Allocator slack (on CPU: what the host heap retains) and (sharded jobs) FSDP buffers."""
    framework: int

    @property
    def model_bytes(self) -> int:
        """Everything the training framework allocates (comparable to a peak-allocated figure)."""
        return self.total - self.framework

    @property
    def total(self) -> int:
        return (
            self.weights + self.gathered_layer + self.dequantized_layer + self.lora_params
            + self.lora_grads + self.optimizer + self.activations + self.logits + self.slack + self.framework
        )


def quantized_bytes_per_param(t: TrainingShape) -> float:
    """Storage of one quantized linear weight element, including quantization constants."""
    if t.quantization == "none":
        return t.compute_bytes
    if t.quantization == "nf4":
        # 4-bit codes + one fp32 absmax per block of 64. Double quantization stores the
        # absmax values as 8-bit codes with one fp32 scale per 256 of them (one fp32
        # offset per tensor is negligible).
        absmax = (1 + _FP32 / 256) / 64 if t.double_quant else _FP32 / 64
        return 0.5 + absmax
    # HQQ: 4-bit codes + a bf16 scale and a bf16 zero per group.
    return 0.5 + 2 * _BF16 / t.hqq_group_size


def lora_params(m: ModelShape, t: TrainingShape, *, frozen: bool = False) -> int:
    """Parameters of the trained LoRA, or (``frozen``) of the parent's frozen one."""
    shapes = m.module_shapes()
    r, modules = (t.frozen_r, t.frozen_target_modules) if frozen else (t.r, t.target_modules)
    try:
        per_layer = sum(r * sum(shapes[name]) for name in modules)
    except KeyError as exc:
        raise EstimateError(f"unknown target module {exc.args[0]!r}", "invalid_adapter") from exc
    return m.layers * per_layer


def activation_bytes_per_layer(m: ModelShape, t: TrainingShape) -> int:
    """Tensors one decoder layer saves for backward (Hugging Face Llama, SDPA attention).

    Counted per token: each RMSNorm saves its input, the normalised input and its output;
    attention saves q, and k, v expanded to all query heads (``repeat_kv`` before SDPA),
    after RoPE, the attention output and its logsumexp, and o_proj's (contiguous) input;
    the MLP saves gate, up, act(gate) and the product fed to down_proj. LoRA adds its
    rank-r intermediate per target module. SDPA/flash keep no s x s matrix.

    In fp32 compute (the CPU trainers) every dtype cast is a no-op and fewer tensors are
    saved: see :func:`_fp32_activation_bytes_per_token`.
    """
    if t.compute_bytes == _FP32:
        return _fp32_activation_bytes_per_token(m, t) * t.tokens_per_micro_batch
    h, f, b = m.hidden, m.intermediate, t.compute_bytes
    q = m.heads * m.hd
    per_token = b * (3 * h + q + 2 * q + q + q) + _FP32 * m.heads  # norm + attention block
    per_token += b * (3 * h + 4 * f)  # norm + MLP block
    per_token += b * t.r * len(t.target_modules)  # LoRA A outputs
    if m.qk_norm:  # Qwen3's q/k RMSNorms save what the layer norms do, at q's and k's widths
        per_token += b * 3 * (q + m.kv_heads * m.hd)
    return per_token * t.tokens_per_micro_batch


def dots_bytes_per_layer(m: ModelShape, t: TrainingShape) -> int:
    """What one decoder layer keeps for backward under ``dots_saveable``: its input, every
    linear module's output, each LoRA module's rank-r and output products (an adapted
    module's output is two matmuls' sum), and the attention's own residuals (its output
    and a logsumexp per head: jax_lora's blockwise attention defines its backward itself
    and keeps no score matrix, ``trainers/jax_lora/model.py`` ``attention``), in the
    compute dtype."""
    shapes = m.module_shapes()
    targets = set(t.target_modules)
    per_token = m.hidden + sum(out for _, out in shapes.values())
    per_token += sum(t.r + shapes[name][1] for name in targets if name in shapes)
    per_token += m.heads * m.hd + m.heads
    return per_token * t.compute_bytes * t.tokens_per_micro_batch


def _fp32_activation_bytes_per_token(m: ModelShape, t: TrainingShape) -> int:
    """Bytes per token one decoder layer saves for backward in fp32 compute.

    Counted with ``torch.autograd.graph.saved_tensors_hooks`` on transformers' Llama (SDPA)
    with peft LoRA (tests/worker/test_estimator.py checks it): each RMSNorm keeps its input
    (the layer's input, then the residual after attention) and its rsqrt; a norm's output
    is kept only when a LoRA module reads it (frozen base linears keep no input); SDPA
    keeps q, k, v after RoPE at their own widths (the GQA path, no ``repeat_kv`` copy),
    its output (also o_proj's input) and a logsumexp per head; the MLP keeps gate, up and
    act(gate), and the product only when down_proj has LoRA; LoRA keeps its rank-r
    intermediates. Casts are no-ops in fp32, so there are no upcast copies. Qwen3's q/k
    norms keep their inputs and rsqrts too (tests/worker/test_model_shapes.py); biases
    keep nothing.
    """
    targets = set(t.target_modules)
    q, kv, h, f = m.heads * m.hd, m.kv_heads * m.hd, m.hidden, m.intermediate
    elements = 2 * h + 2 + 2 * q + 2 * kv + m.heads + 3 * f + t.r * len(targets)
    elements += h if targets & {"q_proj", "k_proj", "v_proj"} else 0
    elements += h if targets & {"gate_proj", "up_proj"} else 0
    elements += f if "down_proj" in targets else 0
    if m.qk_norm:  # Qwen3: each q/k RMSNorm keeps its input and an rsqrt per head
        elements += q + kv + m.heads + m.kv_heads
    return _FP32 * elements


def memory_per_gpu(m: ModelShape, t: TrainingShape, n_gpus: int, *, accelerator: str,
                   offload: bool = False, trainer: str | None = None) -> MemoryBreakdown:
    """Bytes per GPU for ``n_gpus`` sharding the job (``offload``: weights on the host;
    ``trainer``: the family that runs it -- jax_lora adds its runtime on CPU and, on a
    4-bit base, the dequantized layer on every accelerator)."""
    if n_gpus < 1:
        raise EstimateError("n_gpus must be >= 1")
    jax_step = trainer == "jax_lora"
    kind = "cpu" if accelerator == "cpu" else "gpu"
    qb = quantized_bytes_per_param(t)
    # The torch trainer's NF4 statistics (absmax and code) are attributes of bitsandbytes'
    # quant state, not parameters: FSDP neither shards nor offloads them, so every rank
    # holds all of them on its device (trainers/fsdp_qlora/quantize.py). jax_lora's are
    # arrays of the train state, sharded like the codes.
    stats_per_param = qb - 0.5 if t.quantization == "nf4" and not jax_step else 0.0
    sharded_qb = qb - stats_per_param
    weights_total = m.linear_params * sharded_qb + m.embedding_params * t.compute_bytes
    quant_stats = int(m.linear_params * stats_per_param)
    layer_weights = m.linear_params_per_layer * sharded_qb
    lora = lora_params(m, t)
    # One layer's linear kernels in the compute dtype: what 4-bit matmuls materialise
    # (bitsandbytes per matmul, jax_lora per projection inside its custom_vjp).
    dequantized = m.linear_params_per_layer * t.compute_bytes if t.quantization != "none" else 0
    # jax_lora holds them live at its peak. Counted whole, not divided by n_gpus: the
    # worker's mesh has no tensor axis (tensor=1) and FSDP gathers whole kernels for the
    # matmul. The torch trainer's copies are already in its slack, calibrated against the
    # anchors.
    dequantized_live = dequantized if jax_step else 0
    weights_total += lora_params(m, t, frozen=True) * t.adapter_bytes
    weights = (0 if offload else int(weights_total / n_gpus)) + quant_stats
    # With more than one shard FSDP materialises a full layer while computing it (and
    # prefetches the next one); unsharded runs hold it already.
    gathered = int(2 * layer_weights) if n_gpus > 1 or offload else 0
    # The mesh has no tensor axis, so the rules leave the vocabulary unsharded and
    # jax_lora's step gathers the whole embedding table and LM head on every device.
    tables = m.vocab * m.hidden * (1 if m.tie_embeddings else 2)
    gathered_tables = tables * t.compute_bytes if jax_step and n_gpus > 1 else 0
    # The torch trainer's LM head is an FSDP group of its own, whole from its forward to
    # the end of its backward, beside its shard (a tied table stays in the root group,
    # whole all step). Counted on CPU, where the estimate is the live tensors; on GPUs the
    # slack calibrated against the published anchors covers it (counting it there too put
    # the Answer.AI 70B anchor 20.4 % over).
    if not jax_step and kind == "cpu" and n_gpus > 1:
        gathered_tables = m.vocab * m.hidden * t.compute_bytes
    # jax_lora's loss backward multiplies an fp32 cotangent by the 16-bit LM head, which
    # XLA upcasts: an fp32 copy of the whole head (on any backend; none in fp32 compute).
    head_fp32 = m.vocab * m.hidden * _FP32 if jax_step and t.compute_bytes < _FP32 else 0
    lora_b = lora * t.adapter_bytes
    lora_p = int(lora_b / n_gpus)
    grads = int(lora_b / n_gpus)
    optim = 0 if offload else int(2 * lora * _FP32 / n_gpus)
    per_layer = activation_bytes_per_layer(m, t)
    tokens = t.tokens_per_micro_batch
    # The layer being recomputed: its full set of saved tensors plus its gradient buffers;
    # in jax_lora's compiled step on an accelerator, what XLA's plan holds of them.
    recomputed = int((JAX_RECOMPUTED_LAYER if jax_step and kind == "gpu" else 2) * per_layer)
    if t.checkpointing and t.saves_dots:
        # each layer's matmul outputs are saved; one layer's elementwise work is recomputed.
        acts = m.layers * dots_bytes_per_layer(m, t) + recomputed
    elif t.checkpointing:
        # each layer's input is saved; one layer at a time is recomputed.
        acts = m.layers * tokens * m.hidden * t.compute_bytes + recomputed
    else:
        acts = m.layers * per_layer + per_layer
    # logits in the compute dtype, their fp32 upcast for the loss, and its fp32 gradient:
    # of the whole micro batch, or of one chunk of positions per row (jax_lora).
    loss_tokens = min(tokens, tokens // max(t.seq_len, 1) * JAX_LOSS_CHUNK) if jax_step else tokens
    logits = loss_tokens * m.vocab * (t.compute_bytes + _FP32 + _FP32)
    logits += head_fp32 + gathered_tables
    if jax_step and kind == "gpu":
        # The attention scores of the layer being computed (see ATTENTION_SCORE_BYTES):
        # transients of one layer at a time, with or without checkpointing, since the
        # trainer's blockwise attention keeps only O(seq) residuals per layer for the
        # backward pass (trainers/jax_lora/model.py ``attention``).
        scores = int(ATTENTION_SCORE_BYTES * m.heads * t.seq_len**2 * t.micro_batch * t.sequences_per_example)
        layer_transients = gathered + dequantized_live + scores
        if t.checkpointing:
            layer_transients += recomputed
        acts += scores
        # XLA assigns the step's buffers by liveness: the loss (gathered tables, logits,
        # the fp32 head) is done before the backward recomputes its first layer, so the
        # two phases' transients share memory and only the larger one counts. The loss
        # phase is shown in ``logits`` as far as it exceeds the layer phase.
        logits = max(0, logits - layer_transients)
    if t.objective in ("dpo", "reinforcement"):
        # The reference forward: one layer's intermediates and its logits with their fp32
        # log-softmax live at once, nothing kept for backward.
        acts += per_layer
        logits += loss_tokens * m.vocab * (t.compute_bytes + _FP32)
    live = weights + gathered + dequantized_live + lora_p + grads + optim + acts + logits
    # XLA plans jax_lora's collectives' buffers itself (they are the gathered terms above).
    buffers = FSDP_BUFFERS if n_gpus > 1 and not jax_step else 0
    if kind == "cpu" and jax_step:
        # jax_lora's live dequantized layer sits in the compiled step's own temp buffer,
        # which is not re-allocated per matmul, so the heap keeps no copies of it.
        slack = CPU_HEAP_RETAINED_LAYERS * per_layer
    elif kind == "cpu":
        # The torch trainer returns what it frees; live beside the counted tensors is the
        # one kernel bitsandbytes dequantizes for the running matmul (an MLP matrix).
        slack = m.hidden * m.intermediate * t.compute_bytes if t.quantization != "none" else 0
    else:
        slack = int((JAX_ALLOCATOR_SLACK if jax_step else ALLOCATOR_SLACK) * live)
    return MemoryBreakdown(
        weights=weights, gathered_layer=gathered, dequantized_layer=dequantized_live,
        lora_params=lora_p, lora_grads=grads, optimizer=optim, activations=acts, logits=logits,
        slack=slack + buffers,
        framework=FRAMEWORK_OVERHEAD[kind] + (JAX_CPU_RUNTIME_EXTRA if kind == "cpu" and jax_step else 0),
    )


def recomputed_fraction(m: ModelShape, trainer: str | None) -> float:
    """Share of a checkpointed layer's linear FLOPs that its backward recomputes.

    Torch's activation checkpointing reruns the whole layer. jax_lora's per-layer remat
    is differentiated by XLA, which recomputes only what the backward reads: o_proj's
    and down_proj's outputs feed nothing but residual adds, so those two matmuls are
    dropped from the recompute (XLA's plan of the 70B/405B steps: 2.65 passes, not 3).
    """
    if trainer != "jax_lora":
        return 1.0
    shapes = m.module_shapes()
    skipped = sum(math.prod(shapes[name]) for name in ("o_proj", "down_proj"))
    return 1 - skipped / m.linear_params_per_layer


def flops_per_token(m: ModelShape, t: TrainingShape, trainer: str | None = None) -> float:
    """Training FLOPs per token: forward 2P, input-grad backward 2P (the base is frozen,
    so no weight gradients), with checkpointing the decoder layers' recompute (the share
    ``recomputed_fraction`` of their 2P; the LM head is not checkpointed); plus attention
    scores (recomputed whole: the backward needs them)."""
    head = m.vocab * m.hidden
    # dots_saveable keeps every matmul's output: no linear FLOPs are recomputed.
    recompute = recomputed_fraction(m, trainer) if t.checkpointing and not t.saves_dots else 0.0
    attention = 2 * 2 * m.layers * t.seq_len * m.heads * m.hd  # QK^T and AV per token
    # A frozen parent adapter: a forward and an input-gradient backward, no weight gradient.
    frozen = 2 * lora_params(m, t, frozen=True)
    lora = 6 * lora_params(m, t) + 2 * frozen
    per_token = (2 + recompute) * 2 * m.linear_params + 2 * 2 * head
    per_token += (3 + (1 if t.checkpointing and not t.saves_dots else 0)) * attention + lora
    if t.objective == "dpo":
        # per planned token: two sequences, each also run once more through the reference
        # (a forward of the base: 2P, its attention, and the LoRA-free path).
        per_token = 2 * (per_token + 2 * (m.linear_params + head) + attention + frozen)
    elif t.objective == "reinforcement":
        # per planned token: each of the group's sequences trained and run through the
        # reference; the sampling's decoding steps are not counted.
        per_token = t.group_size * (per_token + 2 * (m.linear_params + head) + attention + frozen)
    return per_token


@dataclass(frozen=True)
class PoolEstimate:
    """The estimate of one job on one pool."""

    pool: str
    fits: bool
    gpus: int
    nodes: int
    offload: bool
    memory: MemoryBreakdown | None
    gpu_memory_bytes: int
    tokens_per_s: float
    eta_s: float | None
    cost: float | None
    trainer: str | None
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bytes_per_gpu(self) -> int | None:
        return self.memory.total if self.memory else None

    def for_tokens(self, total_tokens: int | None, price_per_gpu_hour: float) -> PoolEstimate:
        """This estimate for a job of ``total_tokens``: its ETA and cost (memory and
        throughput do not depend on the length of the job)."""
        if not self.fits:
            return self
        eta = total_tokens / self.tokens_per_s if total_tokens else None
        cost = eta / 3600 * self.gpus * price_per_gpu_hour if eta is not None else None
        return replace(self, eta_s=eta, cost=cost)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool, "fits": self.fits, "gpus": self.gpus, "nodes": self.nodes,
            "cpu_offload": self.offload, "trainer": self.trainer,
            "memory_per_gpu_bytes": self.bytes_per_gpu, "gpu_memory_bytes": self.gpu_memory_bytes,
            "memory_breakdown": None if self.memory is None else {
                k: getattr(self.memory, k) for k in (
                    "weights", "gathered_layer", "dequantized_layer", "lora_params", "lora_grads",
                    "optimizer", "activations", "logits", "slack", "framework")},
            "tokens_per_s": round(self.tokens_per_s, 1), "eta_s": self.eta_s,
            "cost": None if self.cost is None else round(self.cost, 4), "reasons": list(self.reasons),
        }


def tokens_per_second(m: ModelShape, t: TrainingShape, pool: NodePool, gpus: int, *, trainer: str,
                      offload: bool = False) -> float:
    """Training throughput of ``gpus`` GPUs of ``pool``: peak FLOP/s x assumed MFU / FLOPs per token."""
    mfu = MFU.get(trainer, 0.35) * (OFFLOAD_SLOWDOWN if offload else 1.0)
    return gpus * pool.peak_tflops * 1e12 * mfu / flops_per_token(m, t, trainer)



def candidate_gpu_counts(pool: NodePool) -> list[int]:
    """GPU counts a gang may have on a pool: powers of two within a node, then whole nodes."""
    counts: list[int] = []
    n = 1
    while n < pool.gpus_per_node:
        counts.append(n)
        n *= 2
    counts += [pool.gpus_per_node * k for k in range(1, pool.max_nodes_per_job + 1)]
    return counts


def estimate_on_pool(m: ModelShape, t: TrainingShape, pool: NodePool, *, trainer: str | None = None,
                     total_tokens: int | None = None, gpus: int | None = None) -> PoolEstimate:
    """Smallest GPU count of ``pool`` that holds the job (or check a pinned ``gpus``)."""
    trainer = trainer or pool.preferred_trainer()
    if pool.is_cpu:
        # What a CPU pool really runs (worker.spec_builder): fp32, no activation checkpointing.
        t = replace(t, compute_bytes=_FP32, checkpointing=False)
    budget = int(pool.gpu_memory_bytes * HEADROOM)
    counts = [gpus] if gpus is not None else candidate_gpu_counts(pool)
    offload_options = {"never": [False], "auto": [False, True], "always": [True]}[t.cpu_offload]
    if pool.is_cpu or trainer != "fsdp_qlora":
        # FSDP's CPU offload needs a CUDA/ROCm device (on CPU it fails with "Cannot access
        # accelerator device"), and only the torch trainer has it.
        offload_options = [o for o in offload_options if not o]
    best: tuple[int, bool, MemoryBreakdown] | None = None
    smallest: MemoryBreakdown | None = None
    for n in counts:
        for off in offload_options:
            mem = memory_per_gpu(m, t, n, accelerator=pool.accelerator, offload=off, trainer=trainer)
            if smallest is None or mem.total < smallest.total:
                smallest = mem
            if mem.total <= budget:
                best = (n, off, mem)
                break
        if best:
            break
    if best is None:
        need = smallest.total if smallest else 0
        top = counts[-1] if counts else 0
        return PoolEstimate(
            pool=pool.name, fits=False, gpus=top, nodes=math.ceil(top / pool.gpus_per_node),
            offload=False, memory=smallest, gpu_memory_bytes=pool.gpu_memory_bytes,
            tokens_per_s=0.0, eta_s=None, cost=None, trainer=trainer,
            reasons=((f"needs {need / GIB:.1f} GiB per GPU even on {top}x {pool.accelerator}; "
                      f"{pool.gpu_memory_gib:.3g} GiB available ({HEADROOM:.0%} usable)"),),
        )
    n, off, mem = best
    tps = tokens_per_second(m, t, pool, n, trainer=trainer, offload=off)
    reasons = [f"{n}x {pool.accelerator}: {mem.total / GIB:.1f} of {pool.gpu_memory_gib:.3g} GiB per GPU"]
    if off:
        reasons.append("CPU offload of sharded weights needed to fit")
    return PoolEstimate(
        pool=pool.name, fits=True, gpus=n, nodes=math.ceil(n / pool.gpus_per_node), offload=off,
        memory=mem, gpu_memory_bytes=pool.gpu_memory_bytes, tokens_per_s=tps, eta_s=None,
        cost=None, trainer=trainer, reasons=tuple(reasons),
    ).for_tokens(total_tokens, pool.price_per_gpu_hour)
