#!/usr/bin/env python3
"""One GPU against two: pp and tg of a model on one hub, and over two hubs (device 0 and
``--peer-device``, one hub each: :class:`vkxsplit.model.Model` with ``devices``), with the bytes
that cross between the GPUs in one prefill and one decode step.

Configurations (``--splits``, separated by ``;``):

- ``one-gpu``: the model on device 0 alone;
- ``layer:A,B[:mN]`` (or ``pipeline:A,B[:mN]``): the layers split A:B over the two hubs, ``N``
  micro-batches per prompt step (default: the model's); crossed bytes = the hidden state per
  link; relay rounds = one per micro-batch and link;
- ``tensor:1,1[:f16|:bf16|:auto]`` (or ``row[:...]``): every matrix split by rows (the output
  projections by columns) over the two hubs, an all-reduce of the partial sums after each
  attention and FFN (crossed bytes: both partials of every all-reduce; "rounds": all-reduces
  per step; the partials cross as f32, or ``:f16`` / ``:bf16``, or ``:auto``: bf16 from the
  size measured once per device on, f32 below it, the model's default);
- ``auto``: what ``split="auto"`` picks among one GPU, the layer split and the row split at
  load (the cost model's prediction; the row shows the candidates and the choice).

pp and tg are ``bench.bench_model``'s (median t/s over the repetitions). Prints one markdown
table.

  python tools/bench_multigpu.py                      # the 2-GPU machine: llama8b q4_0 synth
  python tools/bench_multigpu.py --quick              # lavapipe: both hubs on the one CPU device
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkxsplit.errors import VkxError  # noqa: E402


def _bench(row: dict, path: Path, split: str, peer: str, n_p: int, n_g: int, reps: int) -> None:
    """One GPU alone, or the model over hubs on device 0 and the peer device: pp, tg and the
    bytes that cross between the GPUs in one prefill and one decode step."""
    from vkxsplit.bench import bench_model
    from vkxsplit.model import load_model

    kind, *rest = split.split(":")
    common = {"ubatch": max(n_p, 1), "n_ctx": n_p + n_g + 16}
    if kind == "one-gpu":
        m = load_model(path, split="none", **common)
        row["peer"] = f"{m.device.name} alone"
    elif kind in ("row", "tensor"):
        parts = next((x for x in rest if x in ("f32", "f16", "bf16", "auto")), "f32")
        m = load_model(path, split="tensor:1,1", devices=["0", peer], partials=parts, **common)
        row["peer"] = f"hubs on {', '.join(d.name for d in m.hubs)}: rows of every matrix, {m.partials_label}"
    elif kind in ("layer", "pipeline"):
        micro = int(rest[1][1:]) if len(rest) > 1 else None
        m = load_model(path, split=f"layer:{rest[0]}" if rest else "layer", devices=["0", peer],
                       micro_batches=micro, **common)
        row["peer"] = (f"hubs on {', '.join(d.name for d in m.hubs)}: layers {m.ranges}, "
                       f"{m.micro} x {m.piece}-token micro-batches")
    elif kind == "auto":
        m = load_model(path, split="auto", devices=["0", peer], **common)
        row["peer"] = m.split_label
        kind = "one-gpu" if len(m.hubs) == 1 else "tensor" if m.split.kind == "tensor" else "layer"
    else:
        raise VkxError(f"unknown configuration {split!r}", "one-gpu, layer:A,B[:mN], tensor:1,1[:f16|:bf16|:auto], auto")
    with m:
        res = {r["test"]: statistics.median(r["tps"]) for r in bench_model(m, n_p, n_g, reps)}
        row["pp"], row["tg"] = res[f"pp{n_p}"], res[f"tg{n_g}"]
        if kind == "one-gpu":
            row["pp_step"] = row["tg_step"] = (0, 0)
            return
        m.reset()
        t0 = dict(m.traffic)
        m.prefill(list(range(10, 10 + n_p)))
        t1 = dict(m.traffic)
        m._run([m.last_argmax()], all_logits=False)
        t2 = dict(m.traffic)
        key = "all_reduces" if kind in ("row", "tensor") else "relays"
        row["pp_step"] = (t1["crossed_bytes"] - t0["crossed_bytes"], t1[key] - t0[key])
        row["tg_step"] = (t2["crossed_bytes"] - t1["crossed_bytes"], t2[key] - t1[key])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smol135m shape, 8/2 tokens, both hubs on device 0")
    ap.add_argument("--shape", default=None, help="synthetic shape (default llama8b; --quick smol135m)")
    ap.add_argument("--qtype", default="q4_0")
    ap.add_argument("-m", "--model", default=None, help="a GGUF file instead of a synthetic one")
    ap.add_argument("-p", type=int, default=None, help="prompt tokens (default 512; --quick 8)")
    ap.add_argument("-n", type=int, default=None, help="generated tokens (default 128; --quick 2)")
    ap.add_argument("-r", type=int, default=None, help="repetitions (default 3; --quick 1)")
    ap.add_argument("--peer-device", default=None,
                    help="the second hub's Vulkan device index or name (default 1; --quick 0)")
    ap.add_argument("--splits", default="one-gpu;layer:1,1;layer:1,1:m1;tensor:1,1;tensor:1,1:f16;"
                                        "tensor:1,1:bf16;tensor:1,1:auto;auto")
    ap.add_argument("--dir", default=None, help="where synthetic models go (default: a temporary directory)")
    args = ap.parse_args()
    from vkxsplit.synth import write_synthetic
    from vkxsplit.vk.instance import Instance

    shape = args.shape or ("smol135m" if args.quick else "llama8b")
    n_p = args.p or (8 if args.quick else 512)
    n_g = args.n or (2 if args.quick else 128)
    reps = args.r or (1 if args.quick else 3)
    peer = args.peer_device if args.peer_device is not None else ("0" if args.quick else "1")
    if n_p < 1 or n_g < 1:
        ap.error("-p and -n must be at least 1 (one prefill and one decode step are measured)")
    with Instance(validation=False) as inst:
        devs = inst.physical_devices()
        names = [f"{d.index}: {d.name}" for d in devs]
    if not args.quick and peer.isdigit() and int(peer) >= len(devs):
        print(f"bench_multigpu: no Vulkan device {peer} for the second hub (devices: {'; '.join(names)})",
              file=sys.stderr)
        return 3
    tmp = tempfile.TemporaryDirectory()
    try:
        if args.model:
            path = Path(args.model)
        else:
            path = Path(args.dir or tmp.name) / f"{shape}-{args.qtype}.gguf"
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                t0 = time.time()
                write_synthetic(path, shape, args.qtype, seed=0)
                print(f"synth {path.name}: {path.stat().st_size / 2**30:.2f} GiB in {time.time() - t0:.1f} s",
                      flush=True)
        print(f"devices: {'; '.join(names)}; second hub on device {peer}\n", flush=True)
        rows = []
        for split in (s.strip() for s in args.splits.split(";") if s.strip()):
            row: dict = {"split": split}
            try:
                _bench(row, path, split, peer, n_p, n_g, reps)
            except VkxError as exc:
                row["error"] = str(exc).splitlines()[0]
            print(row, flush=True)
            rows.append(row)
    finally:
        tmp.cleanup()

    def mib(x: int) -> str:
        return f"{x / 2**20:.2f}"

    print(f"\n| split | GPUs | pp{n_p} t/s | tg{n_g} t/s | crossed MiB per prefill step | crossed MiB per decode step "
          "| relay rounds (layer) or all-reduces (tensor) per prefill / decode step |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| `{r['split']}` | - | error: {r['error']} | | | | |")
            continue
        a, d = r["pp_step"], r["tg_step"]
        print(f"| `{r['split']}` | {r['peer']} | {r['pp']:.1f} | {r['tg']:.1f} | {mib(a[0])} | {mib(d[0])} "
              f"| {a[1]} / {d[1]} |")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
