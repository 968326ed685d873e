#!/usr/bin/env bash
# H200, one call (< 90 s): mul_mat_vec's shapes as specialization constants of one module per
# weight type (vkxsplit/shaders.py, Variant.spec). Checks that the shipped manifest loads, the
# mat-vec tests and the spec-constant tests pass with the validation layer, and times the
# f32-x mat-vec kernels (tools/bench_kernels.py --parts matvec: the "f32 x" rows are the
# converted kernels; compare them with docs/PERFORMANCE.md, "Decode kernels": q6_k and f16
# are f32 x there). Carry [".device", "build/tool-spv"] with build/tool-spv fresh here first
# (python tools/build_tool_shaders.py --only '^mul_mat_vec_'; its sweep shapes reuse the
# shipped modules, so it holds no mat-vec SPIR-V of its own). Results in $OUT.
# env: TYPES (default q4_0,q4_k,q6_k,f16), TESTS_S (default 40), BENCH_S (default 45).
. tools/device_common.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 - <<'PY'
from vkxsplit import shaders
man = shaders.load_manifest()
vec = [n for n, m in man["variants"].items() if m["source"] == "mul_mat_vec.comp"]
print(f"shipped: {len(man['modules'])} modules, {len(man['variants'])} variants; "
      f"mul_mat_vec: {len(vec)} variants of {len({man['variants'][n]['module'] for n in vec})} modules")
PY
VKXSPLIT_VALIDATION=1 timeout ${TESTS_S:-40} python3 -m pytest -q -p no:cacheprovider -o addopts="" -x \
  tests/test_mul_mat.py tests/test_shaders.py \
  -k "(mat_vec and not vecq) or vec_variant or two_spec_values or device_limit or share_one_module or sweep_shape" \
  > "$OUT/tests.log" 2>&1
echo "== tests rc=$? (124: timed out): $(tail -n 1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
stamp "tests done"
timeout ${BENCH_S:-45} python3 tools/bench_kernels.py --parts matvec --types "${TYPES:-q4_0,q4_k,q6_k,f16}" \
  2>&1 | tee "$OUT/bench_kernels.md" | tail -n 30
stamp "bench done"
