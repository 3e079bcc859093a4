"""The tiny offline Llama + tokenizer: deterministic, loadable, chat template works."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers.common.tiny_model import TOKENIZER_VOCAB_SIZE, build_tiny_llama


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_model_dir):
    again = build_tiny_llama(tmp_path / "again", seed=0)
    other = build_tiny_llama(tmp_path / "other", seed=1)
    assert _sha(again / "model.safetensors") == _sha(tiny_model_dir / "model.safetensors")
    assert _sha(other / "model.safetensors") != _sha(tiny_model_dir / "model.safetensors")


def test_tokenizer_is_byte_level_with_chat_template(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    text = "héllo 🙂 \n\t{}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # id == byte value
    assert tok.decode(ids) == text
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
    )
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|eot_id|>")


def test_sharded_checkpoint_loads_same_weights_with_rope_scaling(tmp_path, tiny_model_dir):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    sharded = build_tiny_llama(tmp_path / "sharded", max_shard_size="50KB", rope_scaling=rope)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    b = AutoModelForCausalLM.from_pretrained(str(sharded))
    assert b.config.rope_parameters["rope_type"] == "llama3"
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_bf16_and_bad_arguments(tmp_path):
    d = build_tiny_llama(tmp_path / "bf16", dtype="bfloat16", hidden_size=32, intermediate_size=64)
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype="auto")
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        build_tiny_llama(tmp_path / "x", vocab_size=100)
    with pytest.raises(ValueError):
        build_tiny_llama(tmp_path / "y", dtype="int8")
    assert AutoTokenizer.from_pretrained(str(d)).pad_token == "<|pad|>"


def test_chat_template_renders_tools_calls_and_results_like_llama_3_1(tiny_tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
        {"role": "assistant", "content": "Two calls:", "tool_calls": [call, {**call, "function": {
            "name": "get_time", "arguments": '{"tz": "CET"}'}}]},  # arguments may also be JSON text
    ]
    rendered = tiny_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nYou help.\n\n"
        'To call a function, answer with only a JSON object {"name": function name, "parameters": '
        "object of its arguments}. The functions:\n"
        '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}<|eot_id|>'
        "<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n21<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nTwo calls:\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
        '{"name": "get_time", "parameters": {"tz": "CET"}}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # without a system message the tools still get their own system header; no tools, no header
    bare = tiny_tokenizer.apply_chat_template(msgs[1:2], tools=tools, tokenize=False)
    assert bare.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Environment: ipython\n\nTo call")
    assert "ipython" not in tiny_tokenizer.apply_chat_template(msgs[:2], tokenize=False)


def test_refresh_rewrites_an_outdated_chat_template_only(tmp_path):
    from trainers.common.tiny_model import (
        CHAT_TEMPLATE,
        build_tiny_tokenizer,
        refresh_tiny_tokenizer,
    )

    build_tiny_tokenizer(tmp_path)
    assert refresh_tiny_tokenizer(tmp_path) is False
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}old", encoding="utf-8")
    assert refresh_tiny_tokenizer(tmp_path) is True
    assert AutoTokenizer.from_pretrained(str(tmp_path)).chat_template == CHAT_TEMPLATE
    assert refresh_tiny_tokenizer(tmp_path) is False
