#!/usr/bin/env bash
# The CPU test suite against one torch and transformers pair: a fresh venv and a clone of the
# committed HEAD under $FLASHHEAD_COMPAT_DIR (default /tmp/flashhead-compat), installed as
# scripts/run.sh installs it (its [test,models] extras) with the CPU references only, with the
# interpreter $PYTHON (default python3). The README lists the combinations that passed.
# Usage: [PYTHON=python3.10] bash scripts/compat.sh <torch version> <transformers version> [pytest args]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bash scripts/compat.sh <torch version> <transformers version> [pytest args]" >&2; exit 2; }
torch_version=$1 transformers_version=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
interpreter=${PYTHON:-python3}
python_version=$("$interpreter" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
work=${FLASHHEAD_COMPAT_DIR:-/tmp/flashhead-compat}/python-$python_version-torch-$torch_version-transformers-$transformers_version
mkdir -p "$work"
[ -x "$work/venv/bin/python" ] || "$interpreter" -m venv "$work/venv"
python=$work/venv/bin/python
pipq() { "$python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
rm -rf "$work/tree"
git clone -q "$root" "$work/tree"
cd "$work/tree"
# torch first: the extension is compiled against it (--no-build-isolation).
pipq "torch==$torch_version" numpy setuptools wheel
FLASHHEAD_SKIP_CUDA_BUILD=1 MAX_JOBS=${MAX_JOBS:-2} pipq --no-build-isolation -e ".[test,models]" \
  "transformers==$transformers_version" pytest-xdist
"$python" -c "import sys, torch, transformers
print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__)"
"$python" -m pytest python_tests -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" "$@"
