"""``vkxsplit bench``: prompt (pp) and generation (tg) throughput of a GGUF model, as llama.cpp's
``llama-bench`` reports it (its column names and output formats), and ``bench --profile``.

``bench_model`` is also what the benchmark tools in ``tools/`` time a model with. The model
options are :mod:`vkxsplit.runner`'s, shared with ``run`` and ``plan``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import progress
from .errors import VkxError
from .runner import (
    _start_trace,
    _write_trace,
    add_model_args,
    backends_from_args,
    int_at_least,
    load_from_args,
    split_from_args,
)

#: seconds of warm-up runs before timing on a GPU: a short step (a 1B model's 512-token prefill
#: is ~20 ms) after an idle host phase runs at low clocks; one warm-up run was not enough
#: (measured: docs/PERFORMANCE-HISTORY.md, the models section of the warm-up round)
WARMUP_S = 1.0


def _warm(model: Any, run: Any) -> None:
    """``run()`` once (records the sequences), then again until WARMUP_S passed on a GPU."""
    t0 = time.perf_counter()
    run()
    if model.device.is_cpu:
        return
    while time.perf_counter() - t0 < WARMUP_S:
        run()


def bench_model(model: Any, n_prompt: int, n_gen: int, reps: int, seed: int = 0,
                bar: progress.Task | None = None) -> list[dict[str, Any]]:
    """pp (prefill of n_prompt random ids) and tg (n_gen decode steps): seconds (``seconds``)
    and tokens per second (``tps``) of each of ``reps`` runs, each after warm-up runs (at least one; on a GPU for WARMUP_S), which also
    make the plans (and, with ``auto``, the first-run measurements) outside the timed runs."""
    rng = np.random.default_rng(seed)
    results = []
    if n_prompt:
        ids = rng.integers(0, model.hp.n_vocab, n_prompt).tolist()
        _warm(model, lambda: model.prefill(ids))
        secs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.prefill(ids)
            secs.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1, f"pp{n_prompt}")
        results.append({"test": f"pp{n_prompt}", "n_prompt": n_prompt, "n_gen": 0, "seconds": secs,
                        "tps": [n_prompt / s for s in secs]})
    if n_gen:
        def gen() -> float:
            model.prefill([int(rng.integers(0, model.hp.n_vocab))])
            tok = model.last_argmax()
            t0 = time.perf_counter()
            for _ in range(n_gen):
                model.run_step([tok])
                tok = model.last_argmax()
            return time.perf_counter() - t0

        _warm(model, gen)
        secs = []
        for _ in range(reps):
            secs.append(gen())
            if bar is not None:
                bar.update(1, f"tg{n_gen}")
        results.append({"test": f"tg{n_gen}", "n_prompt": 0, "n_gen": n_gen, "seconds": secs,
                        "tps": [n_gen / s for s in secs]})
    return results


def _fmt_count(n: float) -> str:
    """llama-bench's params column: 134.52 M, 1.24 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _fmt_size(b: float) -> str:
    """llama-bench's size column: MiB below a GiB, else GiB."""
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def size_label(n_params: int) -> str:
    """A parameter count as a model size label (135M, 1.2B, 8B), as ``general.size_label`` has it."""
    if n_params >= 1e9:
        v = n_params / 1e9
        return f"{v:.1f}B".replace(".0B", "B") if v < 10 else f"{v:.0f}B"
    return f"{n_params / 1e6:.0f}M"


def model_desc(mf: Any) -> dict[str, Any]:
    """llama-bench's model description of a file: ``arch size-label type`` (``llama 135M Q4_1``),
    its parameter count and its weight bytes."""
    from gguf.constants import GGMLQuantizationType, LlamaFileType

    n_params = sum(t.n_elements for t in mf.tensors.values())
    size = sum(t.nbytes for t in mf.tensors.values())
    label = mf.metadata.get("general.size_label") or size_label(n_params)
    ftype = mf.metadata.get("general.file_type")
    try:
        type_name = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None else None
    except (ValueError, TypeError):
        type_name = None
    if not type_name or type_name == "GUESSED":
        mats = [t for t in mf.tensors.values() if t.n_dims >= 2]
        counts: dict[str, int] = {}
        for t in mats:
            counts[GGMLQuantizationType(t.ggml_type).name] = counts.get(GGMLQuantizationType(t.ggml_type).name, 0) \
                + t.n_elements
        type_name = max(counts, key=lambda k: counts[k]) if counts else "?"
    return {"model_type": f"{mf.architecture} {label} {type_name}", "model_n_params": n_params,
            "model_size": size}


BENCH_FIELDS = ("model", "size", "params", "backend", "split", "test", "t/s")


def cmd_bench(args: argparse.Namespace) -> int:
    from .plan.spec import parse_spec

    out_fmt = "json" if args.json else args.output
    a = argparse.Namespace(**vars(args))
    given = split_from_args(a)
    splits = [s.strip() for s in given.split(";")] if given and ";" in given else [given]
    for s in splits:
        if s is not None:
            parse_spec(s)  # a typo in the third config fails before the first one runs
    if args.profile is not None and args.devices:
        raise VkxError("--profile profiles one hub's steps: it does not go with --devices",
                       "profile one GPU's model (drop --devices)")
    if not args.devices:  # the options are in the spec now
        a.backends = backends_from_args(args)
        a.split, a.tensor_split, a.override_tensor, a.split_mode = splits[0], None, None, None
    model = load_from_args(a)  # loaded once: every split config runs over the same weights and backends
    splits = [a.split_used if s is None else s for s in splits]
    multi = bool(getattr(args, "devices", None))
    desc = model_desc(model.file)
    backend = (f"vulkan x{len(model.hubs)}" if multi else
               "vulkan" + (f",{_backend_names(a.backends_used)}" if a.backends_used else ""))
    rows = []
    try:
        _start_trace(model, args.trace)
        tests = [(args.n_prompt, 0), (0, args.n_gen)] if multi else [(args.n_prompt, args.n_gen)]
        total = len(splits) * args.repetitions * sum((n_p > 0) + (n_g > 0) for n_p, n_g in tests)
        with progress.task("bench", total, "runs") as bar:
            for split in splits:
                if not multi:
                    model.set_split(split)
                # one test at a time, so a pipeline's bytes crossed between GPUs per step are the test's own
                for n_p, n_g in tests:
                    t0 = dict(getattr(model, "traffic", {}))
                    for r in bench_model(model, n_p, n_g, args.repetitions, bar=bar):
                        tps = r["tps"]
                        row = {
                            "model": desc["model_type"], "model_filename": str(model.path if hasattr(model, "path")
                                                                               else args.model),
                            "model_type": desc["model_type"], "model_size": desc["model_size"],
                            "model_n_params": desc["model_n_params"], "size_gib": desc["model_size"] / 2**30,
                            "backends": backend, "split": model.split_label if multi else split, "test": r["test"],
                            "n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "n_ubatch": args.ubatch,
                            "avg_ns": int(statistics.fmean(r["seconds"]) * 1e9),
                            "stddev_ns": int(statistics.stdev(r["seconds"]) * 1e9) if len(tps) > 1 else 0,
                            "avg_ts": statistics.fmean(tps), "stddev_ts": statistics.stdev(tps) if len(tps) > 1 else 0.0,
                            "samples_ns": [int(s * 1e9) for s in r["seconds"]], "samples_ts": tps,
                            "device": ", ".join(d.name for d in model.hubs),
                        }
                        row["tps_mean"], row["tps_std"] = row["avg_ts"], row["stddev_ts"]
                        if multi:
                            t1 = model.traffic
                            steps = t1["steps"] - t0.get("steps", 0)
                            row["crossed_bytes_per_step"] = \
                                (t1["crossed_bytes"] - t0.get("crossed_bytes", 0)) / max(steps, 1)
                        rows.append(row)
        _write_trace(model, args.trace)
        prof_text = _bench_profile(model, args, rows) if args.profile is not None else None
    finally:
        model.close()
    print_bench(rows, out_fmt, multi)
    if prof_text:
        print(prof_text, file=sys.stdout if out_fmt == "md" else sys.stderr)
    return 0


def _bench_profile(model: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    """``bench --profile``: after the measurement, ``--profile-steps`` profiled decode steps and
    one profiled prefill step (:mod:`vkxsplit.profile_step`): per-op tables, the trace file."""
    from . import profile_step

    if hasattr(model, "set_trace"):
        model.set_trace(False)  # the profile's own recordings; the --trace file is written
    decode, prefill = profile_step.profile_model(model, args.profile_steps if args.n_gen else 0, args.n_prompt)
    parts = []
    if decode:
        parts.append(profile_step.format_table("decode", decode, roles=True))
        tg = [r for r in rows if r["n_gen"]]
        if tg:
            parts.append(f"unprofiled tg (bench above): {tg[-1]['avg_ns'] / 1000 / tg[-1]['n_gen']:.1f} us per token")
    if prefill is not None:
        parts.append(profile_step.format_table("prefill", [prefill]))
    doc = profile_step.trace_json(decode, prefill)
    doc["otherData"]["tables"] = {k: profile_step.op_table(v) for k, v in
                                  (("decode", decode), ("prefill", [prefill] if prefill else [])) if v}
    if decode:
        doc["otherData"]["tables"]["decode_by_level"] = profile_step.op_table(decode, "role")
    Path(args.profile).write_text(json.dumps(doc))
    parts.append(f"vkxsplit: per-level trace written to {args.profile} (open in https://ui.perfetto.dev)")
    return "\n\n".join(parts)


def _backend_names(backends: Any) -> str:
    from .plan.spec import parse_backends

    return ",".join(b[0] if isinstance(b, tuple) else getattr(b, "name", str(b)) for b in parse_backends(backends))


def bench_cells(r: dict[str, Any]) -> list[str]:
    return [r["model"], _fmt_size(r["model_size"]), _fmt_count(r["model_n_params"]), r["backends"], str(r["split"]),
            r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"]


def print_bench(rows: list[dict[str, Any]], fmt: str, multi: bool = False, out: Any = None) -> None:
    """llama-bench's outputs: md (a table), json (one array), jsonl (a row a line), csv."""
    out = out or sys.stdout
    if fmt == "json":
        print(json.dumps(rows, indent=1), file=out)
        return
    if fmt == "jsonl":
        for r in rows:
            print(json.dumps(r), file=out)
        return
    if fmt == "csv":
        keys = [k for k in rows[0] if not isinstance(rows[0][k], list)] + ["samples_ns", "samples_ts"] if rows else []
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: " ".join(map(str, r[k])) if isinstance(r.get(k), list) else r.get(k) for k in keys})
        out.write(buf.getvalue())
        return
    head = list(BENCH_FIELDS) + (["between GPUs per step"] if multi else [])
    right = {"size", "params", "test", "t/s", "between GPUs per step"}
    cells = [bench_cells(r) + ([f"{r['crossed_bytes_per_step'] / 1024:.1f} KiB"] if multi else []) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(head)]

    def line(vals: list[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if h in right else v.ljust(w)
                                 for v, w, h in zip(vals, widths, head)) + " |"

    print(line(head), file=out)
    print("| " + " | ".join(("-" * (w - 1) + ":") if h in right else "-" * w
                            for w, h in zip(widths, head)) + " |", file=out)
    for c in cells:
        print(line(c), file=out)


def register(sub: Any) -> None:
    b = sub.add_parser("bench", allow_abbrev=False,
                       help="prompt (pp) and generation (tg) throughput, as llama-bench")
    add_model_args(b, bench=True)
    b.add_argument("-p", "--n-prompt", type=int_at_least(0), default=512, help="prompt tokens (default 512)")
    b.add_argument("-n", "--n-gen", type=int_at_least(0), default=128, help="generated tokens (default 128)")
    b.add_argument("-r", "--repetitions", type=int_at_least(1), default=3, help="runs of each test (default 3)")
    b.add_argument("-o", "--output", choices=("md", "json", "jsonl", "csv"), default="md",
                   help="output format (default md)")
    b.add_argument("--json", action="store_true", help="= -o json")
    b.add_argument("--profile", metavar="FILE.json", nargs="?", const="vkxsplit-profile.json", default=None,
                   help="after the measurement, profile decode and prefill steps per dispatch level (GPU "
                        "timestamps): print a table by op and write a Perfetto trace (default "
                        "vkxsplit-profile.json)")
    b.add_argument("--profile-steps", type=int_at_least(1), default=16,
                   help="profiled decode steps with --profile (default 16)")
    b.set_defaults(func=cmd_bench)
