#!/usr/bin/env bash
# H200, the session's last call (~9 min), most important first: the kernel tests of this
# session's changes with the validation layer (TESTS), the MoE shape's glue kernels
# (tools/bench_levels.py), the three dense shapes before (.before: the tree before the
# consolidation) and after, hub only and mode:cuda>=32, beside llama.cpp
# (tools/bench_before_after.sh), llama8b's decode per level, then the Qwen3-30B-A3B-shaped MoE
# beside llama.cpp (tools/bench_models.py) with what time is left. Carry [".device"]; .before
# travels untracked (see bench_before_after.sh). env: TESTS, TESTS_S, BUDGET_S. Results in $OUT.
BUDGET_S=${BUDGET_S:-550}
. tools/device_common.sh || exit 1
moe=/tmp/models/qwen3moe30b-q4_k.gguf; l8=/tmp/models/llama8b-q4_0.gguf
synth_bg qwen3moe30b q4_k
synth_pid=$!
synth_bg llama8b q4_0 100
l8_pid=$!
VKXSPLIT_VALIDATION=1 timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  ${TESTS:-tests/test_ops_elementwise.py tests/test_moe.py tests/test_ops_attention.py -k "norm or argmax or topk or combine or decode"} \
  > "$OUT/tests.log" 2>&1
echo "== tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
timeout 40 python3 tools/bench_levels.py --embd 2048 --ff 768 --vocab 151936 --heads 32,4,128 2>&1 \
  | tee "$OUT/levels_moe.md" | tail -n 14
stamp "tests and levels done"
wait "$l8_pid"
bash tools/bench_before_after.sh "smol135m:q4_1,llama1b:q4_0,llama8b:q4_0" "none;mode:cuda>=32" 2>&1 | tail -n 40
stamp "before/after done"
if (( $(left) > 70 )); then
  timeout 50 python3 -m vkxsplit bench -m "$l8" -p 512 -n 16 -r 1 --split none --profile "$OUT/llama8b_profile.json" \
    --profile-steps 8 -o md > "$OUT/llama8b_profile.md" 2>&1; grep "### decode" "$OUT/llama8b_profile.md"
fi
wait "$synth_pid"; echo "moe synth rc=$?"
t=$(( $(left) - 5 ))
if (( t > 60 )); then
  timeout $t python3 tools/bench_models.py --shapes qwen3moe30b:q4_k --splits none -p 512 -n 128 -r 3 2>&1 \
    | tee "$OUT/moe.md" | tail -n 8
else echo "moe skipped: budget"; fi
stamp "all done"
