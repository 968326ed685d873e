#!/usr/bin/env bash
# nvidia-h200-x2, one call: a model over two hubs (one per H200) after the hubs became planner
# participants: the hub tests with one hub per GPU (devices 0,1; validation layer on), then
# tools/bench_multigpu.py on llama8b q4_0 (one GPU, the layer split with 4 and 1 micro-batches,
# the row split with f32 and f16 partials) to set beside docs/MULTI_GPU.md's table, then the
# plan of both splits over the two GPUs. Carry [".device"]; results in $OUT.
# env: TESTS=0 (skip the tests), BENCH=0 (skip the bench), REPS (default 3), BENCH_S.
. tools/device_common.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ ${TESTS:-1} == 1 ]]; then
  VKXSPLIT_VALIDATION=1 timeout 300 python3 -m pytest -q -ra -p no:cacheprovider -o addopts="" \
    tests/test_hubs_layer.py tests/test_hubs_row.py tests/test_hubs_plan.py tests/test_link.py 2>&1 \
    | tee "$OUT/tests_hubs.log" | tail -n 15
fi
if [[ ${BENCH:-1} == 1 ]]; then
  mkdir -p /tmp/models
  timeout ${BENCH_S:-420} python3 tools/bench_multigpu.py --dir /tmp/models -r ${REPS:-3} \
    --splits "one-gpu;layer:1,1;layer:1,1:m1;tensor:1,1;tensor:1,1:f16" 2>&1 | tee "$OUT/bench_multigpu.md" | tail -n 9
  f=/tmp/models/llama8b-q4_0.gguf
  for split in layer:1,1 tensor:1,1; do
    [[ -f $f ]] && timeout 120 python3 -m vkxsplit plan -m "$f" --devices 0,1 --split "$split" -t 1,512 \
      > "$OUT/plan_${split%%:*}.txt" 2>&1; echo "plan $split rc=$?"
  done
fi
