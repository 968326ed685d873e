#!/usr/bin/env bash
# H200 (16 cores), one call: what the cpu backend (ggml's CPU kernels) adds beside the GPU hub as
# a layer-split partner, and ggml's own CPU speed there. Carry [".device"]; results in $OUT.
#  1. llama8b Q4_0 (vkxsplit synth): `none` (all on the H200) against the last quarter of the
#     layers' products on the cpu backend (llama.cpp's -ot ...=CPU habit) and everything
#     product-and-glue on it (`mode:cpu`), pp512 / tg128;
#  2. the MoE shape (qwen3moe30b, 4 layers, Q4_K): experts on the cpu (`-ot exps=CPU`) against none;
#  3. the cpu backend's ggml build and thread count (`vkxsplit info`).
# Read: tok/s per split; the cpu rows are the cost of holding those weights in host memory and
# computing them with 16 ggml threads instead of on the GPU.
# env: REPS (default 2), THREADS (cpu backend threads; default: its own, the physical cores)
. tools/device_common.sh || exit 1
python3 -m vkxsplit info 2>&1 | grep -i -A3 "ggml\|cpu" | head -n 20 | tee "$OUT/info.txt"
BE=cpu${THREADS:+:threads=$THREADS}
f=/tmp/models/llama8b-q4_0.gguf
[[ -f $f ]] || timeout 150 python3 -m vkxsplit synth --shape llama8b --type q4_0 -o "$f" 2>&1 | tail -n 1
timeout 60 python3 -m vkxsplit bench -m "$f" -p 64 -n 4 -r 1 --split none >/dev/null 2>&1  # (first cm2 products: slow)
timeout 420 python3 -m vkxsplit bench -m "$f" -p 512 -n 128 -r ${REPS:-2} --backends "$BE" \
  --split 'none;layer:blk\.(2[4-9]|3[01])\.=cpu;mode:cpu' -o md 2>&1 | tee "$OUT/llama8b_cpu_partner.md" | tail -n 8
m=/tmp/models/qwen3moe30b-4l-q4_k.gguf
[[ -f $m ]] || timeout 200 python3 -m vkxsplit synth --shape qwen3moe30b --type q4_k --n-layer 4 -o "$m" 2>&1 | tail -n 1
timeout 300 python3 -m vkxsplit bench -m "$m" -p 512 -n 64 -r ${REPS:-2} --backends "$BE" \
  --split 'none;layer:blk\..*\.ffn_.*_exps=cpu' -o md 2>&1 | tee "$OUT/moe_cpu_partner.md" | tail -n 6
