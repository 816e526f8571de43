#!/usr/bin/env bash
# The GPU check: one prepared command for one H200 (the device tool allows 600 s per call; the stages'
# timeouts sum to 520 s). Each stage is `benchmarks/gpu_check.py --stage NAME`, under its own timeout,
# and writes $OUT/NAME.json as it goes (also on failure: {"error": ...}); a failed or timed-out stage is
# recorded and the next one runs. Stages (what each measures: benchmarks/gpu_check.py's docstring):
#   env      torch/CUDA/device, the NCCL environment, the kernels built for this GPU's arch   <= 200 s
#   kernels  the gpu-marked kernel tests and the CUDA-only tests, pass/fail per test            <= 90 s
#   trainer  the real trainer on a ~1B Llama in bf16: ZeRO-1 + async save, resume (losses must
#            equal), ZeRO-3 + CPU offload + overlap + CPU activation checkpointing; flash forced
#            and confirmed; host syncs per step; step time, tokens/s, MFU, peak memory          <= 150 s
#   plain    transformers' LlamaForCausalLM of the same shape in a plain PyTorch loop            <= 60 s
#   planner  the planner's memory and step time for the ZeRO-1 run, with the measured ratios     <= 20 s
# Usage:
#   bash tools/gpu_check.sh          on the GPU machine (PYTHON=... picks the interpreter; default .venv/bin/python)
#   bash tools/gpu_check.sh --cpu    the same stages on CPU with tiny shapes: the dry run (well under 3 minutes)
# Outputs: $OUT (default runs/gpu_check): env.json kernels.json trainer.json plain.json planner.json log.txt
set -uo pipefail
cd "$(dirname "$0")/.."

CPU=""
if [ "${1:-}" = "--cpu" ]; then CPU="--cpu"; fi
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
DEST="${OUT:-runs/gpu_check}"
mkdir -p "$DEST"
LOG="$DEST/log.txt"
: > "$LOG"

if [ -z "$CPU" ]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to $PY; run with --cpu for the dry run" | tee -a "$LOG" >&2
    exit 2
  fi
  export MEGAZERO_KERNELS=strict  # a failed kernel build is an error here, not a fallback
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then  # build for the GPU that is here only
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")')"
    export TORCH_CUDA_ARCH_LIST
  fi
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
fi
export PYTHONUNBUFFERED=1

status=0
start=$(date +%s)
run_stage() {  # name, timeout in seconds
  local name=$1 limit=$2
  echo "== $name (at most ${limit} s)" | tee -a "$LOG"
  timeout "$limit" "$PY" benchmarks/gpu_check.py --stage "$name" --out "$DEST" $CPU >>"$LOG" 2>&1
  local code=$?
  if [ "$code" -ne 0 ]; then
    status=1
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then  # killed: record it in the stage's JSON
      "$PY" - "$DEST/$name.json" "$limit" <<'EOF'
import json, os, sys
path, limit = sys.argv[1], sys.argv[2]
data = json.load(open(path)) if os.path.exists(path) else {}
data["error"] = f"timed out after {limit} s"
json.dump(data, open(path, "w"), indent=1)
EOF
    fi
    echo "   $name failed (exit $code): see $DEST/$name.json and $LOG" | tee -a "$LOG"
  fi
  tail -n 1 "$LOG"
}

run_stage env 200
run_stage kernels 90
run_stage trainer 150
run_stage plain 60
run_stage planner 20
echo "== done in $(( $(date +%s) - start )) s; outputs in $DEST" | tee -a "$LOG"
exit "$status"
