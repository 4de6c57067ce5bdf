#!/usr/bin/env bash
# The fast path on a lent GPU in one call (issue 6): build for sm_90, the fast-path and decoder-op
# GPU tests, a kernel profile of one fused draft step, the draft-step benchmark (eager and fused
# bodies), then the Qwen3-32B-shaped end-to-end benchmark. Logs and JSON under $OUT; a short table last.
# Usage: FLASHHEAD_COMMIT=<sha> bash scripts/device_fast.sh [PROMPTS] [NEW_TOKENS] [TARGET_BODIES]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_fast}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc)
prompts=${1:-4}
new_tokens=${2:-128}
target_bodies=${3:-fused}
step() { echo; echo "=== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, sys; print('torch', torch.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"

step "build (sm_90, $MAX_JOBS jobs)"
start=$(date +%s)
if ! python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "build ok in $(( $(date +%s) - start )) s"

step "fast-path and decoder-op GPU tests"
timeout 300 python3 -m pytest python_tests/test_fast_decoder.py $(ls python_tests/test_decoder_ops.py 2>/dev/null) -q -m gpu -n 4 --continue-on-collection-errors \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log" | tail -25

step "where a fused draft step's time goes (CUDA kernels of one qwen3-0.6b step)"
timeout 120 python3 - > "$OUT/profile.log" 2>&1 <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from flashhead_ext.bench.spec import SHAPES
from flashhead_ext.fast import Decoder
model = Decoder.random(SHAPES["qwen3-0.6b"], max_len=1024, dtype=torch.bfloat16, device="cuda")
model.reset(1000)
model.body = "fused"
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
grep -E "^kernels|Self CUDA time total" "$OUT/profile.log"

step "decoder-layer ops vs torch"
timeout 150 python3 -m flashhead_ext.bench layer-ops --json "$OUT/layer_ops.json" 2>&1 | tee "$OUT/layer_ops.log"

step "draft step (eager and fused bodies)"
timeout 200 python3 -m flashhead_ext.bench draft-step --attention matmul --bodies eager,fused \
  --json "$OUT/draft_step.json" 2>&1 | tee "$OUT/draft_step.log"

for body in $target_bodies; do
  step "spec: Qwen3-32B-shaped target ($body), Qwen3-0.6B-shaped draft (fused), synthetic R=0.77, K=6"
  timeout 300 python3 -m flashhead_ext.bench spec --attention matmul --body fused --target-body "$body" \
    --num-prompts "$prompts" --max-new-tokens "$new_tokens" --json "$OUT/spec_target_$body.json" 2>&1 \
    | grep -v "prompts:" > "$OUT/spec_target_$body.log"
  echo "exit $?"
done

step "summary"
grep -E "(passed|failed|error)" "$OUT/tests_gpu.log" | tail -1
grep -E "^FAILED" "$OUT/tests_gpu.log" | head
grep -v wrote "$OUT/layer_ops.log"
grep -v wrote "$OUT/draft_step.log"
for body in $target_bodies; do cat "$OUT/spec_target_$body.log"; done
