#!/usr/bin/env bash
# The checks only a machine with an NVIDIA GPU can run, as they are (nothing to edit):
#
#   1. the whole test suite, its workers on cuda (WorkerConfig's device is auto: cuda where there
#      is one), plus the GPU-only tests the CPU suite skips;
#   2. a long multi-step decode (bfloat16, 16 rows, windows of 8) under compute-sanitizer's
#      racecheck;
#   3. an nsys trace of the same decode, and how long the device sat idle between its kernels
#      (scripts/gpu_idle.py): the one-step-behind copy should leave it busy.
#
#   bash scripts/gpu_checks.sh [OUT_DIR]      # reports under OUT_DIR (default: gpu-checks/)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
mkdir -p "$out"
status=0
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || { echo "no NVIDIA GPU here (nvidia-smi failed)"; exit 1; }
python -c "import torch; assert torch.cuda.is_available(), 'torch without CUDA'" || exit 1
python -c "import flashinfer" 2>/dev/null && echo "flashinfer: installed" || echo "flashinfer: not installed (SDPA path)"

echo "== 1. the test suite on cuda"
python -m pytest -q -x -p no:cacheprovider >"$out/pytest.txt" 2>&1 || status=1
tail -3 "$out/pytest.txt"

decode=(scripts/profile_step.py --dtype bfloat16 --rows 16 --steps 256 --window 8 --rounds 1)

echo "== 2. racecheck on a multi-step decode"
if command -v compute-sanitizer >/dev/null 2>&1; then
  compute-sanitizer --tool racecheck --racecheck-report all python "${decode[@]}" >"$out/racecheck.txt" 2>&1 || status=1
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard" "$out/racecheck.txt" | tail -5
else
  echo "compute-sanitizer not found (CUDA toolkit): skipped"
fi

echo "== 3. nsys: device idle between steps"
if command -v nsys >/dev/null 2>&1; then
  nsys profile -o "$out/decode" --force-overwrite true --trace cuda,nvtx python "${decode[@]}" >"$out/nsys.txt" 2>&1 \
    && nsys stats --report cuda_gpu_trace --format csv --output "$out/decode" "$out/decode.nsys-rep" >/dev/null 2>&1 \
    && python scripts/gpu_idle.py "$out"/decode_cuda_gpu_trace.csv | tee "$out/idle.txt" || status=1
else
  echo "nsys not found (Nsight Systems): skipped"
fi
exit $status
