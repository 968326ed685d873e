#!/usr/bin/env bash
# H200, one call: llama8b's decode per level at the current tree (`vkxsplit bench --profile`,
# via tools/device_session17.sh) while the Qwen3-30B-A3B-shaped MoE file is written in the
# background, then tools/device_moe_q8x17.sh on it (the MoE decode with the q8_1 x written by
# its producers vs each product quantizing its own, tests with the validation layer first).
# Carry [".device"]. Results in $OUT (see both scripts).
BUDGET_S=${BUDGET_S:-570}
. tools/device_common.sh || exit 1
model=/tmp/models/qwen3moe30b-q4_k.gguf
synth_bg qwen3moe30b q4_k 330
synth_pid=$!
MODELS=0 PROFILE=${PROFILE-llama8b-q4_0} bash tools/device_session17.sh
stamp "profiles done"
wait "$synth_pid"; echo "moe synth rc=$? ($(tail -n 1 "$OUT/synth_qwen3moe30b.log"))"
stamp "moe synth done"
BUDGET_S=$(( $(left) - 10 )) bash tools/device_moe_q8x17.sh
