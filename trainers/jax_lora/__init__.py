"""JAX LoRA trainer for AMD MI300X pools: Llama 3.x in pure JAX, logical-axis sharding on a
(data, fsdp, tensor) device mesh, tensor-by-tensor HF loading, LoRA with gradients for the
adapter only, one jitted train step, resumable checkpoints and PEFT-format export.

Entry point: ``trainers.jax_lora.recipe:JaxLoraRecipe`` (driven by ``python -m trainers``).
Importing this package does not import jax, so ``trainers`` stays importable without it.
"""
