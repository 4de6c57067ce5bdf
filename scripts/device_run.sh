#!/usr/bin/env bash
# The one script for a lent GPU (device tool): build for sm_90 with every core, run the tests,
# compute-sanitizer (memcheck, racecheck, initcheck) on the ops, the head benchmark and cpp_bench;
# logs and JSON under $OUT; a short table printed last.
# Usage: FLASHHEAD_COMMIT=<sha> bash scripts/device_run.sh [MODE] (the sha given literally: the
# device's copy of the tree may carry an older git HEAD, which bench head would record instead).
#   full (default): the sanitizers, the head benchmark and cpp_bench (the GPU tests left it in
#     session 70: with the fuzz's CUDA cases they take 375 s, and full passed 600 s);
#   sanitize: the sanitizers alone, and memcheck and initcheck over random configurations of the ops
#     too (with them full ran past 600 s in session 67; racecheck did not finish 12 of them in 100 s);
#   quick: the GPU tests and the head benchmark;
#   cpu: the CPU cases alone, under the device's torch, which CI's does not cover (session 52 found a
#     torch.compile break there); with quick's GPU cases the whole suite, which no longer fits one
#     call (session 112: 16,536 tests done in 460 s);
#   jit: built for sm_80's PTX alone, the ops' GPU tests, each kernel compiled by the driver at load
#     from an older arch's PTX, as a GPU newer than the build's archs (Blackwell) does with the
#     default's sm_90 PTX (CUDA_FORCE_PTX_JIT=1 cannot show it: torch's own kernels have no such PTX);
#   two (on a two-GPU kind): the tests of placement across GPUs (marked two_gpus) and the
#     PEFT/accelerate tests (their GPU cases: a target accelerate splits over the GPUs or offloads).
# With .whl/ carried, its wheels are installed first: scripts/stage_transformers.sh stages the
# transformers CI installs, which replaces the image's (the summary names the versions tested);
# wheels of accelerate, peft and psutil (pip download --no-deps) let the PEFT/accelerate tests run
# there (the image has neither, and those tests skip without them).
# A call runs at most 600 s and the build takes about 2 min, so the whole suite takes two calls.
# On one H200 the GPU cases took 375 s on 8 workers (8,566 tests, session 70), while 14 workers had
# 16 of 3,272 tests left after 440 s (session 54): more workers most likely contend for the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc)
mode=${1:-full}
case "$mode" in full | cpu | quick | sanitize | jit | two) ;; *) echo "usage: $0 [full|cpu|quick|sanitize|jit|two], got '$mode'" >&2; exit 2 ;; esac
[ "$mode" = jit ] && TORCH_CUDA_ARCH_LIST="8.0+PTX"
step() { echo; echo "=== $* ($(date +%T))"; }
summary=()

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links .whl .whl/*.whl > "$OUT/wheels_install.log" 2>&1 ||
    { tail -20 "$OUT/wheels_install.log"; echo "the staged wheels did not install"; exit 1; }
fi
versions=$(python3 -c "
import importlib.metadata as m, sys, torch, transformers
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return 'none'
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', version('accelerate'),
      'peft', version('peft'), 'python', sys.version.split()[0])")
echo "$versions"
summary+=("$versions")

step "build ($TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
start=$(date +%s)
if python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  summary+=("build: ok in $(( $(date +%s) - start )) s")
else
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi

# xdist workers: a crashing test fails alone instead of ending the run.
if [ "$mode" = cpu ]; then
  step "tests (CPU cases)"
  timeout 460 python3 -m pytest python_tests -q -rs -m "not gpu" -n 14 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15
elif [ "$mode" = quick ]; then
  step "tests (GPU cases)"
  # 316 s on one H200 with 12 workers (session 79; 8 workers passed 410 s on a machine whose build took
  # 133 s, the head benchmark about 40 s).
  timeout 410 python3 -m pytest python_tests -q -rs -m gpu -n 12 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15
fi
# Counts from pytest's progress lines (. s F E x X): pytest's own summary is lost when the timeout
# stops it, even after every test has reported (session 82's quick run: 100%, then no summary).
progress_counts() {
  grep -E '^[.sFExX]+ *(\[ *[0-9]+%\])?$' "$1" | sed 's/ *\[.*//' | tr -d '\n' | fold -w1 | sort | uniq -c |
    awk '{n[$2] = $1} END {printf "%d passed, %d skipped, %d failed, %d errors, %d xfailed, %d xpassed",
      n["."], n["s"], n["F"], n["E"], n["x"], n["X"]}'
}
if [ "$mode" = cpu ] || [ "$mode" = quick ]; then
  if grep -qE '(passed|failed|error|skipped).* in [0-9.]+s' "$OUT/tests.log"; then
    summary+=("tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1)")
  else
    summary+=("tests: stopped by the timeout before pytest's summary; its progress lines: $(progress_counts "$OUT/tests.log")")
  fi
fi

if [ "$mode" = full ] || [ "$mode" = sanitize ]; then
  step "compute-sanitizer"
  # The whole full mode took 470 s on one H200 (session 62); initcheck alone 13 s.
  for tool in memcheck racecheck initcheck; do
    # No caching allocator: memcheck then sees each buffer's true bounds.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 \
      python3 scripts/sanitize_ops.py > "$OUT/sanitizer_$tool.log" 2>&1
    summary+=("sanitizer $tool: exit $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)")
    tail -3 "$OUT/sanitizer_$tool.log"
  done
  # The ops on 12 seeded random configurations each, beyond sanitize_ops.py's fixed shapes: the head
  # ops (test_random_shapes.py, where initcheck found the sampling decode reading unwritten partials
  # in session 67) and the decoder-layer ops (test_random_decoder_ops.py); both files took 24 s
  # under memcheck and 20 s under initcheck on one H200 (session 68).
  if [ "$mode" = sanitize ]; then
    for tool in memcheck initcheck; do
      FLASHHEAD_RANDOM_DRAWS=12 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool "$tool" \
        --print-limit 20 python3 -m pytest python_tests/test_random_shapes.py python_tests/test_random_decoder_ops.py \
        -q -m gpu -p no:cacheprovider \
        > "$OUT/sanitizer_random_$tool.log" 2>&1
      summary+=("sanitizer $tool, random configurations: exit $?, $(grep -E 'passed|failed' "$OUT/sanitizer_random_$tool.log" | tail -1), $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_random_$tool.log" | tail -1)")
      tail -2 "$OUT/sanitizer_random_$tool.log"
    done
  fi
fi

if [ "$mode" = full ] || [ "$mode" = quick ]; then  # cpu's tests take the whole call
  step "head benchmark"
  rm -f "$OUT/bench_head.json"  # cpp_bench reads this run's bandwidth from it, never an earlier run's
  timeout 300 python3 -m flashhead_ext.bench head --json "$OUT/bench_head.json" 2>&1 | tee "$OUT/bench_head.log"
  summary+=("bench head: exit ${PIPESTATUS[0]}")
fi

if [ "$mode" = two ]; then
  step "tests across two GPUs, and the PEFT/accelerate tests"
  nvidia-smi -L
  timeout 400 python3 -m pytest python_tests -q -n 4 -p no:cacheprovider -rs \
    -k "two_gpus or test_peft_accelerate" 2>&1 | tee "$OUT/tests_two.log" | tail -12
  summary+=("two GPUs: $(grep -E '(passed|failed|error)' "$OUT/tests_two.log" | tail -1)")
fi

if [ "$mode" = jit ]; then
  step "op tests, the kernels compiled from sm_80's PTX at load"
  so=$(python3 -c "import flashhead_ext._C as c; print(c.__file__)")
  if command -v cuobjdump > /dev/null; then
    summary+=("_C holds $(cuobjdump --list-ptx "$so" | grep -c 'sm_80') sm_80 PTX files, $(cuobjdump --list-elf "$so" | grep -c 'sm_') cubins")
  fi
  timeout 330 python3 -m pytest python_tests/test_cuda_shapes.py python_tests/test_ops_equality.py \
    python_tests/test_sampling.py python_tests/test_fp8_centroids.py python_tests/test_decoder_ops.py \
    python_tests/test_layouts.py python_tests/test_compile_graphs.py -q -m gpu -n 12 -p no:cacheprovider \
    2>&1 | tee "$OUT/tests_jit.log" | tail -8
  summary+=("op tests from sm_80's PTX: $(progress_counts "$OUT/tests_jit.log")")
fi

# cpp_bench: the device image has no Google Benchmark, so the binaries are built on the host
# (bash scripts/build_cpp_bench.sh with CMAKE_CUDA_ARCHITECTURES=90) and carried in .cppb/
# with libbenchmark; cuBLAS comes from torch's nvidia wheels.
if [ "$mode" = full ] && [ -d .cppb ]; then
  step "cpp_bench"
  cublas_dir=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
  export LD_LIBRARY_PATH=$PWD/.cppb:$cublas_dir:${LD_LIBRARY_PATH:-}
  # The bandwidth bench head measured on this machine; without it no % of peak (a guess was an H200's).
  peak=$(python3 -c "import json; print(round(json.load(open('$OUT/bench_head.json'))['meta']['copy_bandwidth_gbs']))" 2>/dev/null)
  for bin in .cppb/bench_*; do
    [ -x "$bin" ] || continue
    timeout 60 "$bin" --benchmark_min_time=0.02 ${peak:+--peak_gbps="$peak"} --benchmark_out="$OUT/cpp_$(basename "$bin").json" \
      --benchmark_out_format=json > "$OUT/cpp_$(basename "$bin").log" 2>&1
    rc=$?
    summary+=("cpp ${bin##*/}: exit $rc")
  done
  grep -hE "^BM_(decode|dense)" "$OUT"/cpp_bench_decode.log "$OUT"/cpp_bench_dense_baseline.log | grep -E "B:1/|/1/" | head -12
fi

step "summary"
printf '%s\n' "${summary[@]}"
# This run's benchmark only: $OUT may hold an earlier run's log.
if [ "$mode" = full ] || [ "$mode" = quick ]; then sed -n '/^summary:/,$p' "$OUT/bench_head.log"; fi
