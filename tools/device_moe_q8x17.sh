#!/usr/bin/env bash
# H200, one device call, under 8 minutes: the MoE decode's q8_1 x written by its producers
# (issue 24: the q8_1 pass of vkxsplit/fusion.py over the routed products) against the graph
# in which every routed product quantizes its own x ("before": ops.moe.vecq_id_decode giving
# nothing, so the pass leaves the products alone; everything else the same). Carry [".device"].
# Results in $OUT:
#   tests.log           the tests of the change with the validation layer (test_moe.py's routed
#                       q8_1 decode, test_moe_model.py's decode / cpu-backend tests, the fusion
#                       fixture's MoE entry)
#   tg_{before,after}_N.md   vkxsplit bench of the synthetic Qwen3-30B-A3B (Q4_K), hub only,
#                       -p 16 -n 128 -r 3, alternating before / after (N = 1, 2)
#   profile_{before,after}.md  vkxsplit bench --profile of its decode: the "### decode" line
#                       gives the levels per step and per layer (want: 2 levels per layer fewer
#                       after), the tables the time per op and per level
# env: TESTS_S (default 120), BUDGET_S (450: the benchmarks get what is left of it).
BUDGET_S=${BUDGET_S:-450}
. tools/device_common.sh || exit 1

model=/tmp/models/qwen3moe30b-q4_k.gguf
mkdir -p /tmp/models/part
if [[ ! -f $model ]]; then
  ( timeout 300 python3 -m vkxsplit synth --shape qwen3moe30b --type q4_k -o /tmp/models/part/qwen3moe30b-q4_k.gguf \
      > "$OUT/synth.log" 2>&1 && mv /tmp/models/part/qwen3moe30b-q4_k.gguf "$model" ) &
  synth_pid=$!
else
  synth_pid=
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

VKXSPLIT_VALIDATION=1 timeout ${TESTS_S:-120} python3 -m pytest -q -ra -p no:cacheprovider -o addopts="" --durations=5 \
  tests/test_moe.py tests/test_moe_model.py tests/test_fusion.py \
  -k "vecq or producers or q8_1 or cpu_backend or model_logits or moe_decode_entry or hand_fused" > "$OUT/tests.log" 2>&1
echo "== tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests.log" | head -n 20
stamp "tests done"

if [[ -n $synth_pid ]]; then
  wait "$synth_pid"; echo "synth rc=$? ($(tail -n 1 "$OUT/synth.log"))"
fi
[[ -f $model ]] || { echo "no $model"; exit 1; }
stamp "synth done"

# "before": the routed products left out of the q8_1 pass (each records its own quantize)
vkx() {
  if [[ $1 == before ]]; then shift
    python3 -c 'import sys
from vkxsplit.ops import moe
moe.vecq_id_decode = lambda device: {}
from vkxsplit.cli import main
sys.exit(main(sys.argv[1:]))' "$@"
  else shift; python3 -m vkxsplit "$@"; fi
}
for rep in 1 2; do
  for which in before after; do
    (( $(left) > 40 )) || { echo "bench $which $rep skipped: budget"; continue; }
    timeout 120 bash -c "$(declare -f vkx); vkx $which bench -m $model -p 16 -n 128 -r 3 --split none -o md" \
      > "$OUT/tg_${which}_${rep}.md" 2>&1
    echo "$which $rep rc=$?: $(grep tg128 "$OUT/tg_${which}_${rep}.md")"
  done
done
stamp "tg done"
for which in before after; do
  (( $(left) > 40 )) || { echo "profile $which skipped: budget"; continue; }
  timeout 100 bash -c "$(declare -f vkx); vkx $which bench -m $model -p 16 -n 32 -r 1 --split none \
    --profile $OUT/profile_${which}.json --profile-steps 8 -o md" > "$OUT/profile_${which}.md" 2>&1
  echo "profile $which rc=$?: $(grep '### decode' "$OUT/profile_${which}.md")"
done
stamp "all done"
