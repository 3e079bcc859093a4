#!/usr/bin/env bash
# One-GPU QLoRA benchmark (H200-class, offline, < 10 minutes):
# 8B-shaped Llama with random bf16 weights, NF4, seq 2048, batch 1, LoRA r8 on all 7
# projections, non-reentrant activation checkpointing, bf16 autocast:
#   - ours:  trainers.fsdp_qlora (streamed NF4 load + train_step)
#   - plain: transformers BitsAndBytesConfig + peft + a plain loop
# Prints tokens/s, MFU (4*N*tokens/s / peak bf16), peak GPU memory, load time per side,
# and writes them to $OUT/gpu_fsdp_qlora.jsonl (or bench/gpu_fsdp_qlora.jsonl).
#
# Needs: a Python with a CUDA torch, bitsandbytes and the pinned transformers/peft (the
# repo's venv, or the machine's python3 with those on PYTHONPATH: bench/gpu_lib.sh). No
# network access is used. DEADLINE (epoch seconds) caps every run (bench/gpu_lib.sh).
#
# Published anchors to compare with: torchtune Llama-3-8B QLoRA on an RTX 4090: 7.4 GiB,
# 2,413 tok/s; Answer.AI fsdp_qlora 7B QLoRA ctx 512: 4.98 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_lib.sh
OUTDIR=${OUT:-bench}
MODEL_DIR=${MODEL_DIR:-/tmp/tunefleet-8b-random}
LAYERS=${LAYERS:-32}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-8}
PROFILE=${PROFILE:+--profile}  # PROFILE=1: also print each side's top GPU ops (and our load's profile)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUTDIR"
RESULTS="$OUTDIR/gpu_fsdp_qlora.jsonl"
: > "$RESULTS"

"$PY" -c "import torch, bitsandbytes; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"

if [ ! -f "$MODEL_DIR/model.safetensors.index.json" ]; then
  capped 180 "$PY" bench/fsdp_qlora_gpu.py make --model-dir "$MODEL_DIR" --layers "$LAYERS" | tee -a "$RESULTS" \
    || { echo "making the checkpoint failed"; exit 1; }
fi
# Each side in its own process so peak memory and allocator state do not mix.
capped 200 "$PY" bench/fsdp_qlora_gpu.py ours  --model-dir "$MODEL_DIR" --seq "$SEQ" --steps "$STEPS" $PROFILE | tee -a "$RESULTS" \
    || echo "ours failed"
capped 200 "$PY" bench/fsdp_qlora_gpu.py plain --model-dir "$MODEL_DIR" --seq "$SEQ" --steps "$STEPS" $PROFILE | tee -a "$RESULTS" \
    || echo "plain failed"

"$PY" - "$RESULTS" <<'PY'
import json, sys
rows = {r["what"]: r for r in map(json.loads, open(sys.argv[1])) if r.get("what") in ("ours", "plain")}
for w in ("ours", "plain"):
    if w not in rows:
        print(f"{w:5s} no result")
        continue
    r = rows[w]
    print(f"{w:5s} {r['tokens_per_s']:8.0f} tok/s  MFU {100*r['mfu']:5.1f}%  peak alloc {r['peak_allocated_gib']:.2f} GiB"
          f"  reserved {r['peak_reserved_gib']:.2f} GiB  load {r['load_s']:.0f} s  loss {r['loss']:.3f}")
if len(rows) == 2:
    print(f"ours/plain tokens/s: {rows['ours']['tokens_per_s'] / rows['plain']['tokens_per_s']:.2f}x, "
          f"peak allocated: {rows['ours']['peak_allocated_gib'] / rows['plain']['peak_allocated_gib']:.2f}x")
PY
