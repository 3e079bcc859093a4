"""Estimator parts checked against the libraries that define them.

Storage per quantized weight against bitsandbytes' and HQQ's own quantizers; parameter
counts against a transformers Llama built on the meta device; LoRA parameter counts
against peft. Then the fitting rules (smallest GPU count, headroom, offload).
"""

from dataclasses import replace

import pytest
import torch

from scheduling.estimator import (
    ALLOCATOR_SLACK,
    CPU_HEAP_RETAINED_LAYERS,
    FSDP_BUFFERS,
    HEADROOM,
    JAX_ALLOCATOR_SLACK,
    JAX_CPU_RUNTIME_EXTRA,
    EstimateError,
    ModelShape,
    TrainingShape,
    activation_bytes_per_layer,
    candidate_gpu_counts,
    estimate_on_pool,
    lora_params,
    memory_per_gpu,
    quantized_bytes_per_param,
    recomputed_fraction,
)
from scheduling.model_files import base_model_shape
from scheduling.model_shapes import KNOWN_MODELS
from tests.worker.builders import mi300x, rtx4090

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _bnb_bytes_per_param(double_quant: bool) -> float:
    import bitsandbytes.functional as F

    w = torch.randn(512, 1024, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    total = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
    if state.nested:
        total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total / w.numel()


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_storage_matches_bitsandbytes(double_quant):
    ours = quantized_bytes_per_param(TrainingShape(method="qlora", quantization="nf4", double_quant=double_quant))
    assert ours == pytest.approx(_bnb_bytes_per_param(double_quant), rel=1e-3)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_hqq_storage_matches_hqq(group):
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    lin = torch.nn.Linear(512, 256, bias=False)
    q = HQQLinear(lin, BaseQuantizeConfig(nbits=4, group_size=group), compute_dtype=torch.bfloat16, device="cpu")
    total = q.W_q.numel() * q.W_q.element_size() + sum(
        q.meta[k].numel() * q.meta[k].element_size() for k in ("scale", "zero"))
    ours = quantized_bytes_per_param(TrainingShape(method="qlora", quantization="hqq4", hqq_group_size=group))
    assert ours == pytest.approx(total / (512 * 256), rel=1e-6)


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3.1-8b", "llama-3.1-70b"])
def test_param_count_matches_transformers(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = KNOWN_MODELS[name]
    cfg = LlamaConfig(hidden_size=m.hidden, num_hidden_layers=m.layers, num_attention_heads=m.heads,
                      num_key_value_heads=m.kv_heads, intermediate_size=m.intermediate, vocab_size=m.vocab)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert m.params == sum(p.numel() for p in model.parameters())
    parsed = ModelShape.from_hf_config(cfg.to_dict())
    assert (parsed.params, parsed.hd, parsed.kv_heads) == (m.params, m.hd, m.kv_heads)


def test_lora_param_count_matches_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=list(ALL)))
    trainable, _ = model.get_nb_trainable_parameters()
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert lora_params(shape, TrainingShape(r=4, target_modules=ALL)) == trainable


def test_a_parent_adapter_is_counted_as_frozen_weights_as_peft_builds_it():
    """A job that continues a fine-tuned model holds that model's adapter beside its own, as a
    second peft adapter: its parameters are weights (fp32), with no gradient or AdamW state."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256)
    parent_modules = ("q_proj", "v_proj", "up_proj")
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=list(ALL)))
    model.add_adapter("parent", LoraConfig(r=3, target_modules=list(parent_modules)))
    frozen = sum(p.numel() for name, p in model.named_parameters() if ".parent." in name)
    shape = ModelShape.from_hf_config(cfg.to_dict())
    child = TrainingShape(r=4, target_modules=ALL, frozen_r=3, frozen_target_modules=parent_modules)
    assert lora_params(shape, child, frozen=True) == frozen
    alone = memory_per_gpu(shape, replace(child, frozen_r=0, frozen_target_modules=()), 1, accelerator="gpu")
    stacked = memory_per_gpu(shape, child, 1, accelerator="gpu")
    assert stacked.weights - alone.weights == 4 * frozen
    assert (stacked.lora_params, stacked.lora_grads, stacked.optimizer) == (
        alone.lora_params, alone.lora_grads, alone.optimizer)


def _tiny_peft_llama(kv_heads: int, targets: tuple[str, ...]):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                      intermediate_size=160, vocab_size=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=list(targets)))
    model.train()
    return model, ModelShape.from_hf_config(cfg.to_dict())


def _bytes_layer_1_saves(model, ids) -> int:
    """Every distinct storage autograd saves while decoder layer 1 runs on ``ids``, less
    parameters and RoPE's cos/sin (allocated once per forward and shared by all layers)."""
    layer = model.base_model.model.model.layers[1]
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = []

    def note_inputs(_module, args, kwargs):
        excluded.update(t.untyped_storage().data_ptr() for t in kwargs["position_embeddings"])
        inside.append(True)

    def pack(t):
        if inside and t.untyped_storage().data_ptr() not in excluded:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = [layer.register_forward_pre_hook(note_inputs, with_kwargs=True),
             layer.register_forward_hook(lambda *_: inside.clear())]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    for hook in hooks:
        hook.remove()
    return sum(saved.values())


@pytest.mark.parametrize("kv_heads, targets", [(2, ("q_proj", "k_proj", "v_proj", "o_proj")), (4, ALL)])
def test_fp32_saved_activations_match_transformers_and_peft(kv_heads, targets):
    """Bytes one decoder layer saves for backward in fp32, against autograd's own count."""
    batch, seq = 2, 48
    model, shape = _tiny_peft_llama(kv_heads, targets)
    ids = torch.randint(0, 256, (batch, seq))
    training = TrainingShape(r=4, target_modules=targets, seq_len=seq, micro_batch=batch, compute_bytes=4)
    assert activation_bytes_per_layer(shape, training) == _bytes_layer_1_saves(model, ids)


def test_dpo_saves_two_sequences_per_example():
    """A DPO micro batch of ``batch`` pairs runs chosen and rejected as one batch of
    2 x ``batch`` sequences: what autograd saves is the estimator's DPO figure."""
    batch, seq = 2, 32
    model, shape = _tiny_peft_llama(2, ALL)
    chosen, rejected = torch.randint(0, 256, (batch, seq)), torch.randint(0, 256, (batch, seq))
    pairs = torch.cat([chosen, rejected])
    dpo = TrainingShape(r=4, target_modules=ALL, seq_len=seq, micro_batch=batch, compute_bytes=4, objective="dpo")
    assert activation_bytes_per_layer(shape, dpo) == _bytes_layer_1_saves(model, pairs)
    assert activation_bytes_per_layer(shape, dpo) == 2 * activation_bytes_per_layer(
        shape, replace(dpo, objective="supervised"))


def test_bad_inputs_have_codes():
    with pytest.raises(EstimateError) as e:
        ModelShape.from_hf_config({"hidden_size": 8})
    assert e.value.code == "invalid_model_config"
    with pytest.raises(EstimateError) as e:
        TrainingShape(method="qlora")
    assert e.value.code == "invalid_adapter"
    with pytest.raises(EstimateError):
        lora_params(KNOWN_MODELS["llama-2-7b"], TrainingShape(target_modules=("lm_head",)))


def test_more_gpus_means_less_memory_each_and_checkpointing_saves_activations():
    m = KNOWN_MODELS["llama-3.1-70b"]
    t = TrainingShape(method="qlora", quantization="nf4", seq_len=4096)
    per = [memory_per_gpu(m, t, n, accelerator="gpu").total for n in (2, 4, 8)]
    assert per[0] > per[1] > per[2]
    no_ckpt = TrainingShape(method="qlora", quantization="nf4", seq_len=4096, checkpointing=False)
    assert (memory_per_gpu(m, no_ckpt, 8, accelerator="gpu").activations
            > 5 * memory_per_gpu(m, t, 8, accelerator="gpu").activations)


# (job, pool, expected GPUs, expected offload) -- the smallest count that fits in HEADROOM.
TABLE = [
    ("7b qlora on 4090", KNOWN_MODELS["llama-2-7b"],
     TrainingShape(method="qlora", quantization="nf4"), rtx4090(), 1, False),
    ("8b lora on 4090", KNOWN_MODELS["llama-3.1-8b"],
     TrainingShape(method="lora", seq_len=1024), rtx4090(), 1, False),
    ("8b lora 4k ctx on 4090 (offload)", KNOWN_MODELS["llama-3.1-8b"],
     TrainingShape(method="lora", seq_len=4096), rtx4090(), 1, True),
    ("8b lora 4k ctx on 4090 (no offload)", KNOWN_MODELS["llama-3.1-8b"],
     TrainingShape(method="lora", seq_len=4096, cpu_offload="never"), rtx4090(), 2, False),
    ("70b qlora on 4090 (no offload; Answer.AI: 4x A5000 24GB)", KNOWN_MODELS["llama-2-70b"],
     TrainingShape(method="qlora", quantization="nf4", seq_len=512, cpu_offload="never"), rtx4090(), 4, False),
    ("70b qlora on 4090 (offload allowed)", KNOWN_MODELS["llama-2-70b"],
     TrainingShape(method="qlora", quantization="nf4", seq_len=512), rtx4090(), 1, True),
    ("70b lora on mi300x", KNOWN_MODELS["llama-3.1-70b"],
     TrainingShape(method="lora"), mi300x(), 1, False),
    ("405b lora on mi300x", KNOWN_MODELS["llama-3.1-405b"],
     TrainingShape(method="lora"), mi300x(), 8, False),
    ("70b nf4 qlora on mi300x (jax_lora)", KNOWN_MODELS["llama-3.1-70b"],
     TrainingShape(method="qlora", quantization="nf4"), mi300x(), 1, False),
]


@pytest.mark.parametrize("name, model, training, pool, gpus, offload", TABLE, ids=[t[0] for t in TABLE])
def test_smallest_fitting_gpu_count(name, model, training, pool, gpus, offload):
    est = estimate_on_pool(model, training, pool, total_tokens=1_000_000)
    print(f"{name}: {est.gpus} GPUs, {est.bytes_per_gpu / 2**30:.1f} GiB/GPU, {est.tokens_per_s:.0f} tok/s, "
          f"${est.cost:.2f}")
    assert est.fits and (est.gpus, est.offload) == (gpus, offload)
    assert est.bytes_per_gpu <= HEADROOM * pool.gpu_memory_bytes
    if gpus > 1:  # one step smaller would not fit
        smaller = candidate_gpu_counts(pool)[candidate_gpu_counts(pool).index(gpus) - 1]
        assert (memory_per_gpu(model, training, smaller, accelerator=pool.accelerator).total
                > HEADROOM * pool.gpu_memory_bytes)
    assert est.eta_s == pytest.approx(1_000_000 / est.tokens_per_s)
    assert est.cost == pytest.approx(est.eta_s / 3600 * gpus * pool.price_per_gpu_hour)


def test_8k_context_8b_lora_does_not_fit_4090s_without_offload():
    # the logits of a 128k vocabulary at 8k tokens alone take ~10 GB on every GPU
    est = estimate_on_pool(KNOWN_MODELS["llama-3.1-8b"],
                           TrainingShape(method="lora", seq_len=8192, cpu_offload="never"), rtx4090())
    assert not est.fits and est.memory.logits > 9e9


def test_405b_does_not_fit_4090s_and_says_why():
    est = estimate_on_pool(KNOWN_MODELS["llama-3.1-405b"], TrainingShape(method="lora"), rtx4090())
    assert not est.fits
    assert "per GPU even on 8x nvidia-rtx-4090" in est.reasons[0]


def test_offload_only_on_gpu_torch_pools():
    m = KNOWN_MODELS["llama-3.1-70b"]
    t = TrainingShape(method="qlora", quantization="nf4", seq_len=2048, cpu_offload="always")
    assert estimate_on_pool(m, t, rtx4090()).offload
    assert not estimate_on_pool(m, TrainingShape(method="lora", cpu_offload="always"), mi300x()).fits


def test_jax_lora_on_nf4_holds_one_dequantized_layer():
    """jax_lora dequantizes each projection's kernel to the compute dtype in the step: one
    layer's linear weights, whole on every shard (no tensor-parallel split). The torch
    trainer's figure (calibrated against the anchors) is unchanged by the trainer argument."""
    m, t = KNOWN_MODELS["llama-3.1-70b"], TrainingShape(method="qlora", quantization="nf4")
    layer = m.linear_params_per_layer * 2  # bf16
    for n in (1, 8):
        jax = memory_per_gpu(m, t, n, accelerator="amd-mi300x", trainer="jax_lora")
        torch_ = memory_per_gpu(m, t, n, accelerator="amd-mi300x", trainer="fsdp_qlora")
        assert torch_ == memory_per_gpu(m, t, n, accelerator="amd-mi300x")
        assert (jax.dequantized_layer, torch_.dequantized_layer) == (layer, 0)
        # XLA plans the step's buffers (its collectives' too): a smaller slack, no FSDP buffers.
        assert jax.slack == pytest.approx(JAX_ALLOCATOR_SLACK * (jax.total - jax.slack - jax.framework), abs=2)
        buffers = FSDP_BUFFERS if n > 1 else 0
        assert torch_.slack - buffers == pytest.approx(
            ALLOCATOR_SLACK * (torch_.total - torch_.slack - torch_.framework), abs=2)
    # Nothing to dequantize on a bf16 base.
    lora = TrainingShape(method="lora")
    assert memory_per_gpu(m, lora, 8, accelerator="amd-mi300x", trainer="jax_lora").dequantized_layer == 0
    # On CPU (fp32): jax_lora holds the live layer in its step's buffer and glibc's heap
    # keeps some of its runtime's transients; the torch trainer returns what it frees, and
    # holds beside its counted tensors the one MLP kernel bitsandbytes dequantizes.
    cpu_t = replace(t, compute_bytes=4, checkpointing=False)
    jax = memory_per_gpu(m, cpu_t, 1, accelerator="cpu", trainer="jax_lora")
    torch_ = memory_per_gpu(m, cpu_t, 1, accelerator="cpu", trainer="fsdp_qlora")
    activations = activation_bytes_per_layer(m, cpu_t)
    kernel = m.hidden * m.intermediate * 4
    assert jax.dequantized_layer == 2 * layer
    assert torch_.slack == kernel
    assert jax.slack == CPU_HEAP_RETAINED_LAYERS * activations
    # and its loss holds one chunk of 32 positions' logits, not the micro batch's 2048
    assert (torch_.logits, jax.logits) == (2048 * m.vocab * 12, 32 * m.vocab * 12)
    assert jax.total - torch_.total == (2 * layer + JAX_CPU_RUNTIME_EXTRA + jax.slack - kernel
                                        + jax.logits - torch_.logits)
    # A bf16 base has no kernel to dequantize.
    assert memory_per_gpu(m, replace(cpu_t, method="lora", quantization="none"), 1, accelerator="cpu",
                          trainer="fsdp_qlora").slack == 0


# (job, pool, GPUs for SFT, GPUs for DPO) -- the same job as SFT and as DPO. DPO's micro
# batch holds the preferred and the rejected answer (twice the saved activations and
# logits) plus the reference forward's transients (one layer's intermediates, logits and
# their fp32 log-softmax); weights, adapter and optimizer state are the same. Where
# activations dominate, DPO needs more GPUs.
SFT_VS_DPO = [
    ("7b qlora on 4090", KNOWN_MODELS["llama-2-7b"],
     TrainingShape(method="qlora", quantization="nf4"), rtx4090(), 1, 1),
    ("8b lora 1k ctx on 4090", KNOWN_MODELS["llama-3.1-8b"],
     TrainingShape(method="lora", seq_len=1024, cpu_offload="never"), rtx4090(), 1, 2),
    ("8b lora 2k ctx on 4090", KNOWN_MODELS["llama-3.1-8b"],
     TrainingShape(method="lora", seq_len=2048, cpu_offload="never"), rtx4090(), 2, 4),
    # jax_lora: one MI300X holds both (XLA reuses the loss's buffers for the layer's).
    ("70b lora on mi300x", KNOWN_MODELS["llama-3.1-70b"],
     TrainingShape(method="lora"), mi300x(), 1, 1),
    ("405b lora on mi300x", KNOWN_MODELS["llama-3.1-405b"],
     TrainingShape(method="lora"), mi300x(), 8, 8),
]


@pytest.mark.parametrize("name, model, training, pool, sft_gpus, dpo_gpus", SFT_VS_DPO, ids=[t[0] for t in SFT_VS_DPO])
def test_dpo_needs_what_its_extra_activations_take(name, model, training, pool, sft_gpus, dpo_gpus):
    dpo_training = replace(training, objective="dpo")
    sft = estimate_on_pool(model, training, pool, total_tokens=1_000_000)
    dpo = estimate_on_pool(model, dpo_training, pool, total_tokens=1_000_000)
    assert (sft.gpus, dpo.gpus) == (sft_gpus, dpo_gpus) and sft.fits and dpo.fits
    assert dpo.bytes_per_gpu <= HEADROOM * pool.gpu_memory_bytes
    # On the same GPU count: everything but activations and logits is unchanged.
    a = memory_per_gpu(model, training, dpo_gpus, accelerator=pool.accelerator)
    b = memory_per_gpu(model, dpo_training, dpo_gpus, accelerator=pool.accelerator)
    for part in ("weights", "gathered_layer", "lora_params", "lora_grads", "optimizer", "framework"):
        assert getattr(a, part) == getattr(b, part), part
    doubled = memory_per_gpu(model, replace(training, micro_batch=2 * training.micro_batch), dpo_gpus,
                             accelerator=pool.accelerator)
    per_layer = activation_bytes_per_layer(model, dpo_training)
    assert b.activations == doubled.activations + per_layer
    tokens = 2 * training.seq_len * training.micro_batch
    assert b.logits == doubled.logits + tokens * model.vocab * (training.compute_bytes + 4)
    # Speed: each planned token is two sequences, each trained and run once more through
    # the reference (2 x (p + 1) passes against p = 2 + the recomputed share with
    # checkpointing, less attention/LoRA).
    if sft.gpus == dpo.gpus:
        passes = 2 + recomputed_fraction(model, sft.trainer)
        assert 2.5 < dpo.eta_s / sft.eta_s < 2 * (passes + 1) / passes


def test_a_local_model_without_its_files_gets_no_guessed_shape(tmp_path):
    """Only an s3:// model (whose files are the trainer's to find) falls back to the known
    model nearest its params_b; a local one without its directory or config.json is an
    error, whatever params_b it declares."""
    (tmp_path / "no-config").mkdir()
    for path, missing in ((tmp_path / "gone", "does not exist"), (tmp_path / "no-config", "has no config.json")):
        with pytest.raises(EstimateError, match=missing) as caught:
            base_model_shape(str(path), 7.0, model_id="m")
        assert caught.value.code == "model_unavailable"
    shape, source = base_model_shape("s3://models/llama-2-7b", 6.7, model_id="m")
    assert shape == KNOWN_MODELS["llama-2-7b"] and source.startswith("nearest known model")
