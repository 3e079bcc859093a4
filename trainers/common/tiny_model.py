"""Build tiny random Llama checkpoints in Hugging Face format, fully offline.

There is no model hub here, so tests, benchmarks and the service's demo model all use a
small random-init Llama built by this module: ``config.json`` + safetensors weights
written by ``transformers``' ``save_pretrained`` (optionally sharded, to exercise the
sharded-index path of loaders), and a tokenizer built locally with the ``tokenizers``
library and saved as a ``PreTrainedTokenizerFast``:

- byte level: every one of the 256 bytes is a token (ids 0-255), so any UTF-8 text
  encodes without unknown tokens and decodes back exactly;
- special tokens (ids 256..): ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos),
  ``<|pad|>`` (pad), ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``;
- a Llama-3-style Jinja ``chat_template`` that also renders tools, tool calls and tool
  results the way Llama 3.1's does, so ``AutoTokenizer.from_pretrained(dir)`` and
  ``apply_chat_template(messages, tools=...)`` work as with a real instruct model.

The weights are deterministic given ``seed`` (``torch.manual_seed`` before init), so two
builds with the same arguments are bitwise identical. Imports torch/transformers lazily:
importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, START_HEADER, END_HEADER, EOT)
N_BYTE_TOKENS = 256
TOKENIZER_VOCAB_SIZE = N_BYTE_TOKENS + len(SPECIAL_TOKENS)

# Llama 3 layout: bos, then per turn "<|start_header_id|>role<|end_header_id|>\n\n
# content<|eot_id|>"; the generation prompt opens an assistant header. Tools work as in
# Llama 3.1's template: with ``tools`` the system header (merged with a leading system
# message) says "Environment: ipython", how to call a function and lists each tool as
# JSON; an assistant tool call is the JSON object {"name": ..., "parameters": {...}} (one
# per line after any text); a tool result is an ``ipython`` turn. An assistant turn's
# text, calls and <|eot_id|> sit in a {% generation %} block, so that transformers'
# ``return_assistant_tokens_mask`` marks them (what TRL's assistant-only loss reads).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set rest = messages %}"
    "{% if tools %}"
    "{% set system = '' %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set rest = messages[1:] %}"
    "{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n' + system }}"
    "{{ 'To call a function, answer with only a JSON object {\"name\": function name, "
    "\"parameters\": object of its arguments}. The functions:' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in rest %}"
    "{% set role = 'ipython' if message['role'] in ('tool', 'ipython') else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% set body %}"
    "{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '{\"name\": ' + (fn['name'] | tojson) + ', \"parameters\": ' + args + '}' }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endset %}"
    "{% if role == 'assistant' %}{% generation %}{{ body }}{% endgeneration %}{% else %}{{ body }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_DTYPES = ("float32", "bfloat16", "float16")


def build_tiny_tokenizer(out_dir: str | Path) -> Any:
    """Build the byte-level tokenizer with special tokens and chat template, save it to
    ``out_dir`` and return it (a ``transformers.PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Byte-level's printable stand-ins, ordered by the byte they encode, so id == byte value.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(N_BYTE_TOKENS)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def refresh_tiny_tokenizer(model_dir: str | Path) -> bool:
    """Rewrite a built tiny model's tokenizer if its chat template is not today's.

    A model directory built by an older release keeps the template it was built with
    (one that may not render tools); the weights stay, only the tokenizer files are
    written again. Returns True if they were.
    """
    saved = Path(model_dir) / "chat_template.jinja"
    if saved.exists() and saved.read_text(encoding="utf-8") == CHAT_TEMPLATE:
        return False
    build_tiny_tokenizer(model_dir)
    return True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (what the ByteLevel pre-tokenizer emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | int | None = None,
) -> Path:
    """Save a random-init Llama and its tokenizer as a Hugging Face checkpoint.

    Args:
        out_dir: directory to write (created if missing).
        vocab_size: model vocabulary; None = the tokenizer's size (262). Must be at least
            the tokenizer's size (larger leaves unused rows, like real padded vocabularies).
        rope_scaling: e.g. ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}``; stored in
            ``config.json`` as transformers 5's ``rope_parameters`` (with ``rope_theta``).
        seed: weights are a deterministic function of the arguments and this seed.
        dtype: dtype of the saved weights: float32, bfloat16 or float16.
        max_shard_size: e.g. ``"50KB"``: write sharded safetensors + an index file.

    Returns:
        ``out_dir`` as a Path.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if vocab_size is None:
        vocab_size = TOKENIZER_VOCAB_SIZE
    if vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {TOKENIZER_VOCAB_SIZE} (the tokenizer's size)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out)

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters.update(rope_scaling)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT)],
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; that is what the tests want (a loss that
    # can fall visibly within a few LoRA steps).
    model = model.to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    return out

