#!/usr/bin/env bash
# H200, one call (~3 min): the decode glue kernels after the wide norm / argmax workgroups and
# the router's subgroup reductions: their tests with the validation layer, tools/bench_levels.py
# at llama8b's and Qwen3-30B-A3B's shapes, then tg128 of both models and the MoE decode's
# per-level profile. Carry [".device"]. Results in $OUT.
BUDGET_S=${BUDGET_S:-240}
. tools/device_common.sh || exit 1
synth_bg qwen3moe30b q4_k 150
p1=$!
synth_bg llama8b q4_0 100
p2=$!
VKXSPLIT_VALIDATION=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_ops_elementwise.py tests/test_moe.py -k "norm or argmax or topk" > "$OUT/tests.log" 2>&1
echo "== tests rc=$?: $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
timeout 40 python3 tools/bench_levels.py 2>&1 | tee "$OUT/levels_8b.md" | tail -n 13
timeout 40 python3 tools/bench_levels.py --embd 2048 --ff 768 --vocab 151936 2>&1 | tee "$OUT/levels_moe.md" | tail -n 13
stamp "levels done"
wait $p2; echo "l8 synth rc=$?"
[[ -f $l8 ]] && timeout 60 python3 -m vkxsplit bench -m "$l8" -p 16 -n 128 -r 3 --split none -o md 2>&1 | grep tg128
stamp "l8 done"
wait $p1; echo "moe synth rc=$?"
[[ -f $moe ]] && timeout 60 python3 -m vkxsplit bench -m "$moe" -p 16 -n 128 -r 3 --split none -o md 2>&1 | grep tg128
(( $(left) > 30 )) && timeout 50 python3 -m vkxsplit bench -m "$moe" -p 16 -n 32 -r 1 --split none \
    --profile "$OUT/moe_profile.json" --profile-steps 8 -o md > "$OUT/moe_profile.md" 2>&1
grep "### decode" "$OUT/moe_profile.md"; stamp "all done"
