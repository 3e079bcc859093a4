"""A rank of the block-wise loading tests: load models, write what each rank holds.

Run by ``test_blockwise_load.py`` through ``trainers.fsdp_qlora.distributed.launch_local``
(2 gloo processes). Every case starts from a freshly built model:

- ``load``: ``build_model`` of ``--model`` with a block budget far smaller than a shard
  (several scatter rounds per tensor, a last round with padding); rank 0 writes every
  base parameter's full value (gathered from the shards), and for NF4 the statistics,
  to ``<case>.safetensors`` for the test to compare with Hugging Face's own load;
- ``edges``: FSDP2 parameters whose dim 0 leaves the last rank one row or none, filled
  one row per round; the gathered values are written the same way;
- ``peak``: ``build_model`` of ``--wide`` (embedding and LM head much larger than a
  decoder layer) under :class:`HeapPeak`; each rank writes its heap transient.

Rank 0 writes ``result.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Self

LOAD_CASES = {
    # case: (quantization, base_dtype)
    "none_fp32": ("none", "float32"),
    "none_bf16": ("none", "bfloat16"),
    "nf4_fp32": ("nf4", "float32"),
}
# Far below one row-block of the test model's shards: the embedding (263 x 64 fp32,
# 132 rows per rank) takes 66 rounds of 2 rows per rank.
TINY_BLOCK_BYTES = 1500
PEAK_BLOCK_BYTES = 64 * 2**10
EDGE_SHAPES = {"one_row": (1, 3), "odd_rows": (5, 3), "vector": (7,)}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (glibc ``mallinfo2``): torch's CPU
    tensors and the safetensors/Rust buffers alike, exactly, unlike RSS."""
    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


class HeapPeak:
    """The highest :func:`heap_bytes` seen after any torch op inside the ``with`` block,
    and the value at its end: ``transient = peak - end`` is what was held beyond what
    stays (for a load: beyond the loaded share)."""

    def __enter__(self) -> Self:
        from torch.utils._python_dispatch import TorchDispatchMode

        probe = self

        class _Sample(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                probe.peak = max(probe.peak, heap_bytes())
                return out

        self.start = self.peak = heap_bytes()
        self._mode = _Sample()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.end = heap_bytes()
        self.peak = max(self.peak, self.end)

    @property
    def transient(self) -> int:
        return self.peak - self.end


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def load_state(model_dir: Path, quant: str, base_dtype: str, ctx, block_bytes: int | None) -> dict:
    """``build_model`` -> every base parameter's full value (checkpoint names) and, for
    NF4, each layer's absmax (``<module>.absmax``)."""
    from trainers.fsdp_qlora.loading import ModelOptions, build_model, canonical_name, is_lora_name

    opts = ModelOptions(model_dir=model_dir, quantization=quant, base_dtype=base_dtype,
                        compute_dtype=base_dtype, load_block_bytes=block_bytes)
    model, _ = build_model(opts, ctx)
    out = {}
    for name, p in model.named_parameters():
        if not is_lora_name(name):
            out[canonical_name(name)] = _full(p.detach()).clone()
    for name, m in model.named_modules():
        state = getattr(m, "quant_state", None)
        if state is not None and canonical_name(name) + ".weight" in out:
            out[canonical_name(name) + ".absmax"] = state.absmax.clone()
    return {k: v.contiguous() for k, v in out.items()}


def edge_state(ctx) -> tuple[dict, dict]:
    """Fill FSDP2 parameters of :data:`EDGE_SHAPES` one row per round from known values;
    returns their full values and this rank's local row counts."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from trainers.fsdp_qlora.loading import _fill, _rows_of

    out, rows = {}, {}
    for name, shape in EDGE_SHAPES.items():
        with torch.device("meta"):
            holder = nn.Module()
            holder.p = nn.Parameter(torch.empty(shape), requires_grad=False)
        fully_shard(holder, mesh=ctx.mesh)
        holder.to_empty(device="cpu")
        value = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        row_bytes = 4 * (shape[1] if len(shape) > 1 else 1)
        _fill(holder.p, _rows_of(value, shape) if ctx.is_main else None, ctx, ctx.world_size * row_bytes)
        out[name] = _full(holder.p.detach()).clone()
        rows[name] = holder.p.to_local().shape[0]
    return out, rows


def peak_transient(model_dir: Path, ctx) -> int:
    """Heap held beyond the loaded model at the peak of ``build_model`` (bytes), with the
    loader's default block budget set to :data:`PEAK_BLOCK_BYTES`."""
    import gc

    from trainers.fsdp_qlora import loading

    loading.LOAD_BLOCK_BYTES = PEAK_BLOCK_BYTES
    gc.collect()
    with HeapPeak() as probe:
        model, _ = loading.build_model(loading.ModelOptions(model_dir=model_dir), ctx)
    del model
    return probe.transient


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--wide", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from trainers.fsdp_qlora.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    ctx = init_distributed()
    out = Path(args.out)
    for case, (quant, dtype) in LOAD_CASES.items():
        state = load_state(Path(args.model), quant, dtype, ctx, TINY_BLOCK_BYTES)
        if ctx.is_main:
            save_file(state, str(out / f"{case}.safetensors"))
    edges, rows = edge_state(ctx)
    if ctx.is_main:
        save_file(edges, str(out / "edges.safetensors"))
    local_rows = [None] * ctx.world_size
    dist.all_gather_object(local_rows, rows)
    transients = [None] * ctx.world_size
    dist.all_gather_object(transients, peak_transient(Path(args.wide), ctx))
    if ctx.is_main:
        (out / "result.json").write_text(json.dumps(
            {"world_size": ctx.world_size, "local_rows": local_rows, "transients": transients}))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
