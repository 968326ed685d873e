#!/usr/bin/env bash
# Whole-model speed of two trees of vkxsplit on one device machine, in one sitting: the
# checkout and an older tree unpacked beside it, interleaved shape by shape so both see the
# same clocks and caches. For a refactor's "no slower than before" check.
#
# Here (the machine with the repository):
#   rm -rf .before && mkdir .before && git archive BASE | tar -x -C .before
# then on the device (device tool, carry [".device"]; .before travels as an untracked folder):
#   . .device/on-device.sh && bash tools/bench_before_after.sh [SHAPES] [SPLITS]
# SHAPES default smol135m:q4_1,llama1b:q4_0,llama8b:q4_0; SPLITS default 'none;mode:cuda>=32'.
# Each shape runs the old tree, then the new one (ORDER=after-first: the other way round, to
# see an order effect), then llama.cpp's llama-server (when /tmp/llama-vulkan is there) once,
# through tools/bench_models.py of each tree; REPS repetitions each (default 3). Tables and JSON
# rows go to $OUT/before_after.md. Remove .before afterwards: it is not part of the project.
set -uo pipefail
shapes=${1:-smol135m:q4_1,llama1b:q4_0,llama8b:q4_0}
splits=${2:-none;mode:cuda>=32}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/before_after.md"
[[ -d .before/vkxsplit ]] || { echo "no .before/ tree: see this script's header" >&2; exit 2; }
python3 native/build_native.py >/dev/null 2>&1 || echo "native build failed (new tree)"
(cd .before && python3 native/build_native.py >/dev/null 2>&1) || echo "native build failed (old tree)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
# The first process on a fresh machine runs its first cooperative-matrix products slowly
# (docs/KERNELS.md); a throwaway run of the smallest shape takes that hit for neither tree.
timeout 200 python3 tools/bench_models.py --shapes smol135m:q4_1 --splits none -r 1 -p 512 -n 16 \
  --server /nonexistent >/dev/null 2>&1
before() {
  echo "## $1: before (.before)" | tee -a "$log"
  (cd .before && timeout 280 python3 tools/bench_models.py --shapes "$1" --backends cuda --splits "$splits" \
     -r "${REPS:-3}" --server /nonexistent 2>&1 | tee "$OUT/${1%%:*}_before.log" | tail -n 4) | tee -a "$log"
}
after() {
  echo "## $1: after (checkout)" | tee -a "$log"
  timeout 280 python3 tools/bench_models.py --shapes "$1" --backends cuda --splits "$splits" -r "${REPS:-3}" 2>&1 \
    | tee "$OUT/${1%%:*}_after.log" | tail -n 4 | tee -a "$log"
}
for s in ${shapes//,/ }; do
  if [[ ${ORDER:-} == after-first ]]; then after "$s"; before "$s"; else before "$s"; after "$s"; fi
done
