"""The split planner without a device: spec grammar, plan-time errors, row ranges, layer blocks,
mode ranges, the schedule's invariants, auto on an injected cost model, the device profile."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vkxsplit.backend import Capabilities
from vkxsplit.errors import PlanError
from vkxsplit.features import kernel_config_ident
from vkxsplit.graph import Graph, Tensor, span
from vkxsplit.plan.cost import CostModel, simulate
from vkxsplit.plan.planner import Planner
from vkxsplit.plan.profile import Profile
from vkxsplit.plan.result import Part
from vkxsplit.plan.schedule import BackendOp, HubOp, build_schedule
from vkxsplit.plan.spec import HUB, parse_backends, parse_spec, parse_specs
from vkxsplit.plan.workspace import Workspace

CPU_CAPS = dict(ops={"mul_mat"}, weight_types={"f32", "f16", "bf16", "q4_0", "q8_0"},
                compute_dtypes={"f32", "bf16", "f16"})
NPU_CAPS = dict(ops={"mul_mat"}, weight_types={"bf16"}, compute_dtypes={"bf16"}, min_batch=8, max_kernels=6)


class Fake:
    """A stand-in backend: just a name and capabilities (dry planning)."""

    def __init__(self, name: str, **caps):
        self.name = name
        self.caps = Capabilities(**caps)


def cpu():
    return Fake("cpu", **CPU_CAPS)


def npu(**kw):
    return Fake("npu-emu", **{**NPU_CAPS, **kw})


def mini_graph(T: int, n_layer: int = 2, wtype: str = "q4_0", E: int = 64, F: int = 128, V: int = 96) -> Graph:
    """A llama-shaped graph without memory (node names as the model runner makes them)."""
    g = Graph(f"mini:T{T}", T=T)

    def a(name, cols, rows=T):
        return Tensor(name, (rows, cols), "f32")

    def w(name, rows, cols, dt=wtype):
        return Tensor(name, (rows, cols), dt, weight=True)

    ids = Tensor("ids", (T,), "i32")
    pos = Tensor("positions", (T,), "i32")
    x = g.add("get_rows", "embd", [w("token_embd.weight", V, E), ids], a("x", E))
    for il in range(n_layer):
        p = f"blk.{il}."
        h = g.add("rms_norm", p + "attn_norm", [x, Tensor(p + "attn_norm.weight", (E,), "f32", weight=True)],
                  a("h", E), eps=1e-5)
        q = g.add("mul_mat", p + "attn_q", [w(p + "attn_q.weight", E, E), h], a("q", E))
        k = g.add("mul_mat", p + "attn_k", [w(p + "attn_k.weight", E // 2, E), h], a("k", E // 2))
        v = g.add("mul_mat", p + "attn_v", [w(p + "attn_v.weight", E // 2, E), h], a("v", E // 2))
        g.add("rope", p + "rope_q", [q, pos], q)
        g.add("rope", p + "rope_k", [k, pos], k)
        ck = Tensor(f"cache_k.{il}", (32, E // 2), "f16")
        g.add("kv_store", p + "kv_store", [k, v, pos], ck, cache_v=Tensor(f"cache_v.{il}", (32, E // 2), "f16"))
        at = g.add("attention", p + "attn", [q, ck, ck, pos], a("attn", E))
        o = g.add("mul_mat", p + "attn_output", [w(p + "attn_output.weight", E, E), at], a("o", E))
        g.add("add", p + "attn_residual", [x, o], x)
        h = g.add("rms_norm", p + "ffn_norm", [x, Tensor(p + "ffn_norm.weight", (E,), "f32", weight=True)],
                  a("h", E), eps=1e-5)
        gt = g.add("mul_mat", p + "ffn_gate", [w(p + "ffn_gate.weight", F, E), h], a("gate", F))
        up = g.add("mul_mat", p + "ffn_up", [w(p + "ffn_up.weight", F, E), h], a("up", F))
        g.add("swiglu", p + "ffn_swiglu", [gt, up], gt)
        o = g.add("mul_mat", p + "ffn_down", [w(p + "ffn_down.weight", E, F), gt], a("o", E))
        g.add("add", p + "ffn_residual", [x, o], x)
    hl = g.add("rms_norm", "output_norm", [a("x_out", E, 1), Tensor("output_norm.weight", (E,), "f32", weight=True)],
               a("h_out", E, 1), eps=1e-5)
    lg = g.add("mul_mat", "output", [w("token_embd.weight", V, E), hl], a("logits", V, 1))
    g.add("argmax", "argmax", [lg], Tensor("argmax", (1,), "i32"))
    return g


def planner(*backends, cost=None):
    return Planner(backends, cost=cost, require_shared=False)


# ---------------------------------------------------------------------------------------------
# grammar


def test_parse_valid_specs():
    assert parse_spec(None).kind == parse_spec("none").kind == parse_spec("").kind == "none"
    s = parse_spec(r"layer:blk\..*\.ffn_.*=npu-emu,output=cpu")
    assert s.kind == "layer" and [(o.pattern, o.backend) for o in s.overrides] == [
        (r"blk\..*\.ffn_.*", "npu-emu"), ("output", "cpu")]
    s = parse_spec(r"layer:3,1,blk\.(0|1)\.ffn_.{1,4}=cpu")  # commas inside braces stay in the regex
    assert s.ratios == ((None, 3.0), (None, 1.0)) and s.overrides[0].pattern == r"blk\.(0|1)\.ffn_.{1,4}"
    s = parse_spec(r"layer:a\,b=cpu")  # an escaped comma is a literal one
    assert s.overrides[0].pattern == "a,b"
    s = parse_spec("layer:hub=2,cpu=1")
    assert s.ratios == (("hub", 2.0), ("cpu", 1.0)) and not s.overrides
    s = parse_spec("tensor:3,1")
    assert s.kind == "tensor" and s.ratios == ((None, 3.0), (None, 1.0)) and s.filter is None
    s = parse_spec(r"tensor:cpu=1,hub=0.5@ffn_(gate|up)")
    assert s.ratios == (("cpu", 1.0), ("hub", 0.5)) and s.filter == "ffn_(gate|up)"
    s = parse_spec(r"mode:cuda>=32,cpu<8@blk\.0\.")
    assert [(r.backend, r.lo, r.hi, r.filter) for r in s.rules] == [("cuda", 32, None, None),
                                                                   ("cpu", None, 7, r"blk\.0\.")]
    s = parse_spec("mode:npu-emu>8<=64,cpu=1,x")
    assert [(r.backend, r.lo, r.hi) for r in s.rules] == [("npu-emu", 9, 64), ("cpu", 1, 1), ("x", None, None)]
    assert parse_spec("auto").kind == "auto"
    assert [p.kind for p in parse_specs("none;tensor:1,1;mode:cpu>=8")] == ["none", "tensor", "mode"]
    assert str(parse_spec("tensor:3,1")) == "tensor:3,1"


@pytest.mark.parametrize("spec, match", [
    ("split:1", "unknown split mode 'split'"),
    ("tensor", "gives no ratios"),
    ("tensor:3,x", "'x' is not a number"),
    ("tensor:3,-1", "must be a finite number >= 0"),
    ("tensor:1,cpu=1", "mixes positional and named"),
    ("tensor:cpu=1,cpu=2", "given twice"),
    ("tensor:1,1@(", "bad regex"),
    ("layer:foo", "neither a ratio nor REGEX=BACKEND"),
    ("layer:([=cpu", "bad regex"),
    ("mode", "gives no rules"),
    ("mode:cpu>=0", "nonsensical"),
    ("mode:cpu>=64<8", "nonsensical: lower bound 64 is above upper bound 7"),
    ("mode:cpu>=abc", "not a positive integer"),
    ("mode:cpu>=8>=9", "two lower bounds"),
    ("mode:cpu<1", "selects no batch size"),
    ("mode:cpu>=8 junk", "cannot read the batch condition"),
    ("mode:cpu~8", "not a backend name"),
    ("auto:fast", "takes no arguments"),
    ("none:1", "takes no arguments"),
])
def test_parse_errors_name_the_problem(spec, match):
    with pytest.raises(PlanError, match=match):
        parse_spec(spec)


def test_parse_backends():
    assert parse_backends("cpu, npu-emu:min_batch=1:gflops=50.5") == [
        ("cpu", {}), ("npu-emu", {"min_batch": 1, "gflops": 50.5})]
    assert parse_backends(None) == [] and parse_backends("") == []
    with pytest.raises(Exception, match="twice"):
        parse_backends("cpu,cpu")


# ---------------------------------------------------------------------------------------------
# plan-time errors


@pytest.mark.parametrize("spec, match", [
    (r"layer:blk\.0\..*=cuda", "unknown backend 'cuda'.*attached: hub, cpu, npu-emu"),
    ("mode:tpu>=8", "unknown backend 'tpu'"),
    ("tensor:gpu=1", "unknown backend 'gpu'"),
    ("tensor:3,1", "gives 2 ratios for 3 participants"),
    ("tensor:0,0,0", "every ratio is 0"),
    ("mode:hub>=8", "names the hub"),
    ("mode:cpu>=8,cpu<4", "two rules for cpu"),
    ("mode:cpu>=8,npu-emu>=16", "overlap at T=16"),
    ("mode:cpu,npu-emu", "overlap"),  # both default ranges start at their min_batch
])
def test_name_level_errors(spec, match):
    with pytest.raises(PlanError, match=match):
        planner(cpu(), npu()).check(spec)


def test_max_batch_ranges_are_checked():
    small = Fake("small", **{**CPU_CAPS, "max_batch": 64})
    with pytest.raises(PlanError, match="beyond its max_batch 64"):
        planner(small).check("mode:small>=8<=128")
    with pytest.raises(PlanError, match="nonsensical"):
        planner(small).check("mode:small>=100")
    planner(small).check("mode:small>=8")  # the upper bound defaults to max_batch


def test_graph_level_errors():
    g = mini_graph(16)
    p = planner(cpu(), npu())
    with pytest.raises(PlanError, match=r"override 'blk\\.9\\.=cpu' matches no node or tensor"):
        p.plan(g, r"layer:blk\.9\.=cpu")
    with pytest.raises(PlanError, match="npu-emu computes only in bf16 .*f32-only ops .*rms_norm"):
        p.plan(g, r"layer:blk\.0\.ffn_norm=npu-emu")
    with pytest.raises(PlanError, match="cpu does not run add"):
        p.plan(g, r"layer:attn_residual=cpu")
    with pytest.raises(PlanError, match="regex 'nothing' matches no node"):
        p.plan(g, "tensor:1,1,0@nothing")
    with pytest.raises(PlanError, match="matches only rms_norm.*divides mul_mat"):
        p.plan(g, "tensor:1,1,0@attn_norm")
    with pytest.raises(PlanError, match="holds at most 6 resident kernels"):
        p.plan(g, "tensor:1,0,1")  # a slice of all 15 matrices on the 6-kernel npu
    with pytest.raises(PlanError, match="regex 'zzz' matches no node"):
        p.plan(g, "mode:cpu<8,npu-emu>=8@zzz")
    q8 = Fake("q8only", ops={"mul_mat"}, weight_types={"q8_0"})  # reads q8_0 only: cannot take q4_0
    with pytest.raises(PlanError, match="q8only has ratio 1 but cannot run blk.0.attn_q.*reads q8_0"):
        planner(q8).plan(g, "tensor:1,1")
    with pytest.raises(PlanError, match="cannot run it"):
        planner(q8).plan(g, r"layer:attn_q=q8only")
    planner(q8).plan(g, "tensor:1,0")  # ratio 0: nothing asked of it


# ---------------------------------------------------------------------------------------------
# assignments


def test_tensor_rows_and_ratio_edge_cases():
    g = mini_graph(16)
    p = planner(cpu(), npu())
    assert p.bounds(576, [3, 1]) == [(0, 432), (432, 576)]
    assert p.bounds(100, [1, 1]) == [(0, 48), (48, 100)]
    assert p.bounds(64, [0, 1]) == [(0, 0), (0, 64)]
    assert p.bounds(64, [1, 0]) == [(0, 64), (64, 64)]
    assert p.bounds(64, [1, 0, 1]) == [(0, 32), (32, 32), (32, 64)]
    assert p.bounds(64, [0, 0, 1]) == [(0, 0), (0, 0), (0, 64)]
    plan = p.plan(g, r"tensor:3,1,0")
    q = g.node("blk.0.attn_q")
    assert plan.parts(q) == [Part(HUB, 0, 48), Part("cpu", 48, 64)]
    assert plan.runs_on("blk.0.attn_norm") == [HUB]
    assert all(op.backend == "cpu" for op in plan.items if isinstance(op, BackendOp))  # npu ratio 0: nothing
    one = p.plan(g, "tensor:0,1,0")  # ratio 1 on cpu, 0 elsewhere: every mul_mat whole on the cpu
    assert all(one.parts(n) == [Part("cpu", 0, n.inputs[0].shape[0])] for n in g.mul_mats())
    assert not any(isinstance(i, HubOp) and i.kind == "rows" for i in one.items)
    hub = p.plan(g, "tensor:1,0,0")  # hub only: no job, one submit
    assert hub.schedule.jobs == [] and hub.schedule.submits == 1
    f = p.plan(g, r"tensor:hub=2,cpu=1,npu-emu=1@blk\.1\.ffn_(gate|up)")
    gate = g.node("blk.1.ffn_gate")
    assert f.parts(gate) == [Part(HUB, 0, 64), Part("cpu", 64, 96), Part("npu-emu", 96, 128)]
    assert f.runs_on("blk.0.ffn_gate") == [HUB]
    conv = f.conversions()
    assert conv["once"] == ["blk.1.ffn_gate.weight[96:128]@bf16 (npu-emu)", "blk.1.ffn_up.weight[96:128]@bf16 (npu-emu)"]
    assert conv["per_step"] == ["h f32->bf16 (16x64)"]  # once for gate and up: h is not rewritten between


def test_layer_blocks_overrides_and_capability():
    g = mini_graph(16, n_layer=4)
    p = planner(cpu(), npu())
    plan = p.plan(g, "layer:1,1,0")
    for n in g.mul_mats():
        want = [] if n.layer is None else [HUB] if n.layer < 2 else ["cpu"]
        assert plan.runs_on(n) == (want or [HUB])
    plan = p.plan(g, r"layer:blk\.1\.ffn_.*=npu-emu,blk\.1\..*=cpu,^output$=cpu")
    assert plan.runs_on("blk.1.ffn_up") == ["npu-emu"]       # first match wins
    assert plan.runs_on("blk.1.attn_q") == ["cpu"] and plan.runs_on("output") == ["cpu"]
    assert plan.runs_on("blk.0.attn_q") == [HUB]             # overrides only: the rest stays on the hub
    assert plan.runs_on("blk.1.ffn_norm") == [HUB] and any("other than mul_mat" in n for n in plan.notes)
    small = p.plan(mini_graph(1, n_layer=4), r"layer:blk\.1\.ffn_.*=npu-emu")  # T=1 < npu min_batch 8
    assert small.schedule.jobs == [] and any("min_batch 8" in n for n in small.notes)


def test_mode_picks_by_batch_size():
    p = planner(cpu(), npu())
    spec = r"mode:cpu<8,npu-emu>=8@blk\.0\.ffn_"
    dec, pre = p.plan(mini_graph(1), spec), p.plan(mini_graph(16), spec)
    assert {j.op.backend for j in dec.schedule.jobs} == {"cpu"} and len(dec.schedule.jobs) == 15
    assert {j.op.backend for j in pre.schedule.jobs} == {"npu-emu"} and len(pre.schedule.jobs) == 3
    none = p.plan(mini_graph(4), "mode:npu-emu>=8")
    assert none.schedule.jobs == [] and "no rule takes this batch size" in none.notes[0]


class GlueFake(Fake):
    """A backend that also runs the glue ops (NODE_OPS through ``run_op``), like cpu and cuda."""

    @classmethod
    def implements(cls, hook: str) -> bool:
        return hook == "run_op"


def decode_q8_graph(n_layer: int = 2) -> Graph:
    """mini_graph(1) with the decode q8_1 x as archs.DecodeQ8 builds it: each norm / SwiGLU also
    writes the q8_1 x of the mat-vecs after it (param ``xq``), attention's output gets a
    ``quantize_q8_1`` node, and every mat-vec reads its x's q8_1 (``xq``, ``vecq``)."""
    g = mini_graph(1, n_layer)
    xq_of: dict[int, Tensor] = {}  # id(f32 x tensor) -> its current q8_1 x
    nodes = list(g.nodes)
    g.nodes.clear()
    for n in nodes:
        x = n.inputs[1] if n.op == "mul_mat" else None
        if x is not None and id(x) not in xq_of:
            q = Tensor(f"xq:{x.name}.{len(g.nodes)}", (1, 40), "q8_1")
            g.add("quantize_q8_1", f"quantize.{len(g.nodes)}", [x], q)
            xq_of[id(x)] = q
        n.index = len(g.nodes)
        g.nodes.append(n)
        if n.op in ("rms_norm", "swiglu"):
            n.params["xq"] = xq_of[id(n.output)] = Tensor(f"xq:{n.name}", (1, 40), "q8_1")
        elif n.op == "mul_mat":
            n.params.update(xq=xq_of[id(x)], vecq="q4_0")
        else:
            for t in n.writes():
                xq_of.pop(id(t), None)
    return g


def test_decode_glue_and_q8_1_follow_the_mat_vecs():
    """mode:cpu at T = 1 with a backend running the glue: when every mat-vec is on the cpu, the
    norms / SwiGLU that also write q8_1 x go there too and the quantize_q8_1 nodes are not run
    (one hub segment per layer: attention, RoPE and the KV store); the rule of before (those
    glue nodes and quantizations pinned to the hub) costs ~3 more segments per layer. With one
    mat-vec on the hub, the node writing its q8_1 x (and only that one) stays on the hub."""
    from vkxsplit.plan import lowering, strategies
    from vkxsplit.plan.lowering import hub_xq_reads, lower
    from vkxsplit.plan.strategies import add_glue

    cpu_ = GlueFake("cpu", **{**CPU_CAPS, "ops": {"mul_mat", "rms_norm", "add_rms_norm", "swiglu", "add"}})
    g = decode_q8_graph()
    writers = [n for n in g.nodes if "xq" in n.params and n.op != "mul_mat"]
    quant = [n for n in g.nodes if n.op == "quantize_q8_1"]
    assert len(writers) == 7 and len(quant) == 2  # per layer 2 norms + SwiGLU, output_norm; attn outputs
    plan = planner(cpu_).plan(g, "mode:cpu")
    assert all(plan.runs_on(n) == ["cpu"] for n in writers + g.mul_mats())
    hub_ops = [it.node.op for it in plan.items if isinstance(it, HubOp)]
    assert "quantize_q8_1" not in hub_ops and not {"rms_norm", "swiglu", "add"} & set(hub_ops)
    assert plan.schedule.submits == g.n_layer + 2 and any("quantize_q8_1" in n for n in plan.notes)
    # the old rule (every q8_1 x counted as read on the hub): many more crossings
    try:  # (read by the lowering and by the glue's placement)
        lowering.hub_xq_reads = strategies.hub_xq_reads = \
            lambda g_, a_: {id(n.params["xq"]) for n in g_.nodes if "xq" in n.params}
        before = planner(cpu_).plan(g, "mode:cpu")
    finally:
        lowering.hub_xq_reads = strategies.hub_xq_reads = hub_xq_reads
    assert before.schedule.submits >= plan.schedule.submits + 2 * g.n_layer
    assert all(before.runs_on(n) == ["hub"] for n in writers)
    # one mat-vec on the hub: the norm writing its x stays, the others move
    keep = g.node("blk.1.attn_k")
    assign = {n.index: [Part("cpu", 0, n.inputs[0].shape[0])] for n in g.mul_mats() if n is not keep}
    p = planner(cpu_)
    add_glue(p, g, assign, "cpu")
    assert hub_xq_reads(g, assign) == {id(keep.params["xq"])}
    assert [n.name for n in writers if n.index not in assign] == ["blk.1.attn_norm"]
    lowered = {it.node.name for it in lower(p, g, assign, Workspace()) if isinstance(it, HubOp)}
    assert "blk.1.attn_norm" in lowered and not any(n.name in lowered for n in quant)
    # a hub mat-vec reading the quantized attention output keeps its quantize node
    keep2 = g.node("blk.0.attn_output")
    assign = {n.index: [Part("cpu", 0, n.inputs[0].shape[0])] for n in g.mul_mats() if n is not keep2}
    lowered = {it.node.name for it in lower(p, g, assign, Workspace()) if isinstance(it, HubOp)}
    assert [n.name for n in quant if n.name in lowered] == [quant[0].name]


def test_schedule_invariants():
    g = mini_graph(16)
    plan = planner(cpu(), npu()).plan(g, r"tensor:2,1,1@blk\.0\.(attn_q|ffn_up)")
    sch = plan.schedule
    assert sch.order[0] == ("seg", 0)
    seen_seg: set[int] = set()
    seen_job: set[int] = set()
    for kind, i in sch.order:
        if kind == "seg":
            assert set(sch.segments[i].waits) <= seen_job  # waits for jobs already handed out
            seen_seg.add(i)
        else:
            assert sch.jobs[i].wait in seen_seg  # a job waits for a submitted segment
            seen_job.add(i)
    # the hub's rows of a split mul_mat are not held back by the backends' rows of it
    q = g.node("blk.0.attn_q")
    rows = next(op for s in sch.segments for op in s.ops if op.kind == "rows" and op.node is q)
    seg = next(s for s in sch.segments if rows in s.ops)
    assert not any(sch.jobs[j].op.node is q for j in seg.waits)
    # and the consumer of y waits for them
    rope = next(s for s in sch.segments if any(op.name == "blk.0.rope_q" for op in s.ops))
    waited = {sch.jobs[j].op.backend for s in sch.segments[:rope.index + 1] for j in s.waits}
    assert waited == {"cpu", "npu-emu"}


def test_schedule_orders_backend_effects():
    """A job reading what another backend's job wrote waits (through the hub) for it, also
    when a hub segment already waited for the writer earlier."""
    E = 8
    x, y, z = (Tensor(n, (1, E), "f32") for n in "xyz")
    w1, w2 = (Tensor(f"w{i}", (E, E), "f32", weight=True) for i in (1, 2))
    g = Graph("chain", T=1)
    g.add("add", "a0", [x, x], x)
    g.add("mul_mat", "m1", [w1, x], y)
    g.add("mul_mat", "m2", [w2, y], z)
    p = planner(cpu(), Fake("other", **CPU_CAPS))
    plan = p.plan(g, "layer:m1=cpu,m2=other")
    sch = plan.schedule
    j1, j2 = sch.jobs
    assert j2.wait > j1.wait and j1.index in sch.segments[j2.wait].waits  # joined through the hub
    assert sch.trailing == [j2.index]


def test_auto_on_an_injected_cost_model():
    g = mini_graph(16)
    prof = Profile()
    for n in g.nodes:
        prof.put("hub", "node|" + n.signature(), 1e-3 if n.op == "mul_mat" else 1e-5)
    prof.put("hub", "submit", 1e-6)
    prof.put("hub", "convert", [1e-6, 0.0])
    ws = Workspace()
    fast = cpu()
    slow_npu = npu()
    cm = CostModel(prof, backends=[fast, slow_npu])
    for n in g.mul_mats():
        w, x = n.inputs
        for b, wt, t in ((fast, w.dtype, 1e-4), (slow_npu, "bf16", 1e-2)):
            prof.put(cm.scope(b.name), cm.job_key(wt, w.shape[0], w.shape[-1], x.rows), t)
    for name in ("cpu", "npu-emu"):
        prof.put(cm.scope(name), "latency", 1e-5)
        prof.put(cm.scope(name), "enqueue", 1e-6)
    p = Planner([fast, slow_npu], cost=cm, workspace=ws, require_shared=False)
    plan = p.plan(g, "auto")
    assert plan.family in ("mode", "layer") and all(plan.runs_on(n) == ["cpu"] for n in g.mul_mats())
    assert plan.prediction is not None and plan.prediction.estimated == []
    cands = dict(plan.candidates)
    assert cands["none"] > plan.prediction.total_s == min(cands.values())
    # now the npu is the fast one, but it holds 6 kernels: it gets the 6 ops that save most
    # (the big ffn matrices), the others stay where they are cheapest
    for n in g.mul_mats():
        w, x = n.inputs
        big = "ffn" in n.name
        prof.put(cm.scope("npu-emu"), cm.job_key("bf16", w.shape[0], w.shape[-1], x.rows), 1e-6 if big else 5e-5)
    plan = Planner([fast, slow_npu], cost=cm, workspace=Workspace(), require_shared=False).plan(g, "auto")
    on_npu = sorted(n.name for n in g.mul_mats() if plan.runs_on(n) == ["npu-emu"])
    assert on_npu == sorted(f"blk.{i}.ffn_{m}" for i in (0, 1) for m in ("gate", "up", "down"))
    # a simulated schedule is consistent with the plan's prediction
    assert simulate(plan.schedule, cm).total_s == pytest.approx(plan.prediction.total_s)


def test_auto_needs_a_cost_model():
    with pytest.raises(PlanError, match="'auto' needs a cost model"):
        planner(cpu()).plan(mini_graph(4), "auto")


def test_spans_of_memoryless_tensors_are_their_names():
    a, b = Tensor("a", (2, 2), "f32"), Tensor("a", (4,), "f32")
    assert span(a) == span(b) != span(Tensor("b", (2, 2), "f32"))
    sch = build_schedule([HubOp("node", "n", [a], [a])])
    assert sch.submits == 1 and sch.jobs == []


# ---------------------------------------------------------------------------------------------
# the device profile


def fake_device(driver_version=1, disabled=frozenset()):
    return SimpleNamespace(name="fake gpu", disabled=frozenset(disabled),
                           physical=SimpleNamespace(device_uuid=bytes(range(16)), driver_version=driver_version))


def test_profile_is_keyed_by_device_uuid_and_driver(tmp_path):
    p = Profile.for_device(fake_device(), tmp_path)
    assert p.entries == {} and p.stale_reason is None
    p.put("hub", "submit", 1e-5)
    p.save()
    data = json.loads(p.path.read_text())
    assert data["device_uuid"] == bytes(range(16)).hex() and data["driver_version"] == 1
    again = Profile.for_device(fake_device(), tmp_path)
    assert again.get("hub", "submit") == 1e-5 and again.path == p.path
    new_driver = Profile.for_device(fake_device(driver_version=2), tmp_path)
    assert new_driver.path != p.path and new_driver.get("hub", "submit") is None  # measured again
    # a file whose content names another driver (copied over, renamed) is not trusted
    new_driver.path.write_text(p.path.read_text())
    stale = Profile.for_device(fake_device(driver_version=2), tmp_path)
    assert stale.get("hub", "submit") is None and "driver_version changed" in stale.stale_reason
    p.path.write_text("{broken")
    assert Profile.for_device(fake_device(), tmp_path).stale_reason.startswith("unreadable")


def test_profile_is_keyed_by_the_kernels(tmp_path, monkeypatch):
    """Other shipped SPIR-V (an upgrade, a rebuild) or a kill switch that changes which kernels
    run gives another profile: costs measured with the old kernels are not reused; the same
    kernels and switches find the saved one again."""
    from vkxsplit import shaders

    p = Profile.for_device(fake_device(), tmp_path)
    p.put("hub", "submit", 2e-5)
    p.save()
    assert json.loads(p.path.read_text())["kernels"] == kernel_config_ident(fake_device())
    assert Profile.for_device(fake_device(), tmp_path).get("hub", "submit") == 2e-5
    switched = Profile.for_device(fake_device(disabled={"coopmat2"}), tmp_path)
    assert switched.path != p.path and switched.get("hub", "submit") is None
    real = shaders.shipped()
    name = next(iter(real))
    changed = {**real, name: {**real[name], "spv_sha256": "0" * 64}}
    monkeypatch.setattr(shaders, "shipped", lambda: changed)
    rebuilt = Profile.for_device(fake_device(), tmp_path)
    assert rebuilt.path != p.path and rebuilt.get("hub", "submit") is None
    # a file carrying other kernels under this name (copied over) is not trusted either
    rebuilt.path.write_text(p.path.read_text())
    stale = Profile.for_device(fake_device(), tmp_path)
    assert stale.get("hub", "submit") is None and "kernels changed" in stale.stale_reason


def test_prediction_counts_the_hosts_enqueue_time():
    """A step is enqueued by one host thread: jobs that each take the host 10 ms to enqueue
    cannot finish sooner than 10 ms apiece, however fast the backend computes."""
    g = mini_graph(16)
    prof = Profile()
    for n in g.nodes:
        prof.put("hub", "node|" + n.signature(), 1e-5)
    prof.put("hub", "submit", 1e-6)
    prof.put("hub", "convert", [1e-6, 0.0])
    fast = cpu()
    cm = CostModel(prof, backends=[fast])
    for n in g.mul_mats():
        w, x = n.inputs
        prof.put(cm.scope("cpu"), cm.job_key(w.dtype, w.shape[0], w.shape[-1], x.rows), 1e-6)
    prof.put(cm.scope("cpu"), "latency", 1e-6)
    prof.put(cm.scope("cpu"), "enqueue", 1e-6)
    plan = Planner([fast], cost=cm, workspace=Workspace(), require_shared=False).plan(g, "mode:cpu>=1")
    jobs = len(plan.schedule.jobs)
    assert jobs >= 2
    quick = simulate(plan.schedule, cm).total_s
    prof.put(cm.scope("cpu"), "enqueue", 1e-2)
    slow = simulate(plan.schedule, cm).total_s
    assert slow >= jobs * 1e-2 > quick


def test_a_backends_own_clock_is_its_job_cost(device, monkeypatch):
    """A backend with time_job (CUDA events on the H200) is costed by it, not by host timing of
    queued jobs (which carried host round trips and made CUDA jobs look 10x slower)."""
    from vkxsplit.attach import SharedArena
    from vkxsplit.backend import create_backend
    from vkxsplit.calibrate import MeasuringCostModel

    b = create_backend("cpu", device)
    calls = []

    def time_job(job, reps):
        calls.append((job.N, job.K, job.M, reps))
        return 4.25e-3

    monkeypatch.setattr(b, "time_job", time_job)
    monkeypatch.setattr(type(b), "implements", classmethod(lambda cls, hook: hook == "time_job"))
    arena = SharedArena(device, [b])
    try:
        cm = MeasuringCostModel(Profile(), device=device, arena=arena, backends=[b], reps=2)
        cm._measure_job("cpu", "f32", 48, 64, 3)
        assert calls == [(48, 64, 3, 2)]
        assert cm.job("cpu", "f32", 48, 64, 3) == 4.25e-3 and cm.estimated == set()
    finally:
        arena.close()
        b.close()


#: who may import whom, lowest first: a module imports only its own layer or lower ones
LAYERS = {"vkxsplit.graph": 0, "vkxsplit.plan": 1, "vkxsplit.ops.nodes": 1, "vkxsplit.executor": 2,
          "vkxsplit.relay": 2, "vkxsplit.calibrate": 3, "vkxsplit.hubs": 3, "vkxsplit.generation": 4,
          "vkxsplit.placement": 4, "vkxsplit.model": 4}
#: the model's layer: the generation surface, then the placement over hubs, then the model
MODEL_ORDER = ["vkxsplit.generation", "vkxsplit.placement", "vkxsplit.model"]
#: inside vkxsplit.plan: each module imports only those before it
PLAN_ORDER = ["spec", "schedule", "workspace", "profile", "cost", "result", "participants", "lowering", "strategies",
              "hub_split", "planner", "__init__"]


def _layer(mod: str) -> int | None:
    hit = [k for k in LAYERS if mod == k or mod.startswith(k + ".")]
    return LAYERS[max(hit, key=len)] if hit else None


def _vkx_imports(path, me: str):
    """(module, line, under TYPE_CHECKING) of every vkxsplit import in ``path``, at any depth."""
    import ast

    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = []

    def walk(node, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            t = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                mods = [mod] if child.module else [f"{mod}.{a.name}" for a in child.names]
                out.extend((m, child.lineno, t) for m in mods if m.startswith("vkxsplit"))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, t) for a in child.names if a.name.startswith("vkxsplit"))
            walk(child, t)

    walk(ast.parse(path.read_text()), False)
    return out


def test_imports_go_one_way():
    """graph -> plan.* -> executor, relay -> calibrate, hubs -> generation -> placement -> model,
    never back, not even inside a function (no lazy import dodging a cycle); the executor takes
    only plan.schedule at run time; inside the plan package spec -> schedule -> workspace ->
    profile -> cost -> result -> participants -> lowering -> strategies -> hub_split -> planner."""
    from pathlib import Path

    import vkxsplit

    root = Path(vkxsplit.__file__).parent
    files = {f"vkxsplit.plan.{p.stem}" if p.stem != "__init__" else "vkxsplit.plan": p
             for p in (root / "plan").glob("*.py")}
    files.update({"vkxsplit.ops.nodes": root / "ops" / "nodes.py", "vkxsplit.executor": root / "executor.py",
                  "vkxsplit.calibrate": root / "calibrate.py", "vkxsplit.model": root / "model.py",
                  "vkxsplit.relay": root / "relay.py", "vkxsplit.hubs": root / "hubs.py",
                  "vkxsplit.generation": root / "generation.py", "vkxsplit.placement": root / "placement.py"})
    assert len(files) >= 17
    wrong = []
    for me, path in files.items():
        for mod, line, typing_only in _vkx_imports(path, me):
            up = _layer(mod) is not None and _layer(mod) > _layer(me)
            if me.startswith("vkxsplit.plan.") and mod.startswith("vkxsplit.plan."):
                a, b = me.rsplit(".", 1)[1], mod.rsplit(".", 1)[1]
                up = up or PLAN_ORDER.index(b) >= PLAN_ORDER.index(a)
            if me in MODEL_ORDER and mod in MODEL_ORDER:
                up = up or MODEL_ORDER.index(mod) >= MODEL_ORDER.index(me)
            if me == "vkxsplit.executor" and mod.startswith("vkxsplit.plan") and not typing_only:
                up = up or mod != "vkxsplit.plan.schedule"
            if up:
                wrong.append(f"{path.name}:{line} imports {mod}")
    assert not wrong, wrong


def test_the_planner_loads_without_the_executor_or_the_model():
    import subprocess
    import sys

    code = ("import sys, vkxsplit.plan; "
            "print(sorted(m for m in sys.modules if m in ('vkxsplit.executor', 'vkxsplit.calibrate', "
            "'vkxsplit.model', 'vkxsplit.runner')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
