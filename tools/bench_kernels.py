#!/usr/bin/env python3
"""Kernel throughput on the hub device, timed with GPU timestamps, printed as markdown tables.

- copy bandwidth measured by Vulkan itself (vkCmdCopyBuffer, bytes read + written / time)
- mat-vec GB/s (weight bytes / time) at M = 1 for Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16: the f32-x
  kernel and, for the types decode takes through it, the q8_1-x (integer dot product) path
  with and without its quantize dispatch; and a copy of the same bytes per size
- per weight size, the fastest read-only launch of the same bytes (``probe_read``): a
  mat-vec's ceiling at that size; for Q4_0 / Q8_0 the decode kernel without its x loads
  (``probe_vecq_nox``): what reading x costs it, with its weight loads alone
  (``probe_vecq_nox`` kind ``noc``), and a read-only launch in the kernel's grid with coalesced
  loads (``probe_rows``): what the grid costs, apart from the block layout's loads
- mat-mat TFLOP/s at M = 512 for the same types, tiled and cooperative-matrix paths, and the
  cooperative-matrix multiply-add rate without loads (``probe_mma``): the mat-mat's ceiling

Usage: python tools/bench_kernels.py [--quick]   (tools/device_bench.sh runs it on the H200)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchutil  # noqa: E402
import kernels as tk  # noqa: E402
import probes as pr  # noqa: E402
from bench_matvec import ROTATE_BYTES, time_vecq  # noqa: E402
from benchutil import spin_up  # noqa: E402

from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.ops import mul_mat as mm  # noqa: E402
from vkxsplit.ops.choose import kernels_for, vecq_for_shape  # noqa: E402
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.mul_mat import record_mul_mat  # noqa: E402
from vkxsplit.ops.quant import row_bytes  # noqa: E402
from vkxsplit.vk.command import Sequence  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402
from vkxsplit.vk.kernel import View  # noqa: E402


def timed(dev: Device, record, reps: int) -> float:
    """Seconds per repetition of ``record(seq)``, from GPU timestamps (after one warm-up)."""
    return benchutil.timed(dev, lambda s, _i: record(s), reps, warmup=1)


def rotating(dev: Device, rng: np.random.Generator, nbytes: int, rotate: int, bufs: list) -> list:
    """Copies of one random weight matrix of ``nbytes`` totalling >= ``rotate`` bytes, appended
    to ``bufs`` as they are made (the caller closes them, also when an allocation fails), so
    timings rotating through them read DRAM, not the 50 MB L2."""
    host = rng.integers(0, 64, nbytes, dtype=np.uint8)  # f16 fields < 2: finite
    ws = []
    for _ in range(max(2, -(-rotate // nbytes))):
        ws.append(dev.memory.alloc(nbytes, "device", "w"))
        bufs.append(ws[-1])
        ws[-1].write(host)
    return ws


def matvec_times(dev: Device, rng: np.random.Generator, ty: str, n: int, k: int, reps: int,
                 rotate: int) -> list[tuple[str, float | str]]:
    """(path, seconds, or the error that stopped it) rows of one type and shape for :func:`matvec`."""
    vecq = kernels_for(dev).vecq_decode()
    bufs: list = []
    out: list[tuple[str, float | str]] = []
    try:
        ws = rotating(dev, rng, n * row_bytes(ty, k), rotate, bufs)
        x = dev.memory.alloc(8 * k * 4, "device", "x")
        bufs.append(x)
        x.write(rng.standard_normal(8 * k).astype(np.float32) * 0.01)
        ystride = -(-n // 64) * 64
        y = dev.memory.alloc(reps * 8 * ystride * 4, "device", "y")
        bufs.append(y)
        xq = dev.memory.alloc(reps * (-(-mm.vecq_scratch_bytes(8, k) // 256) * 256), "device", "xq")
        bufs.append(xq)
        yv = View(y, 0, 8 * ystride * 4)
        # working clocks again after the host-side set-up above (without this the first shape
        # of a type has timed several times slow on the H200)
        spin_up(dev, 0.5)
        t = benchutil.timed(dev, lambda s, i: record_mul_mat(s, ws[i % len(ws)], ty, x, yv, 1, n, k), reps)
        out.append(("f32 x (`record_mul_mat`)", t))
        v = vecq.get(ty)
        if v is not None and k % 32 == 0:
            v = vecq_for_shape(v, ty, n, k)
            tag = mm.vecq_spec(v)[1].tag
            try:
                tb, _, tk = time_vecq(dev, ty, v, 1, n, k, ws, x, xq, y, ystride, reps)
                out += [(f"x as q8_1: quantize + dot (`{tag}`)", tb), (f"x as q8_1: dot only (`{tag}`)", tk)]
                if v in pr.NOX_BASES:  # the same kernel without its x loads (a probe: y = row sums)
                    tn = benchutil.timed(dev, lambda s, i, v=v: pr.record_probe_vecq_nox(
                        s, ws[i % len(ws)], ty, xq, yv, n, k, v), reps)
                    out.append((f"probe: dot only, x loads left out (`{tag}`)", tn))
                    tc = benchutil.timed(dev, lambda s, i, v=v: pr.record_probe_vecq_nox(
                        s, ws[i % len(ws)], ty, xq, yv, n, k, v, kind="noc"), reps)
                    out.append((f"probe: the weight loads alone, no x, no dot (`{tag}`)", tc))
                    out += rows_times(dev, ws, yv, n, row_bytes(ty, k), mm.vecq_spec(v)[1], reps)
            except VkxError as exc:
                out.append((f"x as q8_1 (`{tag}`)", str(exc)[:60]))
    except VkxError as exc:
        out.append(("-", str(exc)[:60]))
    finally:
        for buf in bufs:
            buf.close()
    return out


ROWS_GRIDS = (None, 1056, 264)  # probe_rows workgroups: one per row group, or fewer looping


def rows_times(dev: Device, ws: list, yv: View, n: int, rbytes: int, cfg, reps: int) -> list[tuple[str, float | str]]:
    """Rows of the read-only launch in the grid of decode shape ``cfg`` (``probe_rows``: its
    teams and rows per workgroup, 16-byte and 32-bit coalesced loads; one workgroup per row group
    or fewer looping), each checked against numpy's row sums of the first weight copy first."""
    out: list[tuple[str, float | str]] = []
    want = ws[0].read(np.uint32)[: n * rbytes // 4].reshape(n, -1).astype(np.uint64).sum(axis=1) % (1 << 32)
    for shape in pr.ROWS_SHAPES:
        if (shape.nr, shape.r) != (cfg.nr, cfg.rpt) or rbytes % (4 * shape.v):
            continue
        for g in ROWS_GRIDS:
            groups = pr.rows_groups(dev, n, shape) if g is None else min(g, pr.rows_groups(dev, n, shape))
            label = f"probe: read-only launch in this grid (`probe_rows_{shape.tag}`, {groups} workgroups)"
            try:
                run_once(dev, "rows check", lambda seq, shape=shape, groups=groups: pr.record_probe_read_rows(
                    seq, ws[0], yv, n, rbytes, shape, groups))
                got = yv.buffer.read(np.uint32, (n,), yv.offset).astype(np.uint64)
                if not np.array_equal(got, want):
                    raise VkxError(f"probe_rows_{shape.tag} on {groups} workgroups: row sums differ from numpy")
                t = benchutil.timed(dev, lambda s, i, shape=shape, groups=groups: pr.record_probe_read_rows(
                    s, ws[i % len(ws)], yv, n, rbytes, shape, groups), reps)
                out.append((label, t))
            except VkxError as exc:
                out.append((label, str(exc)[:60]))
    return out


def copy_time(dev: Device, nbytes: int, reps: int, rotate: int) -> float:
    """Seconds per compute copy moving ``nbytes`` (half read, half written), rotating buffers
    totalling >= ``rotate`` bytes, a barrier after each. Raises VkxError (buffers closed)."""
    half = nbytes // 2 // 16 * 16
    bufs = []
    try:
        for _ in range(2 * max(2, -(-rotate // nbytes))):
            bufs.append(dev.memory.alloc(half, "device", "c"))
        t = benchutil.timed(dev, lambda s, i: record_copy(s, bufs[(2 * i) % len(bufs)],
                                                          bufs[(2 * i + 1) % len(bufs)], half), reps)
    finally:
        for buf in bufs:
            buf.close()
    return t * nbytes / (2 * half)


READ_GRIDS = (None, 1024, 2048)  # probe_read workgroups: one pass (each thread loads once), or fewer looping


def run_once(dev: Device, label: str, record) -> None:
    """Record ``record(seq)`` into a new sequence, run it once and wait; the sequence is closed
    also when recording or running fails."""
    seq = Sequence(dev, label)
    try:
        record(seq)
        seq.run(timeout=60)
    finally:
        seq.close()


def read_time(dev: Device, nbytes: int, reps: int, rotate: int, passes: int = 1) -> tuple[float, str]:
    """(seconds, configuration) of the fastest read-only launch of ``nbytes`` (``probe_read``,
    unrolls x grids), rotating buffers totalling >= ``rotate`` bytes, a barrier after each; its
    sums are checked against numpy first. Raises VkxError (buffers closed)."""
    nbytes = nbytes // 16 * 16
    host = np.random.default_rng(nbytes).integers(0, 1 << 32, nbytes // 4, dtype=np.uint64).astype(np.uint32)
    want = passes * int(host.astype(np.uint64).sum()) % (1 << 32)
    bufs = []
    try:
        for _ in range(max(2, -(-rotate // nbytes))):
            bufs.append(dev.memory.alloc(nbytes, "device", "r"))
            bufs[-1].write(host)
        srcs = list(bufs)
        words = 4 * max(pr.read_groups(dev, nbytes, u) for u in pr.READ_UNROLLS)
        out = dev.memory.alloc(words, "host", "sums")  # the check reads it
        bufs.append(out)
        out_dev = dev.memory.alloc(words, "device", "sums")  # the timings write it (no writes across PCIe)
        bufs.append(out_dev)
        best: tuple[float, str] = (float("inf"), "")
        for u in pr.READ_UNROLLS:
            for g in READ_GRIDS:
                groups = pr.read_groups(dev, nbytes, u) if g is None else min(g, pr.read_groups(dev, nbytes, u))
                run_once(dev, "read check", lambda seq, u=u, groups=groups: pr.record_probe_read(
                    seq, srcs[0], out, nbytes, u, groups, passes))
                got = int(out.numpy(np.uint32)[:groups].astype(np.uint64).sum()) % (1 << 32)
                if got != want:
                    raise VkxError(f"probe_read_u{u} on {groups} workgroups summed {got:#x}, numpy {want:#x}")
                t = benchutil.timed(dev, lambda s, i, u=u, groups=groups: pr.record_probe_read(
                    s, srcs[i % len(srcs)], out_dev, nbytes, u, groups, passes), reps)
                best = min(best, (t, f"u{u}, {groups} workgroups"))
        return best
    finally:
        for buf in bufs:
            buf.close()


def matvec(dev: Device, rng: np.random.Generator, types: list[str], shapes: list[tuple[int, int]],
           copy_bw: float, reps: int, rotate: int) -> None:
    """The mat-vec table: per type and shape, the f32-x kernel record_mul_mat picks at M = 1,
    and for the types a decode step takes through the integer-dot-product path (x quantized to
    q8_1, ``vecq_decode``) that path with its quantize dispatch and without it (in a model the
    norm writes x as q8_1); then a compute copy moving the same bytes (half read, half
    written: the same DRAM traffic in one launch of that size), so each row can be read
    against it. Weights rotate through copies totalling >= ``rotate`` bytes (each repetition
    reads a copy the previous min(reps, copies) - 1 did not: DRAM, not the 50 MB L2); a
    barrier after every dispatch, as in a decode step."""
    print("mat-vec (M = 1), N x K = output rows x inner dimension; each repetition reads a weight "
          f"copy none of the previous min({reps}, copies) - 1 read (copies totalling >= {rotate >> 20} "
          "MiB); a barrier after each dispatch\n")
    print("| type | N x K | path | us | GB/s | % of copy |\n|---|---|---|---:|---:|---:|")
    labels: dict[int, list[str]] = {}
    for ty in types:
        for n, k in shapes:
            wbytes = n * row_bytes(ty, k)
            labels.setdefault(wbytes, []).append(f"{ty} {n}x{k}")
            for path, t in matvec_times(dev, rng, ty, n, k, reps, rotate):
                if isinstance(t, str):  # the error that stopped this row
                    print(f"| {ty} | {n}x{k} | {path} | - | - | {t} |")
                    continue
                gbs = wbytes / t / 1e9
                print(f"| {ty} | {n}x{k} | {path} | {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% |")
    print("\ncompute copy moving each row's weight bytes (half read, half written; rotating "
          "buffers, a barrier after each): the same DRAM traffic in one launch of that size:\n")
    print("| bytes | weights of | us | GB/s | % of copy |\n|---:|---|---:|---:|---:|")
    for nb in sorted(labels):
        try:
            t = copy_time(dev, nb, reps, rotate)
        except VkxError as exc:
            print(f"| {nb} | {', '.join(labels[nb])} | - | - | {str(exc)[:60]} |")
            continue
        gbs = nb / t / 1e9
        print(f"| {nb} | {', '.join(labels[nb])} | {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% |")
    print("\nread-only launch of each row's weight bytes (`probe_read`: 16-byte loads, the fastest of "
          f"unrolls {pr.READ_UNROLLS} x grids; rotating buffers, a barrier after each): a mat-vec's "
          "ceiling at that size\n")
    print("| bytes | weights of | fastest | us | GB/s | % of copy |\n|---:|---|---|---:|---:|---:|")
    for nb in sorted(labels):
        try:
            t, how = read_time(dev, nb, reps, rotate)
        except VkxError as exc:
            print(f"| {nb} | {', '.join(labels[nb])} | - | - | - | {str(exc)[:60]} |")
            continue
        gbs = nb / t / 1e9
        print(f"| {nb} | {', '.join(labels[nb])} | {how} | {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% |")


def read_rates(dev: Device, copy_bw: float, reps: int, quick: bool) -> None:
    """Read-only rates of the device (``probe_read``): two 16 MiB buffers read in turn, each
    launch reading its buffer 32 times over, stay in the 50 MB L2 (the rate the tile loads of a
    mat-mat draw on: the tiles of x and W are read many times, from L2); 512 MiB ones come from
    DRAM (a read-only launch far past its fixed cost)."""
    print("\nread-only rates (`probe_read`, two buffers read in turn, a barrier after each; the "
          "fastest of its unrolls x grids; bytes read = buffer x passes)\n")
    print("| buffer | passes | from | fastest | us | GB/s | % of copy rate |\n|---:|---:|---|---|---:|---:|---:|")
    sizes = [(1 << 20, 4, "L2")] if quick else [(16 << 20, 32, "L2"), (512 << 20, 1, "DRAM")]
    for nb, passes, where in sizes:
        try:
            t, how = read_time(dev, nb, reps, 0, passes)
        except VkxError as exc:
            print(f"| {nb >> 20} MiB | {passes} | {where} | - | - | - | {str(exc)[:60]} |")
            continue
        gbs = nb * passes / t / 1e9
        print(f"| {nb >> 20} MiB | {passes} | {where} | {how} | {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% |")


def mma(dev: Device, reps: int, quick: bool) -> None:
    """The cooperative-matrix multiply-add rate without loads (``probe_mma``): subgroup scope
    on a full grid, and each workgroup-scope tile mul_mat_cm2 keeps on the grid a 4096 x 4096 x
    512 product gives it (and 1, 2, 4 times the SMs' worth); K loops of 64 steps (a K = 4096
    product's) and 16 times that. Results checked against numpy first (integer operands)."""
    rows = []
    for tile in (None, *pr.MMA_WG_TILES):
        name = pr.mma_variant(tile)
        if not pr.mma_supported(dev, tile):
            print(f"{name}: not supported here")
            continue
        (ar, ac), (br, bc), per = pr.mma_shapes(tile)
        if tile is None:
            grids = [64] if quick else [1056, 4224]
        else:
            g0 = (4096 // tile.bw) * (512 // tile.bx)
            grids = [2] if quick else sorted({g0, 132, 264, 528})
        iters_list = [4] if quick else [4096 // tile.bk if tile else 256, 16 * (4096 // tile.bk if tile else 256)]
        rng = np.random.default_rng(3)
        a = rng.integers(-1, 2, (ar, ac)).astype(np.float16)
        b = rng.integers(-1, 2, (br, bc)).astype(np.float16)
        bufs: list = []
        try:
            for nb, kind, label in ((a.nbytes, "host", "a"), (b.nbytes, "host", "b"),
                                    (4 * per * max(grids), "device", "o"), (4 * per, "host", "chk")):
                bufs.append(dev.memory.alloc(nb, kind, label))
            ba, bb, bo, chk = bufs
            ba.numpy(np.float16)[:] = a.ravel()
            bb.numpy(np.float16)[:] = b.ravel()
            # the check: 5 rounds on one workgroup against numpy
            run_once(dev, "mma check", lambda seq, ba=ba, bb=bb, chk=chk, tile=tile: pr.record_probe_mma(
                seq, ba, bb, chk, 5, 1, tile))
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            if tile is None:
                one = np.einsum("ikl,jlm->ijkm", a64.reshape(-1, 16, 16), b64.reshape(-1, 16, 16)).reshape(-1)
                want = np.tile(5 * one, per // one.size)
            else:
                want = (5 * (a64 @ b64)).ravel()
            if not np.array_equal(chk.numpy(np.float32)[:per].astype(np.float64), want):
                raise VkxError(f"{name}: result differs from numpy")
            spin_up(dev, 0.5)
            for g in grids:
                for it in iters_list:
                    t = benchutil.timed(dev, lambda s, _i, g=g, it=it, tile=tile, ba=ba, bb=bb, bo=bo:
                        pr.record_probe_mma(s, ba, bb, bo, it, g, tile), max(3, reps // 4))
                    rows.append((name, g, it, t, pr.mma_flops(tile, g, it) / t / 1e12))
        except VkxError as exc:
            print(f"{name}: {str(exc)[:80]}")
        finally:
            for buf in bufs:
                buf.close()
    if not rows:
        return
    print("\ncooperative-matrix multiply-adds without loads (`probe_mma`, f16 x f16 -> f32; operands "
          "loaded once, a barrier after each dispatch)\n")
    print("| kernel | workgroups | K steps | us | TFLOP/s |\n|---|---:|---:|---:|---:|")
    for name, g, it, t, tf in rows:
        print(f"| {name} | {g} | {it} | {t * 1e6:.1f} | {tf:.1f} |")


def stats(dev: Device, extra: tuple[str, ...] = ()) -> None:
    """The driver's compiler statistics (VKXSPLIT_PIPELINE_STATS=1; registers decide how many
    workgroups an SM holds) of the F16 coopmat2 tilings, the probes, the decode defaults and the
    vecq variants whose names hold one of ``extra``."""
    from vkxsplit.vk.kernel import Kernel

    names = [mm.cm2_variant_name("f16", tile) for tile in mm.CM2_CHOICES["f16"]]
    names += [pr.mma_variant(t) for t in (None, *pr.MMA_WG_TILES)] + [f"probe_read_u{u}" for u in pr.READ_UNROLLS]
    names += sorted({v for v in kernels_for(dev).vecq_decode().values() if v})
    names += [v for v in tk.VECQ_SWEEP if any(s in v for s in extra) and v not in names]
    print("\ncompiler statistics (VKXSPLIT_PIPELINE_STATS=1)\n\n| variant | statistics |\n|---|---|")
    for name in names:
        try:
            st = Kernel.get(dev, name).statistics()
        except VkxError as exc:
            print(f"| {name} | {str(exc)[:60]} |")
            continue
        print(f"| {name} | {', '.join(f'{k} {v:g}' for k, v in st.items()) or '-'} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (lavapipe smoke run)")
    ap.add_argument("--types", default="q4_0,q4_1,q8_0,q4_k,q6_k,f16", help="comma-separated weight types")
    ap.add_argument("--parts", default="matvec,read,matmat,mma",
                    help="comma-separated parts to run: matvec, read (probe_read), matmat, mma (probe_mma)")
    ap.add_argument("--stats-vecq", default="",
                    help="with VKXSPLIT_PIPELINE_STATS=1: also the compiler statistics of the vecq variants "
                         "whose names hold one of these comma-separated parts")
    args = ap.parse_args()
    tk.ensure("^probe_|^mul_mat_vecq_")  # the probes and the vecq shapes --stats-vecq may name
    parts = set(args.parts.split(","))
    dev = Device.open()
    spin_up(dev)  # working clocks before the first timing (tools/benchutil.py)
    print(f"device: {dev.name} ({dev.physical.driver_name} {dev.physical.driver_info}), "
          f"coopmat={dev.coopmat}\n")
    rng = np.random.default_rng(0)
    reps = 3 if args.quick else 20

    # 1. copy bandwidth
    nbytes = (64 if args.quick else 1024) << 20
    a = dev.memory.alloc(nbytes, "device", "copy_a")
    b = dev.memory.alloc(nbytes, "device", "copy_b")
    t = timed(dev, lambda s: s.copy(a, b), reps)
    xfer_bw = 2 * nbytes / t / 1e9
    t = timed(dev, lambda s: record_copy(s, a, b, nbytes), reps)
    copy_bw = 2 * nbytes / t / 1e9
    a.close()
    b.close()
    print("| measure (read + write bytes / time) | value |\n|---|---:|")
    print(f"| vkCmdCopyBuffer | {xfer_bw:.0f} GB/s |")
    print(f"| compute-shader copy (copy_vec4): the reference below | {copy_bw:.0f} GB/s |\n")

    types = [t for t in args.types.split(",") if t]
    shapes = [(4096, 4096), (4096, 14336), (14336, 4096)] if not args.quick else [(512, 1024)]
    if "matvec" in parts:
        matvec(dev, rng, types, shapes, copy_bw, reps, (8 << 20) if args.quick else ROTATE_BYTES)
    if "read" in parts:
        read_rates(dev, copy_bw, reps, args.quick)
    if "matmat" not in parts:
        types = []
    M = 64 if args.quick else 512
    paths = ["tiled"] + (["coopmat"] if dev.coopmat else [])
    print(f"\nmat-mat (M = {M})\n")
    print("| type | path | N x K | ms | TFLOP/s |\n|---|---|---|---:|---:|")
    for ty in types:
        for n, k in shapes[:1] if args.quick else [(4096, 4096), (14336, 4096)]:
            wbytes = n * row_bytes(ty, k)
            w = dev.memory.alloc(wbytes, "device", "w")
            w.write(rng.integers(0, 64, wbytes, dtype=np.uint8))
            x = dev.memory.alloc(M * k * 4, "device", "x")
            x.write(rng.standard_normal(M * k).astype(np.float32))
            y = dev.memory.alloc(M * n * 4, "device", "y")
            spin_up(dev, 0.5)
            for path in paths:
                try:
                    t = timed(dev, lambda s, w=w, x=x, y=y, n=n, k=k, ty=ty, path=path:
                              record_mul_mat(s, w, ty, x, y, M, n, k, path=path), max(3, reps // 4))
                    print(f"| {ty} | {path} | {n}x{k} | {t * 1e3:.3f} | {2 * M * n * k / t / 1e12:.1f} |")
                except VkxError as exc:
                    print(f"| {ty} | {path} | {n}x{k} | - | {str(exc)[:60]} |")
            for buf in (w, x, y):
                buf.close()
    if "mma" in parts:
        mma(dev, reps, args.quick)
    if dev.pipeline_stats:
        stats(dev, tuple(p for p in args.stats_vecq.split(",") if p))
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
