#!/usr/bin/env bash
# H200, one call: the per-token-speed issue's three shapes beside llama.cpp (hub only, `auto`
# and `mode:cuda>=32` with the cuda backend), then per-level profiles of llama8b's and
# qwen3_8b's decode (`vkxsplit bench --profile`). Carry [".device"]; results in $OUT.
# env: MODELS=0 (skip the model table), SHAPES, SPLITS, REPS, BENCH_S (seconds for the model table), PROFILE ("" to skip).
. tools/device_common.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ ${MODELS:-1} == 1 ]]; then
# the first process on a fresh machine runs its first cooperative-matrix products slowly
# (docs/KERNELS.md): a throwaway run of the smallest shape takes that hit
timeout 120 python3 tools/bench_models.py --shapes smol135m:q4_1 --splits none -r 1 -p 512 -n 16 \
  --server /nonexistent >/dev/null 2>&1
timeout ${BENCH_S:-330} python3 tools/bench_models.py --shapes "${SHAPES:-smol135m:q4_1,llama1b:q4_0,llama8b:q4_0}" \
  --backends cuda --splits "${SPLITS:-none;auto;mode:cuda>=32}" -p 512 -n 128 -r ${REPS:-3} 2>&1 \
  | tee "$OUT/bench_models.md" | tail -n 14
fi
for shape in ${PROFILE-llama8b-q4_0 qwen3_8b-q4_k_m}; do
  mkdir -p /tmp/models; f=/tmp/models/$shape.gguf
  if [[ ! -f $f ]]; then s=${shape%-*}; t=${shape##*-}; timeout 100 python3 -m vkxsplit synth --shape "$s" --type "$t" -o "$f" 2>&1 | tail -n 2; fi
  [[ -f $f ]] || { echo "no $f"; continue; }
  timeout ${PROFILE_S:-150} python3 -m vkxsplit bench -m "$f" -p 512 -n 32 -r 1 --split none --profile "$OUT/${shape}_profile.json" \
    --profile-steps 8 -o md > "$OUT/${shape}_profile.md" 2>&1; echo "profile $shape rc=$?"
  head -c 5000 "$OUT/${shape}_profile.md"
done
