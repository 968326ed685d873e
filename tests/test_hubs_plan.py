"""Vulkan hubs as participants of the one planner (vkxsplit.plan, vkxsplit.hubs): the plan of a
model over two hubs names one participant per hub and the nodes that cross between them; the
schedule cuts per-hub segments with cross-hub waits derived from the bytes each node touches
(the two imports of one host link are one memory); a spec naming a hub the model did not open
is refused; the one-hub graph and plan are the one-hub forward, node for node."""

from __future__ import annotations

import numpy as np
import pytest

from vkxsplit.errors import PlanError
from vkxsplit.graph import Tensor
from vkxsplit.plan.planner import Planner
from vkxsplit.plan.schedule import HubOp, build_schedule


def _t(name):
    return Tensor(name, (4, 8), "f32")  # no buffer: dry tensors are their own memory, by name


def _op(hub, name, reads, writes):
    return HubOp("node", name, [_t(r) for r in reads], [_t(w) for w in writes], hub=hub)


def test_schedule_over_hubs_waits_where_a_hub_reads_what_another_wrote():
    """Two hubs: hub 1's first item reads the link hub 0 wrote (a wait, RAW); hub 0's second
    round writes the page hub 1 read (a wait, WAR); hub-local work never waits across. Built by
    hand: the segments and their waits."""
    items = [_op(0, "a0", ["x0"], ["x0"]), _op(0, "out0", ["x0"], ["link"]),
             _op(1, "in1", ["link"], ["x1"]), _op(1, "b1", ["x1"], ["x1"]),
             _op(0, "c0", ["x0"], ["x0"]),                     # hub 0 again: a new segment, no wait
             _op(0, "out0b", ["x0"], ["link"]),                # rewrites what in1 read: waits hub 1
             _op(1, "in1b", ["link"], ["x1"])]                 # reads the new link: waits hub 0
    sch = build_schedule(items)
    got = [(s.hub, [op.name for op in s.ops], s.hub_waits) for s in sch.segments]
    assert got == [(0, ["a0", "out0"], []), (1, ["in1", "b1"], [0]), (0, ["c0"], []),
                   (0, ["out0b"], [1]), (1, ["in1b"], [3])]
    assert sch.order == [("seg", i) for i in range(5)] and sch.hubs == 2
    assert sch.cross_waits() == [(0, 1), (1, 3), (3, 4)]
    # the same items with hub-private links (nothing shared): no cross-hub wait at all
    private = [_op(it.hub, it.name, [t.name + str(it.hub) for t in it.reads], [t.name + str(it.hub) for t in it.writes])
               for it in items]
    assert build_schedule(private).cross_waits() == []
    # one hub: the schedule of before (one segment, no hub waits), whatever the tensors
    one = build_schedule([HubOp("node", it.name, it.reads, it.writes) for it in items])
    assert [len(s.ops) for s in one.segments] == [len(items)] and one.cross_waits() == []


def test_simulate_runs_each_hub_in_parallel_with_relay_crossings():
    """The cost model's step time over two hubs, worked by hand on the schedule above: each
    item 10 s, a relay crossing 1 s, no submit cost. Hub 0: [a0 out0] 0-20, [c0] 20-30, [out0b]
    waits hub 1's [in1 b1] (21-41): 42-52; hub 1: [in1b] waits [out0b]: 53-63. One lane (the
    hubs' segments one after another) would give 70 and more."""
    from vkxsplit.plan.cost import simulate

    items = [_op(0, "a0", ["x0"], ["x0"]), _op(0, "out0", ["x0"], ["link"]),
             _op(1, "in1", ["link"], ["x1"]), _op(1, "b1", ["x1"], ["x1"]),
             _op(0, "c0", ["x0"], ["x0"]), _op(0, "out0b", ["x0"], ["link"]), _op(1, "in1b", ["link"], ["x1"])]

    class Cost:
        estimated: set = set()

        def submit(self):
            return 0.0

        def relay(self):
            return 1.0

        def hub_item(self, it):
            return 10.0

    pred = simulate(build_schedule(items), Cost())
    assert pred.total_s == 63.0 and pred.busy == {"hub0": 40.0, "hub1": 30.0}


def test_planner_spec_checks_over_hubs():
    """Specs the hubs can run (layer shares, tensor:1,1 over two), and the rest refused with
    the reason: a hub not opened (named), other kinds, unequal row shares, backends."""
    two = Planner(hubs=2)
    assert two.names == ["hub0", "hub1"]
    assert two.hub_shares("layer") == [1.0, 1.0] and two.hub_shares("layer:3,1") == [3.0, 1.0]
    assert two.hub_shares("layer:hub1=1,hub0=2") == [2.0, 1.0] and two.hub_shares("tensor:1,1") == [1.0, 1.0]
    with pytest.raises(PlanError, match="(?s)names hub2, a Vulkan hub this model did not open.*opened 2: hub0, hub1"):
        two.check("layer:hub0=1,hub2=1")
    with pytest.raises(PlanError, match="names hub1, a Vulkan hub this model did not open"):
        Planner().check("tensor:hub=1,hub1=1")
    for bad, why in (("none", "by layers"), ("auto", "by layers"), ("mode:hub1>=2", "by layers"),
                     ("tensor:3,1", "equal shares"), ("tensor:1,1@attn", "no @REGEX"),
                     ("layer:blk\\.0\\..*=hub1", "not REGEX=NAME"), ("layer:1,1,1", "3 ratios for 2")):
        with pytest.raises(PlanError, match=why):
            two.check(bad)
    with pytest.raises(PlanError, match="over two hubs"):
        Planner(hubs=3).check("tensor:1,1,1")

    class Cpu:
        name, caps = "cpu", None

    with pytest.raises(PlanError, match="every participant is a Vulkan hub"):
        Planner([Cpu()], hubs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vkxsplit.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("hubplan") / "tiny.gguf", "tiny", "q8_0", seed=3, n_layer=3)


def _sig(n):
    from vkxsplit.graph import span

    return (n.op, n.name, tuple((t.name, t.shape, t.dtype, span(t)) for t in (*n.inputs, n.output)))


def test_one_hub_plan_is_the_forward_node_for_node(device, tiny):
    """Split none on one hub: the graph is the architecture's forward over the hub's buffers
    (archs.build_graph, built again here), every node lowered once, in order, on the hub, in
    one segment; participants ``hub``."""
    from vkxsplit.archs import build_graph
    from vkxsplit.model import load_model

    with load_model(tiny, split="none", device=device, n_ctx=32, ubatch=8) as m:
        for T in (1, 8):
            plan = m.plan(T)
            ref = build_graph(m.shares[0], T, False)
            assert [_sig(n) for n in plan.graph.nodes] == [_sig(n) for n in ref.nodes]
            assert all(n.hub == 0 for n in plan.graph.nodes)
            assert [(it.kind, it.name, it.hub) for it in plan.items] == [("node", n.name, 0) for n in plan.graph.nodes]
            assert len(plan.schedule.segments) == 1 and plan.participants == ["hub"]
            assert plan.schedule.cross_waits() == [] and plan.cross_nodes == []
            d = plan.to_dict()  # the one-hub JSON keeps its keys
            assert set(d["segments"][0]) == {"index", "ops", "waits"} and "cross" not in d


def test_layer_split_plan_names_each_hub_and_its_cross_nodes(device, tiny):
    """``layer:2,1`` over two hubs: each node of the one-hub forward runs on the hub holding its
    layer (the same nodes in the same order, but for the link copies and the residual add that
    no longer fuses the next hub's first norm), one participant per hub, the link copies as
    the cross-hub nodes, one relay round; ``describe`` says so."""
    from vkxsplit.model import Model, load_model

    with load_model(tiny, split="none", device=device, n_ctx=32, ubatch=8) as one:
        ref = [(n.op, n.name) for n in one.plan(8).graph.nodes]
    with Model(tiny, devices="0,0", split="layer:2,1", n_ctx=32, ubatch=8, micro_batches=1) as m:
        plan = m.plan(8)
        g = plan.graph
        assert plan.participants == ["hub0", "hub1"] and list(plan.by_participant()) == ["hub0", "hub1"]
        assert plan.cross_nodes == ["link_out", "link_in"] and plan.cross == "signal"
        hub_of = {n.name: n.hub for n in g.nodes}
        assert {hub_of[f"blk.{i}.attn_q"] for i in (0, 1)} == {0} and hub_of["blk.2.attn_q"] == 1
        assert hub_of["embd"] == 0 and hub_of["output"] == 1
        got = [(n.op, n.name) for n in g.nodes if n.name not in ("link_out", "link_in")]
        # hub 0 ends its last layer with a plain residual add; hub 1 norms its first input itself
        want = [x for x in ref if x != ("add_rms_norm", "blk.2.attn_norm")]
        k = want.index(("add_rms_norm", "blk.1.ffn_norm")) + 1
        want = want[:k] + [x for x in want[k:] if x[1].startswith("blk.1.")] + [("add", "blk.1.ffn_residual"),
               ("rms_norm", "blk.2.attn_norm")] + [x for x in want[k:] if not x[1].startswith("blk.1.")]
        assert got == want
        sch = plan.schedule
        assert [(s.hub, s.hub_waits) for s in sch.segments] == [(0, []), (1, [0])]
        assert sch.segments[1].ops[0].name == "link_in" and sch.segments[0].ops[-1].name == "link_out"
        assert plan.crossed_bytes == 8 * m.hp.n_embd * 4
        text = plan.describe(points=True)
        assert "  hub0: " in text and "  hub1: " in text and "hub1#1 [link_in" in text and "waits hub0#0" in text
        assert "cpy 2; 1 relay rounds per step, each signalling the next hub" in text
        d = plan.to_dict()
        assert set(d["participants"]) == {"hub0", "hub1"}
        # the JSON (vkxsplit plan --devices --json) carries what the text does: each segment's
        # hub and the other hubs' segments it waits for, how the relay carries them, the bytes
        assert [(s["hub"], s["hub_waits"]) for s in d["segments"]] == [(0, []), (1, [0])]
        assert d["cross"] == "signal" and d["crossed_bytes"] == plan.crossed_bytes
        assert sorted(d["cross_nodes"]) == ["link_in", "link_out"]


def test_row_split_plan_has_an_all_reduce_per_block(device, tiny):
    """``tensor:1,1`` over two hubs: both shards' nodes, interleaved at each all-reduce; the
    cross-hub nodes are each shard's publish and sum of every attention and FFN output; every
    segment after the first of each hub waits for the other hub (the relay submits it)."""
    from vkxsplit.model import Model

    with Model(tiny, devices="0,0", split="tensor:1,1", n_ctx=32, ubatch=8) as m:
        plan = m.plan(4)
        L = m.hp.n_layer
        assert plan.participants == ["hub0", "hub1"] and plan.cross == "submit"
        sums = [n for n in plan.graph.nodes if n.op == "link_sum"]
        assert len(sums) == 2 * 2 * L and {n.hub for n in sums} == {0, 1}
        assert sorted(plan.cross_nodes) == sorted([n.name for n in sums]
                                                  + [n.name for n in plan.graph.nodes if n.name.endswith("_publish")])
        segs = plan.schedule.segments
        assert len(segs) == 2 * (2 * L + 1) and [s.hub for s in segs] == [0, 1] * (2 * L + 1)
        assert all(s.hub_waits == [] for s in segs[:2]) and all(len(s.hub_waits) == 1 for s in segs[2:])
        assert all(segs[j].hub != s.hub for s in segs for j in s.hub_waits)
        assert plan.crossed_bytes == 4 * m.hp.n_embd * 4 * 2 * 2 * L  # both partials of every all-reduce
        # both shards publish before the first sum reads (hub 0's whole graph first, then hub
        # 1's, would put hub 0's sums before hub 1's partials exist)
        first_sum = next(i for i, n in enumerate(plan.graph.nodes) if n.op == "link_sum")
        published = {n.hub for n in plan.graph.nodes[:first_sum] if n.name.endswith("_publish")}
        assert published == {0, 1}
        logits = m.logits([1, 2, 3, 4])
        assert np.isfinite(logits).all()


def test_trace_of_a_step_over_hubs_has_a_track_per_hub(tiny):
    """``trace=True`` over two hubs (layer split): the step's Chrome trace has one track per hub,
    every node on its hub's track, once, with GPU durations; the row split's too, the relay
    submitting its segments (their completions watched as the relay fills the values in)."""
    from vkxsplit.model import Model

    for split in ("layer:2,1", "tensor:1,1"):
        with Model(tiny, devices="0,0", split=split, n_ctx=32, ubatch=8, micro_batches=1, trace=True) as m:
            m.logits([1, 2, 3, 4, 5])
            tr = m.last_trace
            names = {e["args"]["name"] for e in tr["traceEvents"] if e.get("name") == "thread_name"}
            assert {n.split(" ")[0] for n in names} == {"hub0", "hub1"}, names
            graph = m.plan(5).graph
            got = sorted((e["tid"], e["name"]) for e in tr["traceEvents"] if e["ph"] == "X")
            assert got == sorted((n.hub, n.name) for n in graph.nodes)
            assert all(e["dur"] >= 0 for e in tr["traceEvents"] if e["ph"] == "X")
            assert tr["otherData"]["submits"] == len(m.plan(5).schedule.segments)


def test_signalled_segments_acquire_what_the_other_hub_wrote(device, tiny, monkeypatch):
    """A segment the relay *signals* (layer split) is queued before the other hub writes the
    link it reads, so its vkQueueSubmit does not make that write visible: it starts with the
    host-to-device barrier (executor._acquire_host_writes), after its semaphore wait. Segments
    the relay *submits* (row split: covered by that submission) and the one-hub path record
    none (the one-hub path stays command for command what it was)."""
    import vkxsplit.executor as exm
    from vkxsplit.model import Model, load_model

    calls = []
    orig = exm._acquire_host_writes
    monkeypatch.setattr(exm, "_acquire_host_writes", lambda seq: (calls.append(seq.device), orig(seq))[1])
    with Model(tiny, devices="0,0", split="layer:2,1", n_ctx=32, ubatch=8, micro_batches=1) as m:
        ex = m._executor(4, False)
        assert [s.hub_waits for s in ex.schedule.segments] == [[], [0]]
        assert calls == [m.hubs[1]]
        m.logits([1, 2, 3, 4])  # (recorded and run: no validation message, test_hubs_layer checks values)
        assert not [msg for d in m.hubs for msg in d.instance.messages]
    calls.clear()
    with Model(tiny, devices="0,0", split="tensor:1,1", n_ctx=32, ubatch=8) as m:
        m._executor(4, False)
        assert calls == []
    with load_model(tiny, split="none", device=device, n_ctx=32, ubatch=8) as m:
        m._executor(4, False)
        assert calls == []


def _graph(name, nodes):
    """A dry graph of (hub, name, reads, writes) nodes (tensors by name are their own memory)."""
    from vkxsplit.graph import Graph, Node

    g = Graph(name, T=1)
    for hub, nm, reads, writes in nodes:
        g.nodes.append(Node("add", nm, [_t(r) for r in reads], _t(writes[0]), index=len(g.nodes), hub=hub))
    return g


class _FakeCost:
    """Seconds per node by name, per relay crossing; no submit cost; ``groups``: hubs on another
    hub's device."""

    def __init__(self, secs, relay, groups=None):
        self.secs, self.relay_s, self.estimated, self.groups = secs, relay, set(), groups or {}

    def hub_resource(self, lane):
        return self.groups.get(lane, lane)

    def submit(self):
        return 0.0

    def relay(self):
        return self.relay_s

    def hub_item(self, it):
        return self.secs[it.node.name.split(".")[0]]


def test_auto_over_hubs_picks_the_cheapest_candidate():
    """plan.hub_split.choose_hub_split: every candidate's steps simulated (each hub a lane, a relay
    crossing R per cross-hub wait; hubs on one device one lane after another), times weighted
    by how often each step runs (here 2); the cheapest wins. Worked by hand with fake costs that make each candidate the cheapest in turn.
    A step is two pieces of work a then b. One hub: a.1 b.1 a.2 b.2 in a row (2a + 2b). Layer
    split: a on hub 0, b on hub 1, the pieces in flight at once (a pipeline: hub 1 starts b.1
    a relay after a.1, b.2 after a.2 and b.1: 2a + R + b for a = b). Row split: half of all
    of it on each hub (h) at once, then each hub sums both partials a relay after the other
    published its own (h + R + s)."""
    from vkxsplit.plan.hub_split import HubCandidate, choose_hub_split

    one = _graph("one", [(0, "a.1", ["x1"], ["y1"]), (0, "b.1", ["y1"], ["z1"]),
                         (0, "a.2", ["x2"], ["y2"]), (0, "b.2", ["y2"], ["z2"])])
    layer = _graph("layer", [(0, "a.1", ["x1"], ["l1"]), (1, "b.1", ["l1"], ["z1"]),
                             (0, "a.2", ["x2"], ["l2"]), (1, "b.2", ["l2"], ["z2"])])
    row = _graph("row", [(0, "h.0", ["x"], ["p0"]), (1, "h.1", ["x1"], ["p1"]),
                         (0, "s.0", ["p0", "p1"], ["z"]), (1, "s.1", ["p1", "p0"], ["z1"])])
    cands = [HubCandidate("one hub", "none", [(one, 2.0)]), HubCandidate("layer", "layer", [(layer, 2.0)]),
             HubCandidate("row", "tensor:1,1", [(row, 2.0)])]
    shared = {"hub1": "hub0"}  # both hubs on one device: their segments take it in turn
    for secs, relay, groups, want, table in (
            ({"a": 1.0, "b": 1.0, "h": 3.0, "s": 0.0}, 1.5, {}, "one hub", [4.0, 4.5, 4.5]),
            ({"a": 1.0, "b": 1.0, "h": 2.5, "s": 1.0}, 0.0, {}, "layer", [4.0, 3.0, 3.5]),
            ({"a": 1.0, "b": 1.0, "h": 1.0, "s": 0.5}, 0.0, {}, "row", [4.0, 3.0, 1.5]),
            ({"a": 1.0, "b": 1.0, "h": 1.0, "s": 1.5}, 0.0, {}, "row", [4.0, 3.0, 2.5]),
            # the same costs with both hubs on one device: every segment in turn (h.0 h.1 s.0
            # s.1: 5; the pipeline a.1 b.1 a.2 b.2: 4, a tie with one hub, listed first)
            ({"a": 1.0, "b": 1.0, "h": 1.0, "s": 1.5}, 0.0, shared, "one hub", [4.0, 4.0, 5.0])):
        picked, got, est = choose_hub_split(cands, _FakeCost(secs, relay, groups))
        assert picked.label == want and est == []
        assert got == list(zip(["one hub", "layer", "row"], [2 * t for t in table]))
    with pytest.raises(PlanError, match="needs a cost model"):
        choose_hub_split(cands, None)
    with pytest.raises(PlanError, match="no candidate"):
        choose_hub_split([], _FakeCost({}, 0.0))


def test_auto_over_hubs_places_what_the_costs_pick(tiny, tmp_path, monkeypatch):
    """``Model(devices="0,0", split="auto")`` prices one hub, the layer split and the row split
    at load over dry shares (nothing placed) and places the cheapest; fake costs make each the
    cheapest in turn: a product costs its weight's elements times its rows (the pipeline's
    pieces and the row split's halves are cheaper), a relay crossing R, a row split's sum L,
    everything else nothing. R large: one hub (the other hub closed, a one-hub model). R = 0,
    L large: the layer split (2 pieces of 32 tokens in flight at once beat one hub on the
    prompt; the row split's 6 sums per step cost). R = L = 0: the row split (every product
    halved). Priced as if the two hubs were two GPUs (here both are the one lavapipe device,
    whose hubs the cost model otherwise runs one after another). The model placed so runs:
    logits against the float64 reference; its plans name the candidates and the choice."""
    from reference import reference_logits

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import Model
    from vkxsplit.plan.cost import CostModel

    knobs = {}

    def hub_item(self, it):
        n = it.node
        if n.op == "mul_mat":
            return 1e-12 * n.inputs[0].shape[0] * n.inputs[0].shape[-1] * n.inputs[1].rows
        return knobs["L"] if n.op == "link_sum" else 0.0

    monkeypatch.setattr(CostModel, "hub_item", hub_item)
    monkeypatch.setattr(CostModel, "relay", lambda self: knobs["R"])
    monkeypatch.setattr(CostModel, "submit", lambda self: 0.0)
    monkeypatch.setattr(CostModel, "hub_resource", lambda self, lane: lane)  # priced as two GPUs
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with load_gguf(tiny) as mf:
        want = reference_logits(mf, ids)
    for R, L, picked, split, hubs in ((1.0, 0.0, "one hub", "none", 1), (0.0, 1.0, "layer", "layer", 2),
                                      (0.0, 0.0, "row", "tensor:1,1", 2)):
        knobs.update(R=R, L=L)
        with Model(tiny, devices="0,0", split="auto", n_ctx=64, ubatch=64, profile_dir=tmp_path) as m:
            hc = m.hub_choice
            assert hc["picked"] == picked and str(m.split) == split and len(m.hubs) == hubs, hc
            table = dict(hc["candidates"])
            assert set(table) == {"one hub", "layer", "row"} and min(table, key=table.get) == picked
            got = m.logits(ids)
            assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max() + 1e-3
            text = m.plan(8).describe()
            assert f"auto over the hubs picked {picked} at load" in text and "auto candidates: one hub" in text
            if picked == "layer":
                assert m.micro == 2 and m.piece == 32
            assert not [msg for d in m.hubs for msg in d.instance.messages]


def test_plan_command_shows_auto_over_hubs(tiny, tmp_path):
    """``vkxsplit plan --devices 0,0 --split auto``: the candidates auto priced at load, what it
    picked, and the plan of that choice."""
    from test_tools import run_tool

    r = run_tool(["-m", "vkxsplit", "plan", "-m", str(tiny), "--devices", "0,0", "--split", "auto", "-t", "4",
                  "-c", "32"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "split: auto over 3 candidates (one hub " in r.stdout and ", layer " in r.stdout and ", row " in r.stdout
    assert "auto over the hubs picked " in r.stdout and "auto candidates: one hub " in r.stdout
    assert "Traceback" not in r.stderr


def test_relay_crossing_is_measured_between_the_hubs(tiny, tmp_path):
    """The cost model of a model over two hubs prices a relay crossing by a measurement between
    them (calibrate.measure_relay), kept in the profile under the other hub's device; a cost
    model that has no hubs to measure between uses the documented default and says so."""
    from vkxsplit.model import Model
    from vkxsplit.plan.cost import DEFAULTS, CostModel

    with Model(tiny, devices="0,0", split="layer", n_ctx=32, ubatch=8, profile_dir=tmp_path) as m:
        c = m.cost
        assert c.relay_key == "relay|" + bytes(m.hubs[1].physical.device_uuid).hex()
        v = c.relay()
        assert 0 < v < 1.0 and c.profile.get("hub", c.relay_key) == v and "hub relay" not in c.estimated
        dry = CostModel(c.profile)
        dry.relay_key = "relay|another-device"
        assert dry.relay() == DEFAULTS["relay_s"] and "hub relay" in dry.estimated
