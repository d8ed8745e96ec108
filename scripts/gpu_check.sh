#!/usr/bin/env bash
# Prepared GPU check: on a machine with one NVIDIA GPU, set up (full sglang), then run SPEX and ReSpec on SGLang's
# GPU defaults and print one summary table (stages in scripts/gpu_check.py). Nothing depends on it.
#
#   bash scripts/gpu_check.sh             # GPU run, under 8 minutes with a warm environment
#   bash scripts/gpu_check.sh --dry-run   # the same stages on CPU servers with the tiny model (or GPU_CHECK_DRY=1)
#
# Env: GPU_CHECK_BUDGET_S (total seconds, default 470), GPU_CHECK_OUT (results folder, default /tmp/gpu_check),
# GPU_CHECK_STAGES (comma list of stages to run, default all; see scripts/gpu_check.py --help).
# Exit status: 0 when no stage failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY="${GPU_CHECK_DRY:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
OUT="${GPU_CHECK_OUT:-/tmp/gpu_check}"
START=$(date +%s)
mkdir -p "$OUT"

# step price (GPU run only; needs torch, transformers and scipy, not SGLang): SmolLM2-135M's architecture on this
# accelerator, in bench_tot's step-price terms (benchmark/gpu_step_price.py), so it is measured even where SGLang
# cannot be installed.
if [ "$DRY" != 1 ]; then
  nvidia-smi -L > "$OUT/env.txt" 2>&1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    >> "$OUT/env.txt" 2>&1
  if timeout 180 python3 benchmark/gpu_step_price.py --out "$OUT/step_price_gpu.json" > "$OUT/step_price.log" 2>&1; then
    echo "[gpu_check] step price: PASS (see $OUT/step_price_gpu.json)"
  else
    echo "[gpu_check] step price: FAIL"; tail -n 5 "$OUT/step_price.log"
  fi
fi

# setup: the dry run reuses an existing .venv (a CPU checkout is set up already); the GPU run always runs the
# idempotent setup, which installs full sglang when nvidia-smi sees a GPU. SGLang's GPU install needs a package
# index: sglang-kernel (373 MB) and flashinfer-python (65 MB) wheels and torch==2.14.1 do not fit a 64 MiB carry.
SETUP="PASS"
SETUP_T0=$(date +%s)
if [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then
  SETUP="SKIP"
elif [ ! -x .venv/bin/python ] && ! timeout 20 python3 -m pip download -q --no-deps --retries 0 --timeout 5 \
    -d "$OUT/index_probe" pip > "$OUT/setup.log" 2>&1; then
  SETUP="FAIL"
  echo "no package index reachable from this machine: SGLang's GPU install cannot run here" >> "$OUT/setup.log"
elif ! timeout 420 bash scripts/setup.sh > "$OUT/setup.log" 2>&1; then
  SETUP="FAIL"
fi
SETUP_S=$(( $(date +%s) - SETUP_T0 ))
echo "[gpu_check] setup: $SETUP (${SETUP_S} s)"
if [ "$SETUP" = FAIL ] || [ ! -x .venv/bin/python ]; then
  tail -n 5 "$OUT/setup.log" >&2
  echo "setup          FAIL   ${SETUP_S}  see $OUT/setup.log"
  exit 1
fi

LEFT=$(( BUDGET - ($(date +%s) - START) ))  # the step price and setup both spent it
[ "$LEFT" -lt 60 ] && LEFT=60
FLAGS=(--budget-s "$LEFT" --out "$OUT")
[ "$DRY" = 1 ] && FLAGS+=(--dry-run)
[ -n "${GPU_CHECK_STAGES:-}" ] && FLAGS+=(--stages "$GPU_CHECK_STAGES")
# the driver enforces per-stage timeouts and the deadline itself; this outer limit only catches a hang in it
timeout --signal=TERM --kill-after=30 $(( LEFT + 60 )) .venv/bin/python scripts/gpu_check.py "${FLAGS[@]}"
RC=$?
if [ "$RC" -ge 124 ] && [ -f "$OUT/gpu_check.txt" ]; then
  echo "[gpu_check] driver stopped from outside (exit $RC); stages finished so far:"
  cat "$OUT/gpu_check.txt"
fi
echo "setup          $SETUP   ${SETUP_S}  (total $(( $(date +%s) - START )) s)"
exit "$RC"
