#!/usr/bin/env bash
# One-GPU benchmark of the JAX LoRA trainer (H200-class, offline, < 10 minutes):
# 8B-shaped Llama (Llama 3.1 8B dims, llama3 RoPE) with random bf16 weights generated
# on the device, seq 2048, LoRA r16 on all 7 projections, fp32 adapter + AdamW.
# Prints tokens/s, MFU (4*N*tokens/s over peak bf16: forward + activation gradients)
# and peak device memory per configuration; appends JSON lines to
# $OUT/gpu_jax_lora.jsonl (or bench/gpu_jax_lora.jsonl).
#
# Needs: a Python with a CUDA (or ROCm) jaxlib (the repo's venv, or the machine's python3:
# bench/gpu_lib.sh); no network. PEAK_TFLOPS defaults to 989 (H100/H200 SXM dense bf16;
# MI300X: 1307). DEADLINE (epoch seconds) caps every run (bench/gpu_lib.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_lib.sh
OUTDIR=${OUT:-bench}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
STEPS=${STEPS:-10}
mkdir -p "$OUTDIR"
RESULTS="$OUTDIR/gpu_jax_lora.jsonl"
: > "$RESULTS"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

"$PY" -c "import jax; d = jax.devices()[0]; assert d.platform != 'cpu', 'no GPU visible to jax'; print(d.device_kind)"

# 1) the headline configuration: no remat (fits in 141 GB at batch 4 x 2048)
capped 300 "$PY" bench/jax_lora_gpu.py --seq 2048 --batch 4 --remat none --steps "$STEPS" \
    --peak-tflops "$PEAK_TFLOPS" --out "$RESULTS" || echo "batch 4 / no remat failed (likely OOM)"
# 2) QLoRA: the same step on an NF4 base (4-bit codes + fp32 block scales), batch 4, no remat
capped 300 "$PY" bench/jax_lora_gpu.py --seq 2048 --batch 4 --remat none --quantization nf4 --steps "$STEPS" \
    --peak-tflops "$PEAK_TFLOPS" --out "$RESULTS" || echo "nf4 batch 4 / no remat failed"
# 3) memory-lean: dots_saveable remat (keeps matmul outputs, recomputes the rest), batch 2
capped 240 "$PY" bench/jax_lora_gpu.py --seq 2048 --batch 2 --remat dots_saveable --steps "$STEPS" \
    --peak-tflops "$PEAK_TFLOPS" --out "$RESULTS" || echo "batch 2 / dots_saveable failed"
cat "$RESULTS"
