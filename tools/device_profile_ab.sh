#!/usr/bin/env bash
# H200: the per-level profile (vkxsplit bench --profile) of one shape's prefill and decode in the
# checkout and in an older tree unpacked in .before (see tools/bench_before_after.sh), twice each,
# alternated, to find which op a before/after difference lives in. env: SHAPE (default
# llama1b:q4_0), SPLIT (default none). Carry [".device"]. Tables in $OUT/profile_{after,before}_N.md.
BUDGET_S=${BUDGET_S:-300}
. tools/device_common.sh || exit 1
shape=${SHAPE:-llama1b:q4_0}; f=/tmp/models/${shape%%:*}-${shape##*:}.gguf
synth_bg "${shape%%:*}" "${shape##*:}"; wait
(cd .before && python3 native/build_native.py >/dev/null 2>&1)
for i in 1 2; do
  for tree in after before; do
    d=.; [[ $tree == before ]] && d=.before
    (cd $d && timeout 100 python3 -m vkxsplit bench -m "$f" -p 512 -n 16 -r 3 --split "${SPLIT:-none}" \
      --profile "$OUT/profile_${tree}_$i.json" --profile-steps 4 -o md > "$OUT/profile_${tree}_$i.md" 2>&1)
    echo "== $tree $i"; grep -E "^\| (pp|tg)|t/s" "$OUT/profile_${tree}_$i.md" | head -4
  done
done
stamp done
