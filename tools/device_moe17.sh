#!/usr/bin/env bash
# H200, one device call, under 6 minutes: the mixture-of-experts products (issue 24). Carry
# [".device", "build/tool-spv"], with build/tool-spv fresh for the current shaders (here first:
#   python tools/build_tool_shaders.py --only 'mul_mat_id_'
# the emulated routed kernels the tests need and the tilings / decode shapes the sweeps time;
# without them those tests skip and the sweeps show only the shipped kernels). Results in $OUT:
#   tests_moe.log    tests/test_moe.py + tests/test_moe_model.py with the validation layer (on
#                    the H200 the grouped products of T >= 8 pairs per expert take the
#                    cooperative-matrix tiles, so these run the real kernel, not the emulation)
#   bench_moe.md     tools/bench_moe.py: per-layer us of the routed products by path and T
#                    against the bound (vec_f32 / vec_q8_1 mat-vecs, tiled / coopmat grouped
#                    tiles, * = the default), the decode shapes at T = 1, the coopmat tiles
#                    checked against the f32 tiles (FAIL past 1e-2), the tiling sweep
#   bench_models.md  tools/bench_models.py --shapes qwen3moe30b:q4_k -r 2 beside llama.cpp
# The synthetic Qwen3-30B-A3B file (~17 GB) is written in the background while the tests and
# the kernel benchmark run, into a temporary name that is renamed when complete.
# env: TESTS_S (default 100), MOE_S (70), BUDGET_S (350: bench_models gets what is left of it).
BUDGET_S=${BUDGET_S:-350}
. tools/device_common.sh || exit 1

model=/tmp/models/qwen3moe30b-q4_k.gguf   # the name tools/bench_models.py looks for
mkdir -p /tmp/models/part
if [[ ! -f $model ]]; then
  ( timeout 300 python3 -m vkxsplit synth --shape qwen3moe30b --type q4_k -o /tmp/models/part/qwen3moe30b-q4_k.gguf \
      > "$OUT/synth.log" 2>&1 && mv /tmp/models/part/qwen3moe30b-q4_k.gguf "$model" ) &
  synth_pid=$!
else
  synth_pid=
fi

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 tools/build_tool_shaders.py --check 2>&1 | tail -n 3 | sed 's/^/experiment kernels: /'
# pipelines of the routed kernels (shipped and the emulated / sweep ones built in build/tool-spv)
# into the cache first: without the validation layer a cold machine creates them far faster
timeout 40 python3 tools/warm_pipelines.py --prefix mul_mat_id,moe_,quantize_q8_1 2>&1 | tail -n 3
stamp "warm done"

VKXSPLIT_VALIDATION=1 timeout ${TESTS_S:-100} python3 -m pytest -q -ra -p no:cacheprovider -o addopts="" --durations=8 \
  tests/test_moe.py tests/test_moe_model.py > "$OUT/tests_moe.log" 2>&1
echo "== tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests_moe.log")"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests_moe.log" | head -n 30
stamp "tests done"

timeout ${MOE_S:-70} python3 tools/bench_moe.py 2>&1 | tee "$OUT/bench_moe.md"
echo "bench_moe rc=${PIPESTATUS[0]}"
stamp "bench_moe done"

if [[ -n $synth_pid ]]; then
  wait "$synth_pid"; echo "synth rc=$? ($(tail -n 1 "$OUT/synth.log"))"
fi
stamp "synth done"
budget=$(left)
if (( budget < 60 )); then
  echo "bench_models skipped: only ${budget} s of the budget left"
else
  timeout "$budget" python3 tools/bench_models.py --shapes qwen3moe30b:q4_k -p 512 -n 128 -r 2 2>&1 \
    | tee "$OUT/bench_models.md" | tail -n 12
  echo "bench_models rc=${PIPESTATUS[0]} (124: ran past the ${budget} s left)"
fi
stamp "all done"
