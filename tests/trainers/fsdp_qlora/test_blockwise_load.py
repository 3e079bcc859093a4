"""Block-wise loading: rank 0 reads, casts and scatters each tensor in row blocks.

The values must be Hugging Face's own load of the same checkpoint (``from_pretrained``,
plain or with ``BitsAndBytesConfig`` NF4) for 1 and 2 processes, with a block budget far
below a shard (many rounds, padded last rounds) and a vocabulary (263) that 2 ranks
cannot split evenly; FSDP2 parameters whose dim 0 leaves the last rank one row or none
must come out whole. And the point of it: a load must not hold a whole large tensor
(an embedding or LM head) beyond the loaded share; the heap's peak is measured with
glibc's counters after every torch op (``load_worker.HeapPeak``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from trainers.common.hf_checkpoint import read_checkpoint_index
from trainers.fsdp_qlora import loading
from trainers.fsdp_qlora.distributed import DistContext, launch_local

from .load_worker import (
    EDGE_SHAPES,
    LOAD_CASES,
    PEAK_BLOCK_BYTES,
    TINY_BLOCK_BYTES,
    HeapPeak,
    load_state,
)
from .reference import hf_model

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
WORKER = str(Path(__file__).with_name("load_worker.py"))


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory) -> Path:
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("odd-vocab"), vocab_size=263, seed=5, max_shard_size="40KB")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """Embedding and LM head (4096 x 256 fp32: 4 MiB each) much larger than its one
    decoder layer (1.5 MiB), as in a Llama-3-8B (1 GiB each against 416 MiB)."""
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("wide"), hidden_size=256, num_layers=1, num_heads=4,
                            num_kv_heads=2, intermediate_size=256, vocab_size=4096, seed=6)


@pytest.fixture(scope="module")
def two_ranks(odd_model_dir, wide_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("blockwise")
    argv = [sys.executable, WORKER, "--model", str(odd_model_dir), "--wide", str(wide_model_dir),
            "--out", str(out)]
    rc = launch_local(argv, 2, on_cpu=True)
    assert rc == 0, f"worker failed with exit code {rc}"
    return out, json.loads((out / "result.json").read_text())


def _hugging_face_state(model_dir: Path, quant: str, dtype: str) -> dict[str, torch.Tensor]:
    """Hugging Face's load, in the loader's terms: full values by checkpoint name; for
    NF4 the packed bytes (as uint8) and each layer's absmax."""
    if quant == "nf4":
        model = hf_model(model_dir, "nf4")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    out = {name: p.detach() for name, p in model.named_parameters()}
    for name, m in model.named_modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is not None:
            out[f"{name}.weight"] = m.weight.data.view(torch.uint8).reshape(-1)
            out[f"{name}.absmax"] = state.absmax
    return out


def _assert_same_as_hugging_face(got: dict[str, torch.Tensor], model_dir: Path, quant: str, dtype: str) -> None:
    want = _hugging_face_state(model_dir, quant, dtype)
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        if w.dtype == torch.uint8:  # packed NF4 codes, stored by the loader viewed as a float dtype
            g = g.view(torch.uint8).reshape(-1)
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), name
    if quant == "nf4":
        assert any(name.endswith(".absmax") for name in want)


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_single_process_block_load_equals_hugging_face(odd_model_dir, case):
    quant, dtype = LOAD_CASES[case]
    _assert_same_as_hugging_face(load_state(odd_model_dir, quant, dtype, CPU, TINY_BLOCK_BYTES),
                                 odd_model_dir, quant, dtype)


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_two_process_block_load_equals_hugging_face(odd_model_dir, two_ranks, case):
    from safetensors.torch import load_file

    out, result = two_ranks
    assert result["world_size"] == 2
    quant, dtype = LOAD_CASES[case]
    _assert_same_as_hugging_face(load_file(str(out / f"{case}.safetensors")), odd_model_dir, quant, dtype)


def test_two_process_fill_of_rows_that_do_not_split_evenly(two_ranks):
    from safetensors.torch import load_file

    out, result = two_ranks
    got = load_file(str(out / "edges.safetensors"))
    for name, shape in EDGE_SHAPES.items():
        want = torch.arange(1, 1 + math.prod(shape), dtype=torch.float32).reshape(shape)
        assert torch.equal(got[name], want), name
        # torch.chunk's split, as FSDP2 shards: ceil(dim0 / 2) rows on rank 0, the rest on rank 1
        assert [rows[name] for rows in result["local_rows"]] == [-(-shape[0] // 2), shape[0] // 2]
    assert result["local_rows"][1]["one_row"] == 0  # a rank with no rows still takes part


def _layer_and_largest_bytes(model_dir: Path) -> tuple[int, int]:
    tensors = read_checkpoint_index(model_dir)
    layer = sum(loc.end - loc.start for name, loc in tensors.items() if name.startswith("model.layers.0."))
    return layer, max(loc.end - loc.start for loc in tensors.values())


def test_single_process_load_holds_no_whole_large_tensor_beyond_the_model(wide_model_dir, monkeypatch):
    layer, largest = _layer_and_largest_bytes(wide_model_dir)
    assert largest > 2 * layer  # the embedding / LM head dwarf a layer, as at 8B
    monkeypatch.setattr(loading, "LOAD_BLOCK_BYTES", PEAK_BLOCK_BYTES, raising=False)
    with HeapPeak() as probe:
        model, _ = loading.build_model(loading.ModelOptions(model_dir=wide_model_dir), CPU)
    assert model is not None
    assert probe.transient < layer, f"load transient {probe.transient} bytes, one layer is {layer}"


def test_two_process_load_holds_no_whole_large_tensor_beyond_the_share(wide_model_dir, two_ranks):
    _, result = two_ranks
    layer, largest = _layer_and_largest_bytes(wide_model_dir)
    assert largest > 2 * layer
    for rank, transient in enumerate(result["transients"]):
        assert transient < layer, f"rank {rank}: load transient {transient} bytes, one layer is {layer}"
