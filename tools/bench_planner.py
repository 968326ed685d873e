#!/usr/bin/env python3
"""The split planner's predicted step times beside measured ones, for one decoder layer.

A synthetic llama-shaped model with one decoder layer (``vkxsplit.synth``; a small vocabulary,
so the output projection is small next to the layer) is loaded with the backends attached; for
each split mode (none, layer, tensor, mode, auto) and each batch size T it prints the plan's
predicted step time (the cost model, measured on this machine and cached in the device profile)
and the measured one (median wall time of a step: submit, run, collect), and which mode auto
picks for each T.

Usage:
    python tools/bench_planner.py                 # llama8b-shaped layer, T = 1 and 512, cuda
    python tools/bench_planner.py --quick         # smol135m-shaped layer, T = 1 and 32, cpu (lavapipe)
    python tools/bench_planner.py --backends cuda,cpu --batches 1,64,512 --json
(``tools/device_run.sh planner`` runs the first form on the H200.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkxsplit.backend import backend_availability  # noqa: E402
from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.model import load_model  # noqa: E402
from vkxsplit.synth import write_synthetic  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402


def splits_for(backends: list[str], threshold: int) -> list[str]:
    b = backends[0]
    ones = ",".join(["1"] * (1 + len(backends)))
    return ["none", rf"layer:blk\.0\.ffn_.*={b}", f"tensor:{ones}", f"mode:{b}>={threshold}", "auto"]


def measure(model, T: int, reps: int, rng: np.random.Generator) -> float:
    """Median seconds of one step of T tokens at position 0 (after two warm-up steps)."""
    ids = rng.integers(0, model.hp.n_vocab, T).tolist()
    ts = []
    for r in range(reps + 2):
        model.reset()
        t0 = time.perf_counter()
        model.run_step(ids)
        if r >= 2:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def breakdown(model, specs: list[str], T: int, rng: np.random.Generator, trace_dir: str | None) -> None:
    """Trace one step per split at batch T; print the slices by duration and the busy time per
    track (hub slices are GPU timestamps; backend slices host clocks, from the hub point or
    the backend's previous job to when its point was seen)."""
    ids = rng.integers(0, model.hp.n_vocab, T).tolist()
    for spec in specs:
        model.set_split(spec)
        model.set_trace(True)
        try:
            for _ in range(3):  # warm-up (plans, imports), then the traced step
                model.reset()
                model.run_step(ids)
            tr = model.last_trace
        finally:
            model.set_trace(False)
        assert tr is not None
        names = {e["tid"]: e["args"]["name"] for e in tr["traceEvents"] if e.get("name") == "thread_name"}
        xs = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
        span = (max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)) / 1e3 if xs else 0.0
        busy: dict[str, float] = {}
        for e in xs:
            busy[names[e["tid"]]] = busy.get(names[e["tid"]], 0.0) + e["dur"] / 1e3
        print(f"\n#### `{spec}`, T={T}: one traced step, {span:.3f} ms from first slice start to last end; busy: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in busy.items()))
        print("\n| track | op | ms |\n|---|---|---:|")
        for e in sorted(xs, key=lambda e: -e["dur"])[:20]:
            print(f"| {names[e['tid']]} | {e['name']} | {e['dur'] / 1e3:.3f} |")
        if trace_dir:
            out = Path(trace_dir) / f"trace-{spec.replace(':', '_').replace('>=', 'ge')}-T{T}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(tr))
            print(f"\n(trace: {out.name})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small layer, T = 1 and 32, cpu backend (lavapipe)")
    ap.add_argument("--backends", default=None, help="backends to attach (default: cuda; --quick: cpu)")
    ap.add_argument("--shape", default=None, help="synthetic shape (default llama8b; --quick: smol135m)")
    ap.add_argument("--qtype", default="q4_0")
    ap.add_argument("--batches", default=None, help="batch sizes T (default 1,512; --quick: 1,32)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per point (default 5; --quick: 3)")
    ap.add_argument("--threshold", type=int, default=None, help="mode:BACKEND>=N threshold (default 32; --quick 8)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="at the largest T, trace one step of `none` and of the mode split and print "
                         "where the time goes (per op, per track)")
    ap.add_argument("--trace-dir", default=None, help="write those traces as Chrome trace JSON here")
    args = ap.parse_args()
    shape = args.shape or ("smol135m" if args.quick else "llama8b")
    batches = [int(t) for t in (args.batches or ("1,32" if args.quick else "1,512")).split(",")]
    reps = args.reps or (3 if args.quick else 5)
    threshold = args.threshold or (8 if args.quick else 32)
    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        backends = ["cpu"] if args.quick else ["cuda"]
    avail = backend_availability([b.split(":")[0] for b in backends])
    missing = {n: a.reason for n, a in avail.items() if not a}
    if missing:
        for n, why in missing.items():
            print(f"backend {n} is not available here: {why}", file=sys.stderr)
        print("(on a machine without CUDA run: python tools/bench_planner.py --quick)", file=sys.stderr)
        return 3
    dev = Device.open()
    rows = []
    picks: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic(Path(tmp) / f"{shape}-1layer.gguf", shape, args.qtype, seed=1, n_layer=1, n_vocab=2000)
        model = load_model(path, device=dev, backends=",".join(backends), n_ctx=max(batches) + 16,
                           ubatch=max(batches))
        try:
            names = list(model.backends)
            print(f"device: {dev.name} ({dev.physical.driver_name} {dev.physical.driver_info}); backends: "
                  f"{', '.join(f'{n} ({model.backends[n].events.kind} events)' for n in names)}; "
                  f"shared memory: {model.arena.kind if model.arena else '-'}")
            print(f"model: one {shape}-shaped decoder layer, {args.qtype}, vocabulary 2000 "
                  f"({model.weight_bytes / 2**20:.0f} MiB of weights); profile: {model.cost.profile.path}\n")
            rng = np.random.default_rng(0)
            for spec in splits_for(names, threshold):
                try:
                    model.set_split(spec)
                except VkxError as exc:
                    print(f"{spec}: {exc}", file=sys.stderr)
                    continue
                for T in batches:
                    try:
                        plan = model.plan(T, predict=True)
                        meas = measure(model, T, reps, rng)
                    except VkxError as exc:
                        print(f"{spec} T={T}: {str(exc).splitlines()[0]}", file=sys.stderr)
                        continue
                    pred = plan.prediction.total_s if plan.prediction else float("nan")
                    row = {"split": spec, "T": T, "family": plan.family, "submits": plan.schedule.submits,
                           "jobs": len(plan.schedule.jobs), "predicted_ms": pred * 1e3, "measured_ms": meas * 1e3,
                           "estimated": plan.prediction.estimated if plan.prediction else [],
                           "candidates": {k: v * 1e3 for k, v in plan.candidates}}
                    rows.append(row)
                    if spec == "auto":
                        best = min(plan.candidates, key=lambda c: c[1])[0] if plan.candidates else plan.family
                        picks[T] = best
            prof = model.cost.profile.entries
            print("measured backend costs (profile): " + "; ".join(
                f"{scope}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(ent.items())
                                         if isinstance(v, (int, float)))
                for scope, ent in sorted(prof.items()) if scope != "hub"), file=sys.stderr)
            if args.breakdown:
                breakdown(model, [s for s in splits_for(names, threshold) if s.split(":")[0] in ("none", "mode")],
                          max(batches), rng, args.trace_dir)
        finally:
            model.close()
    dev.close()
    if args.json:
        print(json.dumps({"rows": rows, "auto_picks": picks}, indent=1))
        return 0
    print("| split | T | ran as | submits | backend jobs | predicted ms | measured ms | measured / predicted |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = r["measured_ms"] / r["predicted_ms"] if r["predicted_ms"] else float("nan")
        print(f"| `{r['split']}` | {r['T']} | {r['family']} | {r['submits']} | {r['jobs']} | "
              f"{r['predicted_ms']:.3f} | {r['measured_ms']:.3f} | {ratio:.2f} |")
    print()
    for T, pick in picks.items():
        cands = next(r["candidates"] for r in rows if r["split"] == "auto" and r["T"] == T)
        alts = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(cands.items(), key=lambda kv: kv[1]))
        print(f"auto picks {pick} for T={T} (predicted: {alts})")
    est = sorted({e for r in rows for e in r["estimated"]})
    if est:
        print(f"\nnot measured (estimated from defaults): {', '.join(est)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
