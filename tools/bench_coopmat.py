#!/usr/bin/env python3
"""Sweep of the cooperative-matrix mat-mat kernel's variants (shaders/mul_mat_coopmat.comp).

For F16, Q4_0, Q8_0, Q4_K and Q6_K weights: first verifies every coopmat variant of the type
once against a float64 numpy reference on a small odd shape (edge tiles in M, N and K,
interior tiles stored straight to y), printing PASS/FAIL; then times every variant (the
type's default ``mul_mat_coopmat_<type>_f32`` and the sweep tilings
``mul_mat_coopmat_<type>_f32_t<BM>x<BN>_k<BK>_w<WM>x<WN>``) and the tiled path at M = 512 on
4096x4096 and 14336x4096 (N x K; F16 also 4096x14336) with GPU timestamps, printing markdown
tables and the fastest variant per type (the tiling to put in COOP_CONFIG).

Usage: python tools/bench_coopmat.py [--quick] [--reps N] [--m 128,512] [--types q4_0] [--shapes 4096x4096]
                                     [--splits auto,1,2,4] [--tiles t128x256_k32_w64x64_s1,...]
  VKXSPLIT_PIPELINE_STATS=1 adds the driver's compiler statistics per variant (registers).
  --splits times each variant with K split as coop_k_split chooses (auto) and/or into the given
           numbers of ranges (each a multiple of the tile's BK, at least 2 BK long); "auto" adds
           the unsplit default and the tiled path; a "chosen" row per shape is what a model gets
           (record_mul_mat's own choice, vkxsplit.ops.choose.DeviceKernels.matmat)
  --quick  small shapes; on a device without cooperative matrices (lavapipe) it runs the
           emulated variants (mul_mat_coopmat_emu_*), a smoke test of the script and kernel.
Exit status: 0, or 1 when a variant FAILs its check (2 when the device has no coopmat and
--quick is not given).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels as tk  # noqa: E402
from bench_kernels import timed  # noqa: E402
from benchutil import spin_up  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.ops import mul_mat as mm  # noqa: E402
from vkxsplit.ops.choose import DeviceKernels, kernels_for, split_chunk  # noqa: E402
from vkxsplit.ops.get_rows import record_dequant_rows  # noqa: E402
from vkxsplit.ops.quant import block_size, row_bytes, weight_type  # noqa: E402
from vkxsplit.vk.command import Sequence  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402

SWEPT = list(tk.COOP_SWEEP_TYPES)  # the default --types
TYPES = [*SWEPT, "f32", "bf16", "q4_1", "q5_0", "q5_1", "q5_k"]  # --types may name these too
# byte offsets of the f16 scale fields per block (random valid blocks for the check)
SCALES = {"q4_0": [0], "q8_0": [0], "q4_k": [0, 2], "q6_k": [208], "q4_1": [0, 2], "q5_0": [0],
          "q5_1": [0, 2], "q5_k": [0, 2]}


CM2 = False  # --cm2: the mul_mat_cm2 variants (VK_NV_cooperative_matrix2) instead


def default_variant(t: str, emulate: bool) -> str:
    return mm.cm2_variant_name(t) if CM2 else mm.coop_variant_name(t, emulate=emulate)


def variants(t: str, emulate: bool) -> list[str]:
    base = default_variant(t, emulate)
    if CM2:
        names = [n for n in tk.CM2_VARIANTS if n.startswith(f"mul_mat_cm2_{t}_f32_")]
    else:
        table = tk.COOP_EMU_VARIANTS if emulate else tk.COOP_VARIANTS
        names = [n for n in table if n == base or n.startswith(base + "_")]
    return sorted(names, key=lambda n: (n != base, n))


def tile_of(name: str):  # type: ignore[no-untyped-def]
    """The tiling of a coopmat / cm2 variant (shipped or an experiment one)."""
    return mm.coop_tile(name) or {**tk.COOP_VARIANTS, **tk.COOP_EMU_VARIANTS, **tk.CM2_VARIANTS}[name][1]


def auto_split(kc: DeviceKernels, t: str, tile: object, M: int, n: int, k: int) -> int:
    """K elements per split the device's own rule gives ``tile`` (0: none)."""
    if CM2:
        return kc.cm2_k_split(t, tile, M, n, k)  # type: ignore[arg-type]
    return kc.coop_k_split(tile, M, n, k)  # type: ignore[arg-type]


def make_weights(rng: np.random.Generator, t: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw ggml bytes [n, row_bytes], float64 reference [n, k]) from gguf's dequantize."""
    wt = weight_type(t)
    if t in ("f16", "f32"):
        w = rng.standard_normal((n, k)).astype(np.float16 if t == "f16" else np.float32)
        return w.view(np.uint8).reshape(n, -1), w.astype(np.float64)
    if t == "bf16":
        import ml_dtypes

        w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        return w.view(np.uint8).reshape(n, -1), w.astype(np.float64)
    bs, bb = GGML_QUANT_SIZES[wt.ggml]
    raw = rng.integers(0, 256, size=(n, k // bs, bb), dtype=np.uint8)
    for off in SCALES[t]:
        d = (rng.uniform(0.001, 0.01, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    raw = raw.reshape(n, -1)
    ref = np.asarray(dequantize(raw, wt.ggml), dtype=np.float64).reshape(n, k)
    return raw, ref


def abs_weights(raw: np.ndarray, t: str, w: np.ndarray) -> np.ndarray:
    """|d sc q| + |dmin m| for Q4_K / Q5_K (the min term's magnitude counts), else |w|."""
    if t not in ("q4_k", "q5_k"):
        return np.abs(w)
    blocks = raw.reshape(raw.shape[0], -1, 144 if t == "q4_k" else 176).copy()
    blocks[:, :, 1] &= 0x7F
    blocks[:, :, 3] |= 0x80
    return np.abs(np.asarray(dequantize(blocks.reshape(raw.shape), weight_type(t).ggml),
                             dtype=np.float64).reshape(w.shape))


def check_variant(dev: Device, rng: np.random.Generator, t: str, name: str, k_split: int = 0) -> tuple[bool, str]:
    """One run on a small odd shape against numpy: (ok, detail). ``k_split``: K split into
    ranges of that many elements (partials reduced by reduce_splitk_f32), on a longer K."""
    tile = tile_of(name)
    M, N = tile.bm + 13, tile.bn + 76  # N % 4 == 0: the interior tile stores straight to y
    K = {1: 264, 32: 288, 256: 768}[block_size(t)]  # no multiple of BK 32 / 64
    if k_split:
        K += 4 * k_split  # (whole blocks of every type for the splits used here)
    raw, W = make_weights(rng, t, N, K)
    x = rng.standard_normal((M, K))
    bufs = [dev.memory.alloc(max(n, 4), "host", name="check") for n in (raw.nbytes, 4 * M * K, 4 * M * N)]
    try:
        wb, xb, yb = bufs
        wb.numpy(np.uint8, (raw.nbytes,))[:] = raw.ravel()
        xb.numpy(np.float32, (M * K,))[:] = x.astype(np.float32).ravel()
        y = yb.numpy(np.float32, (M * N,))
        y[:] = np.nan
        seq = Sequence(dev, "check")
        try:
            mm.record_mul_mat(seq, wb, t, xb, yb, M, N, K, path="coopmat", coop_variant=name, k_split=k_split)
            seq.run()
        finally:
            seq.close()
        got = y.reshape(M, N).astype(np.float64)
    finally:
        for b in bufs:
            b.close()
    ref = x @ W.T
    bound = (2.0 ** -10 + 2 * K * 2.0 ** -23) * (np.abs(x) @ abs_weights(raw, t, W).T)
    if np.isnan(got).any():
        return False, f"{int(np.isnan(got).sum())} NaN (unwritten) elements, M={M} N={N} K={K}"
    ratio = float(np.max(np.abs(got - ref) / np.maximum(bound, 1e-300)))
    return ratio <= 1.0, f"M={M} N={N} K={K}{f' split K by {k_split}' if k_split else ''}, worst error / bound {ratio:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes; emulated variants without coopmat")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default 10, --quick 1)")
    ap.add_argument("--m", default=None, help="comma-separated batch sizes M to time (default 512; --quick 64)")
    ap.add_argument("--types", default=",".join(SWEPT), help=f"comma-separated weight types ({', '.join(TYPES)})")
    ap.add_argument("--shapes", default=None, help="comma-separated NxK shapes (default 4096x4096,14336x4096)")
    ap.add_argument("--splits", default="auto",
                    help="comma-separated K splits to time every variant with: auto (coop_k_split's choice) "
                         "and/or counts (1: unsplit, 2, 4, ...)")
    ap.add_argument("--tiles", default=None, help="comma-separated tile names (t128x128_k32_w64x64, ...) to time; "
                                                  "default: every tile of the type")
    ap.add_argument("--cm2", action="store_true",
                    help="the VK_NV_cooperative_matrix2 kernels (mul_mat_cm2_*: x converted to f16 first, "
                         "timed with the conversion) instead of mul_mat_coopmat")
    args = ap.parse_args()
    global CM2
    CM2 = args.cm2
    types = [t for t in args.types.split(",") if t]
    splits = [sp for sp in args.splits.split(",") if sp]
    if not splits or any(sp != "auto" and not (sp.isdigit() and int(sp) >= 1) for sp in splits):
        ap.error("--splits: auto and/or counts >= 1")
    tiles = set(args.tiles.split(",")) if args.tiles else None
    if not types or any(t not in TYPES for t in types):
        ap.error(f"--types: choose from {', '.join(TYPES)}")
    t_start = time.perf_counter()
    tk.ensure("^mul_mat_c")  # the sweep's tilings and the emulated variants (tools/kernels.py)
    dev = Device.open()
    spin_up(dev)  # working clocks before the first timing (tools/benchutil.py)
    kc = kernels_for(dev)  # the device's kernel choice (vkxsplit/ops/choose.py)
    real = kc.coopmat2_available if CM2 else kc.coopmat_available
    print(f"device: {dev.name} ({dev.physical.driver_name} {dev.physical.driver_info}), "
          f"{'coopmat2' if CM2 else 'coopmat'}={real}\n")
    if CM2:
        print(f"VK_NV_cooperative_matrix2 properties: {dev.physical.coopmat2}")
        for f in dev.physical.coopmat2_flex:
            print(f"  flexible: granularity {f.m_granularity}x{f.n_granularity}x{f.k_granularity} "
                  f"types A{f.a_type} B{f.b_type} C{f.c_type} R{f.result_type} scope {f.scope} "
                  f"invocations {f.workgroup_invocations}")
        print()
        if not real:
            print("this device cannot run mul_mat_cm2", file=sys.stderr)
            return 2
    if not real and not args.quick:
        print("this device has no usable cooperative matrices; use --quick for the emulated smoke run",
              file=sys.stderr)
        return 2
    emulate = not real
    rng = np.random.default_rng(0)
    reps = args.reps or (1 if args.quick else 10)

    # 1. correctness of every variant
    print("## check against numpy (x, W rounded to f16, f32 accumulation bound)\n")
    print("| type | variant | result | detail |\n|---|---|---|---|")
    failed = 0
    for t in types:
        base = default_variant(t, emulate)
        for name, ks in [*((n, 0) for n in variants(t, emulate)), (base, 4 * tile_of(base).bk)]:
            try:
                ok, detail = check_variant(dev, rng, t, name, ks)
            except VkxError as exc:
                ok, detail = False, str(exc).splitlines()[0]
            failed += not ok
            print(f"| {t} | {name} | {'PASS' if ok else 'FAIL'} | {detail} |")

    # 1b. compiler statistics (registers: how many workgroups an SM can hold), when asked for
    if dev.pipeline_stats:
        from vkxsplit.vk.kernel import Kernel

        print("\n## compiler statistics (VKXSPLIT_PIPELINE_STATS=1)\n")
        print("| variant | threads | statistics |\n|---|---:|---|")
        for t in types:
            for name in variants(t, emulate):
                if tiles is not None and tile_of(name).name not in tiles:
                    continue
                st = Kernel.get(dev, name).statistics()
                desc = ", ".join(f"{k} {v:g}" for k, v in st.items())
                print(f"| {name} | {tile_of(name).threads} | {desc or '-'} |")

    # 2. timings
    Ms = [int(m) for m in args.m.split(",")] if args.m else [64 if args.quick else 512]
    if args.shapes:
        given = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        shapes = {t: [(m, n, k) for m in Ms for n, k in given] for t in TYPES}
    else:
        shapes = {t: [(m, n, k) for m in Ms for n, k in ([(128, 256)] if args.quick else [(4096, 4096), (14336, 4096)])]
                  for t in TYPES}
        if not args.quick:
            shapes["f16"] += [(m, 4096, 14336) for m in Ms]
    print(f"\n## mat-mat timings, M = {', '.join(map(str, Ms))} (N x K = output rows x inner dimension)\n")
    print("| type | M | N x K | variant | tile | workgroups | ms | TFLOP/s |\n|---|---:|---|---|---|---:|---:|---:|")
    best: dict[tuple[str, int, int, int], tuple[float, str]] = {}
    per_variant: dict[tuple[str, str], list[float]] = {}
    for t in types:
        for M, n, k in shapes[t]:
            wbytes = n * row_bytes(t, k)
            w = dev.memory.alloc(wbytes, "device", "w")
            w.write(rng.integers(0, 64, wbytes, dtype=np.uint8))
            x = dev.memory.alloc(M * k * 4, "device", "x")
            x.write((rng.standard_normal(M * k) * 0.01).astype(np.float32))
            y = dev.memory.alloc(M * n * 4, "device", "y")
            flop = 2.0 * M * n * k
            default = default_variant(t, emulate)
            runs: list[tuple[str, str]] = [(v, sp) for v in variants(t, emulate)
                                           if tiles is None or tile_of(v).name in tiles
                                           for sp in splits]
            if "auto" in splits:
                runs += [("no-split", "1"), ("tiled", "-")]
            if not emulate:
                runs.append(("chosen", "-"))
            dq = not emulate and kc.dq16_available(t)
            if dq:  # the dequantize-first path against decoding in the tile loader, and its pass alone
                runs += [("direct", "-"), ("dq16", "-"), ("dequant", "-")]
            for name, sp in runs:
                # "auto": the coopmat variants split K where kc.coop_k_split says so (real coopmat
                # only); a count: split into that many ranges; "no-split": the default variant
                # with k_split=0, for the comparison
                if name in ("direct", "dq16", "dequant"):
                    if name == "dequant":
                        wh = dev.memory.alloc(n * k * 2, "device", "wh")
                        try:
                            sec = timed(dev, lambda s, w=w, wh=wh, n=n, k=k, t=t:
                                        record_dequant_rows(s, w, t, wh, n, k), reps)
                        finally:
                            wh.close()
                        gbs = (n * row_bytes(t, k) + 2 * n * k) / sec / 1e9
                        print(f"| {t} | {M} | {n}x{k} | dequant_rows_{t}_f16 alone | {gbs:.0f} GB/s "
                              f"(read + write) | - | {sec * 1e3:.3f} | - |")
                        continue
                    use = name == "dq16"
                    cname, cks = kc.cm2("f16" if use else t, M, n, k) if (
                        use or t in mm.CM2_TYPES) else kc.coop(t, M, n, k)
                    tile = tile_of(cname).name + (f" split K {-(-k // cks)}x{cks}" if cks else "")
                    tile += " after dequant_rows" if use else ""
                    try:
                        sec = timed(dev, lambda s, w=w, x=x, y=y, n=n, k=k, t=t, use=use, M=M:
                                    mm.record_mul_mat(s, w, t, x, y, M, n, k, path="coopmat", dq16=use), reps)
                    except VkxError as exc:
                        print(f"| {t} | {M} | {n}x{k} | {name} | {tile} | - | - | {str(exc)[:60]} |")
                        continue
                    print(f"| {t} | {M} | {n}x{k} | {name} | {tile} | - | {sec * 1e3:.3f} | {flop / sec / 1e12:.3g} |")
                    continue
                if name == "tiled":
                    kw = {"path": "tiled"}
                elif name == "chosen":  # what a model gets: record_mul_mat's own choice (kc.matmat)
                    kw = {"path": "coopmat"}
                elif name == "no-split":
                    kw = {"path": "coopmat", "coop_variant": default, "k_split": 0}
                else:
                    kw = {"path": "coopmat", "coop_variant": name}
                chooser = kc.cm2 if (CM2 or kc.coopmat2_available) and t in mm.CM2_TYPES else kc.coop
                cname, cks = chooser(t, M, n, k) if name == "chosen" else (name, 0)
                ctile = tile_of(default if name == "no-split" else cname) if name != "tiled" else None
                tile = "64x64 f32" if ctile is None else ctile.name
                bm, bn = (64, 64) if ctile is None else (ctile.bm, ctile.bn)
                groups = -(-M // bm) * -(-n // bn)
                if name == "chosen":
                    if kc.dq16_available(t) and kc.dq16(t, M, n, k):
                        tile = "dq16 (dequant_rows, then f16)"
                    elif cks:
                        tile += f" split K {-(-k // cks)}x{cks}"
                        groups *= -(-k // cks)
                elif ctile is not None and name != "no-split" and sp != "auto":
                    chunk = split_chunk(k, int(sp), ctile.bk)
                    if int(sp) > 1 and (chunk >= k or chunk < 2 * ctile.bk):
                        continue  # K too short for that many ranges
                    kw["k_split"] = 0 if int(sp) == 1 else chunk
                    if int(sp) > 1:
                        tile += f" split K {-(-k // chunk)}x{chunk}"
                        groups *= -(-k // chunk)
                elif ctile is not None and name != "no-split" and not emulate and kc.splits_k:
                    ks = auto_split(kc, t, ctile, M, n, k)
                    kw["k_split"] = ks
                    if ks:
                        tile += f" split K {-(-k // ks)}x{ks}"
                        groups *= -(-k // ks)
                try:
                    sec = timed(dev, lambda s, w=w, x=x, y=y, n=n, k=k, t=t, kw=kw, M=M:
                                mm.record_mul_mat(s, w, t, x, y, M, n, k, **kw), reps)
                except VkxError as exc:
                    print(f"| {t} | {M} | {n}x{k} | {name} | {tile} | {groups} | - | {str(exc)[:60]} |")
                    continue
                tf = flop / sec / 1e12
                print(f"| {t} | {M} | {n}x{k} | {name} | {tile} | {groups} | {sec * 1e3:.3f} | {tf:.3g} |")
                if name not in ("tiled", "no-split", "chosen"):
                    label = name if sp == "auto" else f"{name} /{sp}"
                    per_variant.setdefault((t, label), []).append(tf)
                    if tf > best.get((t, M, n, k), (0.0, ""))[0]:
                        best[(t, M, n, k)] = (tf, label)
            for b in (w, x, y):
                b.close()

    print("\n## fastest coopmat variant per type and shape\n")
    print("| type | M | N x K | fastest | TFLOP/s | default TFLOP/s |\n|---|---:|---|---|---:|---:|")
    for (t, M, n, k), (tf, name) in best.items():
        base = default_variant(t, emulate)
        dflt = per_variant.get((t, base)) or per_variant.get((t, f"{base} /1"), [])
        d = dflt[shapes[t].index((M, n, k))] if len(dflt) == len(shapes[t]) else float("nan")
        print(f"| {t} | {M} | {n}x{k} | {name} | {tf:.3g} | {d:.3g} |")
    print("\n## fastest per type (geometric mean over its shapes; the tiling is COOP_CONFIG's candidate, "
          "a /N label the split it was timed with)\n")
    print("| type | variant | tile | geomean TFLOP/s |\n|---|---|---|---:|")
    for t in types:
        cands = [(math.exp(sum(map(math.log, v)) / len(v)), name) for (tt, name), v in per_variant.items()
                 if tt == t and len(v) == len(shapes[t]) and min(v) > 0]
        if cands:
            g, name = max(cands)
            print(f"| {t} | {name} | {tile_of(name.split(' /')[0]).name} | {g:.3g} |")
    dev.close()
    print(f"\nchecks: {'all PASS' if not failed else f'{failed} FAIL'}; {time.perf_counter() - t_start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
