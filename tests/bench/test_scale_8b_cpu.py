"""bench/scale_8b_cpu.py's checkpoint writer, on a tiny shape: the tensors it lists are
transformers' own, and what it writes is a sharded checkpoint transformers loads whole."""

from __future__ import annotations

import json

import torch

from bench import scale_8b_cpu as bench

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 300}


def tiny_config() -> dict:
    config = bench.model_config(TINY["num_hidden_layers"])
    config.update(TINY)
    return config


def test_tensor_shapes_are_transformers_llama_state_dict():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**tiny_config()))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert dict(bench.tensor_shapes(tiny_config())) == expected


def test_plan_shards_keeps_order_and_size_limit():
    shapes = bench.tensor_shapes(tiny_config())
    limit = 40_000  # bytes: smaller than the embedding (300 x 64 x 2), larger than a layer's matrices
    shards = bench.plan_shards(shapes, limit)
    assert [t for shard in shards for t in shard] == shapes
    assert len(shards) > 2
    for shard in shards:
        size = sum(2 * bench._numel(s) for _, s in shard)
        assert size <= limit or len(shard) == 1


def test_written_checkpoint_loads_in_transformers_with_its_random_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = bench.write_random_checkpoint(tmp_path / "model", tiny_config(), shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    state = model.state_dict()
    names = [name for name, _ in bench.tensor_shapes(tiny_config())]
    assert set(state) == set(names)
    for seed, (name, shape) in enumerate(bench.tensor_shapes(tiny_config())):
        assert torch.equal(state[name], bench.random_tensor(name, shape, seed)), name
    q = state["model.layers.1.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - bench.INIT_STD) < 2e-3
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.pad_token_id == model.config.pad_token_id and tok.bos_token_id == model.config.bos_token_id
    # A second call finds the finished checkpoint and writes nothing.
    before = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    bench.write_random_checkpoint(out, tiny_config(), shard_bytes=40_000)
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == before
