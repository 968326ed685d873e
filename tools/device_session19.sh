#!/usr/bin/env bash
# H200, session 19's first call (~9 min): the consolidation issue's before/after of the three
# dense shapes in the other order (ORDER=after-first; session 18 ran before first), then the
# validation-layer run of the spec-constant coopmat / cm2 / vecq kernel tests with what time is
# left. Carry [".device"]; .before travels untracked (tools/bench_before_after.sh). Results in $OUT.
BUDGET_S=${BUDGET_S:-570}
. tools/device_common.sh || exit 1
synth_bg llama8b q4_0 150
ORDER=after-first bash tools/bench_before_after.sh "smol135m:q4_1,llama1b:q4_0" "none;mode:cuda>=32" 2>&1 | tail -n 30
cp "$OUT/before_after.md" "$OUT/before_after_small.md"; stamp "small shapes done"
wait
ORDER=after-first bash tools/bench_before_after.sh "llama8b:q4_0" "none;mode:cuda>=32" 2>&1 | tail -n 12
stamp "before/after done"
t=$(( $(left) - 10 ))
VKXSPLIT_VALIDATION=1 timeout $t python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_mul_mat_cm2.py tests/test_mul_mat.py tests/test_moe.py -k "cm2 or coopmat or vecq" \
  > "$OUT/tests.log" 2>&1
echo "== tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
stamp "all done"
