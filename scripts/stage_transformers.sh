#!/usr/bin/env bash
# Stages, for a lent GPU, the transformers release that CI installs (the newest 5.x; the device image
# has an older one and no network): its wheel and the wheels of what it needs, for the device's
# Python 3.12, into (ignored) .whl/. numpy is left out: the device's own satisfies it, and its wheel
# alone would take a quarter of a call's 64 MiB. Then carry [".whl"]: scripts/device_run.sh installs
# it from there before it builds, and its summary names the transformers it tested.
# Usage: bash scripts/stage_transformers.sh [VERSION] (default: the newest release pyproject.toml admits).
set -euo pipefail
cd "$(dirname "$0")/.."
# By default the requirement the `models` extra states, so the two cannot drift apart.
spec=${1:+transformers==$1}
spec=${spec:-$(python3 -c "import tomllib; extra = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['models']; print(next(r for r in extra if r.startswith('transformers')))")}
rm -rf .whl
python3 -m pip download -q --disable-pip-version-check -d .whl --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_34_x86_64 "$spec" 2>&1 | { grep -v "^WARNING: Location" || true; }
rm -f .whl/numpy-*.whl
ls .whl/transformers-*.whl
du -sh .whl
