"""The command line in llama.cpp's conventions (the interfaces issue): options parsed whole
(never abbreviated or combined), every numeric option checked naming its flag, -sm/-ts/-ot
mapped onto the split grammar, the one set of defaults, -n -1, the end-of-context message, the
chat template on exactly when the file has one, llama-bench's output, and progress on a
pseudo-terminal. Model runs use a tiny synthetic GGUF (random weights: the text is noise, the
token counts and messages are what is checked)."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkxsplit import defaults
from vkxsplit.cli import main, make_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vkxsplit.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("cli") / "tiny-q4_0.gguf", "tiny", "q4_0", seed=4, n_vocab=512,
                           n_layer=2)


def parse(*argv: str) -> argparse.Namespace:
    return make_parser().parse_args(list(argv))


# ---- parsing: llama.cpp's names, whole -------------------------------------------------------

PARSED = [
    (("run", "-ngl", "99"), "n_gpu_layers", 99),
    (("run", "--n-gpu-layers", "all"), "n_gpu_layers", 1 << 30),
    (("run", "--gpu-layers", "0"), "n_gpu_layers", 0),
    (("run", "-t", "4"), "threads", 4),
    (("run", "--threads", "2"), "threads", 2),
    (("run", "-ts", "3,1"), "tensor_split", [3.0, 1.0]),
    (("run", "--tensor-split", "3/1/0.5"), "tensor_split", [3.0, 1.0, 0.5]),
    (("run", "-ot", r"blk\.1\.ffn_.*=CPU"), "override_tensor", [[(r"blk\.1\.ffn_.*", "cpu")]]),
    (("run", "-ot", "a=cpu,b=npu-emu", "--override-tensor", "c=hub"), "override_tensor",
     [[("a", "cpu"), ("b", "npu-emu")], [("c", "hub")]]),
    (("run", "-sm", "row"), "split_mode", "row"),
    (("run", "--split-mode", "none"), "split_mode", "none"),
    (("run", "--repeat-penalty", "1.1"), "repeat_penalty", 1.1),
    (("run", "--repeat-last-n", "-1"), "repeat_last_n", -1),
    (("run", "--min-p", "0.1"), "min_p", 0.1),
    (("run", "-f", "prompt.txt"), "file", "prompt.txt"),
    (("run", "--file", "p.txt"), "file", "p.txt"),
    (("run", "-sys", "Be brief."), "system_prompt", "Be brief."),
    (("run", "--system-prompt", "x"), "system_prompt", "x"),
    (("run", "-cnv"), "conversation", True),
    (("run", "--conversation"), "conversation", True),
    (("run", "-cnv", "-no-cnv"), "conversation", False),
    (("run", "-n", "-1"), "n_predict", -1),
    (("run", "--predict", "7"), "n_predict", 7),
    (("run", "--n-predict", "0"), "n_predict", 0),
    (("run", "-s", "1"), "seed", 1),
    (("run", "--seed", "5"), "seed", 5),
    (("run", "-c", "0"), "ctx_size", 0),
    (("run", "--ctx-size", "128"), "ctx_size", 128),
    (("run", "-ub", "16"), "ubatch", 16),
    (("run", "--ubatch-size", "8"), "ubatch", 8),
    (("run", "--temp", "0.7"), "temp", 0.7),
    (("run", "--top-k", "0"), "top_k", 0),
    (("run", "--top-p", "1"), "top_p", 1.0),
    (("run", "--no-chat"), "chat", False),
    (("run", "--trace", "t.json"), "trace", "t.json"),
    (("-vv", "run"), "verbose", 2),
    (("bench", "-o", "jsonl"), "output", "jsonl"),
    (("bench", "-o", "csv"), "output", "csv"),
    (("bench", "-p", "0"), "n_prompt", 0),
    (("bench", "-r", "2"), "repetitions", 2),
    (("bench", "--trace", "b.json"), "trace", "b.json"),
    (("bench", "-ts", "1,1"), "tensor_split", [1.0, 1.0]),
    (("serve", "--port", "0"), "port", 0),
    (("serve", "-ngl", "99", "--temp", "0.5"), "temp", 0.5),
    (("plan", "-ot", "ffn=cpu"), "override_tensor", [[("ffn", "cpu")]]),
]


@pytest.mark.parametrize("argv,attr,want", PARSED, ids=[" ".join(a) for a, _, _ in PARSED])
def test_llama_cpp_options_parse(argv: tuple[str, ...], attr: str, want: Any) -> None:
    assert getattr(parse(*argv), attr) == want


def test_defaults_are_the_shared_ones() -> None:
    """`run` and `serve` without options take vkxsplit.defaults' values, as the Python API does."""
    import inspect

    from vkxsplit.model import LanguageModel, Sampler

    s = defaults.SAMPLING
    for cmd in ("run", "serve"):
        a = parse(cmd)
        assert (a.temp, a.top_k, a.top_p, a.min_p, a.repeat_penalty, a.repeat_last_n) == \
            (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.repeat_last_n)
        assert a.split is None and a.backends is None and a.ubatch == defaults.UBATCH
    a = parse("run")
    assert a.n_predict == defaults.N_PREDICT == -1 and a.chat is None
    for fn in (LanguageModel.generate, LanguageModel.generate_ids, Sampler.__init__):
        p = inspect.signature(fn).parameters
        for name, want in (("temperature", s.temperature), ("top_k", s.top_k), ("top_p", s.top_p),
                           ("min_p", s.min_p), ("repeat_penalty", s.repeat_penalty)):
            assert p[name].default == want, (fn.__qualname__, name)
    assert inspect.signature(LanguageModel.generate).parameters["chat"].default is None
    assert inspect.signature(LanguageModel.generate).parameters["max_tokens"].default == defaults.N_PREDICT


REFUSED = [
    (("run", "-c", "-5"), "-c/--ctx-size"),
    (("run", "-ub", "0"), "-ub/--ubatch-size"),
    (("run", "-ub", "-1"), "-ub/--ubatch-size"),
    (("run", "-n", "-2"), "-n/--n-predict"),
    (("run", "-n", "ten"), "-n/--n-predict"),
    (("run", "--temp", "-1"), "--temp"),
    (("run", "--temp", "nan"), "--temp"),
    (("run", "--top-p", "0"), "--top-p"),
    (("run", "--top-p", "1.5"), "--top-p"),
    (("run", "--top-k", "-1"), "--top-k"),
    (("run", "--min-p", "2"), "--min-p"),
    (("run", "--repeat-penalty", "0"), "--repeat-penalty"),
    (("run", "--repeat-last-n", "-2"), "--repeat-last-n"),
    (("run", "-t", "0"), "-t/--threads"),
    (("run", "-s", "-3"), "-s/--seed"),
    (("run", "-ngl", "x"), "-ngl/--n-gpu-layers"),
    (("run", "-ts", "a,b"), "-ts/--tensor-split"),
    (("run", "-ts", "0,0"), "-ts/--tensor-split"),
    (("run", "-ot", "nothing"), "-ot/--override-tensor"),
    (("run", "--micro-batches", "0"), "--micro-batches"),
    (("bench", "-r", "0"), "-r/--repetitions"),
    (("bench", "-p", "-1"), "-p/--n-prompt"),
    (("bench", "-o", "xml"), "-o/--output"),
    (("serve", "--port", "-1"), "--port"),
    (("build-shaders", "-j", "0"), "-j/--jobs"),
    # never abbreviated, never one letter and an attached word
    (("run", "-hf", "x"), "unrecognized option -hf"),
    (("run", "-cnvx"), "unrecognized option -cnvx"),
    (("run", "-ng", "9"), "unrecognized option -ng"),
    (("serve", "-n", "-2"), "-n/--n-predict"),
    (("serve", "-ng", "8"), "unrecognized option -ng"),
    (("run", "--tem", "0.5"), "unrecognized arguments: --tem"),
    (("run", "--split-m", "row"), "unrecognized arguments: --split-m"),
]


@pytest.mark.parametrize("argv,flag", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_values_are_refused_naming_the_flag(argv: tuple[str, ...], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_the_old_prefix_readings_are_gone() -> None:
    """The issue's cases: -ngl 99 was read as -n gl, -s 1 as --split-mode, -cnv as -c nv."""
    a = parse("run", "-ngl", "99", "-s", "1", "-cnv")
    assert (a.n_gpu_layers, a.seed, a.conversation, a.n_predict, a.split_mode, a.ctx_size) == \
        (99, 1, True, -1, None, None)


# ---- -sm / -ts / -ot onto the split grammar ---------------------------------------------------

SPLITS = [
    (("run",), None, None),
    (("run", "--split", "auto"), "auto", None),
    (("run", "-ts", "3,1"), "layer:3,1", None),
    (("run", "-sm", "layer", "-ts", "3,1"), "layer:3,1", None),
    (("run", "-sm", "row", "-ts", "3,1", "--backends", "cpu"), "tensor:3,1", "cpu"),
    (("run", "-ot", r"blk\.1\.ffn_.*=cpu"), r"layer:blk\.1\.ffn_.*=cpu", "cpu"),
    (("run", "-ot", "a=cpu", "-ot", "b=npu-emu", "-ts", "2,1,1"), "layer:a=cpu,b=npu-emu,2,1,1", "cpu,npu-emu"),
    (("run", "-ot", "a=hub,b=cpu"), "layer:a=hub,b=cpu", "cpu"),
    (("run", "-ot", "a=cpu", "--backends", "cpu,npu-emu"), "layer:a=cpu", "cpu,npu-emu"),
    (("run", "-sm", "none"), "none", None),
]


@pytest.mark.parametrize("argv,split,backends", SPLITS, ids=[" ".join(a) for a, _, _ in SPLITS])
def test_llama_cpp_split_options_map_onto_the_grammar(argv: tuple[str, ...], split: str | None,
                                                       backends: str | None) -> None:
    from vkxsplit.plan.spec import parse_spec
    from vkxsplit.runner import backends_from_args, split_from_args

    a = parse(*argv)
    got = split_from_args(a)
    assert got == split and backends_from_args(a) == backends
    if got is not None:
        spec = parse_spec(got)  # the grammar takes what they map to
        if "-ot" in argv:
            assert [o.backend for o in spec.overrides] == [x.split("=")[-1] for g in a.override_tensor
                                                           for x in (f"{p}={n}" for p, n in g)]
        if "-ts" in argv:
            assert [r for _, r in spec.ratios] == a.tensor_split


@pytest.mark.parametrize("argv,msg", [
    (("run", "--split", "none", "-ts", "1,1"), "both describe the split"),
    (("run", "-sm", "row"), "-sm row without --devices"),
    (("run", "-sm", "row", "-ts", "1,1", "-ot", "a=cpu"), "-ot goes with -sm layer"),
    (("run", "-sm", "none", "-ts", "1,1"), "takes no -ts or -ot"),
])
def test_conflicting_split_options_are_refused(argv: tuple[str, ...], msg: str) -> None:
    from vkxsplit.errors import VkxError
    from vkxsplit.runner import split_from_args

    with pytest.raises(VkxError, match=msg):
        split_from_args(parse(*argv))


def test_split_for_machine(tiny: Path, monkeypatch) -> None:
    """One function decides the split for the CLI and load_model: a given split stays;
    --backends without --split is auto over them (it was `none`, silently); on a CPU hub the cpu
    backend with mode:cpu (it reads the weights in place: no memory condition); on a GPU none."""
    f = defaults.split_for_machine
    assert (f("tensor:1,1", "cpu", True, tiny).split, f("tensor:1,1", "cpu", True, tiny).backends) == \
        ("tensor:1,1", "cpu")
    c = f(None, "cpu", False, tiny)
    assert (c.split, c.backends) == ("auto", "cpu") and "planner chooses" in c.note
    c = f(None, "npu-emu", True, tiny)
    assert (c.split, c.backends) == ("auto", "npu-emu")
    assert (f(None, None, False, tiny).split, f(None, None, False, tiny).backends) == (None, None)
    c = f(None, None, True, tiny, "lavapipe")
    assert (c.split, c.backends) == (defaults.CPU_HUB_SPLIT, defaults.CPU_HUB_BACKENDS) == ("mode:cpu", "cpu:step=1")
    assert "CPU device" in c.note


def test_backends_without_split_let_the_planner_choose(tiny: Path) -> None:
    """Through the CLI's loader and through load_model: --backends cpu alone is `auto`."""
    from vkxsplit.model import load_model
    from vkxsplit.runner import load_from_args

    m = load_from_args(parse("run", "-m", str(tiny), "--backends", "cpu", "-c", "32", "-t", "1"))
    try:
        assert str(m.split) == "auto" and list(m.backends) == ["cpu"]
        if hasattr(m.backends["cpu"], "threads"):  # -t reaches the cpu backend
            assert m.backends["cpu"].threads == 1
    finally:
        m.close()
    with load_model(tiny, backends="cpu", n_ctx=32) as m:
        assert str(m.split) == "auto"
    with load_model(tiny, n_ctx=32) as m:  # neither: the machine's split (as the CLI)
        from vkxsplit.vk.device import Device

        with Device.open() as d:
            cpu_hub = d.is_cpu
        assert str(m.split) == (defaults.CPU_HUB_SPLIT if cpu_hub else "none")


def test_threads_go_to_backends_that_take_them() -> None:
    import inspect

    from vkxsplit.backends.cpu import CpuBackend
    from vkxsplit.runner import _with_threads

    takes = "threads" in inspect.signature(CpuBackend.__init__).parameters
    assert _with_threads("cpu", 3) == [("cpu", {"threads": 3} if takes else {})]
    assert _with_threads("cpu:threads=2", 3) == [("cpu", {"threads": 2})]  # the explicit option wins
    assert _with_threads("cpu", None) == "cpu"


def test_plan_shows_the_mapped_split(tiny: Path, capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VKXSPLIT_CACHE_DIR", str(tmp_path))
    assert main(["plan", "-m", str(tiny), "-ot", r"blk\.1\.ffn_.*=cpu", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(r"split: layer:blk\.1\.ffn_.*=cpu") and "cpu:" in out


def test_plan_measures_each_step_and_says_when_the_prediction_misses(tiny: Path, capsys, monkeypatch,
                                                                      tmp_path: Path) -> None:
    """``plan`` runs each planned step and prints the measured time beside the prediction; a
    prediction off by more than 20% is called out (here made tiny on purpose); --no-measure
    skips the runs."""
    import json

    from vkxsplit import runner
    from vkxsplit.plan.cost import Prediction

    monkeypatch.setenv("VKXSPLIT_CACHE_DIR", str(tmp_path))
    assert main(["plan", "-m", str(tiny), "--split", "none", "-t", "1,4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    meas = [p["measured"] for p in doc["plans"]]
    assert [m["T"] for m in meas] == [1, 4] and all(m["measured_s"] > 0 and m["predicted_s"] > 0 for m in meas)
    assert all(m["miss"] == (abs(m["measured_s"] / m["predicted_s"] - 1) > runner.PREDICTION_OFF) for m in meas)
    from vkxsplit.model import Model

    orig = Model.plan

    def tiny_prediction(self, T, all_logits=False, predict=False):
        p = orig(self, T, all_logits, predict)
        p.prediction = Prediction(1e-9, {"hub": 1e-9}, [])
        return p

    monkeypatch.setattr(Model, "plan", tiny_prediction)
    assert main(["plan", "-m", str(tiny), "--split", "none", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured:" in out and "off by more than 20%" in out
    assert main(["plan", "-m", str(tiny), "--split", "none", "-t", "1", "--no-measure"]) == 0
    assert "measured:" not in capsys.readouterr().out


# ---- runs -----------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    c = capsys.readouterr()
    return rc, c.out, c.err


def counts(err: str) -> tuple[int, int]:
    line = next(ln for ln in err.splitlines() if ln.startswith("prompt: "))
    p = line.split("prompt: ")[1].split(" tokens")[0]
    g = line.split("generation: ")[1].split(" tokens")[0]
    return int(p), int(g)


def test_n_minus_one_runs_to_a_full_context_and_says_so(tiny: Path, capsys) -> None:
    """-n -1: until the end of generation or the context; this random model never ends, so it
    fills the context (-c 24) and says so, naming -c; a prompt over the context is refused
    naming -c, not the API's n_ctx alone."""
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-p", "a b c", "--no-chat", "-n", "-1", "-c", "24",
                           "--split", "none")
    assert rc == 0
    p, g = counts(err)
    assert p + g == 24 and g > 0
    assert "the context is full (24 tokens)" in err and "-c" in err
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-p", "a b c", "--no-chat", "-n", "3", "-c", "24",
                           "--split", "none")
    assert rc == 0 and counts(err) == (p, 3) and "context is full" not in err
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-p", "a " * 40, "--no-chat", "-c", "16",
                           "--split", "none")
    assert rc != 0 and "-c (command line)" in err and "Traceback" not in err


def test_chat_is_on_exactly_when_the_file_has_a_template(tiny: Path, capsys, monkeypatch, tmp_path: Path) -> None:
    """The synthetic file has a (ChatML) template: the default wraps the prompt (more tokens than
    --no-chat, as many as --chat); -f reads the same prompt; without a template the default is
    the raw text."""
    base = ["run", "-m", str(tiny), "-n", "2", "-c", "64", "--split", "none"]
    (tmp_path / "p.txt").write_text("hello there")
    _, out_d, err_d = run_cli(capsys, *base, "-p", "hello there")
    _, out_c, err_c = run_cli(capsys, *base, "-p", "hello there", "--chat")
    _, out_r, err_r = run_cli(capsys, *base, "-p", "hello there", "--no-chat")
    _, out_f, err_f = run_cli(capsys, *base, "-f", str(tmp_path / "p.txt"))
    assert counts(err_d)[0] == counts(err_c)[0] == counts(err_f)[0] > counts(err_r)[0]
    assert out_d == out_c == out_f and out_r.startswith("hello there")
    from vkxsplit.tokenizer import Tokenizer

    orig = Tokenizer.from_model_file.__func__  # type: ignore[attr-defined]

    def no_template(cls: type, mf: Any) -> Tokenizer:
        t = orig(cls, mf)
        t.chat_template = None
        return t

    monkeypatch.setattr(Tokenizer, "from_model_file", classmethod(no_template))
    _, out_n, err_n = run_cli(capsys, *base, "-p", "hello there")
    assert counts(err_n)[0] == counts(err_r)[0] and out_n == out_r
    rc, _, err = run_cli(capsys, *base, "-p", "x", "-f", str(tmp_path / "p.txt"))
    assert rc != 0 and "-p and -f" in err
    rc, _, err = run_cli(capsys, *base, "-f", str(tmp_path / "missing.txt"))
    assert rc != 0 and "-f" in err and "cannot read" in err


def test_empty_answer_is_explained() -> None:
    from vkxsplit.runner import _end_message

    m = SimpleNamespace(timings={"stop": "eos", "gen_tokens": 0}, n_ctx=64)
    raw = _end_message(m, None, chat=False)
    assert raw is not None and "ended its answer at once" in raw and "--no-chat" in raw
    assert "--no-chat" not in (_end_message(m, None, chat=True) or "")
    m.timings = {"stop": "eos", "gen_tokens": 3}
    assert _end_message(m, None, chat=False) is None


def test_conversation_keeps_the_history(tiny: Path, capsys, monkeypatch) -> None:
    """-cnv: a line in, an answer out; the second turn's prompt holds the first turn (more
    tokens than the second line alone); /exit ends."""
    import io

    from vkxsplit import runner

    seen: list[int] = []
    real = runner._stream_answer

    def spy(model: Any, ids: list[int], *a: Any, **kw: Any) -> str:
        seen.append(len(ids))
        return real(model, ids, *a, **kw)

    monkeypatch.setattr(runner, "_stream_answer", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nhello\n/exit\nnever read\n"))
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-cnv", "-n", "3", "-c", "128", "--split", "none")
    assert rc == 0 and len(seen) == 2 and seen[1] > 2 * seen[0] - 4


def test_ngl_is_accepted_and_explained(tiny: Path, capsys) -> None:
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-p", "a", "--no-chat", "-n", "1", "-c", "16",
                           "--split", "none", "-ngl", "0")
    assert rc == 0 and "holds all 2 layers" in err
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-p", "a", "--no-chat", "-n", "1", "-c", "16",
                           "--split", "none", "-ngl", "99")
    assert rc == 0 and "holds all" not in err


def test_run_trace(tiny: Path, capsys, tmp_path: Path) -> None:
    rc, out, err = run_cli(capsys, "run", "-m", str(tiny), "-p", "a", "--no-chat", "-n", "2", "-c", "16",
                           "--split", "none", "--trace", str(tmp_path / "t.json"))
    assert rc == 0 and json.loads((tmp_path / "t.json").read_text())["traceEvents"]


# ---- bench: llama-bench's table and formats ----------------------------------------------------


def test_bench_as_llama_bench(tiny: Path, capsys, tmp_path: Path) -> None:
    from vkxsplit.bench import BENCH_FIELDS, print_bench

    rc, out, err = run_cli(capsys, "bench", "-m", str(tiny), "-p", "8", "-n", "2", "-r", "2", "-c", "32",
                           "-ub", "8", "--split", "none", "-o", "json", "--trace", str(tmp_path / "b.json"))
    assert rc == 0
    rows = json.loads(out)
    assert [r["test"] for r in rows] == ["pp8", "tg2"]
    for r in rows:
        assert r["model"] == "llama 2M Q4_0" or r["model"].startswith("llama ") and r["model"].endswith(" Q4_0")
        assert len(r["samples_ts"]) == len(r["samples_ns"]) == 2 and all(x > 0 for x in r["samples_ts"])
        n = r["n_prompt"] or r["n_gen"]
        assert r["samples_ts"] == pytest.approx([n / (ns * 1e-9) for ns in r["samples_ns"]], rel=1e-6)
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2)
        assert r["split"] == "none" and r["backends"] == "vulkan" and r["model_n_params"] > 0
    assert json.loads((tmp_path / "b.json").read_text())["traceEvents"]
    import io

    md = io.StringIO()
    print_bench(rows, "md", out=md)
    lines = md.getvalue().splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(BENCH_FIELDS)
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == rows[0]["model"] and cells[1].endswith("MiB") and cells[2].endswith(" M")
    assert cells[5] == "pp8" and " ± " in cells[6]
    jl = io.StringIO()
    print_bench(rows, "jsonl", out=jl)
    assert [json.loads(x) for x in jl.getvalue().splitlines()] == rows
    cs = io.StringIO()
    print_bench(rows, "csv", out=cs)
    import csv

    got = list(csv.DictReader(io.StringIO(cs.getvalue())))
    assert [g["test"] for g in got] == ["pp8", "tg2"] and len(got[0]["samples_ts"].split()) == 2


def test_model_description() -> None:
    """llama-bench's `arch size-label type`: the file's general.size_label, else the count."""
    from conftest import smol_path

    from vkxsplit.bench import model_desc, size_label
    from vkxsplit.gguf_model import load_model as load_gguf

    assert [size_label(n) for n in (134_515_008, 1_235_814_400, 8_030_261_248, 360_000_000)] == \
        ["135M", "1.2B", "8B", "360M"]
    with load_gguf(smol_path()) as mf:
        d = model_desc(mf)
    assert d["model_type"] == "llama 135M Q4_1" and 130e6 < d["model_n_params"] < 140e6


# ---- progress ---------------------------------------------------------------------------------


def _on_pty(code: str, timeout: float = 240) -> str:
    """Run ``code`` in a Python child whose stderr (and stdout) is a pseudo-terminal; its output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                         cwd=ROOT, env=env)
    os.close(slave)
    chunks = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif p.poll() is not None:
            break
    p.wait(timeout=10)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def test_progress_bar_on_a_terminal_lines_elsewhere(capsys) -> None:
    out = _on_pty("import time\nfrom vkxsplit import progress\nprogress.enable()\n"
                  "with progress.task('working', 5, 'steps') as t:\n"
                  "    for i in range(5):\n        time.sleep(0.3); t.update(1)\n")
    assert "working" in out and "5/5" in out and "\r" in out and "%|" in out  # tqdm's bar, redrawn in place
    # not a terminal: quiet when short, one line per period when long, then a closing line
    import io

    from vkxsplit import progress

    buf = io.StringIO()
    progress.enable(buf)
    try:
        with progress.task("short", 3) as t:
            t.update(3)
        assert buf.getvalue() == ""
        old = progress.DELAY_S, progress.PERIOD_S
        progress.DELAY_S, progress.PERIOD_S = 0.0, 0.0
        try:
            with progress.task("long", 2, "steps") as t:
                t.update(1, "first")
                t.update(1)
        finally:
            progress.DELAY_S, progress.PERIOD_S = old
        lines = buf.getvalue().splitlines()
        assert lines[0].startswith("long: 1/2 steps, first (") and lines[-1].startswith("long: done in")
    finally:
        progress.disable()


def test_loading_and_calibration_show_progress_on_a_terminal(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    """`vkxsplit plan --split auto` on a pseudo-terminal: a bar while loading and while the
    planner measures what the device profile lacks (its first run on this device)."""
    code = ("import sys; from vkxsplit.cli import main; "
            f"sys.exit(main(['plan', '-m', {str(tiny)!r}, '--split', 'auto', '--backends', 'cpu', '-t', '4', "
            "'-c', '32']))")
    monkeypatch.setenv("VKXSPLIT_CACHE_DIR", str(tmp_path))  # an empty profile: everything is measured
    out = _on_pty(code)
    assert "loading" in out and "calibrating for T=4" in out and "measurements" in out, out[-3000:]
    assert "predicted:" in out


def test_calibration_is_not_counted_in_the_rates(tiny: Path, tmp_path: Path) -> None:
    """With --split auto the first step of each size measures costs first; generate_ids does
    that before its clocks start (setup_s), so the prompt rate is the prefill's alone."""
    from vkxsplit.model import load_model

    with load_model(tiny, split="auto", backends="cpu", n_ctx=32, ubatch=8, profile_dir=tmp_path) as m:
        list(m.generate_ids(list(range(5, 11)), 2, stop_ids=set()))
        t = m.timings
        assert m.cost.measured > 0  # it did measure
        assert t["setup_s"] > t["prompt_s"] and t["gen_tokens"] == 2
        n_execs = len(m._execs)
        list(m.generate_ids(list(range(5, 11)), 2, stop_ids=set()))
        assert m.timings["setup_s"] < t["setup_s"] and len(m._execs) == n_execs
