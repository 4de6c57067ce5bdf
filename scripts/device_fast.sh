#!/usr/bin/env bash
# The fast path on a lent GPU in one call (issue 6): build for sm_90, the fast-path GPU tests, a
# kernel profile of one draft step, the draft-step benchmark with each attention, then the full
# Qwen3-32B-shaped end-to-end benchmark with the faster one. Logs and JSON under $OUT; a short table printed last.
# Usage: FLASHHEAD_COMMIT=<sha> bash scripts/device_fast.sh [PROMPTS] [NEW_TOKENS]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_fast}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc)
prompts=${1:-8}
new_tokens=${2:-128}
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

step "fast-path GPU tests"
timeout 240 python3 -m pytest python_tests/test_fast_decoder.py -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log" | tail -25

step "where a draft step's time goes (CUDA kernels of one eager qwen3-0.6b step, per attention)"
timeout 120 python3 - > "$OUT/profile.log" 2>&1 <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from flashhead_ext.bench.spec import SHAPES
from flashhead_ext.fast import Decoder
model = Decoder.random(SHAPES["qwen3-0.6b"], max_len=1024, dtype=torch.bfloat16, device="cuda")
model.reset(1000)
ids = torch.zeros(1, dtype=torch.int64, device="cuda")
for attention in ("sdpa", "matmul"):
    model.attention = attention
    for _ in range(3):
        model.forward(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(ids)
        torch.cuda.synchronize()
    print(f"--- attention {attention}: kernels per step {sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
PY
grep -E "^---|Self CUDA time total" "$OUT/profile.log"

step "draft step (sdpa and matmul attention)"
for attention in sdpa matmul; do
  timeout 150 python3 -m flashhead_ext.bench draft-step --attention $attention --json "$OUT/draft_step_$attention.json" 2>&1 \
    | tee "$OUT/draft_step_$attention.log"
done
best=$(python3 -c "
import json
step = {a: next(r['step_us'] for r in json.load(open('$OUT/draft_step_' + a + '.json'))['rows'] if r['shape'] == 'qwen3-0.6b' and r['head'] == 'dense') for a in ('sdpa', 'matmul')}
print(min(step, key=step.get))" 2>/dev/null || echo sdpa)
echo "faster attention at qwen3-0.6b: $best"

step "spec: Qwen3-32B-shaped target, Qwen3-0.6B-shaped draft, synthetic R=0.77, K=6, attention $best"
timeout 300 python3 -m flashhead_ext.bench spec --attention "$best" --num-prompts "$prompts" --max-new-tokens "$new_tokens" \
  --json "$OUT/spec.json" 2>&1 | grep -v "prompts:" > "$OUT/spec.log"
echo "exit $?"

step "summary"
grep -E "(passed|failed|error)" "$OUT/tests_gpu.log" | tail -1
grep -hv wrote "$OUT/draft_step_sdpa.log" "$OUT/draft_step_matmul.log"
cat "$OUT/spec.log"
