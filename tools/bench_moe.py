"""Benchmark the hub's routed expert product (vkxsplit/ops/moe.py) on one MoE layer's shapes.

For T tokens routed to n_used of n_expert experts (random distinct ids per token), it times
per T the gate product (N = n_ff_exp rows, K = n_embd, x shared by the slots) and the down
product (N = n_embd, K = n_ff_exp, one x row per slot) on each path (the mat-vecs, one pass
per (token, slot) pair, which read an expert once per pair routed to it: ``vec_f32`` with f32
x, ``vec_q8_1`` with x quantized to q8_1 and integer dot products, the quantization counted
in, where the device has them for the type; the grouped paths, pairs
grouped by expert on the GPU and then tiled per expert, the grouping counted in: ``tiled``,
the f32 tiles of mul_mat_id.comp, and ``coopmat``, the cooperative-matrix tiles of
mul_mat_coopmat.comp with MUL_MAT_ID, where the device has them), the grouping alone, the
router (``moe_topk``) and the combine; and as the bound the bytes of the experts the step
touches at the device's copy bandwidth. ``*`` marks the path the default choice takes
(ops.moe.use_grouped, ops.moe.grouped_path). Prints markdown tables: the paths by T; where
the device has cooperative matrices, a check of the coopmat tiles against the f32 tiles (max
|difference| / max |f32 result|, f16 operands: ~1e-3 expected) and the tilings of
tools/kernels.py's COOP_ID_SWEEP (those built in build/tool-spv) beside the shipped one.

    python tools/bench_moe.py [--shape qwen3moe30b] [--type q4_k] [--T 1,4,16,64,128,256,512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from benchutil import spin_up, timed  # noqa: E402

from vkxsplit.ops import moe  # noqa: E402
from vkxsplit.ops.choose import kernels_for  # noqa: E402
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.quant import weight_type  # noqa: E402
from vkxsplit.synth import _BLOCKS, QTYPES, SHAPES, _Rand  # noqa: E402
from vkxsplit.vk.command import Sequence  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3moe30b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--T", default="1,4,16,64,128,256,512")
    ap.add_argument("--sweep-T", default="128,512", help="T of the tiling sweep ('' to skip it)")
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
        kc = kernels_for(dev)
        coop = kc.coopmat_available
        paths = ["vec_f32"] + (["vec_q8_1"] if kc.vecq(a.type, 1) else []) + ["tiled"] + (["coopmat"] if coop else [])
        cols = [f"{m} {p_} us" for m in ("gate", "down") for p_ in paths]
        print(f"| T | experts touched | bound gate+down us | {' | '.join(cols)} | group us | topk us | combine us "
              "| default vs bound |")
        print("|---" * (len(cols) + 7) + "|")

        def mm(path, w, N, K, n_xb, T, variant=None):
            kw = {"vec_variant" if path == "vec_q8_1" else "coop_variant": variant} if variant else {}

            def rec(sq, i):
                moe.record_mul_mat_id(sq, w, a.type, x, ids, y, n_expert=E, N=N, K=K, T=T, n_used=U, n_xb=n_xb,
                                      groups=grp, path=path, grouped=False, **kw)
            return timed(dev, rec, a.reps) * 1e6

        for T in Ts:
            idn = ids.numpy(np.int32, (Tmax, U))[:T]
            touched = len(np.unique(idn))
            bound = touched * (gbytes + dbytes) / E / bw
            default = moe.grouped_path(dev) if moe.use_grouped(T, U, E) else moe.vec_path(dev, a.type, T)
            got = {}
            for m, (w, N, K, n_xb) in (("gate", (gw, F, D, 1)), ("down", (dw, D, F, U))):
                for p_ in paths:
                    got[m, p_] = mm(p_, w, N, K, n_xb, T) if p_.startswith("vec") or T > 1 else float("nan")
            g_s = timed(dev, lambda sq, i, T=T: moe.record_moe_group(sq, ids, grp, T, U, E), a.reps) * 1e6
            tk = timed(dev, lambda sq, i, T=T: moe.record_moe_topk(sq, logits, ids2, wts, T=T, n_expert=E, n_used=U),
                       a.reps) * 1e6
            cb = timed(dev, lambda sq, i, T=T: moe.record_moe_combine(sq, y, wts, yc, T=T, n_used=U, N=D), a.reps) * 1e6
            cells = [f"{got[m, p_]:.1f}" + ("*" if p_ == default else "") for m in ("gate", "down") for p_ in paths]
            taken = got["gate", default] + got["down", default]
            print(f"| {T} | {touched} | {bound * 1e6:.1f} | {' | '.join(cells)} | {g_s:.1f} | {tk:.1f} | {cb:.1f} | "
                  f"{taken / (bound * 1e6):.2f}x |")
        if kc.vecq(a.type, 1):
            decode_sweep(dev, a, kc, (E, U, F, D), (gw, dw), ids, bw, gbytes + dbytes, mm)
        if coop:
            check_and_sweep(dev, a, (E, U, F, D), (gw, dw), (x, ids, y, grp), Ts, bw, gbytes + dbytes, mm)
    finally:
        for b in bufs:
            b.close()
        dev.close()
    return 0


def decode_sweep(dev, a, kc, shape, ws, ids, bw, layer_bytes, mm) -> None:
    """T = 1: the routed q8_1 decode's shipped shape beside tools/kernels.py's VECQ_ID_SWEEP
    shapes of the type (those built in build/tool-spv) and the f32-x mat-vec."""
    E, U, F, D = shape
    gw, dw = ws
    shipped = moe.vecq_id_name(a.type, moe.vecq_id_config(a.type, kc.is_cpu))
    names = [n for n, (t, _) in kernels.VECQ_ID_SWEEP.items() if t == a.type]
    have = kernels.ensure(lambda n: n in names, log=lambda msg: None) if names else set()
    touched = len(np.unique(ids.numpy(np.int32, (1, U))))
    bound = touched * layer_bytes / E / bw * 1e6
    print(f"\n| decode T=1 ({a.type}) | gate us | down us | vs bound ({bound:.1f} us) |")
    print("|---|---|---|---|")
    rows = [("vec_f32 (mul_mat_id.comp)", "vec_f32", None), (f"{shipped} (shipped)", "vec_q8_1", shipped)]
    rows += [(n, "vec_q8_1", n) for n in names if n in have]
    for label, path, variant in rows:
        g = mm(path, gw, F, D, 1, 1, variant=variant)
        d = mm(path, dw, D, F, U, 1, variant=variant)
        print(f"| {label} | {g:.1f} | {d:.1f} | {(g + d) / bound:.2f}x |")


def check_and_sweep(dev, a, shape, ws, io, Ts, bw, layer_bytes, mm) -> None:
    """The coopmat tiles against the f32 tiles (same ids, same x), then the sweep's tilings."""
    E, U, F, D = shape
    gw, dw = ws
    x, ids, y, grp = io
    print("\n| product | T | max abs diff coopmat vs tiled / max abs tiled |")
    print("|---|---|---|")
    T = max(Ts)
    for m, (w, N, K, n_xb) in (("gate", (gw, F, D, 1)), ("down", (dw, D, F, U))):
        outs = []
        for path in ("tiled", "coopmat"):
            seq = Sequence(dev, "check")
            try:
                moe.record_mul_mat_id(seq, w, a.type, x, ids, y, n_expert=E, N=N, K=K, T=T, n_used=U, n_xb=n_xb,
                                      groups=grp, path=path)
                seq.run(timeout=60)
            finally:
                seq.close()
            yh = np.empty(T * U * N, np.float32)
            stage = dev.memory.alloc(4 * T * U * N, "host", "check")
            try:
                seq = Sequence(dev, "readback")
                try:
                    record_copy(seq, y, stage, 4 * T * U * N)
                    seq.run(timeout=60)
                finally:
                    seq.close()
                yh[:] = stage.numpy(np.float32, (T * U * N,))
            finally:
                stage.close()
            outs.append(yh.astype(np.float64))
        rel = np.abs(outs[1] - outs[0]).max() / max(np.abs(outs[0]).max(), 1e-30)
        print(f"| {m} | {T} | {rel:.2e}{'  FAIL' if not rel < 1e-2 else ''} |")
    sweep_T = [int(t) for t in a.sweep_T.split(",") if t]
    names = [n for n, (t, _, emu) in kernels.COOP_ID_VARIANTS.items() if t == a.type and not emu]
    have = kernels.ensure(lambda n: n in names, log=lambda msg: None) if names and sweep_T else set()
    tiles = [moe.coop_id_name(a.type)] + sorted(n for n in names if n in have)
    if not sweep_T or len(tiles) < 2:
        print(f"\n(tiling sweep: no built variants of tools/kernels.py's COOP_ID_SWEEP for {a.type}; "
              "python tools/build_tool_shaders.py --only mul_mat_id_coopmat and carry build/tool-spv)")
        return
    print(f"\n| tiling ({a.type}) | " + " | ".join(f"gate T={T} us | down T={T} us" for T in sweep_T)
          + " | vs bound at the largest T |")
    print("|---" * (2 * len(sweep_T) + 2) + "|")
    for name in tiles:
        cells, last = [], 0.0
        for T in sweep_T:
            g = mm("coopmat", gw, F, D, 1, T, variant=name)
            d = mm("coopmat", dw, D, F, U, T, variant=name)
            cells += [f"{g:.1f}", f"{d:.1f}"]
            last = g + d
        touched = len(np.unique(ids.numpy(np.int32, (max(Ts), U))[:max(sweep_T)]))
        bound = touched * layer_bytes / E / bw * 1e6
        label = name.removeprefix(f"mul_mat_id_coopmat_{a.type}_f32").lstrip("_") or f"{moe.COOP_ID_TILE.name} (shipped)"
        print(f"| {label} | {' | '.join(cells)} | {last / bound:.2f}x |")


if __name__ == "__main__":
    raise SystemExit(main())
