"""The per-level GPU profile of a step (vkxsplit.profile_step, ``vkxsplit bench --profile``).

Checked against what the executor itself recorded (its barriers and dispatches), against the
graph's dependencies (any_overlap of what one item writes and a later one reads), against an
unprofiled step's logits (bit-identical), and by counting timestamp writes in a normal replay
(none)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vkxsplit import profile_step as ps
from vkxsplit.graph import any_overlap, span
from vkxsplit.profile_step import LevelProfiler, layer_of, op_table, profiled_step, role_of
from vkxsplit.vk.command import Sequence

N_VOCAB = 512


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vkxsplit.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("profile") / "tiny-q8_0.gguf", "tiny", "q8_0", seed=7,
                           n_vocab=N_VOCAB, n_layer=2)


@pytest.fixture(scope="module")
def model(device, tiny_path):
    from vkxsplit.model import load_model

    with load_model(tiny_path, device=device, split="none", n_ctx=64, ubatch=8) as m:
        yield m


def _level_of(prof: LevelProfiler) -> list[dict[int, list[int]]]:
    """Per segment: item index -> the levels (indices within the segment) holding its commands."""
    out = []
    for seq in prof.seqs:
        where: dict[int, list[int]] = {}
        for k, items in enumerate(seq.levels):
            for i in items:
                where.setdefault(i, []).append(k)
        out.append(where)
    return out


def _in_dependency_order(ops, where: dict[int, list[int]]) -> tuple[bool, int]:
    """Every item that reads bytes an earlier item writes runs in a later level (and one that
    writes bytes an earlier item reads, too). Returns (ok, dependent pairs seen)."""
    pairs = 0
    for b in range(len(ops)):
        rb = [span(t) for t in ops[b].reads]
        wb = [span(t) for t in ops[b].writes]
        for a in range(b):
            wa = [span(t) for t in ops[a].writes]
            ra = [span(t) for t in ops[a].reads]
            if any_overlap(wa, rb) or any_overlap(ra, wb) or any_overlap(wa, wb):
                pairs += 1
                if max(where[a]) >= min(where[b]):
                    return False, pairs
    return True, pairs


@pytest.mark.parametrize("T", [1, 4])
def test_levels_are_the_recorded_barriers_and_hold_every_node_once_in_dependency_order(model, T):
    model.reset()
    model.prefill(list(range(1, T + 1)))  # makes (and runs once) the executor of T tokens
    ex = model._executor(T, False)
    prof = LevelProfiler(ex, model.hp.n_layer)
    try:
        assert len(prof.seqs) == len(ex.schedule.segments) == len(ex._seqs)
        for seg, own, seq, where in zip(ex.schedule.segments, ex._seqs, prof.seqs, _level_of(prof)):
            # the executor's own recording: its first barrier orders it after earlier submits,
            # every other one separates two levels
            assert len(seq.levels) == (own.barriers - 1) + 1
            assert seq.barriers == own.barriers and seq.dispatches == own.dispatches
            assert sum(seq.level_cmds) == own.dispatches
            assert seq.n_stamps == len(seq.levels) + 1
            # every graph node in exactly one level (each is one dispatch here, but an attention
            # writing q8_1 x without a KV split, which quantizes in a second one), all of them
            assert sorted(where) == list(range(len(seg.ops)))
            assert all(len(v) == 1 for k, v in where.items()
                       if not (seg.ops[k].node.op == "attention" and "xq" in seg.ops[k].node.params))
            ok, pairs = _in_dependency_order(seg.ops, where)
            assert ok and pairs > len(seg.ops) // 2
            # the check can fail: the same items squeezed into one level are out of order
            assert not _in_dependency_order(seg.ops, {i: [0] for i in where})[0]
        nodes = [op.node.name for s in ex.schedule.segments for op in s.ops]
        assert sorted(nodes) == sorted(n.name for n in ex.plan.graph.nodes)
    finally:
        prof.close()


def test_profiled_step_logits_are_bit_identical_and_the_trace_has_a_slice_per_level(model, tmp_path):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, N_VOCAB, 4).tolist()
    profs: dict[int, LevelProfiler] = {}
    try:
        model.reset()
        model.prefill(ids)
        want_prefill = model.last_logits()
        tok = int(want_prefill.argmax())
        model.run_step([tok])
        want = model.last_logits()
        model.reset()
        pp = profiled_step(model, ids, profs)
        assert model.n_past == len(ids)
        got_prefill = model.last_logits()
        d = profiled_step(model, [tok], profs)
        got = model.last_logits()
        assert np.array_equal(got_prefill, want_prefill)
        assert np.array_equal(got, want)
        assert not np.array_equal(got, want_prefill)  # the comparison can tell two steps apart
        assert pp.T == 4 and d.T == 1
        for p in (pp, d):
            assert all(lv.us >= 0 for lv in p.levels) and p.busy_us > 0 and p.wall_us > 0
            starts = [lv.start_us for lv in p.levels]
            assert starts == sorted(starts) and starts[0] == 0.0
            assert p.levels[-1].start_us + p.levels[-1].us == pytest.approx(p.busy_us, rel=1e-6, abs=1e-3)
            assert p.barriers == len(p.levels) - p.segments
        # the trace: loads, one slice per level, named by its ops, nodes as args
        path = tmp_path / "p.json"
        path.write_text(json.dumps(d.trace()))
        tr = json.loads(path.read_text())
        xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
        assert len(xs) == len(d.levels)
        for e, lv in zip(xs, d.levels):
            assert e["name"] == "+".join(sorted(set(lv.ops))) and e["args"]["nodes"] == lv.items
            assert e["dur"] == pytest.approx(lv.us)
        both = json.loads(json.dumps(ps.trace_json([d], pp)))
        assert sum(e["ph"] == "X" for e in both["traceEvents"]) == len(d.levels) + len(pp.levels)
        # the op table: every level counted once, shares of the GPU busy time
        rows = op_table([d])
        assert sum(r["levels_per_step"] for r in rows) == len(d.levels)
        assert sum(r["us_per_step"] for r in rows) == pytest.approx(d.busy_us)
        assert sum(r["share"] for r in rows) == pytest.approx(1.0)
        mm = next(r for r in rows if r["op"] == "mul_mat")
        n_mm_levels = sum(1 for lv in d.levels if set(lv.ops) == {"mul_mat"})
        assert mm["levels_per_step"] == n_mm_levels
        assert mm["levels_per_layer"] == pytest.approx(
            sum(1 for lv in d.levels if set(lv.ops) == {"mul_mat"} and lv.layers) / model.hp.n_layer)
        assert "| mul_mat |" in ps.format_table("decode", [d])
        # by role: the same level of each layer together, e.g. the q/k/v projections
        by_role = {r["op"]: r for r in op_table([d], "role")}
        assert sum(r["levels_per_step"] for r in by_role.values()) == len(d.levels)
        qkv = by_role["mul_mat [attn_q+attn_k+attn_v]"]
        assert qkv["levels_per_step"] == model.hp.n_layer and qkv["levels_per_layer"] == 1.0
        assert by_role["mul_mat [output]"]["levels_per_layer"] is None
        assert "| mul_mat [attn_q+attn_k+attn_v] |" in ps.format_table("decode", [d], roles=True)
    finally:
        for p in profs.values():
            p.close()


def test_the_unprofiled_replay_writes_no_timestamps(model, monkeypatch):
    calls = []
    real = Sequence.write_timestamp

    resets = []
    real_reset = Sequence.reset_timestamps

    def counting(self, ts, index, reset=True):
        calls.append(index)
        real(self, ts, index, reset)

    def counting_reset(self, ts):
        resets.append(ts.count)
        real_reset(self, ts)

    monkeypatch.setattr(Sequence, "write_timestamp", counting)
    monkeypatch.setattr(Sequence, "reset_timestamps", counting_reset)
    model._drop_executors()  # recorded again below, with the counter in place
    model.reset()
    model.prefill([5, 6])
    for t in (7, 8, 9):
        step = model.run_step([t])
        assert step.recordings == 0 or t == 7
    assert calls == [] and resets == []
    ex = model._executor(1, False)
    prof = LevelProfiler(ex, model.hp.n_layer)
    try:
        assert len(calls) == sum(len(s.levels) + 1 for s in prof.seqs) > 0
        assert len(resets) == len(prof.seqs)  # one reset of the whole pool per recording
        assert all(a is not b for a, b in zip(prof.seqs, ex._seqs))
        n = len(calls)
        model.run_step([10])  # still the executor's own recording: no new timestamp
        assert len(calls) == n
    finally:
        prof.close()


def test_a_profile_reads_only_the_timestamps_its_step_wrote(model, monkeypatch):
    """A pool is sized with headroom (4 per item) and written in part; reading a query that was
    reset but never written, with the wait bit, blocks forever on the NVIDIA driver (lavapipe
    returns), so every read must stop at the written count."""
    from vkxsplit.vk.command import Timestamps

    reads: list[tuple[int, int]] = []
    real = Timestamps.read

    def checking(self, count=None):
        reads.append((self.count if count is None else count, self.count))
        return real(self, count)

    monkeypatch.setattr(Timestamps, "read", checking)
    model.reset()
    model.prefill([5, 6])
    profilers: dict = {}
    try:
        prof = profiled_step(model, [7], profilers)
        seqs = next(iter(profilers.values())).seqs
        written = [s.n_stamps for s in seqs]
        assert [n for n, _ in reads] == written
        assert all(n < cap for n, cap in reads)  # the pools were written in part
        assert len(prof.levels) == sum(written) - len(seqs)
    finally:
        for p in profilers.values():
            p.close()
    ts = Timestamps(model.device, 4)
    try:
        with pytest.raises(Exception, match="5 timestamps from a pool of 4"):
            ts.read(5)
    finally:
        ts.close()


def test_layer_and_role_of_node_names():
    assert layer_of("blk.12.attn_q") == 12 and layer_of("blk.0.quantize.0") == 0
    assert layer_of("output") is None and layer_of("embd") is None and layer_of("xblk.3.y") is None
    assert role_of("blk.12.attn_q") == "attn_q" and role_of("blk.7.quantize.7") == "quantize"
    assert role_of("blk.7.quantize.1") == "quantize.1" and role_of("output_norm") == "output_norm"


def test_bench_profile_cli(tiny_path, capsys, tmp_path):
    from vkxsplit.cli import main

    out = tmp_path / "prof.json"
    rc = main(["bench", "-m", str(tiny_path), "-p", "4", "-n", "2", "-r", "1", "-c", "32", "-ub", "4",
               "--split", "none", "--profile", str(out), "--profile-steps", "3"])
    c = capsys.readouterr()
    assert rc == 0, c.err
    assert "### decode: T=1" in c.out and "### prefill: T=4" in c.out and "| mul_mat |" in c.out
    doc = json.loads(out.read_text())
    od = doc["otherData"]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == od["decode"]["levels"] + od["prefill"]["levels"]
    assert {e["pid"] for e in xs} == {1, 2}
    assert sum(r["levels_per_step"] for r in od["tables"]["decode"]) == od["decode"]["levels"]
    # with --devices: a clear error before anything loads
    rc = main(["bench", "-m", str(tiny_path), "--devices", "0,1", "--profile"])
    assert rc != 0 and "--profile" in capsys.readouterr().err


def test_a_traced_executor_is_refused_with_what_to_do(model):
    from vkxsplit.errors import VkxError

    model.set_trace(True)
    try:
        ex = model._executor(1, False)
        with pytest.raises(VkxError, match="trace") as ei:
            LevelProfiler(ex, model.hp.n_layer)
        assert "set_trace(False)" in ei.value.hint
    finally:
        model.set_trace(False)


def test_a_split_with_backend_jobs_profiles_its_hub_levels_with_the_same_logits(device, tiny_path):
    """mode:cpu: the mat-muls run on the cpu backend between hub segments; the profiled step
    submits the same jobs and its logits are bit-identical, its levels are the hub's only."""
    from vkxsplit.model import load_model

    ids = [3, 1, 4, 1]
    profs: dict[int, LevelProfiler] = {}
    with load_model(tiny_path, device=device, n_ctx=64, ubatch=8, split="mode:cpu", backends="cpu") as m:
        try:
            m.reset()
            m.prefill(ids)
            m.run_step([5])
            want = m.last_logits()
            m.reset()
            m.prefill(ids)
            d = profiled_step(m, [5], profs)
            assert np.array_equal(m.last_logits(), want)
            ex = m._executor(1, False)
            assert ex.schedule.jobs and d.segments == len(ex.schedule.segments) > 1
            hub_nodes = sorted(op.name for s in ex.schedule.segments for op in s.ops)
            assert sorted(n for lv in d.levels for n in lv.items) == hub_nodes
            assert all(n not in hub_nodes for n in (j.op.name for j in ex.schedule.jobs))
        finally:
            for p in profs.values():
                p.close()
