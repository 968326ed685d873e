#!/usr/bin/env python3
"""Creates this device's pipeline for every shader variant it can run (or those whose names
start with one of ``--prefix``): the shipped ones, and the experiment kernels already built in
build/tool-spv (tools/kernels.py; nothing is compiled here), so the pipeline cache in
VKXSPLIT_CACHE_DIR is warm before a test run on a fresh machine. Why: on the H200 a cold run of
tests/test_mul_mat_cm2.py under the validation layer spends most of its time creating
pipelines, several times what the tests take with the cache warm. Run without the validation
layer (it is not needed to fill the cache). Prints how many pipelines were made, how many
failed (with the first errors) and the time; exit status 1 when any failed.

Usage: VKXSPLIT_CACHE_DIR=/tmp/vkxcache python tools/warm_pipelines.py [--prefix mul_mat_cm2_,dequant_rows_] [--shipped-only]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402

from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.info import kernel_report  # noqa: E402
from vkxsplit.shaders import load_manifest, variant_meta  # noqa: E402
from vkxsplit.vk.device import Device, cache_dir  # noqa: E402
from vkxsplit.vk.kernel import Kernel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default="", help="comma-separated name prefixes (default: every usable variant)")
    ap.add_argument("--shipped-only", action="store_true", help="not the experiment kernels of build/tool-spv")
    args = ap.parse_args()
    prefixes = tuple(p for p in args.prefix.split(",") if p)
    t0 = time.perf_counter()
    variants = load_manifest()["variants"]
    if not args.shipped_only:
        variants = {**{n: variant_meta(n) for n in kernels.load()}, **variants}
    dev = Device.open()
    try:
        usable = kernel_report(dev.physical, variants)["usable"]
        names = [n for n in usable if not prefixes or n.startswith(prefixes)]
        failed: list[str] = []
        for name in names:
            try:
                Kernel.get(dev, name)
            except VkxError as exc:
                failed.append(f"{name}: {str(exc).splitlines()[0]}")
        print(f"device: {dev.name}; created {len(names) - len(failed)} of {len(names)} pipelines "
              f"({len(usable)} usable variants) in {time.perf_counter() - t0:.1f} s; cache: {cache_dir()}")
        for f in failed[:10]:
            print(f"  FAILED {f}")
    finally:
        dev.close()  # writes the pipeline cache
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
