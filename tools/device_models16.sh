#!/usr/bin/env bash
# H200: the models issue's shapes beside llama.cpp (Qwen3-8B-shaped dense at the Q4_K_M mix,
# Qwen3-30B-A3B-shaped MoE at Q4_K), then a per-level profile of the dense shape's decode and
# the YaRN kernels' tests. Carry [".device"]; results in $OUT.
set -uo pipefail
. .device/on-device.sh || exit 1
export VK_LAYER_PATH=/usr/share/vulkan/explicit_layer.d
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export VKXSPLIT_CACHE_DIR=/tmp/vkxcache
timeout ${BENCH_S:-400} python3 tools/bench_models.py --shapes "${SHAPES:-qwen3_8b:q4_k_m,qwen3moe30b:q4_k}" \
  -p 512 -n 128 -r ${REPS:-2} 2>&1 | tee "$OUT/bench_models.md" | tail -n 25
f=$(ls /tmp/models/qwen3_8b*.gguf 2>/dev/null | head -1)
if [[ -n $f ]]; then
  timeout 70 python3 -m vkxsplit bench -m "$f" -p 512 -n 16 -r 1 --split none --profile "$OUT/qwen3_8b_profile.json" \
    --profile-steps 16 -o md > "$OUT/profile.md" 2>&1; echo "profile rc=$?"; head -c 6000 "$OUT/profile.md"
fi
VKXSPLIT_VALIDATION=1 timeout 40 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_rope_yarn.py 2>&1 | tail -n 3
