#!/usr/bin/env bash
# H200: the cooperative-matrix prefill attention (shaders/attention_coopmat.comp). First its
# tests with the validation layer (tests/test_ops_attention.py: the real kernel at head_dim 64
# and 128 against the float64 reference), then pp512 / tg32 of the dense synth shapes with it
# and without it (VKXSPLIT_DISABLE=attn_coopmat), alternated twice, hub only and llama8b's
# mode:cuda>=32, then the prefill per-level profile of llama8b. Carry [".device"]. Results in $OUT.
BUDGET_S=${BUDGET_S:-420}
. tools/device_common.sh || exit 1
synth_bg llama8b q4_0 150; l8_pid=$!
synth_bg llama1b q4_0; synth_bg smol135m q4_1
VKXSPLIT_VALIDATION=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
  tests/test_ops_attention.py > "$OUT/tests.log" 2>&1
echo "== tests rc=$?: $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)|SKIPPED|Error" "$OUT/tests.log" | head
stamp "tests done"
wait
ab() {  # ab SHAPE SPLIT [extra args]
  local f=/tmp/models/$1.gguf
  for i in 1 2; do
    for sw in "" attn_coopmat; do
      r=$(VKXSPLIT_DISABLE=$sw timeout 120 python3 -m vkxsplit bench -m "$f" -p 512 -n 32 -r 3 --split "$2" "${@:3}" \
        -o md 2>&1 | grep -E "pp512|tg32" | awk -F'|' '{gsub(/ /,"",$7); gsub(/^ +| +$/,"",$8); printf "%s %s; ", $7, $8}')
      echo "| $1 | $2 | ${sw:-attn_coopmat on} | $i | $r |" | tee -a "$OUT/ab.md"
    done
  done
}
ab smol135m-q4_1 none
ab llama1b-q4_0 none
ab llama8b-q4_0 none
stamp "hub-only A/B done"
ab llama8b-q4_0 "mode:cuda>=32" --backends cuda
stamp "mode A/B done"
if (( $(left) > 50 )); then
  timeout 45 python3 -m vkxsplit bench -m /tmp/models/llama8b-q4_0.gguf -p 512 -n 4 -r 1 --split none \
    --profile "$OUT/llama8b_profile.json" --profile-steps 2 -o md > "$OUT/llama8b_profile.md" 2>&1
  sed -n '/### prefill/,$p' "$OUT/llama8b_profile.md" | head -16
fi
stamp "all done"
