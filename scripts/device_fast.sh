#!/usr/bin/env bash
# The fast path on a lent GPU in one call (issue 6): build for sm_90, the fast-path and decoder-op
# GPU tests, a kernel profile of one draft step, the draft-step benchmark (eager, fused and
# persistent bodies; then Gemma-3-270M's and Gemma-3-1B's own layers, eager and compiled, beside the
# 270M's dimensions in a Llama layer, and Qwen2.5-0.5B), then the Qwen3-32B-shaped end-to-end
# benchmark; not run by default: other pairs end to end, a Gemma-3-27B-shaped target with
# Gemma-3-270M- and 1B-shaped drafts and a Qwen2.5-7B-shaped one with a Qwen2.5-0.5B-shaped draft
# (stage pairs), and with two GPUs (stage placement) the placement tests and the Qwen3 benchmark
# with the draft on cuda:1. Logs and JSON under $OUT; a short table last.
# Usage: FLASHHEAD_COMMIT=<sha> [STAGES="tests sanitize profile layer draft families spec pairs placement"] \
#          bash scripts/device_fast.sh [PROMPTS] [NEW_TOKENS] [TARGET_BODIES] [DRAFT_BODY]
# (STAGES picks a subset, to stay within one device call's time limit.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_fast}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc)
prompts=${1:-4}
new_tokens=${2:-128}
target_bodies=${3:-compiled}
draft_body=${4:-persistent}
stages=" ${STAGES:-tests sanitize profile layer draft families spec} "
step() { echo; echo "=== $* ($(date +%T))"; }
want() { [[ "$stages" == *" $1 "* ]]; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, sys; print('torch', torch.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"

step "build (sm_90, $MAX_JOBS jobs)"
start=$(date +%s)
if ! python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "build ok in $(( $(date +%s) - start )) s"

want tests && step "fast-path and decoder-op GPU tests" && timeout 300 python3 -m pytest python_tests/test_fast_decoder.py python_tests/test_decoder_ops.py python_tests/test_decoder_step.py -q -m gpu -n 4 --continue-on-collection-errors \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log" | tail -25

want sanitize && step "compute-sanitizer on decoder_step" && for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 \
    python3 scripts/sanitize_ops.py step > "$OUT/sanitizer_step_$tool.log" 2>&1
  echo "$tool: exit $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_step_$tool.log" | tail -1)" | tee -a "$OUT/sanitizer_step.txt"
done

want profile && step "where a $draft_body draft step's time goes (CUDA kernels of one qwen3-0.6b step)" && DRAFT_BODY=$draft_body timeout 120 python3 - > "$OUT/profile.log" 2>&1 <<'PY'
import os
import torch
from torch.profiler import ProfilerActivity, profile
from flashhead_ext.bench.spec import SHAPES
from flashhead_ext.fast import Decoder
model = Decoder.random(SHAPES["qwen3-0.6b"], max_len=1024, dtype=torch.bfloat16, device="cuda")
model.reset(1000)
model.body = os.environ["DRAFT_BODY"]
ids = torch.zeros(1, dtype=torch.int64, device="cuda")
for _ in range(3):
    model.forward(ids)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    model.forward(ids)
    torch.cuda.synchronize()
print(f"kernels per step {sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
PY
want profile && grep -E "^kernels|Self CUDA time total" "$OUT/profile.log"

want layer && step "decoder-layer ops vs torch" && timeout 150 python3 -m flashhead_ext.bench layer-ops --json "$OUT/layer_ops.json" 2>&1 | tee "$OUT/layer_ops.log"

want draft && step "draft step (eager, fused and persistent bodies)" && timeout 200 python3 -m flashhead_ext.bench draft-step --attention matmul --bodies eager,fused,persistent \
  --json "$OUT/draft_step.json" 2>&1 | tee "$OUT/draft_step.log"

want families && step "draft step, other families: Gemma-3-270M's and 1B's layers (eager, compiled), the 270M's dimensions in a Llama layer, Qwen2.5-0.5B" \
  && timeout 500 python3 -m flashhead_ext.bench draft-step --attention matmul --shapes gemma3-270m,gemma3-1b,gemma3-270m-llama,qwen2.5-0.5b \
  --bodies eager,compiled,persistent --json "$OUT/draft_step_families.json" 2>&1 | tee "$OUT/draft_step_families.log"

# spec NAME [ARGS...]: the end-to-end run (bench spec's default pair: Qwen3-32B and Qwen3-0.6B shapes)
# for each target body, logged as spec_NAME_<body>.
spec() {
  local name=$1 body; shift
  for body in $target_bodies; do
    step "spec ($name): target body $body, draft body $draft_body, synthetic R=0.77, K=6 $*"
    timeout 300 python3 -m flashhead_ext.bench spec --attention matmul --body "$draft_body" --target-body "$body" \
      --num-prompts "$prompts" --max-new-tokens "$new_tokens" --json "$OUT/spec_${name}_$body.json" "$@" 2>&1 \
      | grep -v "prompts:" > "$OUT/spec_${name}_$body.log"
    echo "exit $?"
  done
}

want spec && spec target
want pairs && spec gemma270m --target gemma3-27b --draft gemma3-270m
want pairs && spec gemma1b --target gemma3-27b --draft gemma3-1b
want pairs && spec qwen25 --target qwen2.5-7b --draft qwen2.5-0.5b

want placement && step "two GPUs: placement tests" && timeout 300 python3 -m pytest python_tests -q -m gpu -k "second_gpu or current_one" \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests_two_gpus.log" | tail -5 && spec two_gpus --draft-device cuda:1

step "summary ($stages)"
want tests && grep -E "(passed|failed|error)" "$OUT/tests_gpu.log" | tail -1
want tests && grep -E "^FAILED" "$OUT/tests_gpu.log" | head
want sanitize && cat "$OUT/sanitizer_step.txt"
want layer && grep -v wrote "$OUT/layer_ops.log"
want draft && grep -v wrote "$OUT/draft_step.log"
want families && grep -v wrote "$OUT/draft_step_families.log"
want spec && for body in $target_bodies; do cat "$OUT/spec_target_$body.log"; done
want pairs && for body in $target_bodies; do cat "$OUT/spec_gemma270m_$body.log" "$OUT/spec_gemma1b_$body.log" "$OUT/spec_qwen25_$body.log"; done
want placement && grep -E "(passed|failed|error)" "$OUT/tests_two_gpus.log" | tail -1
want placement && for body in $target_bodies; do cat "$OUT/spec_two_gpus_$body.log"; done
true
