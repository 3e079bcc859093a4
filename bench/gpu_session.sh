#!/usr/bin/env bash
# Everything a short one-GPU lease should measure, in one command that ends on time:
#   1. bench/gpu_jax_lora.sh   (JAX LoRA trainer, 8B shape: bf16, NF4, remat), then its
#      headline configuration again with 128 query rows per attention block (the CPU's)
#   2. bench/gpu_fsdp_qlora.sh (FSDP-QLoRA trainer vs transformers+peft+bitsandbytes, 8B
#      shape), with each side's top GPU ops and our load's profile
#   3. with the time left: the JAX trainer's numerics tests on the GPU backend (attention,
#      logits vs transformers, NF4 vs bitsandbytes), fp32 matmuls at full precision as on
#      the CPU (XLA's GPU default would round fp32 matmul inputs to TF32).
# BUDGET_S (default 480) is the whole command's wall time; each step is skipped or cut
# short rather than overrun it (bench/gpu_lib.sh). Results go to $OUT (or bench/).
#
#   BUDGET_S=480 bash bench/gpu_session.sh 2>&1 | tee "$OUT/gpu_session.log"
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_lib.sh
OUTDIR=${OUT:-bench}
BUDGET_S=${BUDGET_S:-480}
start=$(date +%s)
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
"$PY" - <<'PY'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "jax", "jaxlib", "transformers", "peft", "bitsandbytes", "optax", "accelerate", "safetensors"):
    try:
        print(f"{name:13s}", importlib.import_module(name).__version__)
    except Exception as exc:  # a missing package is reported; the step that needs it fails later
        print(f"{name:13s} MISSING ({exc})")
PY

echo "== jax_lora ($(( $(date +%s) - start )) s)"
DEADLINE=$(( start + BUDGET_S * 40 / 100 )) STEPS=${JAX_STEPS:-6} bash bench/gpu_jax_lora.sh
echo "== jax_lora, 128 query rows per attention block ($(( $(date +%s) - start )) s)"
DEADLINE=$(( start + BUDGET_S * 50 / 100 )) XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
  capped 120 "$PY" bench/jax_lora_gpu.py --seq 2048 --batch 4 --remat none --steps "${JAX_STEPS:-6}" --query-block 128 \
    --out "$OUTDIR/gpu_jax_lora.jsonl" || echo "query block 128 failed"
echo "== fsdp_qlora ($(( $(date +%s) - start )) s)"
DEADLINE=$(( start + BUDGET_S * 87 / 100 )) STEPS=${FSDP_STEPS:-6} PROFILE=1 bash bench/gpu_fsdp_qlora.sh
echo "== jax_lora numerics on the GPU backend ($(( $(date +%s) - start )) s)"
DEADLINE=$(( start + BUDGET_S )) JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false \
  capped 120 "$PY" -m pytest -p no:cacheprovider --confcutdir=tests/trainers/jax_lora -o addopts="" -q \
    tests/trainers/jax_lora/test_attention.py tests/trainers/jax_lora/test_model_parity.py \
    tests/trainers/jax_lora/test_nf4.py 2>&1 | tail -25 | tee "$OUTDIR/gpu_jax_numerics.txt"
echo "== done ($(( $(date +%s) - start )) s)"
