#!/usr/bin/env bash
# H200, session 20's first call: the tests of what changed since the last GPU run (the attention
# review fixes, the cpu backend's repacked weights, the model tests with the cpu wheel), the
# SmolLM2-shaped mode:cuda>=32 cell before/after the consolidation in both orders (the one cell
# of the consolidation issue's table below its "before"), and the Q4_K_M-mix dense shapes
# (Llama-8B and Qwen3-8B) beside llama.cpp. Carry [".device"]; .before travels untracked.
BUDGET_S=${BUDGET_S:-560}
. tools/device_common.sh || exit 1
synth_bg llama8b q4_k_m 200; l8_pid=$!
synth_bg qwen3_8b q4_k_m 240; q8_pid=$!
VKXSPLIT_VALIDATION=1 timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_ops_attention.py tests/test_archs.py tests/test_cpu_repack.py > "$OUT/tests.log" 2>&1
echo "== tests rc=$?: $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)|^E  .*Error" "$OUT/tests.log" | head
stamp "tests done"
REPS=3 bash tools/bench_before_after.sh smol135m:q4_1 "mode:cuda>=32;none" 2>&1 | grep -E "^\||^##" | tail -n 12
cp "$OUT/before_after.md" "$OUT/before_after_1.md"
ORDER=after-first REPS=3 bash tools/bench_before_after.sh smol135m:q4_1 "mode:cuda>=32;none" 2>&1 | grep -E "^\||^##" | tail -n 12
stamp "smol done"
wait $l8_pid; wait $q8_pid; ls -la /tmp/models
t=$(( $(left) - 5 ))
if (( t > 60 )); then
  timeout $t python3 tools/bench_models.py --shapes llama8b:q4_k_m,qwen3_8b:q4_k_m --splits none -p 512 -n 128 -r 3 2>&1 \
    | tee "$OUT/q4km.md" | tail -n 6
else echo "q4_k_m skipped: budget"; fi
stamp "all done"
