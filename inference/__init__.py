"""The embedded inference worker: OpenAI-style completions on base models and their
fine-tuned LoRA adapters.

A separate process (``tunefleet inference``, started by ``tunefleet serve``) that keeps
each base model loaded once and switches adapters per request (``engine``), serving the
API over a local HTTP channel with a shared secret (``protocol``, ``server``). The API
reaches it only through ``client``; this package imports neither ``api`` nor ``worker``:
the API resolves what a tenant may use into paths, the worker only loads and generates.
"""
