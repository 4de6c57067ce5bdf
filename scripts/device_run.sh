#!/usr/bin/env bash
# The one script for a lent GPU (device tool): build for sm_90 with every core, run the GPU tests,
# compute-sanitizer on the ops, the head benchmark and cpp_bench; logs and JSON under $OUT;
# a short table printed last. Usage: FLASHHEAD_COMMIT=<sha> bash scripts/device_run.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc)
mode=${1:-full}
step() { echo; echo "=== $* ($(date +%T))"; }
summary=()

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"

step "build (sm_90, $MAX_JOBS jobs)"
start=$(date +%s)
if python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  summary+=("build: ok in $(( $(date +%s) - start )) s")
else
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi

step "GPU tests"
python3 -m pytest python_tests -q -m gpu -x -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log" | tail -15
summary+=("gpu tests: $(grep -E '(passed|failed|error)' "$OUT/tests_gpu.log" | tail -1)")

if [ "$mode" = full ]; then
  step "compute-sanitizer"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/sanitize_ops.py > "$OUT/sanitizer_$tool.log" 2>&1
    summary+=("sanitizer $tool: exit $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)")
    tail -3 "$OUT/sanitizer_$tool.log"
  done
fi

step "head benchmark"
python3 -m flashhead_ext.bench head --json "$OUT/bench_head.json" 2>&1 | tee "$OUT/bench_head.log"

if [ "$mode" = full ] && [ -f CMakeLists.txt ]; then
  step "cpp_bench"
  if CPP_BENCH_BUILD=build/cpp_bench MAX_JOBS=$(nproc) bash scripts/build_cpp_bench.sh > "$OUT/cpp_bench_build.log" 2>&1; then
    for bin in build/cpp_bench/bench_*; do
      "$bin" --benchmark_min_time=0.05s --benchmark_out="$OUT/$(basename "$bin").json" --benchmark_out_format=json 2>&1 | tail -12
    done
  else
    tail -20 "$OUT/cpp_bench_build.log"; summary+=("cpp_bench: BUILD FAILED")
  fi
fi

step "summary"
printf '%s\n' "${summary[@]}"
sed -n '/^summary:/,$p' "$OUT/bench_head.log"
