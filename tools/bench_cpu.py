#!/usr/bin/env python3
"""pp / tg and peak memory of vkxsplit on a machine without a GPU, beside llama.cpp's CPU llama-server.

For each GGUF file (default: the default model, SmolLM2-135M-Instruct Q4_1, and a llama1b-shaped
Q4_0 file written with `vkxsplit synth`), in one invocation:

- vkxsplit: `vkxsplit bench -p P -n N -r R -o json` in a child process with the command line's
  defaults (on a CPU hub: the default split and the cpu backend; `--split`/`--backends` to
  measure others), one child per split so that each child's peak resident memory (VmHWM, read
  from /proc when it exits, through a wait4 rusage) belongs to that configuration alone;
- llama.cpp: llama-server from the llama-vulkan tarball with `-ngl 0 -t THREADS` (every layer
  on the CPU), the same P prompt ids and N generated tokens through /completion, the median of
  R runs after a warm-up, read from its own timings (as tools/bench_models.py drives it on GPUs).

Prints one markdown table: tokens per second, their ratios, vkxsplit's peak resident memory beside
the file size plus the KV cache (f16, n_ctx tokens). The machine may be shared: the load average
before and after is printed with it. The default configurations: the command line's default (on
a CPU hub `--split mode:cpu --backends cpu:step=1`, the whole step on the cpu backend) and the
products-and-glue split it replaced (`mode:cpu@cpu`); `--splits` names others (thread counts:
`mode:cpu@cpu:step=1:threads=2`). `VKXSPLIT_GGML_LIBDIR=DIR` in the environment runs vkxsplit on
another build of ggml's libraries (the table's header names the one used).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import llama_peer  # noqa: E402

TARBALL = ROOT / ".device" / "peer" / "llama-vulkan.tar.xz"


def server_path(dest: Path) -> Path:
    """llama-server, unpacked from the tarball the first time."""
    exe = dest / "llama-server"
    if not exe.exists():
        if not TARBALL.exists():
            raise SystemExit(f"bench_cpu: {TARBALL} is missing (llama.cpp's prebuilt llama-server)")
        subprocess.run(["tar", "-C", str(dest.parent), "-xJf", str(TARBALL)], check=True)
    return exe


def llama_cpp(server: Path | None, model: Path, ids: list[int], n_gen: int, reps: int, threads: int, n_ctx: int,
              port: int, extra: list[str] = ()) -> dict[str, float]:  # type: ignore[assignment]
    """Median prompt and generation tokens/s of llama-server on the CPU (-ngl 0)."""
    return llama_peer.peer_bench(server, model, ids, n_gen, reps,
                                 ["-ngl", "0", "-t", str(threads), "-c", str(n_ctx), *extra], port, timeout=1200)


#: the child: `vkxsplit bench` in-process, then its own peak resident memory on stderr
CHILD = """
import sys
from vkxsplit.cli import main
rc = main(sys.argv[1:])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("VKX-VMHWM", int(hwm.split()[1]) * 1024, file=sys.stderr)
sys.exit(rc)
"""


def vkxsplit(model: Path, split: str | None, backends: str | None, p: int, n: int, reps: int,
             n_ctx: int) -> dict[str, object]:
    """`vkxsplit bench` in a child: median tokens/s per test, the split it used, and its VmHWM."""
    cmd = [sys.executable, "-c", CHILD, "bench", "-m", str(model), "-p", str(p), "-n", str(n), "-r", str(reps),
           "-c", str(n_ctx), "-o", "json"]
    if split is not None:
        cmd += ["--split", split]
    if backends is not None:
        cmd += ["--backends", backends]
    proc = subprocess.run(cmd, capture_output=True, cwd=ROOT)
    err = proc.stderr.decode()
    if proc.returncode != 0:
        return {"error": err[-800:]}
    res: dict[str, object] = {"vmhwm": int(err.rsplit("VKX-VMHWM", 1)[1].split()[0])}
    for r in json.loads(proc.stdout):
        res[r["test"]] = statistics.median(r["samples_ts"])
        res["split"] = r.get("split", split)
        res["backends"] = r.get("backends", backends)
    return res


def model_facts(model: Path, n_ctx: int) -> tuple[int, int]:
    """(vocabulary size, KV cache bytes: K and V, f16, n_ctx tokens)."""
    from vkxsplit.gguf_model import load_model

    with load_model(model) as mf:
        hp = mf.hparams
        return hp.n_vocab, 2 * hp.n_layer * n_ctx * hp.n_head_kv * hp.head_dim * 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,llama1b:q4_0",
                    help="comma-separated: 'default' (SmolLM2-135M Q4_1), SHAPE:TYPE (vkxsplit synth), or a path")
    ap.add_argument("--dir", default="/tmp/models", help="where synthetic files are written")
    ap.add_argument("--server-dir", default="/tmp/llama-vulkan")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-c", type=int, default=4096, help="context size for both (the KV cache of the memory column)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="llama-server threads")
    ap.add_argument("--splits", default="default;mode:cpu@cpu",
                    help="';'-separated vkxsplit configurations: 'default' (the command line's: no --split, no "
                         "--backends), or SPEC[@BACKENDS] (--split SPEC --backends BACKENDS, default cpu), e.g. "
                         "'mode:cpu@cpu' (products and glue on the cpu backend), 'mode:cpu@cpu:step=1:threads=2'")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (vkxsplit's columns only)")
    ap.add_argument("--server-args", default="",
                    help="more llama-server options, e.g. '--no-repack' (weights read as stored, as vkxsplit reads them)")
    ap.add_argument("--port", type=int, default=18091)
    args = ap.parse_args()
    from vkxsplit.backends import ggml_cpu
    from vkxsplit.defaults import CPU_HUB_BACKENDS
    from vkxsplit.gguf_model import default_model_path
    from vkxsplit.synth import write_synthetic

    server = None if args.no_llama else server_path(Path(args.server_dir))
    load0 = os.getloadavg()
    rows = []
    for spec in (s.strip() for s in args.models.split(",") if s.strip()):
        if spec == "default":
            path = Path(default_model_path())
        elif ":" in spec and not Path(spec).exists():
            shape, qtype = spec.split(":")
            path = Path(args.dir) / f"{shape}-{qtype}.gguf"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                write_synthetic(path, shape, qtype, seed=0)
        else:
            path = Path(spec)
        n_vocab, kv = model_facts(path, args.c)
        size = path.stat().st_size
        ids = [int(i) for i in np.random.default_rng(1).integers(10, n_vocab, args.p)]
        peer = ({"pp": float("nan"), "tg": float("nan")} if args.no_llama else
                llama_cpp(server, path, ids, args.n, args.r, args.threads, args.c, args.port, args.server_args.split()))
        for sp in (s.strip() for s in args.splits.split(";") if s.strip()):
            spec, _, be = sp.partition("@")
            default = spec == "default"
            be = None if default else (be or "cpu")
            vk = vkxsplit(path, None if default else spec, be, args.p, args.n, args.r, args.c)
            label = f"{vk.get('split', spec)} ({'default: ' + CPU_HUB_BACKENDS if default else be})"
            row = {"model": path.name, "split": label, "size": size, "kv": kv, **peer,
                   **{k: v for k, v in vk.items() if k not in ("split", "backends")}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    load1 = os.getloadavg()
    p, n = args.p, args.n
    print(f"\nload average before {load0[0]:.2f}, after {load1[0]:.2f} ({os.cpu_count()} CPUs); llama-server -ngl 0 "
          f"-t {args.threads} {args.server_args}; -c {args.c}; median of {args.r} runs; vkxsplit's ggml: {ggml_cpu.version()}\n")
    print(f"| model | vkxsplit split (backends) | vkxsplit pp{p} | llama.cpp pp{p} | ratio | vkxsplit tg{n} | llama.cpp tg{n} "
          "| ratio | vkxsplit VmHWM | file + KV | VmHWM / (file + KV) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['split']} | error: {str(r['error']).splitlines()[-1][:80]} |")
            continue
        vpp, vtg = r.get(f"pp{p}"), r.get(f"tg{n}")
        fk = r["size"] + r["kv"]
        print(f"| {r['model']} | {r['split']} | {vpp:.1f} | {r['pp']:.1f} | {vpp / r['pp']:.2f} | {vtg:.1f} | "
              f"{r['tg']:.1f} | {vtg / r['tg']:.2f} | {r['vmhwm'] / 2**20:.0f} MiB | {fk / 2**20:.0f} MiB "
              f"({r['size'] / 2**20:.0f} + {r['kv'] / 2**20:.0f}) | {r['vmhwm'] / fk:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
