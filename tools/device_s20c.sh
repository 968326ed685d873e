#!/usr/bin/env bash
# H200, session 20: the cpu backend as the experts' partner on the GPU machine (16 cores): the
# Qwen3-30B-A3B-shaped MoE (Q4_K) all on the hub, and with its expert tensors on the cpu backend
# (llama.cpp's `-ot exps=CPU`), on the libggml-python wheel's ggml and on llama.cpp's build (the
# peer's libraries, VKXSPLIT_GGML_LIBDIR). Carry [".device"]. Results in $OUT/moe_cpu.md.
BUDGET_S=${BUDGET_S:-560}
. tools/device_common.sh || exit 1
synth_bg qwen3moe30b q4_k 240; wait
f=/tmp/models/qwen3moe30b-q4_k.gguf
exps='layer:blk\..*\.ffn_.*_exps=cpu'
timeout 150 python3 -m vkxsplit bench -m "$f" -p 512 -n 32 -r 2 --split "none;$exps" --backends cpu -o md 2>&1 \
  | tee "$OUT/moe_cpu.md" | grep -E "^\|" | tail -n 5
stamp "wheel done"
t=$(( $(left) - 5 ))
(( t > 60 )) && VKXSPLIT_GGML_LIBDIR=/tmp/llama-vulkan timeout $t python3 -m vkxsplit bench -m "$f" -p 512 -n 32 -r 2 \
  --split "$exps" --backends cpu -o md 2>&1 | tee -a "$OUT/moe_cpu.md" | grep -E "^\|" | tail -n 3
python3 -m vkxsplit info 2>&1 | grep -A4 "cpu  " | head -6
stamp "all done"
