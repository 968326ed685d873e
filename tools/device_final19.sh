#!/usr/bin/env bash
# H200, session 19's measurement call: the cooperative-matrix attention's tests with the
# validation layer (kernel and a whole-model prefill against the float64 references), then the
# dense synth shapes (hub only and mode:cuda>=32) in the tree before the consolidation (.before)
# and this one beside llama.cpp's llama-server (tools/bench_before_after.sh), then the
# Qwen3-30B-A3B-shaped MoE beside llama.cpp (tools/bench_models.py), median of 3 each.
# Carry [".device"]; .before travels untracked. Results in $OUT.
BUDGET_S=${BUDGET_S:-540}
. tools/device_common.sh || exit 1
synth_bg qwen3moe30b q4_k; moe_pid=$!
synth_bg llama8b q4_0 150; l8_pid=$!
VKXSPLIT_VALIDATION=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_ops_attention.py tests/test_archs.py > "$OUT/tests.log" 2>&1
echo "== tests rc=$?: $(tail -n 1 "$OUT/tests.log")"; grep -E "^_+ test|^E  .*Error" "$OUT/tests.log" | head
stamp "tests done"
wait $l8_pid
# the tree before the consolidation (.before, tools/bench_before_after.sh) and this one, shape by
# shape, hub only and mode:cuda>=32, llama.cpp beside them (its warm-up run included)
bash tools/bench_before_after.sh "smol135m:q4_1,llama1b:q4_0,llama8b:q4_0" "none;mode:cuda>=32" 2>&1 | tail -n 30
stamp "dense done"
wait $moe_pid; echo "moe synth rc=$?"
t=$(( $(left) - 5 ))
if (( t > 60 )); then
  timeout $t python3 tools/bench_models.py --shapes qwen3moe30b:q4_k --splits none -p 512 -n 128 -r 3 2>&1 \
    | tee "$OUT/moe.md" | tail -n 4
else echo "moe skipped: budget"; fi
stamp "all done"
