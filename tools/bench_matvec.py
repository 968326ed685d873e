#!/usr/bin/env python3
"""Mat-vec kernel sweep (shaders/mul_mat_vec.comp) on the hub device, GPU timestamps, markdown.

For each weight type and N x K shape it times the default mat-vec variant and every sweep
variant of the type (``VEC_SWEEP`` of tools/kernels.py, and for Q4_0 / Q8_0 the wide variants
of ``VEC_WIDE``, shaders/mul_mat_vec_wide.comp, K % 256 == 0 only) at M = 1, and the default
and the wide M = 4 variant at M = 4 (the sweep variants are built on demand, tools/kernels.py):

- weights rotate through enough copies of the matrix to total >= 256 MiB (over 2x the H200's
  50 MB L2), so the bandwidth is DRAM's, not L2's;
- ``barrier`` mode: dispatches back to back with a full barrier after each (what a decode
  step does); ``no-barrier`` mode: the same dispatches writing different y buffers with no
  barrier between them, so they may overlap (launch / barrier latency separated from the
  kernel's own time);
- ``dot only``: for the integer-dot-product rows, the dot-product dispatches alone in barrier
  mode with x quantized once before (in a model the norm before a mat-vec writes x as q8_1);
  the f32-x rows repeat their barrier-mode time there;
- GB/s = weight bytes / time, and % of the compute-shader copy bandwidth (copy_vec4, read +
  write bytes / time) measured in the same run;
- every variant is first checked once against a float64 numpy reference on a small shape
  (PASS / FAIL), so a variant that is wrong on this device is caught;
- for Q4_0 / Q8_0 also the integer-dot-product variants (``VECQ_SWEEP`` of tools/kernels.py,
  shaders/mul_mat_vecq.comp, ggml's MMVQ scheme): each timed dispatch is the quantize-x kernel
  (quantize_q8_1), the barrier after it and the dot-product kernel, so the time includes the
  quantization (a ``quantize_q8_1 only`` row gives that part alone). Their check is against
  the float64 product of the same 8-bit-rounded x (vkxsplit.ops.mul_mat.q8_1_reference);
  variants needing a feature the device lacks (shaderIntegerDotProduct) are SKIPped.

Usage: python tools/bench_matvec.py [--quick] [--types q4_0,q8_0] [--reps 50] [--variants b1_,u4] [--shapes 4096x14336]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from benchutil import spin_up, timed  # noqa: E402

from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.ops import mul_mat as mm  # noqa: E402
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.quant import row_bytes, weight_type  # noqa: E402
from vkxsplit.vk.command import Sequence  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402
from vkxsplit.vk.kernel import View  # noqa: E402

TYPES = ("q4_0", "q8_0", "q4_1", "q4_k", "q6_k", "f16")
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
QUICK_SHAPES = ((256, 1024),)
ROTATE_BYTES = 256 << 20


def shape_of(v: str):  # type: ignore[no-untyped-def]
    """The shape (with a ``tag``) of a mat-vec variant: a wide one's from tools/kernels.py, else
    from its manifest entry (mm.vec_config)."""
    return kernels.VEC_WIDE[v][1] if v in kernels.VEC_WIDE else mm.vec_config(v)


def time_variant(dev: Device, t: str, v: str, m: int, n: int, k: int, ws: list, x, y, ystride: int,
                 reps: int) -> tuple[float, float, float]:
    """(barrier-mode, no-barrier-mode, dot-only) seconds per dispatch of variant ``v``; rep i
    reads weight copy i % len(ws); in no-barrier mode it writes its own y slot (no hazard, no
    barrier); dot-only is barrier mode again (these kernels take x as f32: nothing to split off)."""
    slot = 8 * ystride * 4

    def rec(s: Sequence, i: int, sep: bool) -> None:
        yv = View(y, (i if sep else 0) * slot, slot)
        mm.record_mul_mat(s, ws[i % len(ws)], t, x, yv, m, n, k, y_stride=ystride, vec_variant=v)

    tb = timed(dev, lambda s, i: rec(s, i, False), reps, True)
    tn = timed(dev, lambda s, i: rec(s, i, True), reps, False)
    return tb, tn, tb


def reference_weights(rng: np.random.Generator, t: str, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw ggml bytes, float64 dequantized reference): quantize() where gguf has it, else
    random blocks with finite f16 scales (K-quants, IQ4_NL, IQ4_XS)."""
    from gguf.quants import dequantize, quantize

    wt = weight_type(t)
    if t in ("f16", "q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "bf16", "f32"):
        if t == "f32":
            w = rng.standard_normal((rows, k)).astype(np.float32)
            return w.view(np.uint8).reshape(rows, -1), w.astype(np.float64)
        raw = np.ascontiguousarray(quantize(rng.standard_normal((rows, k)).astype(np.float32), wt.ggml))
        raw = raw.view(np.uint8).reshape(rows, -1)
    else:
        nb = k // wt.block_size
        raw = rng.integers(0, 256, size=(rows, nb, wt.block_bytes), dtype=np.uint8)
        offs = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q2_k": (80, 82), "q3_k": (108,), "iq4_nl": (0,),
                "iq4_xs": (0,)}[t]
        for off in offs:
            d = (rng.uniform(0.001, 0.01, (rows, nb)) * rng.choice([-1.0, 1.0], (rows, nb))).astype(np.float16)
            raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
        raw = raw.reshape(rows, -1)
    ref = dequantize(raw.view(np.float16) if t == "f16" else raw, wt.ggml)
    return raw, np.asarray(ref, dtype=np.float64).reshape(rows, k)


def verify(dev: Device, rng: np.random.Generator, t: str, variants: list[str]) -> dict[str, str]:
    """PASS / FAIL (with the worst error ratio) per variant on a small shape: rows not a
    multiple of any NR, K a multiple of 256 (wide units) plus an odd block count."""
    out: dict[str, str] = {}
    n, k = 37, 1280
    raw, w = reference_weights(rng, t, n, k)
    x = rng.standard_normal((4, k))
    wb = dev.memory.alloc(raw.nbytes, "host", "verify_w")
    xb = dev.memory.alloc(x.size * 4, "host", "verify_x")
    yb = dev.memory.alloc(4 * 4 * n, "host", "verify_y")
    try:
        wb.numpy(np.uint8, (raw.nbytes,))[:] = raw.ravel()
        xb.numpy(np.float32, (x.size,))[:] = x.ravel()
        for v in variants:
            m = min(4, mm.vec_variant_maxm(v) or 4)
            y = yb.numpy(np.float32, (4 * n,))
            y[:] = np.nan
            seq = Sequence(dev, "verify")
            try:
                mm.record_mul_mat(seq, wb, t, xb, yb, m, n, k, vec_variant=v)
                seq.run()
            except VkxError as exc:
                out[v] = f"FAIL ({str(exc)[:60]})"
                continue
            finally:
                seq.close()
            got = y[:m * n].astype(np.float64).reshape(m, n)
            ref = x[:m] @ w.T
            # loose (a broken kernel is off by O(1)); tests/test_mul_mat.py holds the tight bound
            bound = 1e-4 * (np.abs(x[:m]) @ np.abs(w).T) + 1e-6
            err = np.abs(got - ref)
            ratio = float(np.nanmax(err / bound)) if not np.isnan(got).any() else float("inf")
            out[v] = "PASS" if ratio <= 1.0 else f"FAIL (err/bound {ratio:.3g})"
    finally:
        for b in (wb, xb, yb):
            b.close()
    return out


def verify_vecq(dev: Device, rng: np.random.Generator, t: str, variants: list[str]) -> dict[str, str]:
    """PASS / FAIL / SKIP per integer-dot-product variant on a small shape (as verify()),
    against the float64 product of the same quantized x; x is rounded to 8 bits, so the
    unquantized product is no reference here."""
    out: dict[str, str] = {}
    n, k = 37, 1280
    raw, w = reference_weights(rng, t, n, k)
    x = rng.standard_normal((4, k)).astype(np.float32)
    wb = dev.memory.alloc(raw.nbytes, "host", "verify_w")
    xb = dev.memory.alloc(x.size * 4, "host", "verify_x")
    qb = dev.memory.alloc(mm.vecq_scratch_bytes(4, k), "host", "verify_xq")
    yb = dev.memory.alloc(4 * 4 * n, "host", "verify_y")
    try:
        wb.numpy(np.uint8, (raw.nbytes,))[:] = raw.ravel()
        xb.numpy(np.float32, (x.size,))[:] = x.ravel()
        for v in variants:
            _, _, maxm = kernels.VECQ_SWEEP[v]
            m = min(4, maxm)
            y = yb.numpy(np.float32, (4 * n,))
            y[:] = np.nan
            seq = Sequence(dev, "verify")
            try:
                mm.record_mul_mat_vecq(seq, wb, t, xb, qb, yb, m, n, k, variant=v)
                seq.run()
            except VkxError as exc:
                msg = str(exc)
                out[v] = f"SKIP ({msg[:60]})" if "needs device feature" in msg else f"FAIL ({msg[:60]})"
                continue
            finally:
                seq.close()
            q, d, _ = mm.q8_1_reference(x[:m])
            xdq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
            got = y[:m * n].astype(np.float64).reshape(m, n)
            bound = 1e-4 * (np.abs(xdq) @ np.abs(w).T) + 1e-6
            err = np.abs(got - xdq @ w.T)
            ratio = float(np.nanmax(err / bound)) if not np.isnan(got).any() else float("inf")
            out[v] = "PASS" if ratio <= 1.0 else f"FAIL (err/bound {ratio:.3g})"
    finally:
        for b in (wb, xb, qb, yb):
            b.close()
    return out


def time_vecq(dev: Device, t: str, v: str | None, m: int, n: int, k: int, ws: list, x, xq, y, ystride: int,
              reps: int) -> tuple[float, float, float]:
    """(barrier-mode, no-barrier-mode, dot-only) seconds per quantize-x + barrier + dot-product pair of
    vecq variant ``v`` (``v`` None: the quantize-x dispatch alone); in no-barrier mode rep i
    uses its own scratch and y slots (no hazard between reps; the barrier inside a rep stays);
    dot only: the dot-product dispatches alone in barrier mode, x quantized once before (for
    ``v`` None: the barrier-mode time again)."""
    slot = 8 * ystride * 4
    qslot = -(-mm.vecq_scratch_bytes(8, k) // 256) * 256

    def rec(s: Sequence, i: int, sep: bool) -> None:
        j = i if sep else 0
        qv = View(xq, j * qslot, qslot)
        if v is None:
            mm.record_quantize_q8_1(s, x, qv, m, k, k, 0)
            return
        yv = View(y, j * slot, slot)
        mm.record_mul_mat_vecq(s, ws[i % len(ws)], t, x, qv, yv, m, n, k, y_stride=ystride, variant=v)

    tb = timed(dev, lambda s, i: rec(s, i, False), reps, True)
    tn = timed(dev, lambda s, i: rec(s, i, True), reps, False)
    if v is None:
        return tb, tn, tb
    # the dot-product dispatches alone, barrier after each, x quantized once before (in a model
    # the norm before the mat-vec writes x as q8_1: rms_norm_mul_q8_1_f32)
    qv = View(xq, 0, qslot)
    yv = View(y, 0, slot)
    tk = timed(dev, lambda s, i: mm.record_mul_mat_vecq(s, ws[i % len(ws)], t, x, qv, yv, m, n, k,
                                                         y_stride=ystride, variant=v, quantize=False),
               reps, True, setup=lambda s: mm.record_quantize_q8_1(s, x, qv, m, k, k, 0))
    return tb, tn, tk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, two variants per type (lavapipe smoke run)")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated weight types")
    ap.add_argument("--reps", type=int, default=0, help="dispatches per timing (default 50, --quick 3)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated substrings: time only the variants whose name holds one (defaults always)")
    ap.add_argument("--shapes", default=None, help="comma-separated NxK shapes (default 4096x4096,4096x14336,14336x4096)")
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]
    reps = args.reps or (3 if args.quick else 50)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(","))
    pick = [p for p in (args.variants or "").split(",") if p]

    def wanted(v: str, default: str | None) -> bool:
        return not pick or v == default or any(p in v for p in pick)
    rotate = (8 << 20) if args.quick else ROTATE_BYTES
    t0 = time.time()
    kernels.ensure("^mul_mat_vecq?_")  # the sweep's shapes, built where missing (a compiler here) and loaded
    dev = Device.open()
    spin_up(dev)  # working clocks before the first timing (tools/benchutil.py)
    print(f"device: {dev.name} ({dev.physical.driver_name} {dev.physical.driver_info}), "
          f"subgroup size {dev.physical.subgroup_size}\n")
    cpu = dev.is_cpu
    rng = np.random.default_rng(0)

    # copy reference (same kernel and accounting as tools/bench_kernels.py)
    nbytes = (16 if args.quick else 1024) << 20
    nbytes = min(nbytes, int(dev.physical.limits["maxStorageBufferRange"]) // 16 * 16)  # lavapipe: 128 MiB
    a = dev.memory.alloc(nbytes, "device", "copy_a")
    b = dev.memory.alloc(nbytes, "device", "copy_b")
    copy_bw = 2 * nbytes / timed(dev, lambda s, i: record_copy(s, a, b, nbytes), max(3, reps // 5), True) / 1e9
    a.close()
    b.close()
    print(f"compute-shader copy (copy_vec4, read + write): {copy_bw:.0f} GB/s\n")

    by_type: dict[str, list[str]] = {}   # M = 1 variants
    m4_by_type: dict[str, list[str]] = {}  # M = 4 variants
    for t in types:
        sweep = [n for n, (ty, _) in kernels.VEC_SWEEP.items() if ty == t]
        wide = [n for n, (ty, _, mx) in kernels.VEC_WIDE.items() if ty == t and mx == 1]
        by_type[t] = [mm.vec_kernel_name(t, 1)] + [v for v in (sweep[:1] + wide[:1] if args.quick else sweep + wide)
                                                    if wanted(v, None)]
        m4_by_type[t] = [mm.vec_kernel_name(t, 4)] + [n for n, (ty, _, mx) in kernels.VEC_WIDE.items()
                                                      if ty == t and mx == 4 and wanted(n, None)]
    vecq_by_type: dict[str, list[tuple[str, int]]] = {}  # (variant, M)
    for t in types:
        q1 = [n for n, (ty, _, mx) in kernels.VECQ_SWEEP.items() if ty == t and mx == 1]
        q4 = [n for n, (ty, _, mx) in kernels.VECQ_SWEEP.items() if ty == t and mx == 4]
        dq = f"mul_mat_vecq_{t}_q8_1_m1_{mm.vecq_default_config(t, cpu=cpu).tag}"
        mine = [n for n in (q1[:2] if args.quick else q1) if wanted(n, dq)]
        if q1 and dq in kernels.VECQ_SWEEP and dq not in mine:
            mine.insert(0, dq)  # the device's decode default: always checked and timed
        vecq_by_type[t] = [(n, 1) for n in mine] + [(n, 4) for n in q4[:1] if not pick]

    print("## correctness (small shape, float64 reference)\n\n| type | variant | check |\n|---|---|---|")
    failed: set[str] = set()
    skipped: set[str] = set()
    for t in types:
        for v, res in verify(dev, rng, t, by_type[t] + m4_by_type[t]).items():
            print(f"| {t} | `{v}` | {res} |")
            if res != "PASS":
                failed.add(v)
        if vecq_by_type[t]:
            for v, res in verify_vecq(dev, rng, t, [v for v, _ in vecq_by_type[t]]).items():
                print(f"| {t} | `{v}` (x as q8_1) | {res} |")
                if res.startswith("SKIP"):
                    skipped.add(v)
                elif res != "PASS":
                    failed.add(v)
    print()

    print("## timings: M columns, N x K = output rows x inner dimension; GB/s = weight bytes / time\n")
    print("| type | N x K | M | variant | shape | us (barrier) | GB/s | % copy | us (no barrier) | GB/s | % copy "
          "| us (dot only) | GB/s | % copy |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    best: dict[str, dict[str, float]] = {t: {} for t in types}
    for t in types:
        for n, k in shapes:
            wbytes = n * row_bytes(t, k)
            copies = max(2, -(-rotate // wbytes))
            host = rng.integers(0, 64, wbytes, dtype=np.uint8)  # f16 fields < 2: finite
            ws = []
            try:
                for _ in range(copies):
                    w = dev.memory.alloc(wbytes, "device", "w")
                    w.write(host)
                    ws.append(w)
            except VkxError as exc:
                print(f"| {t} | {n}x{k} | - | - | - | {str(exc)[:60]} | | | | | | | | |")
                for w in ws:
                    w.close()
                continue
            x = dev.memory.alloc(8 * k * 4, "device", "x")
            x.write(rng.standard_normal(8 * k).astype(np.float32) * 0.01)
            ystride = -(-n // 64) * 64  # 256-byte aligned y slots
            y = dev.memory.alloc(reps * 8 * ystride * 4, "device", "y")
            # working clocks again after writing the copies (without this the first variant
            # timed per shape has run several times slow on the H200)
            spin_up(dev, 0.5)
            runs = [(v, 1) for v in by_type[t]] + [(v, 4) for v in m4_by_type[t]]
            for v, m in runs:
                if v in failed or (v in kernels.VEC_WIDE and k % mm.WIDE_K):
                    continue
                cfg = shape_of(v)
                try:
                    tb, tn, tk = time_variant(dev, t, v, m, n, k, ws, x, y, ystride, reps)
                except VkxError as exc:
                    print(f"| {t} | {n}x{k} | {m} | `{v}` | {cfg.tag} | {str(exc)[:60]} | | | | | | | | |")
                    continue
                gb, gn, gk = wbytes / tb / 1e9, wbytes / tn / 1e9, wbytes / tk / 1e9
                print(f"| {t} | {n}x{k} | {m} | `{v}` | {cfg.tag} | {tb * 1e6:.1f} | {gb:.0f} | "
                      f"{100 * gb / copy_bw:.0f}% | {tn * 1e6:.1f} | {gn:.0f} | {100 * gn / copy_bw:.0f}% | "
                      f"{tk * 1e6:.1f} | {gk:.0f} | {100 * gk / copy_bw:.0f}% |")
                if m == 1:
                    best[t][v] = best[t].get(v, 0.0) + tb  # summed over the shapes
            if vecq_by_type[t] and k % 32 == 0:
                xq = dev.memory.alloc(reps * (-(-mm.vecq_scratch_bytes(8, k) // 256) * 256), "device", "xq")
                qruns = [(None, 1)] + [(v, m) for v, m in vecq_by_type[t] if v not in failed and v not in skipped
                                       and not (kernels.VECQ_SWEEP[v][1].blk == 8 and k % mm.WIDE_K)]
                for v, m in qruns:
                    label = f"`{v}`" if v else "`quantize_q8_1` only"
                    tag = kernels.VECQ_SWEEP[v][1].tag + " +q8_1" if v else "-"
                    try:
                        tb, tn, tk = time_vecq(dev, t, v, m, n, k, ws, x, xq, y, ystride, reps)
                    except VkxError as exc:
                        print(f"| {t} | {n}x{k} | {m} | {label} | {tag} | {str(exc)[:60]} | | | | | | | | |")
                        continue
                    if v is None:  # not a weight-streaming kernel: no GB/s
                        print(f"| {t} | {n}x{k} | {m} | {label} | {tag} | {tb * 1e6:.1f} | - | - | "
                              f"{tn * 1e6:.1f} | - | - | {tk * 1e6:.1f} | - | - |")
                        continue
                    gb, gn, gk = wbytes / tb / 1e9, wbytes / tn / 1e9, wbytes / tk / 1e9
                    print(f"| {t} | {n}x{k} | {m} | {label} | {tag} | {tb * 1e6:.1f} | {gb:.0f} | "
                          f"{100 * gb / copy_bw:.0f}% | {tn * 1e6:.1f} | {gn:.0f} | {100 * gn / copy_bw:.0f}% | "
                          f"{tk * 1e6:.1f} | {gk:.0f} | {100 * gk / copy_bw:.0f}% |")
                    if v and m == 1:
                        best[t][v] = best[t].get(v, 0.0) + tb
                xq.close()
            for buf in (*ws, x, y):
                buf.close()
    # the fixed cost of one mat-vec in a decode step: the default vecq kernel on 64 rows (a few KB
    # of weights), dot only, barrier mode; what a shape could reach at best is its bytes at the
    # copy rate plus this floor
    floor_rows = []
    for t in types:
        if not vecq_by_type[t] or not (cpu or t in mm.VECQ_GPU_TYPES):
            continue
        v = f"mul_mat_vecq_{t}_q8_1_m1_{mm.vecq_default_config(t, cpu=cpu).tag}"
        if v in failed or v in skipped or v not in {n for n, _ in vecq_by_type[t]}:
            continue
        for n, k in shapes:
            if k % 32:
                continue
            wb = 64 * row_bytes(t, k)
            ws = [dev.memory.alloc(wb, "device", "w_floor")]
            ws[0].write(rng.integers(0, 64, wb, dtype=np.uint8))
            x = dev.memory.alloc(8 * k * 4, "device", "x")
            x.write(rng.standard_normal(8 * k).astype(np.float32) * 0.01)
            y = dev.memory.alloc(reps * 8 * 64 * 4, "device", "y")
            xq = dev.memory.alloc(reps * (-(-mm.vecq_scratch_bytes(8, k) // 256) * 256), "device", "xq")
            try:
                _, _, tf = time_vecq(dev, t, v, 1, 64, k, ws, x, xq, y, 64, reps)
            except VkxError as exc:
                floor_rows.append(f"| {t} | {n}x{k} | `{v}` | {str(exc)[:60]} | | |")
                continue
            finally:
                for buf in (*ws, x, y, xq):
                    buf.close()
            big = n * row_bytes(t, k)
            best_t = tf + big / (copy_bw * 1e9)
            floor_rows.append(f"| {t} | {n}x{k} | `{v}` | {tf * 1e6:.1f} | {best_t * 1e6:.1f} | "
                              f"{100 * big / best_t / 1e9 / copy_bw:.0f}% |")
    if floor_rows:
        print("\n## per-dispatch floor: the default kernel on 64 rows (dot only, barrier mode), and the best a "
              "shape's time could be: the floor + its weight bytes at the copy rate\n")
        print("| type | N x K | variant | floor us (64 rows) | floor + bytes / copy us | best % of copy |")
        print("|---|---|---|---:|---:|---:|")
        print("\n".join(floor_rows))

    print("\n## fastest M = 1 variant per type (sum of barrier-mode times over the shapes)\n")
    for t in types:
        if best[t]:
            v = min(best[t], key=best[t].get)
            d = best[t].get(mm.vec_kernel_name(t, 1))
            rel = f", default {d / best[t][v]:.2f}x its time" if d else ""
            note = " (x rounded to q8_1: integer dot products)" if v in kernels.VECQ_SWEEP else ""
            print(f"- {t}: `{v}` ({shape_of(v).tag}){rel}{note}")
    if failed:
        print(f"\nFAILED variants: {', '.join(sorted(failed))}")
    print(f"\n(total {time.time() - t0:.0f} s)")
    dev.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
