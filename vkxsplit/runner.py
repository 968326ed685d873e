"""``vkxsplit run`` and ``vkxsplit plan``, and the model options every command that loads a
GGUF model shares (``bench``: :mod:`vkxsplit.bench`; ``serve``: :mod:`vkxsplit.server`).

The options follow llama.cpp's names (``common/arg.cpp``; ``llama-bench`` for ``bench``), with
no prefix abbreviations (``-ngl`` is one option, never ``-n gl``). Every numeric option is
checked when parsed, so a bad value is refused naming its flag. Defaults come from
:mod:`vkxsplit.defaults`, shared with the Python API.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import defaults, progress
from .defaults import CPU_HUB_SPLIT, PARTIALS  # noqa: F401  (CPU_HUB_SPLIT: re-exported)
from .errors import VkxError

log = logging.getLogger("vkxsplit.runner")

# -- argument types: a bad value is argparse's "argument -c/--ctx-size: ..." naming the flag --


def int_at_least(lo: int, what: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is below {lo}{what}")
        return v

    return parse


def float_in(lo: float, hi: float = math.inf, lo_open: bool = False, what: str = "") -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            lo_s = f"({lo:g}" if lo_open else f"[{lo:g}"
            hi_s = "inf)" if hi == math.inf else f"{hi:g}]"
            raise argparse.ArgumentTypeError(f"{text} is not in {lo_s}, {hi_s}{what}")
        return v

    return parse


def ratios(text: str) -> list[float]:
    """llama.cpp's ``-ts 3,1`` (or ``3/1``): non-negative proportions, at least one positive."""
    parts = [p.strip() for p in text.replace("/", ",").split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of proportions like 3,1") from None
    if any(not math.isfinite(v) or v < 0 for v in vals) or not any(vals):
        raise argparse.ArgumentTypeError(f"{text!r}: proportions are numbers >= 0, at least one above 0")
    return vals


def override(text: str) -> list[tuple[str, str]]:
    """llama.cpp's ``-ot PATTERN=BACKEND[,PATTERN=BACKEND...]``."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        pat, eq, name = item.rpartition("=")
        if not eq or not pat.strip() or not name.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not PATTERN=BACKEND (e.g. 'ffn_.*=cpu')")
        out.append((pat.strip(), name.strip().lower()))
    return out


def gpu_layers(text: str) -> int:
    if text in ("all", "auto"):
        return 1 << 30
    return int_at_least(-1)(text)


# -- the split from llama.cpp's -sm / -ts / -ot ---------------------------------------------


def split_from_args(args: argparse.Namespace) -> str | None:
    """``--split``, or the split spec llama.cpp's ``-sm/-ts/-ot`` describe (None: neither):
    ``-ot PATTERN=BACKEND`` -> ``layer:PATTERN=BACKEND``; ``-ts R,R`` -> ``layer:R,R`` (``-sm
    layer``, llama.cpp's default) or ``tensor:R,R`` (``-sm row``); ``-sm none`` -> ``none``.
    Ratios: the hub first, then the backends in --backends order."""
    ts = getattr(args, "tensor_split", None)
    ot = [x for group in (getattr(args, "override_tensor", None) or []) for x in group]
    sm = getattr(args, "split_mode", None)
    if getattr(args, "devices", None):
        return args.split
    if args.split is not None and (ts or ot or sm):
        raise VkxError("--split and -sm/-ts/-ot both describe the split", "give one of them")
    if args.split is not None:
        return str(args.split)
    if sm == "none":
        if ts or ot:
            raise VkxError("-sm none keeps everything on the hub: it takes no -ts or -ot")
        return "none"
    if sm == "row":
        if ot:
            raise VkxError("-ot goes with -sm layer (whole tensors to a backend), not -sm row")
        if not ts:
            raise VkxError("-sm row without --devices splits matrix rows over the hub and the backends by -ts",
                           "e.g. -sm row -ts 3,1 --backends cpu (or --devices 0,1 -sm row for two GPUs)")
        return "tensor:" + ",".join(f"{r:g}" for r in ts)
    items = [f"{pat}={name}" for pat, name in ot] + [f"{r:g}" for r in (ts or [])]
    return "layer:" + ",".join(items) if items else None


def hub_split_from_args(args: argparse.Namespace) -> str:
    """The split over the hubs of ``--devices``: ``--split`` (``layer[:R,..]`` or
    ``tensor:1,1``), or llama.cpp's ``-sm layer|row`` with ``-ts``/``--layer-split`` as that
    spec (:func:`vkxsplit.plan.spec.hub_split`); the planner checks it against the hubs."""
    from .plan.spec import hub_split

    if args.device is not None or args.backends or getattr(args, "override_tensor", None):
        raise VkxError("--devices puts one hub on each device: it does not take --device, --backends or -ot",
                       "attach backends to a model on one hub (no --devices)")
    shares = getattr(args, "layer_split", None)
    if args.tensor_split is not None:
        if shares is not None:
            raise VkxError("-ts and --layer-split both give the layers per device", "give one of them")
        shares = ",".join(f"{r:g}" for r in args.tensor_split)
    if args.split is not None:
        if args.split_mode is not None or shares is not None:
            raise VkxError("--split and -sm/-ts/--layer-split both give the split over the hubs", "give one of them")
        return str(args.split)
    if args.split_mode == "row" and getattr(args, "micro_batches", None) is not None:
        raise VkxError("--layer-split/-ts and --micro-batches go with --split-mode layer")
    return hub_split(args.split_mode or "layer", shares)


def backends_from_args(args: argparse.Namespace) -> str | None:
    """``--backends``; without it, the backends ``-ot`` names (other than the hub)."""
    if args.backends is not None:
        return str(args.backends)
    from .plan.spec import HUB_ALIASES

    names: list[str] = []
    for group in getattr(args, "override_tensor", None) or []:
        for _, name in group:
            if name not in HUB_ALIASES and name not in names:
                names.append(name)
    return ",".join(names) or None


def _with_threads(backends: str | None, threads: int | None) -> Any:
    """``--backends`` with ``-t N`` passed to each backend that takes a thread count."""
    if threads is None or not backends:
        return backends
    from .backend import _REGISTRY, _resolve
    from .plan.spec import parse_backends

    out = []
    for name, opts in parse_backends(backends):
        e = _REGISTRY.get(name)
        cls = None
        if e is not None:
            try:
                cls = _resolve(e.target) if isinstance(e.target, str) else e.target
            except Exception:  # noqa: BLE001  (an unavailable backend says so when created)
                cls = None
        params = inspect.signature(cls.__init__).parameters if cls is not None else {}
        key = next((k for k in ("threads", "n_threads") if k in params), None)
        if key and key not in opts:
            opts = {**opts, key: threads}
        elif name == "cpu" and key is None:
            log.info("-t %d: the cpu backend here takes no thread count (numpy uses its own)", threads)
        out.append((name, opts))
    return out


# -- options shared by run, bench and serve ---------------------------------------------------


def add_model_args(p: argparse.ArgumentParser, bench: bool = False) -> None:
    from .plan.spec import SPLIT_HELP

    p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(0), default=None,
                   help="context size in tokens (default and 0: the model's, at most 4096)")
    p.add_argument("-ub", "--ubatch-size", "--ubatch", dest="ubatch", type=int_at_least(1), default=defaults.UBATCH,
                   help=f"tokens per prompt step (default {defaults.UBATCH})")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=None,
                   help="threads of the cpu backend, where it takes a count")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=gpu_layers, default=None,
                   metavar="N", help="accepted for llama.cpp's habits: the Vulkan hub always holds every layer "
                   "(as llama.cpp's -ngl 99); work moves to the CPU or other backends with --backends "
                   "and --split/-ot/-ts")
    p.add_argument("--device", default=None, help="hub device index or name part (VKXSPLIT_DEVICE)")
    p.add_argument("--devices", default=None,
                   help="one hub per GPU, each a participant of the planner: comma-separated device indices "
                        "or name parts (e.g. 0,1); the split over them: --split-mode layer (a pipeline, "
                        "default) or row, -ts shares, or --split layer:R,.. | tensor:1,1")
    p.add_argument("-sm", "--split-mode", default=None, choices=("none", "layer", "row"),
                   help="llama.cpp's split mode: with --devices, layer = a pipeline of whole layers per GPU, "
                        "row = every matrix split by rows over two GPUs; on one hub, with -ts: layer -> "
                        "--split layer:R,.. and row -> --split tensor:R,..; none = everything on the hub")
    p.add_argument("-ts", "--tensor-split", type=ratios, default=None, metavar="R,R,...",
                   help="proportions of the work (llama.cpp's -ts): the hub first, then --backends in order; "
                        "with --devices, the layers per device")
    p.add_argument("-ot", "--override-tensor", type=override, action="append", default=None,
                   metavar="PATTERN=BACKEND", help="tensors (node or weight names matching the regex) to a "
                   "backend, first match wins (llama.cpp's -ot; = --split layer:PATTERN=BACKEND); repeatable")
    p.add_argument("--layer-split", default=None,
                   help="with --devices: share of the layers per device (e.g. 3,1; default equal); = -ts")
    p.add_argument("--micro-batches", type=int_at_least(1), default=None,
                   help="with --devices: pieces of a prompt step in flight on different GPUs at once "
                        "(default twice the devices, pieces of at least 32 tokens)")
    p.add_argument("--partials", default=None, choices=PARTIALS,
                   help="with --devices and the row split: the type the all-reduce's partial sums cross in "
                        "(default auto: f32 below a size measured once per device, bf16 from it on)")
    p.add_argument("--split", default=None,
                   help=SPLIT_HELP + ("; several separated by ';' are swept (e.g. 'none;tensor:1,1;mode:cpu>=8')"
                                      if bench else "") + "; default: see the README's defaults table")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to attach, with options: cpu,npu-emu:min_batch=1 "
                        "(`vkxsplit info` lists what this machine can run); without --split the planner "
                        "chooses over them (--split auto)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write the last step's Chrome trace-event JSON (open in https://ui.perfetto.dev)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    s = defaults.SAMPLING
    p.add_argument("--temp", type=float_in(0), default=s.temperature,
                   help=f"temperature (default {s.temperature:g}: greedy)")
    p.add_argument("--top-k", type=int_at_least(0), default=s.top_k, help=f"top-k (0 = off; default {s.top_k})")
    p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=s.top_p,
                   help=f"top-p (1 = off; default {s.top_p:g})")
    p.add_argument("--min-p", type=float_in(0, 1), default=s.min_p, help=f"min-p (0 = off; default {s.min_p:g})")
    p.add_argument("--repeat-penalty", type=float_in(0, lo_open=True), default=s.repeat_penalty,
                   help=f"penalty of repeated tokens (1 = off; default {s.repeat_penalty:g})")
    p.add_argument("--repeat-last-n", type=int_at_least(-1), default=s.repeat_last_n,
                   help=f"recent tokens the penalty looks at (-1 = all; default {s.repeat_last_n})")
    p.add_argument("-s", "--seed", type=int_at_least(0), default=None, help="sampling seed (default: random)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


# -- loading --------------------------------------------------------------------------------


def _note(text: str) -> None:
    print(text, file=sys.stderr)


#: loading prints its first progress line where stderr is not a terminal only after this long
#: (a model usually loads well within it: `tools/run.sh | cat` shows only the answer and its timing)
LOAD_DELAY_S = 60.0


def load_from_args(args: argparse.Namespace) -> Any:
    """The model as the options describe it; the split chosen by
    :func:`vkxsplit.defaults.split_for_machine` where none is given (``args.split_used`` and
    ``args.backends_used`` say what was taken)."""
    from .model import load_model
    from .vk.device import Device

    progress.enable()
    devices = getattr(args, "devices", None)
    if devices:
        split = hub_split_from_args(args)
        args.split_used, args.backends_used = split, None
        with progress.task("loading", unit="B", delay=LOAD_DELAY_S) as bar:
            return load_model(args.model, split=split, devices=devices, n_ctx=args.ctx_size or None,
                              ubatch=args.ubatch, micro_batches=args.micro_batches, progress=bar.callback(),
                              partials=args.partials or "auto")
    if args.layer_split is not None or args.micro_batches is not None or args.partials is not None:
        raise VkxError("--layer-split, --micro-batches and --partials go with --devices (a model split over "
                       "several GPUs)")
    split = split_from_args(args)
    backends = backends_from_args(args)
    dev = Device.open(args.device)
    try:
        choice = defaults.split_for_machine(split, backends, dev.is_cpu, args.model, dev.name)
        if choice.note and choice.warn:
            _note(choice.note)
        elif choice.note:
            log.info("%s", choice.note)
        args.split_used, args.backends_used = choice.split or "none", choice.backends
        with progress.task("loading", unit="B", delay=LOAD_DELAY_S) as bar:
            model = load_model(args.model, split=choice.split, backends=_with_threads(choice.backends, args.threads),
                               device=dev, n_ctx=args.ctx_size or None, ubatch=args.ubatch,
                               progress=bar.callback())
    except BaseException:
        dev.close()
        raise
    model.owns_device = True
    ngl = getattr(args, "n_gpu_layers", None)
    if ngl is not None and ngl < model.hp.n_layer:
        _note(f"vkxsplit: -ngl {ngl}: the Vulkan hub holds all {model.hp.n_layer} layers whatever -ngl says; "
              "to move work to the CPU give --backends cpu with --split, -ot or -ts")
    return model


def _start_trace(model: Any, path: str | None) -> None:
    if path:
        model.set_trace(True)


def _write_trace(model: Any, path: str | None) -> None:
    if not path:
        return
    if model.last_trace is None:
        raise VkxError("--trace: no step ran, so there is nothing to write")
    Path(path).write_text(json.dumps(model.last_trace))
    _note(f"vkxsplit: trace of the last step written to {path} (open in https://ui.perfetto.dev)")


# -- run ------------------------------------------------------------------------------------


def _prompt_text(args: argparse.Namespace) -> str | None:
    if args.file is not None:
        if args.prompt is not None:
            raise VkxError("-p and -f both give the prompt", "give one of them")
        try:
            return Path(args.file).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise VkxError(f"-f {args.file}: cannot read it ({exc.strerror or exc})") from None
    return args.prompt


def timing_line(model: Any, split: str | None) -> str:
    t = model.timings
    pp = t["prompt_tokens"] / t["prompt_s"] if t.get("prompt_s") else 0.0
    tg = t["gen_tokens"] / t["gen_s"] if t.get("gen_s") else 0.0
    devs = ", ".join(d.name for d in getattr(model, "hubs", [model.device]))
    line = (f"prompt: {t['prompt_tokens']} tokens, {pp:.1f} tok/s | generation: {t['gen_tokens']} tokens, "
            f"{tg:.1f} tok/s | device: {devs}")
    if split:
        line += f" | split: {split}"
    if t.get("setup_s", 0.0) >= 0.5:
        line += f" | planning: {t['setup_s']:.1f} s (not in the rates)"
    return line


def _end_message(model: Any, args: argparse.Namespace, chat: bool) -> str | None:
    """Why generation stopped, where the user would otherwise be left guessing."""
    t = model.timings
    if t.get("stop") == "context":
        return (f"vkxsplit: the context is full ({model.n_ctx} tokens): generation stopped; "
                "a larger -c gives longer answers")
    if t.get("stop") == "eos" and t.get("gen_tokens") == 0:
        hint = (" (--no-chat sends the text as it is: an instruct model often ends at once; without "
                "--no-chat it gets the chat template)" if not chat else "")
        return f"vkxsplit: the model ended its answer at once (its end-of-generation token came first){hint}"
    return None


class _Interrupt:
    """Ctrl-C while an answer is generated: stop that answer (not the program)."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def __enter__(self) -> _Interrupt:
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.hit = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old)


def _stream_answer(model: Any, ids: list[int], args: argparse.Namespace, out: Any,
                   stop_on: _Interrupt | None = None) -> str:
    """Generate from ``ids``, writing the pieces to ``out``; the whole text."""
    parts = []
    gen = model.tokenizer.decode_stream(model.generate_ids(ids, args.n_predict, **{
        k: v for k, v in sampling_kwargs(args).items()}))
    try:
        for piece in gen:
            out.write(piece)
            out.flush()
            parts.append(piece)
            if stop_on is not None and stop_on.hit:
                break
    finally:
        gen.close()
    return "".join(parts)


def cmd_run(args: argparse.Namespace) -> int:
    prompt = _prompt_text(args)
    model = load_from_args(args)
    try:
        chat = defaults.chat_default(model.tokenizer) if args.chat is None else args.chat
        _start_trace(model, args.trace)
        if args.conversation:
            return _conversation(model, args, prompt)
        if prompt is None:
            prompt = DEFAULT_PROMPT
        ids = model.chat_ids(prompt, chat, args.system_prompt)
        out = sys.stdout
        if not chat:
            out.write(((args.system_prompt + "\n\n") if args.system_prompt else "") + prompt)
            out.flush()
        _stream_answer(model, ids, args, out)
        out.write("\n")
        out.flush()
        msg = _end_message(model, args, chat)
        if msg:
            _note(msg)
        print("\n" + timing_line(model, args.split_used), file=sys.stderr)
        _write_trace(model, args.trace)
    finally:
        model.close()
    return 0


def _conversation(model: Any, args: argparse.Namespace, first: str | None) -> int:
    """llama.cpp's -cnv: read a line, answer it with the whole history through the chat
    template; /exit or end of input ends, /clear forgets the history, Ctrl-C stops the current
    answer (and, at the prompt, ends)."""
    tty = sys.stdin.isatty()
    history: list[dict[str, str]] = []
    if args.system_prompt:
        history.append({"role": "system", "content": args.system_prompt})
    base = len(history)
    if tty:
        _note("vkxsplit: chat with the model; /exit or Ctrl-D ends, /clear forgets the history, "
              "Ctrl-C stops an answer")
    pending = first
    stop = _Interrupt()
    while True:
        if pending is None:
            try:
                line = input("> " if tty else "")
            except EOFError:
                break
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
        else:
            line, pending = pending, None
            if tty:
                print(f"> {line}")
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/clear":
            del history[base:]
            continue
        history.append({"role": "user", "content": text})
        ids = model.tokenizer.encode_chat(history)
        if len(ids) >= model.n_ctx:
            history.pop()
            _note(f"vkxsplit: the conversation ({len(ids)} tokens) no longer fits the context of {model.n_ctx} "
                  "tokens: /clear forgets it, a larger -c holds more")
            continue
        with stop:
            answer = _stream_answer(model, ids, args, sys.stdout, stop)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": answer})
        if stop.hit:
            _note("vkxsplit: answer interrupted")
        msg = _end_message(model, args, True)
        if msg:
            _note(msg)
        if args.verbose_timings:
            _note(timing_line(model, args.split_used))
    return 0


DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


# -- bench (llama-bench) ----------------------------------------------------------------------


# -- plan -----------------------------------------------------------------------------------


#: a measured step this much slower or faster than predicted is reported as a cost-model miss
PREDICTION_OFF = 0.20


def measure_plans(model: Any, plans: list[Any], reps: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Each plan's step run for real on random ids from an empty context (once to record and
    warm, then ``reps`` times): the median wall time beside the prediction, and whether the
    prediction is off by more than :data:`PREDICTION_OFF` (then ``auto``, which compares plans by
    their predictions, may not have picked the fastest)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in plans:
        ids = rng.integers(0, model.hp.n_vocab, p.T).tolist()
        times = []
        for r in range(reps + 1):
            model.reset()
            t0 = time.perf_counter()
            model.run_step(ids)
            if r:
                times.append(time.perf_counter() - t0)
        measured = statistics.median(times)
        predicted = p.prediction.total_s if p.prediction is not None else None
        off = measured / predicted - 1 if predicted else None
        out.append({"T": p.T, "measured_s": measured, "predicted_s": predicted, "off": off,
                    "miss": off is not None and abs(off) > PREDICTION_OFF})
    model.reset()
    return out


def measured_line(m: dict[str, Any]) -> str:
    if m["predicted_s"] is None:
        return f"  measured: {m['measured_s'] * 1e3:.3f} ms (no prediction)"
    line = (f"  measured: {m['measured_s'] * 1e3:.3f} ms (median of the steps run; predicted "
            f"{m['predicted_s'] * 1e3:.3f} ms, {m['off']:+.0%})")
    if m["miss"]:
        line += (f"\n  the prediction is off by more than {PREDICTION_OFF:.0%}: the cost model does not know this "
                 "step well, so `auto` may not pick the fastest plan here (the device profile's measurements "
                 "are per kernel and shape: a fresh profile may help, VKXSPLIT_CACHE_DIR)")
    return line


def cmd_plan(args: argparse.Namespace) -> int:
    """``vkxsplit plan``: the plan of each ``-t`` batch size (who runs which ops and rows, the
    conversions, the timeline) with its predicted step time, measuring what the device
    profile lacks; ``--trace FILE``: one traced step of the largest. ``-ts``/``-ot``/``-sm`` are
    shown as the split spec they map to."""
    from .model import load_model
    from .vk.device import Device

    progress.enable()
    try:
        Ts = sorted({int(t) for t in str(args.tokens).split(",") if t.strip()})
    except ValueError:
        raise VkxError(f"--tokens wants token counts like 1 or 1,512, got {args.tokens!r}") from None
    if not Ts or min(Ts) < 1:
        raise VkxError("--tokens wants positive token counts")
    ub = max(Ts)
    n_ctx = args.ctx_size or max(ub + 1, 256)
    if args.devices:  # one hub per device: each a participant (hub0, hub1, ...)
        from .plan.spec import parse_spec

        split = hub_split_from_args(args)
        auto = parse_spec(split).kind == "auto"  # (priced with the micro-batches a run would have)
        model = load_model(args.model, split=split, devices=args.devices, n_ctx=n_ctx, ubatch=ub,
                           micro_batches=None if auto else 1, partials=args.partials or "auto")
        if model.micro > 1:  # auto picked the pipeline: its plans are of one piece of a prompt step
            _note(f"vkxsplit: auto picked the layer split in {model.micro} micro-batches of {model.piece} tokens: "
                  f"plans of at most {model.piece} tokens")
            Ts = sorted({min(T, model.piece) for T in Ts})
        try:
            plans = [model.plan(T, predict=True) for T in Ts]
            meas = measure_plans(model, plans) if args.measure else [None] * len(plans)
            _print_plans(args, model, plans, meas, model.split_label,
                         {"devices": [d.name for d in model.hubs], "split": str(model.split),
                          "placed": model.split_label})
        finally:
            model.close()
        return 0
    backends = backends_from_args(args)
    # as run's: --backends without a split lets the planner choose over them
    split = split_from_args(args) or defaults.split_for_machine(None, backends, False).split or "none"
    dev = Device.open(args.device) if args.device is not None else None
    try:
        model = load_model(args.model, split=split, backends=backends, device=dev, n_ctx=n_ctx, ubatch=ub)
    except BaseException:
        if dev is not None:
            dev.close()
        raise
    if dev is not None:
        model.owns_device = True
    try:
        plans = [model.plan(T, predict=True) for T in Ts]
        meas = measure_plans(model, plans) if args.measure else [None] * len(plans)
        if args.trace:
            model.set_trace(True)
            rng = np.random.default_rng(0)
            model.reset()
            model.run_step(rng.integers(0, model.hp.n_vocab, Ts[-1]).tolist())
            Path(args.trace).write_text(json.dumps(model.last_trace))
            print(f"trace of one step (T={Ts[-1]}) written to {args.trace} (open in https://ui.perfetto.dev)",
                  file=sys.stderr)
        _print_plans(args, model, plans, meas, str(model.split),
                     {"device": model.device.name, "split": str(model.split), "backends": list(model.backends),
                      "profile": str(model.cost.profile.path)})
    finally:
        model.close()
    return 0


def _print_plans(args: argparse.Namespace, model: Any, plans: list[Any], meas: list[Any], split: str,
                 head: dict[str, Any]) -> None:
    """``plan``'s output: JSON (``head``'s fields, then every plan with its measurement) or the
    text of each plan and its measured line."""
    if args.json:
        print(json.dumps({"model": model.file.name, **head,
                          "plans": [{**p.to_dict(), "measured": m} for p, m in zip(plans, meas)]}, indent=1))
        return
    print(f"split: {split}")
    for p, m in zip(plans, meas):
        print(p.describe(points=args.verbose_points))
        if m is not None:
            print(measured_line(m))
        print()
    print(f"device profile: {model.cost.profile.path}")


def _register_plan(sub: Any) -> None:
    from .plan.spec import SPLIT_HELP

    p = sub.add_parser("plan", allow_abbrev=False,
                       help="show which backend runs which ops (and rows) and the predicted time")
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--split", default=None, help=SPLIT_HELP + " (default: none; auto with --backends)")
    p.add_argument("-sm", "--split-mode", default=None, choices=("none", "layer", "row"),
                   help="with -ts: layer -> --split layer:R,.., row -> --split tensor:R,..")
    p.add_argument("-ts", "--tensor-split", type=ratios, default=None, metavar="R,R,...",
                   help="proportions: the hub first, then --backends in order (llama.cpp's -ts)")
    p.add_argument("-ot", "--override-tensor", type=override, action="append", default=None,
                   metavar="PATTERN=BACKEND", help="tensors matching the regex to a backend (llama.cpp's -ot)")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to attach, with options: cpu,npu-emu:min_batch=1")
    p.add_argument("-t", "-T", "--tokens", dest="tokens", default="1", help="batch size(s) T to plan for, e.g. 1,512 (default 1)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(0), default=None,
                   help="context size (default: max(T + 1, 256))")
    p.add_argument("--device", default=None, help="hub device index or name part (VKXSPLIT_DEVICE)")
    p.add_argument("--devices", default=None,
                   help="one hub per device (e.g. 0,1), each a participant: the plan over them "
                        "(--split layer[:R,..] | tensor:1,1, or -sm layer|row with -ts)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--points", dest="verbose_points", action="store_true",
                   help="list every timeline point (hub segments and backend jobs)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also run one step of the largest T and write its Chrome trace-event JSON")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="run each planned step (median of 3) and print the measured time beside the "
                        f"prediction, saying so when they differ by more than {PREDICTION_OFF:.0%} (default: on)")
    p.add_argument("--partials", default=None, choices=PARTIALS,
                   help="with --devices and the row split: the type the all-reduce's partial sums cross in "
                        "(default auto)")
    p.set_defaults(func=cmd_plan, split_used=None, layer_split=None, micro_batches=None)


def register(sub: Any) -> None:
    p = sub.add_parser("run", allow_abbrev=False,
                       help="generate text with a GGUF model (default: SmolLM2-135M-Instruct)")
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("-f", "--file", default=None, help="read the prompt from this file")
    p.add_argument("-sys", "--system-prompt", default=None, help="a system message before the prompt")
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int_at_least(-1),
                   default=defaults.N_PREDICT,
                   help=f"tokens to generate (default {defaults.N_PREDICT}: until the end of generation or "
                        "a full context)")
    add_sampling_args(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: on exactly when the file has one)")
    p.add_argument("-cnv", "--conversation", action="store_true", default=False,
                   help="chat interactively: a line in, an answer out, with the history; /exit or end of "
                        "input ends, Ctrl-C stops the current answer")
    p.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_false",
                   help="one prompt, one answer (the default)")
    p.add_argument("--timings", dest="verbose_timings", action="store_true",
                   help="with -cnv: print each answer's timing line")
    p.set_defaults(func=cmd_run)
    _register_plan(sub)
