"""OpenAI-compatible completions on base and fine-tuned models: routes, the
local inference worker's client side, the vLLM proxy, schemas.
"""
