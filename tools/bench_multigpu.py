#!/usr/bin/env python3
"""One GPU against two: pp and tg of a model on one GPU, split over two hubs as a pipeline
(``layer:A,B`` over ``devices``, :class:`vkxsplit.model.Model`), and with the second GPU attached as a ``vulkan-peer`` backend
under layer and tensor splits, with the cross-GPU traffic of one step of each.

Configurations (``--splits``, separated by ``;``):

- ``one-gpu``: the model on device 0 alone, no backend;
- ``pipeline:A,B[:mN]``: layers split A:B over device 0 and ``--peer-device``, one hub each,
  ``N`` micro-batches per prompt step (default: the pipeline's); crossed bytes = the hidden
  state per link;
- ``row[:f16]``: the row split over two hubs (``tensor:1,1`` over ``devices``): every matrix split by
  rows (the output projections by columns) over device 0 and ``--peer-device``, an all-reduce of
  the partial sums after each attention and FFN (crossed bytes: both partials of every
  all-reduce; "jobs": all-reduces per step; ``:f16``: the partials cross as f16);
- any planner split (``none``, ``layer:1,1``, ``tensor:1,1``): the model on device 0 with the
  peer attached (``vulkan-peer:device=N``); one prefill step of ``-p`` tokens and one decode
  step are run between ``traffic.begin_step()`` and ``traffic.step()``: bytes that crossed
  between the two devices (``crossed``: split mode, through host pages), bytes the peer read or
  wrote in place in the hub's memory (``in place``: shared mode, one physical device) and weight
  bytes loaded into the peer.

pp and tg are ``runner.bench_model``'s (median t/s over the repetitions). Prints one markdown
table.

  python tools/bench_multigpu.py                      # the 2-GPU machine: llama8b q4_0 synth
  python tools/bench_multigpu.py --quick              # lavapipe: the peer is a second logical
                                                      # device on the same CPU device
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


def _bench_hubs(row: dict, path: Path, split: str, peer: str, n_p: int, n_g: int, reps: int) -> None:
    """One GPU alone, or a pipeline over device 0 and the peer device: pp, tg and the bytes that
    cross between the GPUs in one prefill and one decode step."""
    from vkxsplit.model import load_model
    from vkxsplit.runner import bench_model

    if split == "one-gpu":
        m = load_model(path, split="none", ubatch=max(n_p, 1), n_ctx=n_p + n_g + 16)
        row["peer"] = f"{m.device.name} alone"
    elif split.split(":")[0] == "row":
        parts = split.split(":")[1] if ":" in split else "f32"
        m = load_model(path, split="tensor:1,1", devices=["0", peer], ubatch=max(n_p, 1), n_ctx=n_p + n_g + 16,
                       partials=parts)
        row["peer"] = f"hubs on {', '.join(d.name for d in m.hubs)}: rows of every matrix, {parts} partials"
    else:
        parts = split.split(":")
        micro = int(parts[2][1:]) if len(parts) > 2 else None
        m = load_model(path, split=f"layer:{parts[1]}", devices=["0", peer], ubatch=max(n_p, 1),
                       n_ctx=n_p + n_g + 16, micro_batches=micro)
        row["peer"] = (f"hubs on {', '.join(d.name for d in m.hubs)}: layers {m.ranges}, "
                       f"{m.micro} x {m.piece}-token micro-batches")
    with m:
        res = {r["test"]: statistics.median(r["tps"]) for r in bench_model(m, n_p, n_g, reps)}
        row["pp"], row["tg"] = res[f"pp{n_p}"], res[f"tg{n_g}"]
        m.reset()
        m.prefill(list(range(10, 10 + n_p)))
        pp_x, pp_relays = m.last_traffic, m.traffic["relays"]
        m._run([m.last_argmax()], all_logits=False)
        tg_x, tg_relays = m.last_traffic, m.traffic["relays"] - pp_relays
        if split.startswith("row"):  # "jobs": all-reduces per step
            per_step = m.traffic["all_reduces"] // max(1, m.traffic["steps"])
            row["pp_step"] = {"crossed_bytes": pp_x, "inplace_bytes": 0, "loaded_bytes": 0, "jobs": per_step}
            row["tg_step"] = {"crossed_bytes": tg_x, "inplace_bytes": 0, "loaded_bytes": 0, "jobs": per_step}
            return
        pp_jobs = (len(m.hubs) - 1) * -(-n_p // m.piece) if len(m.hubs) > 1 else 0  # link relays
        row["pp_step"] = {"crossed_bytes": pp_x, "inplace_bytes": 0, "loaded_bytes": 0, "jobs": pp_jobs}
        row["tg_step"] = {"crossed_bytes": tg_x, "inplace_bytes": 0, "loaded_bytes": 0,
                          "jobs": tg_relays if len(m.hubs) > 1 else 0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smol135m shape, 8/2 tokens, peer on device 0")
    ap.add_argument("--shape", default=None, help="synthetic shape (default llama8b; --quick smol135m)")
    ap.add_argument("--qtype", default="q4_0")
    ap.add_argument("-m", "--model", default=None, help="a GGUF file instead of a synthetic one")
    ap.add_argument("-p", type=int, default=None, help="prompt tokens (default 512; --quick 8)")
    ap.add_argument("-n", type=int, default=None, help="generated tokens (default 128; --quick 2)")
    ap.add_argument("-r", type=int, default=None, help="repetitions (default 3; --quick 1)")
    ap.add_argument("--peer-device", default=None, help="the peer's Vulkan device index or name (default 1; --quick 0)")
    ap.add_argument("--splits", default="one-gpu;pipeline:1,1;pipeline:1,1:m1;row;layer:1,1;tensor:1,1")
    ap.add_argument("--dir", default=None, help="where synthetic models go (default: a temporary directory)")
    args = ap.parse_args()
    from vkxsplit.backends.vulkan_peer import traffic
    from vkxsplit.model import load_model
    from vkxsplit.runner import bench_model
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
        print(f"bench_multigpu: no Vulkan device {peer} for the peer (devices: {'; '.join(names)})",
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
        print(f"devices: {'; '.join(names)}; peer: vulkan-peer:device={peer}\n", flush=True)
        rows = []
        for split in (s.strip() for s in args.splits.split(";") if s.strip()):
            row: dict = {"split": split}
            try:
                if split == "one-gpu" or split.split(":")[0] in ("row", "pipeline"):
                    _bench_hubs(row, path, split, peer, n_p, n_g, reps)
                    print(row, flush=True)
                    rows.append(row)
                    continue
                with load_model(path, backends=f"vulkan-peer:device={peer}", split=split,
                                ubatch=max(n_p, 1), n_ctx=n_p + n_g + 16) as m:
                    b = m.backends.get("vulkan-peer")
                    row["peer"] = f"{b.peer.name} ({b.mode})" if b is not None else "-"
                    res = {r["test"]: statistics.median(r["tps"]) for r in bench_model(m, n_p, n_g, reps)}
                    row["pp"], row["tg"] = res[f"pp{n_p}"], res[f"tg{n_g}"]
                    m.reset()
                    traffic.begin_step()
                    m.prefill(list(range(10, 10 + n_p)))
                    row["pp_step"] = traffic.step()
                    traffic.begin_step()
                    m._run([m.last_argmax()], all_logits=False)
                    row["tg_step"] = traffic.step()
            except VkxError as exc:
                row["error"] = str(exc).splitlines()[0]
            print(row, flush=True)
            rows.append(row)
    finally:
        tmp.cleanup()

    def mib(x: int) -> str:
        return f"{x / 2**20:.2f}"

    print(f"\n| split | GPUs | pp{n_p} t/s | tg{n_g} t/s | prefill step: crossed / in place / weights loaded MiB "
          "| decode step: crossed / in place MiB | peer jobs (pipeline: link relays) per prefill / decode step |")
    print("|---|---|---:|---:|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| `{r['split']}` | - | error: {r['error']} | | | | |")
            continue
        a, d = r["pp_step"], r["tg_step"]
        print(f"| `{r['split']}` | {r['peer']} | {r['pp']:.1f} | {r['tg']:.1f} | "
              f"{mib(a['crossed_bytes'])} / {mib(a['inplace_bytes'])} / {mib(a['loaded_bytes'])} | "
              f"{mib(d['crossed_bytes'])} / {mib(d['inplace_bytes'])} | {a['jobs']} / {d['jobs']} |")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
