"""``vkxsplit run``, ``vkxsplit bench`` and ``vkxsplit plan``: the main jobs a user runs on a GGUF model."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .errors import VkxError


class Progress:
    """A one-line progress bar on a terminal (silent when stderr is not a tty)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: float, total: float) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}%")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default: min(train, 4096))")
    p.add_argument("-ub", "--ubatch", type=int, default=512, help="tokens per prefill step")
    p.add_argument("--device", default=None, help="hub device index or name part (VKXSPLIT_DEVICE)")
    p.add_argument("--devices", default=None,
                   help="split the layers over several GPUs, one hub each: comma-separated device indices "
                        "or name parts (e.g. 0,1); a pipeline, like llama.cpp's --split-mode layer")
    p.add_argument("-sm", "--split-mode", default="layer", choices=("layer", "row"),
                   help="with --devices: layer = a pipeline of whole layers per GPU; row = every matrix "
                        "split by rows over two GPUs, an all-reduce after each attention and FFN "
                        "(llama.cpp's --split-mode)")
    p.add_argument("--layer-split", default=None,
                   help="with --devices: share of the layers per device (e.g. 3,1; default equal)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="with --devices: pieces of a prompt step in flight on different GPUs at once "
                        "(default twice the devices, pieces of at least 32 tokens)")
    from .plan.spec import SPLIT_HELP

    p.add_argument("--split", default=None, help=SPLIT_HELP + "; `vkxsplit bench` sweeps several "
                   "separated by ';' (e.g. 'none;tensor:1,1;mode:cpu>=8')")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to attach, with options: cpu,npu-emu:min_batch=1 "
                        "(`vkxsplit info` lists what this machine can run)")


#: the split `run` / `bench` take on a CPU hub when given neither --split nor --backends
CPU_HUB_SPLIT = "mode:cpu"
#: ... when the cpu backend's f32 weights take at most this share of the available memory
CPU_HUB_MEMORY_SHARE = 0.5


def _cpu_backend_bytes(model: Any) -> int:
    """Bytes of the f32 copies the cpu backend makes of the model's matrices (4 per element)."""
    from .gguf_model import default_model_path
    from .gguf_model import load_model as load_gguf

    with load_gguf(model or default_model_path()) as mf:
        return 4 * sum(t.n_elements for t in mf.tensors.values() if t.n_dims >= 2)


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _load(args: argparse.Namespace) -> Any:
    from .model import load_model
    from .vk.device import Device

    if getattr(args, "devices", None):
        if args.device is not None or args.backends or args.split not in (None, "none"):
            raise VkxError("--devices puts one hub on each device: it does not take --device, --backends "
                           "or a --split other than none")
        if getattr(args, "split_mode", "layer") == "row":
            if args.layer_split is not None or args.micro_batches is not None:
                raise VkxError("--layer-split and --micro-batches go with --split-mode layer")
            from .tensor_split import TensorSplitModel

            return TensorSplitModel(args.model, devices=args.devices, n_ctx=args.ctx_size, ubatch=args.ubatch,
                                    progress=Progress("loading"))
        from .pipeline import PipelineModel

        return PipelineModel(args.model, devices=args.devices, layer_split=args.layer_split, n_ctx=args.ctx_size,
                             ubatch=args.ubatch, micro_batches=args.micro_batches, progress=Progress("loading"))
    if getattr(args, "layer_split", None) is not None or getattr(args, "micro_batches", None) is not None:
        raise VkxError("--layer-split and --micro-batches go with --devices (a model split over several GPUs)")
    if getattr(args, "split_mode", "layer") != "layer":
        raise VkxError("--split-mode row goes with --devices (a model split over two GPUs)")
    dev = Device.open(args.device)
    split, backends = args.split, args.backends
    try:
        if split is None and backends is None and dev.is_cpu:
            # No GPU: the hub is a CPU Vulkan driver (lavapipe), whose shaders run the matrix
            # products far slower than the cpu backend's; what the planner picks there (`auto`:
            # mode:cpu at T = 1 and 40 for SmolLM2, prompt 7.8 -> 245-260 tok/s, generation
            # 11.4 -> 22.7-25.3 on 2 cores), without its first-run measurement. The cpu backend
            # keeps an f32 copy of every matrix it multiplies: only where that fits in memory.
            need, have = _cpu_backend_bytes(args.model), _available_memory()
            if have is None or need <= CPU_HUB_MEMORY_SHARE * have:
                split, backends = CPU_HUB_SPLIT, "cpu"
                args.split, args.backends = split, backends  # (what `bench` reports)
                print(f"vkxsplit: '{dev.name}' is a CPU device: the cpu backend takes the matrix products "
                      f"(--split {CPU_HUB_SPLIT} --backends cpu; --split none keeps them on the hub)",
                      file=sys.stderr)
            else:
                print(f"vkxsplit: '{dev.name}' is a CPU device, but the cpu backend's f32 copy of the weights "
                      f"({need / 2**30:.1f} GiB) does not fit the available memory ({have / 2**30:.1f} GiB): "
                      "the hub runs everything (give --split/--backends to choose)", file=sys.stderr)
        model = load_model(args.model, split=split, backends=backends, device=dev, n_ctx=args.ctx_size,
                           ubatch=args.ubatch, progress=Progress("loading"))
    except BaseException:
        dev.close()
        raise
    model.owns_device = True
    return model


def cmd_run(args: argparse.Namespace) -> int:
    model = _load(args)
    try:
        out = sys.stdout
        if not args.chat:
            out.write(args.prompt)
        out.flush()
        for piece in model.generate(args.prompt, args.n_predict, temperature=args.temp, seed=args.seed,
                                    chat=args.chat, top_k=args.top_k, top_p=args.top_p):
            out.write(piece)
            out.flush()
        out.write("\n")
        t = model.timings
        pp = t["prompt_tokens"] / t["prompt_s"] if t.get("prompt_s") else 0.0
        tg = t["gen_tokens"] / t["gen_s"] if t.get("gen_s") else 0.0
        devs = ", ".join(d.name for d in getattr(model, "devices", [model.device]))
        print(f"\nprompt: {t['prompt_tokens']} tokens, {pp:.1f} tok/s | generation: {t['gen_tokens']} "
              f"tokens, {tg:.1f} tok/s | device: {devs}", file=sys.stderr)
    finally:
        model.close()
    return 0


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


def bench_model(model: Any, n_prompt: int, n_gen: int, reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """pp (prefill of n_prompt random ids) and tg (n_gen decode steps) tok/s over ``reps`` runs,
    each after warm-up runs (at least one; on a GPU for WARMUP_S)."""
    rng = np.random.default_rng(seed)
    results = []
    if n_prompt:
        ids = rng.integers(0, model.hp.n_vocab, n_prompt).tolist()
        _warm(model, lambda: model.prefill(ids))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.prefill(ids)
            ts.append(n_prompt / (time.perf_counter() - t0))
        results.append({"test": f"pp{n_prompt}", "tps": ts})
    if n_gen:
        def gen() -> float:
            model.prefill([int(rng.integers(0, model.hp.n_vocab))])
            tok = model.last_argmax()
            t0 = time.perf_counter()
            for _ in range(n_gen):
                model.run_step([tok])
                tok = model.last_argmax()
            return n_gen / (time.perf_counter() - t0)

        _warm(model, gen)
        results.append({"test": f"tg{n_gen}", "tps": [gen() for _ in range(reps)]})
    return results


def cmd_bench(args: argparse.Namespace) -> int:
    from .plan.spec import parse_spec

    splits = [s.strip() for s in (args.split or "none").split(";")]
    for s in splits:
        parse_spec(s)  # a typo in the third config fails before the first one runs
    rows = []
    a = argparse.Namespace(**vars(args))
    default = args.split is None and args.backends is None
    a.split = None if default else splits[0]  # None: run's default (on a CPU hub: mode:cpu)
    model = _load(a)  # loaded once: every split config runs over the same weights and backends
    if default:
        splits = [a.split or "none"]
        args.backends = a.backends
    multi = bool(getattr(args, "devices", None))
    try:
        for split in splits:
            model.set_split(split)
            # one test at a time, so a pipeline's bytes crossed between GPUs per step are the test's own
            tests = [(args.n_prompt, 0), (0, args.n_gen)] if multi else [(args.n_prompt, args.n_gen)]
            for n_p, n_g in tests:
                t0 = dict(getattr(model, "traffic", {}))
                for r in bench_model(model, n_p, n_g, args.repetitions):
                    tps = r["tps"]
                    row = {
                        "model": model.file.name, "size_gib": model.weight_bytes / 2**30,
                        "backends": f"vulkan x{len(model.devices)}" if multi else
                                    "vulkan" + (f",{args.backends}" if args.backends else ""),
                        "split": model.split if multi else split, "test": r["test"],
                        "tps_mean": statistics.fmean(tps), "tps_std": statistics.stdev(tps) if len(tps) > 1 else 0.0,
                        "device": ", ".join(d.name for d in getattr(model, "devices", [model.device])),
                    }
                    if multi:
                        t1 = model.traffic
                        steps = t1["steps"] - t0.get("steps", 0)
                        row["crossed_bytes_per_step"] = (t1["crossed_bytes"] - t0.get("crossed_bytes", 0)) / max(steps, 1)
                    rows.append(row)
    finally:
        model.close()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    xcol = multi
    print("| model | size | backends | split | test | t/s |" + (" between GPUs per step |" if xcol else ""))
    print("| --- | ---: | --- | --- | ---: | ---: |" + (" ---: |" if xcol else ""))
    for r in rows:
        extra = f" {r['crossed_bytes_per_step'] / 1024:.1f} KiB |" if xcol else ""
        print(f"| {r['model']} | {r['size_gib']:.2f} GiB | {r['backends']} | {r['split']} | {r['test']} | "
              f"{r['tps_mean']:.2f} ± {r['tps_std']:.2f} |" + extra)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``vkxsplit plan``: the plan of each ``-t`` batch size (who runs which ops and rows, the
    conversions, the timeline) with its predicted step time, measuring what the device
    profile lacks; ``--trace FILE``: one traced step of the largest."""
    from .model import load_model
    from .vk.device import Device

    try:
        Ts = sorted({int(t) for t in str(args.tokens).split(",") if t.strip()})
    except ValueError:
        raise VkxError(f"-t wants token counts like 1 or 1,512, got {args.tokens!r}") from None
    if not Ts or min(Ts) < 1:
        raise VkxError("-t wants positive token counts")
    dev = Device.open(args.device) if args.device is not None else None
    ub = max(Ts)
    n_ctx = args.ctx_size or max(ub + 1, 256)
    try:
        model = load_model(args.model, split=args.split, backends=args.backends, device=dev, n_ctx=n_ctx,
                           ubatch=ub)
    except BaseException:
        if dev is not None:
            dev.close()
        raise
    if dev is not None:
        model.owns_device = True
    try:
        plans = [model.plan(T, predict=True) for T in Ts]
        if args.trace:
            model.set_trace(True)
            rng = np.random.default_rng(0)
            model.reset()
            model.run_step(rng.integers(0, model.hp.n_vocab, Ts[-1]).tolist())
            Path(args.trace).write_text(json.dumps(model.last_trace))
            print(f"trace of one step (T={Ts[-1]}) written to {args.trace} (open in https://ui.perfetto.dev)",
                  file=sys.stderr)
        if args.json:
            print(json.dumps({"model": model.file.name, "device": model.device.name,
                              "backends": list(model.backends), "profile": str(model.cost.profile.path),
                              "plans": [p.to_dict() for p in plans]}, indent=1))
        else:
            for p in plans:
                print(p.describe(points=args.verbose_points))
                print()
            print(f"device profile: {model.cost.profile.path}")
    finally:
        model.close()
    return 0


def _register_plan(sub: Any) -> None:
    from .plan.spec import SPLIT_HELP

    p = sub.add_parser("plan", help="show which backend runs which ops (and rows) and the predicted time")
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--split", default="none", help=SPLIT_HELP)
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to attach, with options: cpu,npu-emu:min_batch=1")
    p.add_argument("-t", "--tokens", default="1", help="batch size(s) T to plan for, e.g. 1,512 (default 1)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default: max(T + 1, 256))")
    p.add_argument("--device", default=None, help="hub device index or name part (VKXSPLIT_DEVICE)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--points", dest="verbose_points", action="store_true",
                   help="list every timeline point (hub segments and backend jobs)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also run one step of the largest T and write its Chrome trace-event JSON")
    p.set_defaults(func=cmd_plan)


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="generate text with a GGUF model (default: SmolLM2-135M-Instruct)")
    _add_model_args(p)
    p.add_argument("-p", "--prompt", default="Explain in two sentences why the sky is blue.",
                   help="prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40, help="top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: on when the model has one)")
    p.set_defaults(func=_run_entry)
    b = sub.add_parser("bench", help="llama-bench-style prompt (pp) and generation (tg) throughput")
    _add_model_args(b)
    b.add_argument("-p", "--n-prompt", type=int, default=512)
    b.add_argument("-n", "--n-gen", type=int, default=128)
    b.add_argument("-r", "--repetitions", type=int, default=3)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)
    _register_plan(sub)


def _run_entry(args: argparse.Namespace) -> int:
    if args.chat is None:
        args.chat = True  # the default model is an instruct model; --no-chat for raw completion
    return cmd_run(args)
