#!/usr/bin/env bash
# The GPU check: one prepared command for one H200 (the device tool allows 600 s per call; this script ends
# within BUDGET = 480 s (+10 s), each stage under its own timeout, cut to what is left of the budget).
# Each stage is `benchmarks/gpu_check.py --stage NAME` and writes $OUT/NAME.json as it goes (also on
# failure: "error", "traceback"); a failed or timed-out stage is recorded in its JSON and the next stage runs.
# What each stage measures: benchmarks/gpu_check.py's docstring and docs/benchmarks.md ("The GPU check").
#   env      (<= 140 s) torch/CUDA/device, megazero's requirements, the NCCL environment; the kernels built
#            for this GPU's arch (MEGAZERO_KERNELS=strict), the build's time, its cache key and gencode
#   kernels  (<= 75 s) the gpu-marked kernel tests and the CUDA-only tests, pass/fail per test
#   trainer  (<= 175 s) the real trainer on a 1.1B Llama in bf16, flash forced: ZeRO-1 (the benchmark),
#            ZeRO-1 with an async save, a resume from it (losses equal), ZeRO-3 + CPU optimizer offload +
#            overlap_comm + CPU activation checkpointing; host syncs per step; flash confirmed by the profiler
#   planner  (<= 20 s) the planner's memory and step time for the trainer's runs, predicted / measured
#   plain    (<= 70 s) transformers' LlamaForCausalLM of the same shape from megazero's initial weights,
#            in a plain PyTorch loop
# Usage:
#   bash tools/gpu_check.sh          on the GPU machine (PYTHON=... picks the interpreter; default .venv/bin/python,
#                                    else python3)
#   bash tools/gpu_check.sh --cpu    the same stages on CPU with tiny shapes: the dry run (about 15 s)
#   bash tools/gpu_check.sh --wheels here, where pip reaches PyPI: the pure-Python packages an image may lack
#                                    (omegaconf) as wheels in .whl/, which the GPU run installs if they are missing
# Outputs (flat, 6 files): $OUT (default runs/gpu_check)/{env,kernels,trainer,planner,plain}.json and log.txt;
# the summary is printed at the end.
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
ROOT="$PWD"

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
WHEELS="${WHEELS:-.whl}"

if [ "${1:-}" = "--wheels" ]; then  # pure-Python wheels: one file serves any platform and Python >= 3.10
  exec "$PY" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" "omegaconf==2.4.0"
fi
CPU=""
if [ "${1:-}" = "--cpu" ]; then CPU="--cpu"; fi
DEST="${OUT:-runs/gpu_check}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
LOG="$DEST/log.txt"
rm -f "$DEST"/{env,kernels,trainer,planner,plain}.json
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ -z "$CPU" ]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "gpu_check: no CUDA device visible to $PY; run with --cpu for the dry run"
    exit 2
  fi
  # megazero's pure-Python requirements the image may lack (omegaconf): from $WHEELS (see --wheels)
  missing="$("$PY" -c '
import importlib.util as u
names = ("omegaconf", "einops", "networkx", "tqdm", "safetensors", "yaml")
print(" ".join(m for m in names if u.find_spec(m) is None))')"
  if [ -n "$missing" ]; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
      SITE="${TMPDIR:-/tmp}/gpu_check_site"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
      export PYTHONPATH="$PYTHONPATH:$SITE"
      say "gpu_check: $missing missing from $PY's packages; installed $(cd "$WHEELS" && ls *.whl) into $SITE"
    else
      say "gpu_check: $missing missing from $PY's packages and no wheels in $WHEELS" \
          "(bash tools/gpu_check.sh --wheels where pip works, then bring $WHEELS)"
    fi
  fi
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then  # build for the GPU that is here only
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")')"
    export TORCH_CUDA_ARCH_LIST
  fi
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
fi

BUDGET="${BUDGET:-480}"  # from the script's start; a stage's limit is cut to what is left (+10 s to kill one)
status=0
run_stage() {  # name, timeout in seconds, then environment assignments for the stage
  local name=$1 limit=$2
  shift 2
  local left=$(( BUDGET - ($(date +%s) - start) ))
  if [ "$left" -lt 10 ]; then
    say "== $name skipped: ${left} s left of the ${BUDGET} s budget"
    echo "{\"error\": \"skipped: ${left} s left of the ${BUDGET} s budget\"}" > "$DEST/$name.json"
    status=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "== $name (at most ${limit} s)"
  env "$@" timeout -k 10 "$limit" "$PY" benchmarks/gpu_check.py --stage "$name" --out "$DEST" --limit "$limit" $CPU \
    >>"$LOG" 2>&1
  local code=$?
  grep "^gpu_check $name:" "$LOG" | tail -n 1
  if [ "$code" -ne 0 ]; then
    status=1
    # a stage killed (timeout) or crashed (no Python exception) wrote no error of its own: record it
    "$PY" - "$DEST/$name.json" "$code" "$limit" <<'EOF'
import json, os, sys
path, code, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3]
data = {}
if os.path.exists(path):
    try:
        data = json.load(open(path))
    except ValueError:
        data = {"unreadable_partial_json": open(path).read()[-2000:]}
if code in (124, 137):
    data["error"] = f"timed out after {limit} s" + (f" (during: {data['error']})" if "error" in data else "")
elif "error" not in data:
    data["error"] = f"exit code {code} without a Python exception (see log.txt)"
data["exit_code"] = code
json.dump(data, open(path, "w"), indent=1, sort_keys=True)
EOF
    say "   $name failed (exit $code): see $DEST/$name.json and $LOG"
  fi
}

STRICT="MEGAZERO_KERNELS=${MEGAZERO_KERNELS:-auto}"
[ -z "$CPU" ] && STRICT="MEGAZERO_KERNELS=strict"  # a failed kernel build is an error in these two, not a fallback
run_stage env 140 "$STRICT"
run_stage kernels 75 "$STRICT"
run_stage trainer 175   # MEGAZERO_KERNELS as set (auto: the built kernels, else the reference twins; trainer.json says)
run_stage planner 20
run_stage plain 70
say "== done in $(( $(date +%s) - start )) s; outputs in $DEST"
"$PY" benchmarks/gpu_check.py --summary --out "$DEST" 2>&1 | tee -a "$LOG"
exit "$status"
