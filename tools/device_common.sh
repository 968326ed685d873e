# Sourced first by the tools/device_*.sh scripts (on the lent GPU machine, from the repository
# root, carry [".device"]): the carried Vulkan loader and wheels (.device/on-device.sh), the
# validation layer's path, $OUT and /tmp/models, the pipeline cache, the native helpers built
# in place, and two helpers: `stamp MSG` (seconds since the start) and `left` (seconds left of
# $BUDGET_S, for a script that fits its last step into what remains).
set -uo pipefail
. .device/on-device.sh || exit 1
export VK_LAYER_PATH=/usr/share/vulkan/explicit_layer.d
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models
export VKXSPLIT_CACHE_DIR=/tmp/vkxcache
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( ${BUDGET_S:-400} - ($(date +%s) - t0) )); }
python3 native/build_native.py >/dev/null 2>&1 || echo "native build failed (tests needing it skip)"
# synth_bg SHAPE TYPE [TIMEOUT]: write /tmp/models/SHAPE-TYPE.gguf in the background, niced (through a
# part file, so no reader sees half a file; the log in $OUT/synth_SHAPE.log); `wait $!` for it.
synth_bg() {
  local f=/tmp/models/$1-$2.gguf part=/tmp/models/part/$1-$2.gguf
  mkdir -p /tmp/models/part
  ( [[ -f $f ]] || { timeout "${3:-200}" nice -n 19 python3 -m vkxsplit synth --shape "$1" --type "$2" -o "$part" \
      > "$OUT/synth_$1.log" 2>&1 && mv "$part" "$f"; } ) &
}
