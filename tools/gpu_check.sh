#!/usr/bin/env bash
# GPU check for megazero, bounded under 10 minutes in total (one device call):
#   1. build the CUDA extension (JIT, strict: a failed build is an error, not a fallback) for this GPU's
#      arch (-gencode sm_90 on an H200) into a cache keyed by arch, nvcc and torch; check the key   <= 3.5 min
#   2. run the tests marked gpu and the CUDA-only tests (kernels vs reference twins, CUDA-event clock) <= 2 min
#   3. run the GPU kernel benchmark (time, GB/s as % of measured copy bandwidth, vs torch and apex) <= 45 s
#   4. GPT-2 1.3B bf16 training, megazero vs a plain PyTorch loop (benchmarks/gpu_train.py)  <= 2.5 min
#      (megazero.initialize loads the kernels before any process group; its "megazero kernels (...)" line
#      says which backend each op uses: megazero_cuda here, since a failed build is an error)
# (timeouts sum to 525 s: the device tool allows 600 s per call)
# Writes its outputs (kernel_info.json, kernel_cache.txt, pytest.log, gpu_kernels.json, gpu_train.json) to $OUT or ./runs/gpu_check.
# Usage: tools/gpu_check.sh            (PYTHON=... to pick the interpreter; default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)')); nothing to check" >&2
  exit 2
fi
DEST="${OUT:-runs/gpu_check}"
mkdir -p "$DEST"
export MEGAZERO_KERNELS=strict
# Build for the GPU that is here only (fast); override with TORCH_CUDA_ARCH_LIST.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")')"
  export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

echo "== 1/4 build ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'), arch $TORCH_CUDA_ARCH_LIST)"
start=$(date +%s)
timeout 210 "$PY" -c 'import json, megazero.runtime.kernels as K; print(json.dumps(K.kernel_info(), indent=1))' \
  | tee "$DEST/kernel_info.json"
echo "   build + load: $(( $(date +%s) - start )) s"
"$PY" -c '
import torch
from megazero.runtime.kernels import build
out = build.build_dir(build.CUDA_OPS, torch.cuda.current_device())
m, n = torch.cuda.get_device_capability()
aot = build.aot_library(build.CUDA_OPS)
if aot is not None:  # MEGAZERO_BUILD_OPS=1 pip install: built for aot_nvcc_flags(), no JIT cache
    print("   ahead-of-time library:", aot, "nvcc flags:", " ".join(build.aot_nvcc_flags()))
else:
    print("   cache:", out)
    assert f"{m}{n}" in out.parent.name.split("-sm")[-1].split("_"), f"build key {out.parent.name} lacks sm{m}{n}"
    ninja = (out / "build.ninja").read_text()
    assert f"code=sm_{m}{n}" in ninja, f"{out}/build.ninja has no -gencode for sm_{m}{n}"
' | tee "$DEST/kernel_cache.txt"

echo "== 2/4 tests marked gpu, and the CUDA-only tests"
status=0
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu -x tests/test_kernels_gpu.py 2>&1 \
  | tee "$DEST/pytest.log" | tail -n 25 || status=$?
timeout 30 "$PY" -m pytest -q -p no:cacheprovider tests/test_clock.py tests/test_attention_core.py 2>&1 \
  | tee -a "$DEST/pytest.log" | tail -n 5 || status=$?

echo "== 3/4 kernel benchmark"
timeout 45 "$PY" benchmarks/gpu_kernels.py | tee "$DEST/gpu_kernels.json"

echo "== 4/4 training benchmark (GPT-2 1.3B, bf16)"
timeout 150 "$PY" benchmarks/gpu_train.py --json "$DEST/gpu_train.json" | tail -n 40 || status=$?
echo "== done in $(( $(date +%s) - start )) s; outputs in $DEST"
exit "$status"
