"""The executor on small hand-made graphs over shared memory: hub segments and cpu / npu-emu jobs
submitted in one go, checked against float64 with per-op error bounds, counters (submits, host
waits, staged bytes, re-recordings), steps that overlap, and the Chrome trace."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from conftest import WAIT_S
from gguf import quants
from gguf.constants import GGMLQuantizationType
from test_cpu_ggml import ggml_bound

from vkxsplit.attach import SharedArena, stats
from vkxsplit.backend import create_backend
from vkxsplit.executor import Executor
from vkxsplit.graph import Graph, Tensor
from vkxsplit.plan.planner import Planner
from vkxsplit.plan.schedule import BackendOp, HubOp
from vkxsplit.plan.spec import HUB
from vkxsplit.plan.workspace import ArenaWorkspace

TIMEOUT = WAIT_S  # (conftest: first dispatches compile inside the wait on lavapipe)
M, K, N1, N2 = 8, 64, 48, 32
U = 2.0**-8  # unit roundoff of bf16 (8 significant bits, round to nearest even)


@pytest.fixture(scope="module")
def cpu(device):
    b = create_backend("cpu", device, timeout=TIMEOUT)
    yield b
    b.close()


@pytest.fixture(scope="module")
def npu(device):
    b = create_backend("npu-emu", device, timeout=TIMEOUT, gflops=200.0, min_batch=8, max_kernels=6)
    yield b
    b.close()


@pytest.fixture
def arena(device, cpu, npu):
    a = SharedArena(device, [cpu, npu], name="test-exec")
    yield a
    a.close()


class Chain:
    """x2 = x + x (hub) -> y1 = W1 x2 (q8_0) -> y1 += b (hub) -> y2 = W2 y1 (f32) -> out = y2 + y2 (hub)."""

    def __init__(self, arena, rng, tail_mul_mat=False):
        self.x = rng.standard_normal((M, K)).astype(np.float32)
        w1 = rng.standard_normal((N1, K)).astype(np.float32)
        self.w1q = quants.quantize(w1, GGMLQuantizationType.Q8_0)
        self.w1 = quants.dequantize(self.w1q, GGMLQuantizationType.Q8_0).astype(np.float64)
        self.b = rng.standard_normal(N1).astype(np.float32)
        self.w2 = (rng.standard_normal((N2, N1)) * 0.2).astype(np.float32)
        self.bufs = []

        def put(name, a, shape, dtype, weight=False):
            a = np.ascontiguousarray(a)
            sb = arena.alloc(a.nbytes, name)
            sb.numpy(np.uint8)[:] = a.view(np.uint8).ravel()
            self.bufs.append(sb)
            return Tensor(name, shape, dtype, sb.view(), weight=weight), sb

        def act(name, cols):
            sb = arena.alloc(M * cols * 4, name)
            sb.numpy(np.float32)[:] = np.nan
            self.bufs.append(sb)
            return Tensor(name, (M, cols), "f32", sb.view()), sb

        self.tx, _ = put("x", self.x, (M, K), "f32")
        self.tw1, self.sw1 = put("w1", self.w1q, (N1, K), "q8_0", weight=True)
        self.tb, _ = put("b", self.b, (N1,), "f32", weight=True)
        self.tw2, self.sw2 = put("w2", self.w2, (N2, N1), "f32", weight=True)
        self.tx2, _ = act("x2", K)
        self.ty1, self.sy1 = act("y1", N1)
        self.ty2, self.sy2 = act("y2", N2)
        self.tout, self.sout = act("out", N2)
        g = Graph("chain", T=M)
        g.add("add", "double", [self.tx, self.tx], self.tx2)
        g.add("mul_mat", "m1", [self.tw1, self.tx2], self.ty1)
        g.add("add", "bias", [self.ty1, self.tb], self.ty1)
        g.add("mul_mat", "m2", [self.tw2, self.ty1], self.ty2)
        if tail_mul_mat:
            g.add("mul_mat", "m3", [self.tw2, self.ty1], self.tout)
        else:
            g.add("add", "double2", [self.ty2, self.ty2], self.tout)
        self.graph = g
        self.tail = tail_mul_mat

    def check(self, plan):
        """Every output against float64 with the bound of the participant that computed it."""
        x2 = 2.0 * self.x.astype(np.float64)
        y1 = self.sy1.numpy(np.float32).reshape(M, N1).astype(np.float64)
        y2 = self.sy2.numpy(np.float32).reshape(M, N2).astype(np.float64)
        out = self.sout.numpy(np.float32).reshape(M, N2).astype(np.float64)
        assert np.isfinite(y1).all() and np.isfinite(y2).all() and np.isfinite(out).all()
        for name, xin, w, y, extra in (("m1", x2, self.w1, y1, self.b.astype(np.float64)),
                                       ("m2", y1, self.w2.astype(np.float64), y2, 0.0)):
            for p in plan.parts(name):
                cols = slice(p.r0, p.r1)
                got = y[:, cols] - extra[cols] if name == "m1" else y[:, cols]
                absprod = np.abs(xin) @ np.abs(w[cols]).T
                if p.participant == "npu-emu":
                    # bf16 inputs: |bf(a)bf(b) - ab| <= (2u + u^2)|ab| (u = 2^-8), f32 sum of K terms
                    bound = (2 * U + U * U + xin.shape[1] * 2.0**-24) * absprod
                elif p.participant == "cpu":  # ggml rounds x to the weight's dot type (q8_0 for m1)
                    bound = ggml_bound(xin, w[cols], "q8_0" if name == "m1" else "f32")
                else:  # f32 products and sums (hub kernels, numpy): K terms of unit roundoff 2^-24
                    bound = 4 * xin.shape[1] * 2.0**-24 * absprod
                if name == "m1":  # + the bias add's rounding (one f32 add)
                    bound = bound + 2.0**-23 * np.abs(y[:, cols])
                assert np.all(np.abs(got - xin @ w[cols].T) <= bound + 1e-30), f"{name} rows {p.r0}:{p.r1} on {p.participant}"
        if not self.tail:
            np.testing.assert_array_equal(out, 2 * y2)  # doubling is exact

    def close(self):
        for b in self.bufs:
            b.close()


def plan_for(device, arena, cpu, npu, chain, spec):
    ws = ArenaWorkspace(device, arena)
    return Planner([cpu, npu], workspace=ws).plan(chain.graph, spec), ws


SPECS = ["none", "layer:m1=cpu,m2=npu-emu", "layer:m1=npu-emu,m2=cpu", "tensor:1,1,1", "tensor:0,1,0",
         "tensor:1,0,0", "tensor:0,0,1", "tensor:2,0,1", "mode:npu-emu>=8"]


@pytest.mark.parametrize("spec", SPECS)
def test_plans_match_float64_with_zero_host_waits(device, cpu, npu, arena, rng, caller_waits, spec):
    chain = Chain(arena, rng)
    plan, ws = plan_for(device, arena, cpu, npu, chain, spec)
    ex = Executor(device, plan, {"cpu": cpu, "npu-emu": npu})
    try:
        assert ex.recordings == plan.schedule.submits
        staged0 = stats.staged_bytes
        for rep in range(2):
            caller_waits.clear()
            st = ex.step()
            assert st.host_waits == 0 and stats.host_waits_in_step == 0 and caller_waits == []
            assert st.submits == plan.schedule.submits and st.jobs == len(plan.schedule.jobs)
            assert st.recordings == (ex.recordings if rep == 0 else 0)  # a replay records nothing
            st.wait(TIMEOUT)
            assert st.staged_bytes == 0
            chain.check(plan)
        assert stats.staged_bytes == staged0 == 0
        # no weight copies: in-place jobs read the weight's own shared memory; conversions are
        # for the bf16 backend only, made once at plan time
        for op in plan.items:
            if isinstance(op, BackendOp) and not op.converted_weight:
                assert op.weight is chain.tw1 or op.weight is chain.tw2
                assert ex._jobs[[j.op for j in plan.schedule.jobs].index(op)].weight.shared in (chain.sw1, chain.sw2)
            if isinstance(op, BackendOp) and op.converted_weight:
                assert op.backend == "npu-emu" and op.weight.dtype == "bf16"
        n_conv = ws.conversions
        assert n_conv == len({op.weight.name for op in plan.items if isinstance(op, BackendOp) and op.converted_weight})
        if spec == "none":
            assert plan.schedule.submits == 1 and plan.schedule.jobs == []
    finally:
        ex.close()
        ws.close()
        chain.close()


def test_tensor_split_parts_run_concurrently(device, cpu, npu, arena, rng):
    """The hub's rows of a split mul_mat sit in a segment that does not wait for the
    backends' rows; the consumer of y waits for both backends."""
    chain = Chain(arena, rng)
    plan, ws = plan_for(device, arena, cpu, npu, chain, "tensor:1,1,1")
    sch = plan.schedule
    try:
        for name in ("m1", "m2"):
            rows = next(op for s in sch.segments for op in s.ops if op.kind == "rows" and op.node.name == name)
            seg = next(s for s in sch.segments if rows in s.ops)
            assert not any(sch.jobs[j].op.node.name == name for s in sch.segments[:seg.index + 1] for j in s.waits)
        bias = next(s for s in sch.segments if any(op.name == "bias" for op in s.ops))
        assert {sch.jobs[j].op.backend for j in bias.waits} == {"cpu", "npu-emu"}
        convs = [op for op in plan.items if isinstance(op, HubOp) and op.kind == "convert"]
        assert [c.src.name for c in convs] == ["x2", "y1"]  # x -> bf16 for the npu, once per x
    finally:
        ws.close()
        chain.close()


def test_submission_does_not_wait_for_the_backends(device, cpu, arena, rng):
    """A slow npu (~0.3 s per job): step() returns long before the step is done."""
    chain = Chain(arena, rng)
    slow = create_backend("npu-emu", device, timeout=TIMEOUT, gflops=2 * M * N2 * N1 / 0.3e9, min_batch=1)
    ws = ArenaWorkspace(device, arena)
    try:
        plan = Planner([cpu, slow], workspace=ws).plan(chain.graph, "layer:m1=cpu,m2=npu-emu")
        ex = Executor(device, plan, [cpu, slow])
        ex.run(TIMEOUT)  # warm: the npu loads its kernel
        t0 = time.monotonic()
        st = ex.step()
        assert time.monotonic() - t0 < 0.25
        assert st.seg_values[-1] > ex.timeline.value  # the last segment has not run yet
        st.wait(TIMEOUT)
        assert time.monotonic() - t0 >= 0.25
        chain.check(plan)
        ex.close()
    finally:
        ws.close()
        slow.close()
        chain.close()


def test_back_to_back_steps_carry_unfinished_jobs(device, cpu, npu, arena, rng, caller_waits):
    """The step's last op runs on the cpu (a trailing job nobody on the hub waits for): the next
    step, submitted without collecting the first, waits for it on the GPU, not on the host."""
    chain = Chain(arena, rng, tail_mul_mat=True)
    plan, ws = plan_for(device, arena, cpu, npu, chain, "layer:m3=cpu")
    ex = Executor(device, plan, [cpu, npu])
    try:
        assert [plan.schedule.jobs[j].op.name for j in plan.schedule.trailing] == ["m3"]
        caller_waits.clear()
        a = ex.step()
        b = ex.step()
        assert caller_waits == [] and a.host_waits == b.host_waits == 0
        b.wait(TIMEOUT)
        a.wait(TIMEOUT)
        chain.check(plan)
        out = chain.sout.numpy(np.float32).reshape(M, N2).astype(np.float64)
        y1 = chain.sy1.numpy(np.float32).reshape(M, N1).astype(np.float64)
        ref = y1 @ chain.w2.astype(np.float64).T
        assert np.all(np.abs(out - ref) <= 4 * N1 * 2.0**-24 * (np.abs(y1) @ np.abs(chain.w2.astype(np.float64)).T))
        # waiting only for one output: the writer's point (here the cpu job of m3)
        c = ex.step()
        c.wait(TIMEOUT, outputs=[chain.tout])
        c.wait(TIMEOUT)
    finally:
        ex.close()
        ws.close()
        chain.close()


def test_trace_is_chrome_json_with_a_track_per_backend(device, cpu, npu, arena, rng):
    chain = Chain(arena, rng)
    plan, ws = plan_for(device, arena, cpu, npu, chain, "tensor:1,1,1")
    ex = Executor(device, plan, [cpu, npu], trace=True)
    try:
        ex.run(TIMEOUT)
        st = ex.run(TIMEOUT)
        tr = json.loads(json.dumps(st.trace()))
        ev = tr["traceEvents"]
        names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
        tid = {v.split(" ")[0]: k for k, v in names.items()}
        assert set(tid) == {HUB, "cpu", "npu-emu"}
        slices = [e for e in ev if e["ph"] == "X"]
        assert all(e["dur"] >= 0 for e in slices)
        hub_ops = [op.name for s in plan.schedule.segments for op in s.ops]
        assert sorted(e["name"] for e in slices if e["tid"] == tid[HUB]) == sorted(hub_ops)
        for b in ("cpu", "npu-emu"):
            want = sorted(j.op.name for j in plan.schedule.jobs if j.op.backend == b)
            got = sorted(e["name"] for e in slices if e["tid"] == tid[b])
            assert got == want and want
        # a backend slice starts no earlier than the end of the hub op it waits for
        x2 = next(e for e in slices if e["name"] == "double")
        m1cpu = next(e for e in slices if e["tid"] == tid["cpu"] and e["name"].startswith("m1"))
        assert m1cpu["ts"] >= x2["ts"] + x2["dur"] - 1.0  # us; host clocks vs GPU clocks: 1 us slack
        assert tr["otherData"]["host_waits_in_step"] == 0
        assert set(st.op_times()) == {id(op) for s in plan.schedule.segments for op in s.ops}
    finally:
        ex.close()
        ws.close()
        chain.close()


def test_npu_kernel_cap_is_a_plan_error_not_a_runtime_one(device, cpu, npu, arena, rng):
    from vkxsplit.errors import PlanError

    chain = Chain(arena, rng)
    ws = ArenaWorkspace(device, arena)
    p = Planner([cpu, npu], workspace=ws, granule=8)
    try:
        keys: set[tuple[str, int, int]] = set()
        for spec in ("1,0,1", "1,0,3", "1,0,1", "0,0,1", "3,0,1", "1,0,7", "5,0,1", "2,0,1", "1,0,15"):
            ratios = [float(r) for r in spec.split(",")]
            new = set()
            for w, N in (("w1", N1), ("w2", N2)):
                n0, n1 = p.bounds(N, ratios)[2]
                if n1 > n0:
                    new.add((w, n0, n1))
            if len(keys | new) > 6:
                # a plan whose converted slices would be kernels #7.. is refused before anything runs
                with pytest.raises(PlanError, match="holds at most 6 resident kernels"):
                    p.plan(chain.graph, f"tensor:{spec}")
                break
            p.plan(chain.graph, f"tensor:{spec}")  # the same slices again: no new kernels
            keys |= new
        else:
            pytest.fail("the specs never exceeded the cap")
        assert ws.resident("npu-emu") == keys and len(keys) <= 6
    finally:
        ws.close()
        chain.close()


def test_hub_recorders_are_looked_up_by_op_name(device):
    """The hub recorders of graph nodes live in vkxsplit.ops.nodes behind a registry: every op
    the model's graphs use has one; an op nobody registered is a KernelError naming it (at
    lookup, and when an executor records a node of it); an op takes one recorder."""
    from vkxsplit.errors import KernelError
    from vkxsplit.executor import record_graph
    from vkxsplit.ops import nodes
    from vkxsplit.vk.command import Sequence

    table = nodes.recorders()
    assert {"mul_mat", "quantize_q8_1", "get_rows", "rms_norm", "add_rms_norm", "add", "swiglu", "rope", "kv_store",
            "attention", "argmax", "cpy", "link_sum", "convert"} <= set(table)
    assert nodes.recorder("rms_norm") is table["rms_norm"]
    with pytest.raises(TypeError):
        table["bogus"] = print  # a read-only view: ops register through the decorator
    with pytest.raises(KernelError, match="no hub kernel for op bogus"):
        nodes.recorder("bogus")
    with pytest.raises(KernelError, match="already has a hub recorder"):
        nodes.register("add")(lambda seq, n: None)
    mem = device.memory
    bufs = [mem.alloc(M * K * 4, "device", f"t{i}") for i in range(2)]
    g = Graph("bogus-graph", T=M)
    g.add("bogus", "odd", [Tensor("a", (M, K), "f32", bufs[0])], Tensor("b", (M, K), "f32", bufs[1]))
    try:
        with pytest.raises(KernelError, match=r"no hub kernel for op bogus \(node odd\)"):
            Executor(device, Planner().plan(g, "none"))
        seq = Sequence(device, "bogus")
        try:
            with pytest.raises(KernelError, match="graph bogus-graph: no hub kernel for op bogus"):
                record_graph(seq, g)
        finally:
            seq.close()
    finally:
        for b in bufs:
            b.close()


def test_a_traced_step_waits_without_a_stall_limit(device, cpu, npu, arena, rng):
    """``timeout=inf`` (VKXSPLIT_TIMEOUT_S=inf: never stalled) with the trace watcher on: the
    wait must not hand inf to Thread.join (OverflowError)."""
    chain = Chain(arena, rng)
    plan, ws = plan_for(device, arena, cpu, npu, chain, "tensor:1,1,1")
    ex = Executor(device, plan, [cpu, npu], trace=True)
    try:
        st = ex.run(float("inf"))
        assert st.done and any(e["ph"] == "X" for e in st.trace()["traceEvents"])
    finally:
        ex.close()
        ws.close()
        chain.close()
