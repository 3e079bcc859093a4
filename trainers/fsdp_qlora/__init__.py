"""PyTorch trainer: transformers + peft LoRA (``recipe.py``), extended by FSDP2 and 4-bit
(bitsandbytes NF4 / HQQ) quantized bases for consumer GPUs. Imports nothing at package
level so ``python -m trainers`` stays cheap until this recipe is chosen."""
