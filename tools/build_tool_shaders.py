#!/usr/bin/env python3
"""Build the experiment kernels benchmarks and tests use (tools/kernels.py: sweep shapes,
emulated coopmat variants, decode checks, probes, flag waits) into build/tool-spv (git-ignored;
env VKXSPLIT_TOOL_SPV overrides it). Benchmarks and tests build what they need themselves
where a compiler is installed; this builds everything ahead, e.g. here before carrying
build/tool-spv to the GPU machine, which has no compiler (tools/device_run.sh). Variants whose
compiler is missing here are skipped and named (glslang15: bash tools/build_glslang.sh).

Usage: python tools/build_tool_shaders.py [--only REGEX] [--force] [--check] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402

from vkxsplit import shaders  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="regex: build only the variants whose name matches")
    ap.add_argument("--force", action="store_true", help="recompile even fresh variants")
    ap.add_argument("--check", action="store_true", help="only report variants missing or stale in --out")
    ap.add_argument("--out", type=Path, default=kernels.OUT_DIR, help=f"output directory (default {kernels.OUT_DIR})")
    args = ap.parse_args()
    if args.check:
        vs = {n: v for n, v in kernels.tool_variants().items() if kernels._select(args.only)(n)}
        problems = shaders.check_dir(vs, args.out)
        for p in problems:
            print(p)
        print(f"{len(vs) - len(problems)} of {len(vs)} experiment kernels built and fresh in {args.out}")
        return 1 if problems else 0
    built, skipped = kernels.build(args.only, args.out, force=args.force)
    size = sum(f.stat().st_size for f in args.out.glob("*.spv"))
    print(f"{len(built)} experiment kernels in {args.out} ({size / 2**20:.1f} MiB of modules of their own; "
          "the others specialize shipped modules)")
    if skipped:
        print(f"skipped {len(skipped)} (compiler missing here): {' '.join(skipped[:8])}"
              + (" ..." if len(skipped) > 8 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
