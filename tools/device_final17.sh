#!/usr/bin/env bash
# H200, one call at the end of a session: the changed kernels' and passes' tests with the
# validation layer, then every benchmark shape beside llama.cpp (hub only), then the per-level
# profile of llama8b's decode. Carry [".device", "build/tool-spv"]; results in $OUT.
# env: TESTS (pytest selection), TESTS_S (default 70), SHAPES, REPS (2), BENCH_S (300),
#      BUDGET_S (470: what is left of it at the end runs the MoE experts-on-cpu row).
BUDGET_S=${BUDGET_S:-470}
. tools/device_common.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m vkxsplit build-shaders --check 2>&1 | tail -n 1
VKXSPLIT_VALIDATION=1 timeout ${TESTS_S:-70} python3 -m pytest -q -p no:cacheprovider -o addopts="" -x \
  ${TESTS:-tests/test_fusion.py tests/test_ops_attention.py tests/test_moe_model.py tests/test_hubs_plan.py} \
  > "$OUT/tests.log" 2>&1
echo "== tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
# the mat-vec shapes as specialization constants of one module per type
VKXSPLIT_VALIDATION=1 timeout ${SPEC_S:-40} python3 -m pytest -q -p no:cacheprovider -o addopts="" -x \
  tests/test_mul_mat.py tests/test_shaders.py \
  -k "(mat_vec and not vecq) or vec_variant or two_spec_values or device_limit or share_one_module" \
  > "$OUT/tests_spec.log" 2>&1
echo "== spec tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests_spec.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests_spec.log" | head -n 20
stamp "tests done"
# the first process on a fresh machine runs its first cooperative-matrix products slowly
# (docs/KERNELS.md): a throwaway run of the smallest shape takes that hit
timeout 40 python3 tools/bench_models.py --shapes smol135m:q4_1 --splits none -r 1 -p 512 -n 8 \
  --server /nonexistent >/dev/null 2>&1
stamp "warm done"
timeout ${BENCH_S:-300} python3 tools/bench_models.py \
  --shapes "${SHAPES:-smol135m:q4_1,llama8b:q4_0,qwen3_8b:q4_k_m,qwen3moe30b:q4_k}" \
  --splits none -p 512 -n 128 -r ${REPS:-2} 2>&1 | tee "$OUT/bench_models.md" | grep -v "^{" | tail -n 12
stamp "models done"
f=/tmp/models/llama8b-q4_0.gguf
if [[ -f $f && ${PROFILE:-1} == 1 ]]; then
  timeout 50 python3 -m vkxsplit bench -m "$f" -p 512 -n 16 -r 1 --split none --profile "$OUT/llama8b_profile.json" \
    --profile-steps 8 -o md > "$OUT/llama8b_profile.md" 2>&1; echo "profile rc=$?"
  sed -n '/### decode/,/### prefill/p' "$OUT/llama8b_profile.md" | head -n 40
fi
b=$(left)
m=/tmp/models/qwen3moe30b-4l-q4_k.gguf
if (( b > 50 )); then  # the MoE shape's experts on the cpu backend (llama.cpp's -ot exps=CPU), 4 layers
  [[ -f $m ]] || timeout 40 python3 -m vkxsplit synth --shape qwen3moe30b --type q4_k --n-layer 4 -o "$m" 2>&1 | tail -n 1
  timeout $(( b - 10 )) python3 -m vkxsplit bench -m "$m" -p 512 -n 32 -r 1 --backends cpu \
    --split 'none;layer:blk\..*\.ffn_.*_exps=cpu' -o md 2>&1 | tee "$OUT/moe_cpu_experts.md" | tail -n 6
fi
stamp "all done"
