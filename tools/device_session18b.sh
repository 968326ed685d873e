#!/usr/bin/env bash
# H200, one call: what a decode level costs kernel by kernel (tools/bench_levels.py at llama8b's
# and SmolLM2's shapes), then the MoE decode with the q8_1 x written by its producers vs each
# product quantizing its own (tools/device_moe_q8x17.sh: tests with the validation layer, then
# tg before/after) on the Qwen3-30B-A3B-shaped file, whose load also times the weight upload.
# Carry [".device"]. Results in $OUT.
BUDGET_S=${BUDGET_S:-420}
. tools/device_common.sh || exit 1
model=/tmp/models/qwen3moe30b-q4_k.gguf
synth_bg qwen3moe30b q4_k
synth_pid=$!
timeout 60 python3 tools/bench_levels.py 2>&1 | tee "$OUT/levels_8b.md"
timeout 40 python3 tools/bench_levels.py --embd 576 --ff 1536 --vocab 49152 2>&1 | tee "$OUT/levels_smol.md"
stamp "levels done"
wait "$synth_pid"; echo "moe synth rc=$? ($(tail -n 1 "$OUT/synth_qwen3moe30b.log"))"
t1=$(date +%s)
timeout 150 python3 -c "
import time, sys
from vkxsplit.model import load_model
t = time.perf_counter(); m = load_model('$model'); dt = time.perf_counter() - t
print(f'load of the MoE file: {dt:.1f} s ({m.weight_bytes / dt / 1e9:.2f} GB/s of weights)'); m.close()" 2>&1 | tail -n 2
stamp "load timed"
BUDGET_S=$(( $(left) - 5 )) bash tools/device_moe_q8x17.sh
