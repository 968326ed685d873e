#!/usr/bin/env bash
# H200, session 20's second call: the decode fusions of this session (attention folding its KV
# split merge: attn_fold; gate/up mat-vecs with SwiGLU in one kernel: fuse_glu). Their tests with
# the validation layer, then per shape the default beside llama.cpp and with both switched off,
# alternated (on, off, on; llama8b also each alone), the per-level decode profile of llama8b,
# and `auto` beside none and mode:cuda>=32. Carry [".device"]. Results in $OUT.
BUDGET_S=${BUDGET_S:-570}
. tools/device_common.sh || exit 1
synth_bg llama8b q4_0 150; l8=$!
synth_bg llama1b q4_0 100
synth_bg smol135m q4_1 60
VKXSPLIT_VALIDATION=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_ops_attention.py tests/test_fusion.py ${EXTRA_TESTS:-} > "$OUT/tests.log" 2>&1
echo "== tests rc=$?: $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)|^E  .*Error" "$OUT/tests.log" | head
stamp "tests done"
wait
timeout 120 python3 tools/bench_models.py --shapes smol135m:q4_1 --splits none -r 1 -p 512 -n 16 --server /nonexistent >/dev/null 2>&1
bm() {  # bm LABEL SHAPE [bench_models args...]
  local label=$1 s=$2; shift 2
  echo "## $label $s" >> "$OUT/ab.md"
  timeout 150 python3 tools/bench_models.py --shapes "$s" --splits none -r 3 "$@" 2>&1 | tail -n 1 | tee -a "$OUT/ab.md"
}
for s in smol135m:q4_1 llama1b:q4_0 llama8b:q4_0; do
  bm on "$s"
  VKXSPLIT_DISABLE=attn_fold,fuse_glu bm off "$s" --server /nonexistent
  bm on "$s" --server /nonexistent
done
VKXSPLIT_DISABLE=attn_fold bm glu-only llama8b:q4_0 --server /nonexistent
VKXSPLIT_DISABLE=fuse_glu bm fold-only llama8b:q4_0 --server /nonexistent
stamp "a/b done"
timeout 150 python3 -m vkxsplit bench -m /tmp/models/llama8b-q4_0.gguf -p 512 -n 16 -r 1 --split none \
  --profile "$OUT/profile_l8.json" --profile-steps 8 -o md > "$OUT/profile_l8.md" 2>&1
grep -E "levels per|GPU busy" "$OUT/profile_l8.md" | head -4
stamp "profile done"
t=$(( $(left) - 5 ))
if (( t > 60 )); then
  timeout $t python3 tools/bench_models.py --shapes llama1b:q4_0,llama8b:q4_0 --backends cuda \
    --splits "none;auto;mode:cuda>=32" -r 3 --server /nonexistent 2>&1 | tee "$OUT/auto.md" | tail -n 8
else echo "auto skipped: budget"; fi
stamp "all done"
