# Sourced by the GPU benchmark scripts (bench/gpu_*.sh): which Python to run, and
# timeouts that respect an overall deadline.
#
# PY: the repo's venv when there is one, else the machine's python3 (a lent GPU machine
# brings its own CUDA builds of torch and jax; the repo root goes on PYTHONPATH so the
# trainers import without an install).
# DEADLINE: epoch seconds by which every benchmark command must have ended (unset: no
# overall limit). A device lease is short; a configuration that cannot finish in time
# is skipped with a message instead of being cut off half-way by the lease.

if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# capped SECONDS CMD...: run CMD under `timeout`, never past DEADLINE (less 10 s for the
# caller's summary); returns CMD's status, or 124 when there was too little time to start.
capped() {
  local limit=$1; shift
  if [ -n "${DEADLINE:-}" ]; then
    local left=$(( DEADLINE - $(date +%s) - 10 ))
    if (( left < 30 )); then
      echo "skipped (${left} s left before the deadline): $*" >&2
      return 124
    fi
    (( left < limit )) && limit=$left
  fi
  timeout "$limit" "$@"
}
