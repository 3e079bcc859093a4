"""PyTorch trainer: LoRA on transformers' Llama (``recipe.py``, one rank's run), for 1 or N
processes (FSDP2; ``launch.py`` starts the ranks) and for full-precision or 4-bit
(bitsandbytes NF4 / HQQ) bases. Imports nothing at package level so ``python -m
trainers`` stays cheap until this recipe is chosen."""
