#!/usr/bin/env bash
# The checks only a machine with an NVIDIA GPU can run, in one go, as they are (nothing to edit).
# On one H100 it finishes within 10 minutes: every stage runs under its own `timeout`, and none
# starts once the budget (GPU_CHECKS_BUDGET_S, 570 s) could not fit it. Results go under $OUT
# (default gpu-checks/); the last lines printed say what ran, what failed and what could not run.
#
#   environment.txt   nvidia-smi, torch and its CUDA, FlashInfer (version, and whether the worker
#                     accepts its API), the tools found
#   1 tests           the GPU-only tests (tests/test_worker_cuda.py: FlashInfer against the torch
#                     path in bfloat16 and float16, multi-step windows with and without the lag;
#                     every test named for cuda: the sampler, grammar masks, NCCL, memory) and the
#                     parity tests on cuda (tests/test_worker_parity.py: float32 greedy against
#                     transformers, bfloat16 and float16 casts)           tests.log, pytest.xml
#   2 stream-sanitizer  a multi-step decode of SmolLM2 in bfloat16 with every sampling path in the
#                     batch (scripts/gpu_decode.py --mixed), under PyTorch's CUDA stream sanitizer
#                     (TORCH_CUDA_SANITIZER=1): a tensor used on two streams with no order between
#                     them (the staged copies, the ids' copy to the host, the grammar masks)
#   3 synccheck       the same decode under compute-sanitizer --tool synccheck: barriers misused
#                     inside the kernels
#   4 nsys            64 greedy streams decoding in windows of 8, then the same with one stream
#                     held to a grammar (no one-step lag for that batch): the device's idle time
#                     between its kernels over the decode steps alone (scripts/gpu_idle.py)
#                                                                          idle-*.txt, decode-*.nsys-rep
#   5 speculative     the same decode with proposals verified in every step, by prompt lookup and
#                     by the model drafting for itself (scripts/gpu_decode.py --speculative):
#                     two runs give the same tokens, and proposals are accepted  speculative.log
#   6 vllm            where vLLM is installed: SmolLM2 in bfloat16 served by Sluice, then by vLLM,
#                     on this GPU: tokens/s, TTFT and ITL at 1/16/64/256 streams
#                     (scripts/gpu_vs_vllm.py)                             vllm.log, vllm.json
#
#   bash scripts/gpu_checks.sh                  # OUT=/some/dir bash scripts/gpu_checks.sh
#
# Exit status 0 when every stage that ran passed (and where there is no GPU at all: nothing ran,
# and it says so), 1 when a stage failed or timed out, or torch here cannot use the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
BUDGET_S=${GPU_CHECKS_BUDGET_S:-570}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: >"$summary"
deadline=$((SECONDS + BUDGET_S))
status=0
STAGES=(tests stream-sanitizer synccheck nsys speculative vllm)

say() { echo "$*" | tee -a "$summary"; }
not_run() { say "NOT RUN  $1: $2"; }

# stage NAME LIMIT_S LEAST_S CMD...: CMD with its output in $OUT/NAME.log, stopped after LIMIT_S
# or when the budget runs out, whichever comes first; not started with less than LEAST_S left.
stage() {
  local name=$1 limit=$2 least=$3
  shift 3
  local left=$((deadline - SECONDS))
  if ((left < least)); then
    not_run "$name" "${left} s of the budget left, it needs ${least} s"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit} s)"
  local start=$SECONDS rc
  timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 4 "$OUT/$name.log" | sed 's/^/   /'
  if ((rc == 0)); then
    say "ok       $name ($((SECONDS - start)) s)"
  elif ((rc == 124 || rc == 137)); then
    say "TIMEOUT  $name after ${limit} s (see $OUT/$name.log)"
    status=1
  else
    say "FAILED   $name: exit status $rc after $((SECONDS - start)) s (see $OUT/$name.log)"
    status=1
  fi
}

finish() {
  if grep -qE "^(ok|FAILED|TIMEOUT) " "$summary"; then  # stages ran: their lines together, at the end
    echo
    echo "summary ($summary):"
    cat "$summary"
  fi
  if grep -q "^NOT RUN" "$summary"; then
    echo "could not run: $(grep "^NOT RUN" "$summary" | sed 's/^NOT RUN  //; s/:.*//' | paste -sd, | sed 's/,/, /g')"
  fi
  exit "$status"
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; then
  say "no NVIDIA GPU here (nvidia-smi $(command -v nvidia-smi >/dev/null 2>&1 && echo failed || echo "not found")): nothing was run"
  for s in "${STAGES[@]}"; do not_run "$s" "no GPU"; done
  finish
fi
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "a GPU, but torch here cannot use it ($(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)): nothing was run"
  for s in "${STAGES[@]}"; do not_run "$s" "torch without CUDA"; done
  status=1
  finish
fi

{
  head -n 15 "$OUT/nvidia-smi.txt"
  python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} "
      f"(capability {'.'.join(map(str, torch.cuda.get_device_capability()))})")
try:
    import flashinfer
except Exception as e:  # not installed, or not for this torch or CUDA
    print(f"flashinfer: cannot be imported ({type(e).__name__}: {e}): attention takes the torch path")
else:
    from worker.attention.flashinfer import SUPPORTED, api_mismatch
    refused = api_mismatch(flashinfer)
    print(f"flashinfer {getattr(flashinfer, '__version__', '?')} (written for {SUPPORTED}): "
          + ("its API is the one the worker calls" if refused is None else f"refused: {refused}"))
try:
    import vllm
    print(f"vllm {vllm.__version__}")
except ImportError:
    print("vllm: not installed")
EOF
  for tool in nsys compute-sanitizer; do
    command -v "$tool" >/dev/null 2>&1 && echo "$tool: $("$tool" --version 2>&1 | tail -n 1)" || echo "$tool: not found"
  done
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# 1. The GPU-only tests and the parity tests, on cuda.
mapfile -t gpu_only < <(grep -l "needs a CUDA device" tests/test_*.py)
stage tests 200 60 python -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/pytest.xml" -k "cuda or parity" \
  tests/test_worker_parity.py "${gpu_only[@]}"

# 2 and 3. A short multi-step decode with every sampling path (FlashInfer's kernels compiled by now).
decode=(scripts/gpu_decode.py --dtype bfloat16 --rows 16 --context 64 --steps 24 --window 8 --mixed)
stage stream-sanitizer 100 30 env TORCH_CUDA_SANITIZER=1 python "${decode[@]}"
if command -v compute-sanitizer >/dev/null 2>&1; then
  stage synccheck 120 45 compute-sanitizer --tool synccheck --error-exitcode 1 --print-limit 20 python "${decode[@]}"
else
  not_run synccheck "compute-sanitizer not found (the CUDA toolkit's)"
fi

# 4. Idle time between decode steps: the trace holds the second decode run alone (cudaProfilerApi).
if command -v nsys >/dev/null 2>&1; then
  trace() {  # NAME FLAGS...: trace, export the kernel and copy trace, measure the gaps
    local name=$1
    shift
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx --force-overwrite=true \
      -o "$OUT/decode-$name" python scripts/gpu_decode.py --dtype bfloat16 --rows 64 --steps 64 --window 8 \
      --profile-range "$@" \
      && nsys stats --report cuda_gpu_trace --format csv --force-export=true --output "$OUT/decode-$name" \
        "$OUT/decode-$name.nsys-rep" \
      && rm -f "$OUT/decode-$name.sqlite" \
      && python scripts/gpu_idle.py "$OUT/decode-${name}_cuda_gpu_trace.csv" | tee "$OUT/idle-$name.txt"
  }
  export -f trace
  export OUT
  stage nsys-free 80 40 bash -c 'trace free'
  stage nsys-constrained 80 40 bash -c 'trace constrained --constrained 1'
else
  not_run nsys "nsys not found (Nsight Systems)"
fi

# 5. Speculative decoding on the device: n-gram proposals, then a draft model (the model itself).
stage speculative 90 40 bash -c "python scripts/gpu_decode.py --rows 8 --steps 32 --mixed --speculative ngram \
  && python scripts/gpu_decode.py --rows 8 --steps 32 --mixed --speculative draft"

# 6. Against vLLM on the same GPU, where it is installed (this script installs nothing).
if python -c "import vllm" >/dev/null 2>&1; then
  stage vllm 300 150 python scripts/gpu_vs_vllm.py --out "$OUT"
else
  not_run vllm "vLLM is not installed here"
fi
finish
