#!/usr/bin/env python3
"""What one decode level costs on the hub, kernel by kernel, at a model's decode shapes.

A decode token of a llama-shaped model is ~10 dependent dispatch levels a layer, and
``vkxsplit bench --profile`` shows the small ones (norms, SwiGLU, the KV store) costing 5-15 us
each. This separates what a level costs for being a level (a dispatch behind a barrier: the
floor, timed with a 16-byte copy) from what each small kernel adds on top, and what the same
dispatches cost with no barrier between them (the launch alone). GPU timestamps around
``--reps`` repetitions; microseconds per dispatch; one markdown table.

Usage: python tools/bench_levels.py [--embd 4096] [--ff 14336] [--vocab 32000] [--reps 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import spin_up, timed  # noqa: E402

from vkxsplit.ops.argmax import record_argmax  # noqa: E402
from vkxsplit.ops.attention import (  # noqa: E402
    attention_scratch_bytes,
    attention_splits,
    decode_target_workgroups,
    record_attention,
)
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.elementwise import record_add, record_swiglu  # noqa: E402
from vkxsplit.ops.moe import record_moe_combine, record_moe_topk  # noqa: E402
from vkxsplit.ops.mul_mat import record_quantize_q8_1, record_swiglu_q8_1, vecq_scratch_bytes  # noqa: E402
from vkxsplit.ops.norm import record_add_rms_norm, record_rms_norm  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", default="32,8,128", help="attention heads, kv heads, head_dim")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--pos", type=int, default=600, help="cache positions the decode attention reads")
    ap.add_argument("--experts", type=int, default=128, help="router width of the moe_topk row")
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    E, F, V = a.embd, a.ff, a.vocab
    dev = Device.open()
    rng = np.random.default_rng(0)
    bufs = []

    def buf(n: int, name: str, fill: bool = True):
        b = dev.memory.alloc(max(n, 16), "device", name)
        if fill:
            b.write(rng.standard_normal(max(n, 16) // 4).astype(np.float32))
        bufs.append(b)
        return b

    x, r, w, y = buf(4 * E, "x"), buf(4 * E, "r"), buf(4 * E, "w"), buf(4 * E, "y")
    g, u, h = buf(4 * F, "gate"), buf(4 * F, "up"), buf(4 * F, "h")
    lg, am = buf(4 * V, "logits"), buf(16, "argmax")
    xq = buf(vecq_scratch_bytes(1, max(E, F)), "xq", fill=False)
    src16, dst16 = buf(16, "a16"), buf(16, "b16")
    ne, nu = a.experts, a.used
    eo = buf(4 * nu * E, "expert outputs")
    H, HKV, D = (int(v) for v in a.heads.split(","))
    qb, ob = buf(4 * H * D, "q"), buf(4 * H * D, "attn out")
    kc, vc = buf(2 * a.ctx * HKV * D, "k cache"), buf(2 * a.ctx * HKV * D, "v cache")
    pb = dev.memory.alloc(16, "host", "pos")
    bufs.append(pb)
    pb.numpy(np.int32)[:] = a.pos
    S = attention_splits(1, H, HKV, a.ctx, decode_target_workgroups(dev))
    sc = buf(attention_scratch_bytes(1, H, D, S), "attn scratch", fill=False)
    rl, rid, rw = buf(4 * ne, "router"), buf(4 * nu, "ids", fill=False), buf(4 * nu, "weights", fill=False)
    cases = [
        ("copy 16 B (the level floor)", lambda s, i: record_copy(s, src16, dst16, 16)),
        (f"add 1x{E}", lambda s, i: record_add(s, x, r, y, 1, E)),
        (f"rms_norm_mul 1x{E}", lambda s, i: record_rms_norm(s, x, y, 1, E, 1e-5, w)),
        (f"rms_norm_mul_q8_1 1x{E}", lambda s, i: record_rms_norm(s, x, y, 1, E, 1e-5, w, xq=xq)),
        (f"add_rms_norm_mul 1x{E}", lambda s, i: record_add_rms_norm(s, x, r, w, y, 1, E, 1e-5)),
        (f"add_rms_norm_mul_q8_1 1x{E}", lambda s, i: record_add_rms_norm(s, x, r, w, y, 1, E, 1e-5, xq=xq)),
        (f"quantize_q8_1 1x{E}", lambda s, i: record_quantize_q8_1(s, x, xq, 1, E, E, 0)),
        (f"swiglu 1x{F}", lambda s, i: record_swiglu(s, g, u, h, 1, F)),
        (f"swiglu_q8_1 1x{F}", lambda s, i: record_swiglu_q8_1(s, g, u, h, xq, 1, F)),
        (f"argmax 1x{V}", lambda s, i: record_argmax(s, lg, am, 1, V)),
        (f"attention {H}/{HKV}x{D} at {a.pos + 1} of {a.ctx}, {S} split(s)" + (" + combine" if S > 1 else ""),
         lambda s, i: record_attention(s, qb, kc, vc, pb, ob, 1, H, HKV, D, a.ctx, n_splits=S, scratch=sc)),
        (f"moe_topk 1x{ne} top-{nu}", lambda s, i: record_moe_topk(s, rl, rid, rw, T=1, n_expert=ne, n_used=nu)),
        (f"moe_combine {nu}x{E}", lambda s, i: record_moe_combine(s, eo, rw, y, T=1, n_used=nu, N=E)),
    ]
    spin_up(dev)
    print(f"# dispatch levels on {dev.name}: us per dispatch, {a.reps} repetitions\n")
    print("| kernel | behind a barrier (a level) | no barrier (launch) | level - floor |")
    print("|---|---:|---:|---:|")
    floor = None
    for name, rec in cases:
        lvl = timed(dev, rec, a.reps, barrier=True) * 1e6
        free = timed(dev, rec, a.reps, barrier=False) * 1e6
        floor = lvl if floor is None else floor
        print(f"| {name} | {lvl:.2f} | {free:.2f} | {lvl - floor:+.2f} |", flush=True)
    for b in bufs:
        b.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
