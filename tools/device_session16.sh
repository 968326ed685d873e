#!/usr/bin/env bash
# The H200 checks of the models / types / MoE / RoPE / profile work (device tool, carry
# [".device", "build/tool-spv"]): warms the pipelines the new tests use, then runs those tests
# with the validation layer on. Results in $OUT/tests*.log.
set -uo pipefail
. .device/on-device.sh || exit 1
export VK_LAYER_PATH=/usr/share/vulkan/explicit_layer.d
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 native/build_native.py >/dev/null 2>&1 || echo "native build failed"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 150 python3 tools/warm_pipelines.py --shipped-only \
  --prefix mul_mat_cm2_q2,mul_mat_cm2_q3,mul_mat_cm2_iq4,mul_mat_coopmat_q2,mul_mat_coopmat_q3,mul_mat_coopmat_iq4,mul_mat_id,moe_,attn_,rope,kv_store,geglu,softcap,get_rows,mul_mat_vec_q2,mul_mat_vec_q3,mul_mat_vec_iq4 2>&1 | tail -3
echo "warm: $(( $(date +%s) - t0 )) s"
run() {  # name, timeout, pytest args...
  local name=$1 to=$2; shift 2
  VKXSPLIT_VALIDATION=1 VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout "$to" python3 -m pytest -q -ra -p no:cacheprovider \
    -o addopts="" --durations=5 "$@" > "$OUT/tests_$name.log" 2>&1
  echo "== $name rc=$?: $(tail -n 1 "$OUT/tests_$name.log")"
}
run models 200 tests/test_archs.py tests/test_moe.py tests/test_moe_model.py tests/test_rope_yarn.py \
  tests/test_ops_attention.py tests/test_profile.py tests/test_cpu_ggml.py
run types 200 tests/test_mul_mat.py tests/test_mul_mat_cm2.py tests/test_get_rows.py tests/test_kernel_choice.py \
  -k "q2_k or q3_k or iq4_nl or iq4_xs or nearest or new_types"
grep -h "FAILED\|Error" "$OUT"/tests_*.log | head -40
