"""Benchmark the hub's routed expert product (vkxsplit/ops/moe.py) on one MoE layer's shapes.

For T tokens routed to n_used of n_expert experts (random distinct ids per token), it times
per T the gate product (N = n_ff_exp rows, K = n_embd, x shared by the slots) and the down
product (N = n_embd, K = n_ff_exp, one x row per slot) on both paths (``vec``: one pass per
(token, slot) pair, which reads an expert once per pair routed to it; ``grouped``: pairs
grouped by expert on the GPU, then tiled per expert, the grouping counted in), the grouping
alone, the router (``moe_topk``) and the combine; and as the bound the bytes of the experts
the step touches at the device's copy bandwidth. Prints a markdown table.

    python tools/bench_moe.py [--shape qwen3moe30b] [--type q4_k] [--T 1,4,16,64,256,512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import spin_up, timed  # noqa: E402

from vkxsplit.ops import moe  # noqa: E402
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.quant import weight_type  # noqa: E402
from vkxsplit.synth import _BLOCKS, QTYPES, SHAPES, _Rand  # noqa: E402
from vkxsplit.vk.command import Sequence  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3moe30b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--T", default="1,4,16,64,256,512")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    E, U, F, D = s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_embd
    wt = weight_type(a.type)
    Ts = [int(t) for t in a.T.split(",")]
    Tmax = max(Ts)
    dev = Device.open()
    rnd = _Rand(0)
    bufs = []

    def alloc(nbytes: int, pool: str = "device"):
        b = dev.memory.alloc(max(nbytes, 256), pool, "bench")
        bufs.append(b)
        return b

    def weights(N: int, K: int):
        nb = E * N * wt.row_bytes(K)
        host = alloc(nb, "host")
        host.numpy(np.uint8, (nb,))[:] = _BLOCKS[QTYPES[a.type]](rnd, nb // wt.block_bytes).reshape(-1)
        w = alloc(nb)
        return host, w, nb

    try:
        gh, gw, gbytes = weights(F, D)
        dh, dw, dbytes = weights(D, F)
        x = alloc(4 * Tmax * U * max(D, F), "host")
        x.numpy(np.float32, (Tmax * U * max(D, F),))[:] = np.random.default_rng(0).standard_normal(
            Tmax * U * max(D, F)).astype(np.float32)
        ids = alloc(4 * Tmax * U, "host")
        rng = np.random.default_rng(1)
        ids.numpy(np.int32, (Tmax, U))[:] = np.stack([rng.permutation(E)[:U] for _ in range(Tmax)])
        logits = alloc(4 * Tmax * E, "host")
        logits.numpy(np.float32, (Tmax * E,))[:] = rng.standard_normal(Tmax * E)
        y = alloc(4 * Tmax * U * max(D, F))
        yc = alloc(4 * Tmax * D)
        wts = alloc(4 * Tmax * U)
        ids2 = alloc(4 * Tmax * U)
        grp = alloc(moe.group_bytes(Tmax, U, E))

        def upload(seq):
            record_copy(seq, gh, gw, gbytes)
            record_copy(seq, dh, dw, dbytes)

        seq_up = Sequence(dev, "upload")
        try:
            upload(seq_up)
            seq_up.run(timeout=600)
        finally:
            seq_up.close()
        spin_up(dev)
        cpy_s = timed(dev, lambda sq, i: record_copy(sq, gw, y, min(gbytes, y.size)), 10)
        bw = min(gbytes, y.size) / cpy_s
        print(f"# routed expert product, {a.shape} ({E} experts, {U} used, n_embd {D}, expert FFN {F}), "
              f"{a.type.upper()} weights, on {dev.name}")
        print(f"device copy bandwidth {bw / 1e9:.0f} GB/s; one expert's gate matrix "
              f"{gbytes / E / 1e6:.2f} MB, down {dbytes / E / 1e6:.2f} MB\n")
        print("| T | experts touched | bound gate+down us | gate vec us | gate grouped us | down vec us | "
              "down grouped us | group us | topk us | combine us | grouped vs bound |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for T in Ts:
            idn = ids.numpy(np.int32, (Tmax, U))[:T]
            touched = len(np.unique(idn))
            bound = touched * (gbytes + dbytes) / E / bw

            def mm(path, w, N, K, n_xb, grouped, T=T):
                def rec(sq, i):
                    moe.record_mul_mat_id(sq, w, a.type, x, ids, y, n_expert=E, N=N, K=K, T=T, n_used=U, n_xb=n_xb,
                                          groups=grp, path=path, grouped=grouped)
                return timed(dev, rec, a.reps) * 1e6

            gv = mm("vec", gw, F, D, 1, False)
            dv = mm("vec", dw, D, F, U, False)
            gg = mm("grouped", gw, F, D, 1, False) if T > 1 else float("nan")
            dg = mm("grouped", dw, D, F, U, False) if T > 1 else float("nan")
            g_s = timed(dev, lambda sq, i, T=T: moe.record_moe_group(sq, ids, grp, T, U, E), a.reps) * 1e6
            tk = timed(dev, lambda sq, i, T=T: moe.record_moe_topk(sq, logits, ids2, wts, T=T, n_expert=E, n_used=U),
                       a.reps) * 1e6
            cb = timed(dev, lambda sq, i, T=T: moe.record_moe_combine(sq, y, wts, yc, T=T, n_used=U, N=D), a.reps) * 1e6
            best = min(gv, gg if T > 1 else gv) + min(dv, dg if T > 1 else dv)
            print(f"| {T} | {touched} | {bound * 1e6:.1f} | {gv:.1f} | {gg:.1f} | {dv:.1f} | {dg:.1f} | {g_s:.1f} | "
                  f"{tk:.1f} | {cb:.1f} | {best / (bound * 1e6):.2f}x |")
    finally:
        for b in bufs:
            b.close()
        dev.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
