"""Models: the base-model registry, fine-tuned models, admin registration of base
models (local or Hugging Face Hub), their routes and schemas.
"""
