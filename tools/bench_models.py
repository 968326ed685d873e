#!/usr/bin/env python3
"""pp512 / tg128 of vkxsplit beside llama.cpp's Vulkan llama-server, on the same GGUF files.

Run on the device (tools/device_bench.sh): for each shape, writes a synthetic GGUF with
`vkxsplit synth`, measures vkxsplit (hub only) with `vkxsplit.bench.bench_model`, then starts
llama-server on the same file (-ngl 99 -c 4096 -b 2048 -ub 512), sends the same 512 prompt
token ids with n_predict 128 (median of the runs after a warm-up) and reads its timings.
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_peer  # noqa: E402


def peer_bench(server: str, model: Path, ids: list[int], n_gen: int, reps: int, port: int = 18080) -> dict:
    return llama_peer.peer_bench(server, model, ids, n_gen, reps,
                                 ["-ngl", "99", "-c", "4096", "-b", "2048", "-ub", "512"], port)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smol135m:q4_1,llama1b:q4_0,llama8b:q4_0")
    ap.add_argument("--dir", default="/tmp/models")
    ap.add_argument("--server", default="/tmp/llama-vulkan/llama-server")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--backends", default=None, help="backends to attach, e.g. cuda (default: none)")
    ap.add_argument("--splits", default="none",
                    help="split specs measured per shape, ';'-separated, e.g. 'none;mode:cuda>=32'")
    args = ap.parse_args()
    from vkxsplit.bench import bench_model
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    rows = []
    for spec in args.shapes.split(","):
        shape, qtype = spec.split(":")
        path = Path(args.dir) / f"{shape}-{qtype}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            t0 = time.time()
            write_synthetic(path, shape, qtype, seed=0)
            print(f"synth {path.name}: {path.stat().st_size / 2**30:.2f} GiB in {time.time() - t0:.1f} s", flush=True)
        ids = np.random.default_rng(1).integers(10, 30000, args.p).tolist()
        splits = [x.strip() for x in args.splits.split(";") if x.strip()]
        shape_rows = [{"shape": shape, "type": qtype, "split": sp} for sp in splits]
        try:
            with load_model(path, split=splits[0], backends=args.backends) as m:
                for row in shape_rows:
                    try:
                        m.set_split(row["split"])
                        res = {r["test"]: statistics.median(r["tps"]) for r in bench_model(m, args.p, args.n, args.r)}
                        row["vk_pp"], row["vk_tg"] = res[f"pp{args.p}"], res[f"tg{args.n}"]
                    except Exception as exc:  # keep measuring the others
                        row["vk_error"] = repr(exc)[:300]
        except Exception as exc:
            for row in shape_rows:
                row.setdefault("vk_error", repr(exc)[:300])
        if Path(args.server).exists():
            try:
                peer = peer_bench(args.server, path, ids, args.n, args.r)
                for row in shape_rows:
                    row["peer_pp"], row["peer_tg"] = peer["pp"], peer["tg"]
            except Exception as exc:
                for row in shape_rows:
                    row["peer_error"] = repr(exc)[-1500:]
        for row in shape_rows:
            print(json.dumps(row), flush=True)
        rows.extend(shape_rows)
    print(f"\n| shape | type | split | vkxsplit pp{args.p} | llama.cpp pp{args.p} | ratio | vkxsplit tg{args.n} | "
          f"llama.cpp tg{args.n} | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        def f(k: str, r: dict = r) -> str:
            return f"{r[k]:.1f}" if k in r else "-"

        def ratio(a: str, b: str, r: dict = r) -> str:
            return f"{r[a] / r[b]:.2f}x" if a in r and b in r and r[b] else "-"

        print(f"| {r['shape']} | {r['type']} | `{r['split']}` | {f('vk_pp')} | {f('peer_pp')} | {ratio('vk_pp', 'peer_pp')} | "
              f"{f('vk_tg')} | {f('peer_tg')} | {ratio('vk_tg', 'peer_tg')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
