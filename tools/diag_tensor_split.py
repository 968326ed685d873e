#!/usr/bin/env python3
"""Where a row-split step's time goes (a model over two hubs, ``tensor:1,1``): decode and prefill steps of a
synthetic model with the relay spinning on the shards' timelines (the default on GPUs), spinning
only, or blocking in vkWaitSemaphores (slices of 0.05 s or 10 s). Prints one table: ms per
step, host time submitting segment 0, and the logits' distance to a one-hub model.

(Segments queued up front, waiting on timelines the relay signalled, read the other GPU's
partial stale: docs/PERFORMANCE-HISTORY.md section 0000. The relay submits each segment itself.)

  python tools/diag_tensor_split.py --devices 0,1 --shape llama1b
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--shape", default="llama1b")
    ap.add_argument("--qtype", default="q4_0")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    with tempfile.TemporaryDirectory() as d:
        path = write_synthetic(Path(d) / "m.gguf", a.shape, a.qtype, seed=1, n_layer=a.n_layer)
        ids = list(range(10, 10 + a.p))
        with load_model(path, split="none", n_ctx=a.p + 64, ubatch=a.p) as one:
            want = one.logits(ids[:8])
            t0 = time.perf_counter()
            one.prefill(ids)
            for _ in range(a.steps):
                one._run([1], all_logits=False)
            one_ms = (time.perf_counter() - t0) * 1e3
        print(f"one hub: prefill {a.p} + {a.steps} decode steps: {one_ms:.1f} ms")
        print("\n| relay | decode ms/step | host ms submitting | prefill ms | max abs(logits - one hub) |")
        print("|---|---:|---:|---:|---:|")
        with load_model(path, split="tensor:1,1", devices=a.devices, n_ctx=a.p + 64, ubatch=a.p) as m:
            for label, spin, sl in (("spin 0.5 s, then block", 0.5, 0.05), ("spin only", float("inf"), 0.05),
                                    ("block, 0.05 s slices", 0.0, 0.05), ("block, 10 s", 0.0, 10.0)):
                m.relay.spin_s, m.relay.slice_s = spin, sl
                m.reset()
                err = float(np.abs(m.logits(ids[:8]) - want).max())
                m.reset()
                t0 = time.perf_counter()
                m.prefill(ids)
                pre = (time.perf_counter() - t0) * 1e3
                dec, sub = [], []
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    m._run([1], all_logits=False)
                    dec.append((time.perf_counter() - t0) * 1e3)
                    sub.append(m.last_submit_s * 1e3)
                print(f"| {label} | {np.median(dec):.2f} | {np.median(sub):.2f} | {pre:.1f} | {err:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
