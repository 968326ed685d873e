#!/usr/bin/env python3
"""A/B of kill switches on whole models: pp / tg tok/s of one synthetic GGUF per shape, loaded
once per setting (env assignments, or none), median of the runs after warm-up
(``vkxsplit.bench.bench_model``). For measuring what a kernel choice is worth to a model, e.g.

    python tools/bench_ab.py --shapes llama8b:q4_0 --settings 'none;VKXSPLIT_DISABLE=splitk;VKXSPLIT_DISABLE=dq16,splitk'

Settings are separated by ``;`` (a VKXSPLIT_DISABLE value is itself a comma list), the
assignments of one setting by ``+``. They are applied to ``os.environ`` before the model loads
(its device reads VKXSPLIT_DISABLE when it is created) and removed after it closes. Prints one
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama8b:q4_0", help="comma-separated shape:type (vkxsplit synth)")
    ap.add_argument("--settings", default="none;VKXSPLIT_DISABLE=splitk",
                    help="settings separated by ';': none, or NAME=VALUE[+NAME=VALUE...]")
    ap.add_argument("--dir", default="/tmp/models")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    args = ap.parse_args()

    from vkxsplit.bench import bench_model
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    settings = []
    for s in args.settings.split(";"):
        pairs = [] if s == "none" else [tuple(p.split("=", 1)) for p in s.split("+")]
        if any(len(p) != 2 or not p[0].startswith("VKXSPLIT_") for p in pairs):
            ap.error(f"--settings: {s!r} is not none or VKXSPLIT_NAME=VALUE[+...]")
        settings.append((s, pairs))
    print(f"| shape | setting | pp{args.p} tok/s | tg{args.n} tok/s |\n|---|---|---:|---:|")
    for spec in args.shapes.split(","):
        shape, qtype = spec.split(":")
        path = Path(args.dir) / f"{shape}-{qtype}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            write_synthetic(path, shape, qtype, seed=0)
            print(f"<!-- synth {path.name}: {time.time() - t0:.1f} s -->", flush=True)
        switched = sorted({k for _, pairs in settings for k, _ in pairs})
        for label, pairs in settings:
            # every name any setting switches is cleared first: "none" is the baseline even when
            # the caller's environment has one of them set
            saved = {k: os.environ.pop(k, None) for k in switched}
            os.environ.update(dict(pairs))
            try:
                m = load_model(path)
                try:
                    res = {r["test"]: statistics.median(r["tps"]) for r in bench_model(m, args.p, args.n, args.r)}
                finally:
                    m.close()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            print(f"| {shape} {qtype} | {label} | {res.get(f'pp{args.p}', float('nan')):.1f} | "
                  f"{res.get(f'tg{args.n}', float('nan')):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
