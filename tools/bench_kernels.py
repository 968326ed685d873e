#!/usr/bin/env python3
"""Kernel throughput on the hub device, timed with GPU timestamps, printed as markdown tables.

- copy bandwidth measured by Vulkan itself (vkCmdCopyBuffer, bytes read + written / time)
- mat-vec GB/s (weight bytes / time) at M = 1 for Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16
- mat-mat TFLOP/s at M = 512 for the same types, tiled and cooperative-matrix paths

Usage: python tools/bench_kernels.py [--quick]   (tools/device_bench.sh runs it on the H200)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchutil  # noqa: E402
from benchutil import spin_up  # noqa: E402

from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.ops.copy import record_copy  # noqa: E402
from vkxsplit.ops.mul_mat import record_mul_mat  # noqa: E402
from vkxsplit.ops.quant import row_bytes  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402


def timed(dev: Device, record, reps: int) -> float:
    """Seconds per repetition of ``record(seq)``, from GPU timestamps (after one warm-up)."""
    return benchutil.timed(dev, lambda s, _i: record(s), reps, warmup=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (lavapipe smoke run)")
    args = ap.parse_args()
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

    types = ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "f16"]
    shapes = [(4096, 4096), (4096, 14336), (14336, 4096)] if not args.quick else [(512, 1024)]
    print("mat-vec (M = 1), N x K = output rows x inner dimension\n")
    print("| type | N x K | us | GB/s | % of copy |\n|---|---|---:|---:|---:|")
    for ty in types:
        for n, k in shapes:
            wbytes = n * row_bytes(ty, k)
            w = dev.memory.alloc(wbytes, "device", "w")
            w.write(rng.integers(0, 64, wbytes, dtype=np.uint8))
            x = dev.memory.alloc(8 * k * 4, "device", "x")
            y = dev.memory.alloc(8 * n * 4, "device", "y")
            x.write(rng.standard_normal(8 * k).astype(np.float32) * 0.01)
            try:
                t = timed(dev, lambda s, w=w, x=x, y=y, n=n, k=k, ty=ty: record_mul_mat(s, w, ty, x, y, 1, n, k), reps)
                gbs = wbytes / t / 1e9
                print(f"| {ty} | {n}x{k} | {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% |")
            except VkxError as exc:
                print(f"| {ty} | {n}x{k} | - | - | {exc} |")
            for buf in (w, x, y):
                buf.close()
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
            y = dev.memory.alloc(M * n * 4, "device", "y")
            for path in paths:
                try:
                    t = timed(dev, lambda s, w=w, x=x, y=y, n=n, k=k, ty=ty, path=path:
                              record_mul_mat(s, w, ty, x, y, M, n, k, path=path), max(3, reps // 4))
                    print(f"| {ty} | {path} | {n}x{k} | {t * 1e3:.3f} | {2 * M * n * k / t / 1e12:.1f} |")
                except VkxError as exc:
                    print(f"| {ty} | {path} | {n}x{k} | - | {str(exc)[:60]} |")
            for buf in (w, x, y):
                buf.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
