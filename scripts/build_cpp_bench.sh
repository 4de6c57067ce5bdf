#!/usr/bin/env bash
# Configures and compiles cpp_bench/ (Google Benchmark over csrc/kernels, no libtorch) so that a
# kernel or benchmark that does not compile fails the test command, GPU or not; then runs the
# launcher checks that need no GPU.
# Skips with a message only where no nvcc exists at all.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$nvcc" ]; then echo "cpp_bench: no nvcc found, not compiled"; exit 0; fi
if [ ! -f /usr/include/benchmark/benchmark.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq libbenchmark-dev) >/dev/null
fi
build=${CPP_BENCH_BUILD:-build/cpp_bench}
cmake -S . -B "$build" -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_BUILD_TYPE=Release ${CPP_BENCH_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "${MAX_JOBS:-2}"
echo "cpp_bench: built $(ls "$build"/bench_* 2>/dev/null | wc -l) binaries in $build"
"$build"/test_launcher_limits
