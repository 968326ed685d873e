"""A model's layers split over several hubs (``Model(devices=..., split="layer:...")``: hubs as
participants of the one planner and executor, vkxsplit.hubs): on lavapipe every hub is its own
VkDevice on the one CPU device (devices "0,0"), so the whole path runs: per-hub weights and
KV caches, the hidden state through host pages both devices import, the relay signalling the
next hub, micro-batches in flight on different hubs. Checked against the float64 reference forward
pass (tests/reference.py: gguf's own dequantization) and a one-hub model."""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference_logits

from vkxsplit.errors import PlanError, VkxError, WaitTimeout
from vkxsplit.gguf_model import load_model as load_gguf
from vkxsplit.hubs import layer_ranges
from vkxsplit.model import Model


def layer_model(path, devices=(0, 1), layer_split=None, **kw):
    """The layer split over ``devices`` as the one Model builds it (``layer:R,R`` shares)."""
    from vkxsplit.plan.spec import hub_split

    return Model(path, devices=devices, split=hub_split("layer", layer_split), **kw)


def _device_lists():
    """Two hubs on the first device everywhere; on a machine with two devices (the 2-GPU H200
    machine), also one hub on each: the hidden state then really crosses between GPUs."""
    from vkxsplit.vk.instance import Instance

    with Instance(validation=False) as inst:
        n = len(inst.physical_devices())
    return ["0,0"] + (["0,1"] if n > 1 else [])


def _bound(want):
    # the models' own bound (test_model.test_synthetic_model_matches_reference): q8_0 weights,
    # f32 accumulation, f16 KV cache
    return 2e-3 * np.abs(want).max() + 1e-3


def _messages(m):
    return [msg for d in m.hubs for msg in d.instance.messages]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from vkxsplit.synth import write_synthetic

    d = tmp_path_factory.mktemp("pipe")
    return {L: write_synthetic(d / f"pipe{L}.gguf", "smol135m", "q8_0", seed=11, n_vocab=400, n_layer=L)
            for L in (3, 4)}


def test_layer_ranges_follow_the_shares():
    # cumulative shares rounded to whole layers (llama.cpp's --tensor-split rule), worked by hand
    assert layer_ranges(30, [1, 1]) == [(0, 15), (15, 30)]
    assert layer_ranges(8, [3, 1]) == [(0, 6), (6, 8)]
    assert layer_ranges(32, [1, 2, 1]) == [(0, 8), (8, 24), (24, 32)]
    # a zero share still gets one layer (every stage holds at least one)
    assert layer_ranges(4, [1, 0]) == [(0, 3), (3, 4)]
    assert layer_ranges(3, [0, 0, 1]) == [(0, 1), (1, 2), (2, 3)]
    for bad in ([], [0, 0], [1, -1], [1, float("nan")]):
        with pytest.raises(VkxError, match="layer split"):
            layer_ranges(8, bad)
    with pytest.raises(VkxError, match="at least one layer"):
        layer_ranges(2, [1, 1, 1])


@pytest.mark.parametrize("devices", _device_lists())
@pytest.mark.parametrize("micro", [1, 3])
def test_two_hubs_match_the_reference_and_one_hub(device, synth, micro, devices, monkeypatch):
    """Teacher-forced logits of a 21-token prompt in steps of 16 (3 micro-batches: pieces of 6,
    the last step 5 tokens in one piece), then greedy decode steps checked against the float64
    forward pass over the whole sequence: the KV caches of both stages carry over."""
    from vkxsplit.model import load_model

    path = synth[3]
    ids = [int(i) for i in np.random.default_rng(5).integers(0, 400, 21)]
    with load_gguf(path) as mf:
        want = reference_logits(mf, ids)
    with load_model(path, device=device, n_ctx=64, ubatch=16) as one:
        hub = one.logits(ids)
    with layer_model(path, devices=devices, n_ctx=64, ubatch=16, micro_batches=micro) as m:
        assert m.ranges == [(0, 2), (2, 3)] and m.micro == micro and m.piece == -(-16 // micro)
        got = m.logits(ids)
        assert np.abs(got - want).max() <= _bound(want)
        assert np.abs(got - hub).max() <= _bound(want)
        # the two 16- and 5-token steps: every token's hidden state crossed once
        assert m.traffic["crossed_bytes"] == 21 * m.hp.n_embd * 4
        assert m.traffic["relays"] == -(-16 // m.piece) + -(-5 // m.piece)
        # greedy decode: prefill 7 tokens, 4 steps of one token
        seq = ids[:7]
        m.prefill(seq)
        for _ in range(4):
            tok = m.last_argmax()
            assert tok == int(np.argmax(m.last_logits()))
            seq.append(tok)
            m._run([tok], all_logits=False)
        with load_gguf(path) as mf:
            ref = reference_logits(mf, seq)
        last = m.last_logits()
        # decode mat-vecs read x rounded to q8_1 where the device has integer dot products:
        # test_model.test_decode_integer_dot_products' bound (3% of the logit scale)
        assert np.abs(last - ref[-1]).max() <= 3e-2 * np.abs(ref[-1]).max()
        assert m.last_traffic == m.hp.n_embd * 4
        # every hub's segments submitted before the caller waits for any (the hubs' order of
        # work is the GPUs' and the relay's, not the caller's)
        from vkxsplit.executor import Step
        from vkxsplit.vk.command import Sequence

        events = []
        wait = Step.wait
        monkeypatch.setattr(Step, "wait", lambda self, *a, **k: (events.append("wait"), wait(self, *a, **k))[1])
        submit = Sequence.submit
        monkeypatch.setattr(Sequence, "submit",
                            lambda self, *a, **k: (events.append("submit"), submit(self, *a, **k))[1])
        m.prefill(ids[:16])
        assert events.count("submit") == 2 * m.micro and "submit" not in events[events.index("wait"):]
        monkeypatch.undo()
        steps0 = m.stats["steps"]
        m._run([1], all_logits=False)
        assert m.stats["steps"] == steps0 + 1
        msgs = _messages(m)
    assert not msgs, msgs


def test_three_stages_hold_only_their_layers(synth):
    path = synth[4]
    ids = [int(i) for i in np.random.default_rng(8).integers(0, 400, 9)]
    with load_gguf(path) as mf:
        want = reference_logits(mf, ids)
        tied = "output.weight" not in mf.tensors
    with layer_model(path, devices=["0", "0", "0"], layer_split="1,2,1", n_ctx=32, ubatch=9) as m:
        assert m.ranges == [(0, 1), (1, 3), (3, 4)]
        for st, (a, b) in zip(m.shares, m.ranges):
            layers = {int(n.split(".")[1]) for n in st.weights if n.startswith("blk.")}
            assert layers == set(range(a, b))
            assert sorted(st.kv) == list(range(a, b))
        first, mid, last = m.shares
        assert "token_embd.weight" in first.weights and "token_embd.weight" not in mid.weights
        assert ("token_embd.weight" in last.weights) == tied
        assert "output_norm.weight" in last.weights and "output_norm.weight" not in first.weights
        assert first.logits_buf is None and mid.logits_buf is None
        got = m.logits(ids)
        assert np.abs(got - want).max() <= _bound(want)
        assert m.last_traffic == 9 * m.hp.n_embd * 4 * 2  # two links
        msgs = _messages(m)
    assert not msgs, msgs


def test_bad_input_is_refused(synth, monkeypatch):
    from vkxsplit.native import open_fd_targets
    from vkxsplit.vk.device import Device

    path = synth[3]
    opened = []  # every device a refused construction opened must be closed again
    real_open = Device.open.__func__
    monkeypatch.setattr(Device, "open", classmethod(lambda cls, *a, **k: opened.append(real_open(cls, *a, **k))
                                                     or opened[-1]))
    fds = open_fd_targets()
    with pytest.raises(PlanError, match="3 ratios for 2 participants"):
        layer_model(path, devices="0,0", layer_split="1,1,1")
    with pytest.raises(PlanError, match="(?s)names hub2, a Vulkan hub this model did not open.*--devices"):
        Model(path, devices="0,0", split="layer:hub0=1,hub2=1")
    with pytest.raises(PlanError, match="names hub1, a Vulkan hub this model did not open"):
        Model(path, split="layer:hub0=1,hub1=1")  # one hub
    with pytest.raises(PlanError, match="(?s)by layers.*or by rows"):
        Model(path, devices="0,0", split="mode:hub1>=8")
    with pytest.raises(PlanError, match="with several hubs every participant is a Vulkan hub"):
        Model(path, devices="0,0", backends="cpu")
    with pytest.raises(VkxError, match="at least one layer"):
        layer_model(path, devices="0,0,0,0")
    with pytest.raises(VkxError, match="does not exist"):  # the first device opened is closed again
        layer_model(path, devices="0,9")
    assert opened and all(d.handle is None for d in opened)
    # micro-batches: a positive count, and only where there are pieces to put in flight (a layer
    # split over several hubs): never silently one
    for kw in ({"devices": "0,0", "micro_batches": 0}, {"devices": "0,0", "micro_batches": -2}):
        with pytest.raises(VkxError, match="micro_batches .* at least 1"):
            layer_model(path, **kw)
    for kw in ({"devices": "0,0", "split": "tensor:1,1", "micro_batches": 2}, {"micro_batches": 2},
               {"devices": "0", "micro_batches": 3}):
        with pytest.raises(VkxError, match="micro_batches=.* layer split over several hubs"):
            Model(path, n_ctx=16, ubatch=8, **kw)
    # refused constructions leave no file, device or memfd open
    assert {fd: t for fd, t in open_fd_targets().items() if fds.get(fd) != t} == {}
    assert all(d.handle is None for d in opened)
    monkeypatch.undo()
    with layer_model(path, devices="0,0", n_ctx=16, ubatch=8) as m:
        with pytest.raises(VkxError, match="more than ubatch"):
            m._run(list(range(9)), all_logits=False)
        m._run(list(range(8)), all_logits=False)
        m._run(list(range(8)), all_logits=False)
        with pytest.raises(VkxError, match="context is full"):
            m._run([1], all_logits=False)
        with pytest.raises(VkxError, match="not supported"):
            m.set_split("tensor:1,1")
        m.set_split("layer")  # the spec it was loaded with
    with layer_model(path, devices="0,0", n_ctx=16, ubatch=8, micro_batches=2) as m:
        # a plan is one piece's: a whole ubatch is two of them (named as such, not "ubatch 4")
        with pytest.raises(VkxError, match="more than a micro-batch: ubatch 8 runs as 2 pieces of at most 4"):
            m.plan(8)
        assert m.plan(4).T == 4
    with layer_model(path, devices="0,0", n_ctx=16, ubatch=8, micro_batches=5) as m:
        # 8 tokens in pieces of ceil(8 / 5) = 2 are 4 pieces: 4 micro-batches (and slots), not 5
        assert (m.micro, m.piece, m.slots) == (4, 2, 4)
        m._run(list(range(8)), all_logits=False)
        assert m.stats["steps"] == 4 and m.traffic["relays"] == 4


def test_a_stuck_stage_is_reported_not_run_silently(synth):
    """Stage 0 held behind a gate: the relay gives up after its timeout, the step raises
    WaitTimeout (never returns logits computed from a stale hidden state), and once the stage
    runs again the pipeline still works."""
    import time

    from vkxsplit.vk.event import Gate

    path = synth[3]
    ids = [3, 1, 4, 1, 5, 9, 2, 6]  # two pieces of 4 (a 1-token piece would be a decode step: q8_1 x)
    with load_gguf(path) as mf:
        want = reference_logits(mf, ids)
    # two micro-batches: the relay of the second is still waiting when the step gives up
    with layer_model(path, devices="0,0", n_ctx=32, ubatch=8, micro_batches=2, timeout=0.5) as m:
        gate = Gate(m.hubs[0])
        hold = gate.hold(watchdog_s=30)
        orig = m._submit

        def held(*a, **k):  # hub 0's first segment of each piece waits for the gate
            return orig(*a, **dict(k, waits=[*k.get("waits", ()), hold.point]))

        m._submit = held
        with pytest.raises(WaitTimeout):
            m._run(ids, all_logits=True)
        assert m.n_past == 0
        time.sleep(1.0)  # the old relay's later waits time out too: that must not reach the next step
        hold.release()
        del m._submit
        m.timeout = 60.0  # lavapipe with the validation layer: a step may take longer than 0.5 s
        m.relay.timeout = 60.0
        got = m.logits(ids)
        assert np.abs(got - want).max() <= _bound(want)
        gate.close()
        msgs = _messages(m)
    assert not msgs, msgs


def test_close_leaves_no_fds(synth):
    """Links (memfd, mapping, an import on each device), relay threads and the devices: twice,
    the second round must leave the fd count where it found it."""
    from vkxsplit.native import open_fd_targets

    path = synth[3]
    for _ in range(2):
        before = open_fd_targets()
        with layer_model(path, devices="0,0", n_ctx=32, ubatch=8, micro_batches=2) as m:
            m.logits([1, 2, 3, 4, 5, 6, 7])
            assert m.links[0].mapping is not None
            thread = m.relay._worker.thread
        assert not m.links and not thread.is_alive() and not m.hubs
    new = {fd: t for fd, t in open_fd_targets().items() if before.get(fd) != t}
    assert not new, f"fds left open: {sorted(new.values())}"


def test_command_line_and_load_model(synth, tmp_path):
    """``vkxsplit bench --devices 0,0`` runs the layer split over two hubs and reports it; options
    that do not go with it are refused with the reason; ``vkxsplit.load_model(devices=...)`` gives
    a Model over two hubs; ``vkxsplit plan --devices 0,0`` prints one participant per hub."""
    import json

    from test_tools import run_tool

    import vkxsplit

    def cli(*args):
        return run_tool(["-m", "vkxsplit", *args], tmp_path)

    path = str(synth[3])
    r = cli("bench", "-m", path, "--devices", "0,0", "--layer-split", "2,1", "-p", "8", "-n", "2", "-r", "1",
            "-c", "32", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {row["test"] for row in rows} == {"pp8", "tg2"} and all(row["tps_mean"] > 0 for row in rows)
    assert all(row["backends"] == "vulkan x2" and "0-1,2-2" in row["split"] for row in rows)
    # bytes between the GPUs per step: the hidden state, T x n_embd f32 (smol135m: 576)
    per = {row["test"]: row["crossed_bytes_per_step"] for row in rows}
    assert per == {"pp8": 8 * 576 * 4, "tg2": 576 * 4}
    r = cli("bench", "-m", path, "--devices", "0,0", "--backends", "cpu", "-p", "8", "-n", "0", "-r", "1")
    assert r.returncode != 0 and "--devices" in r.stderr and "Traceback" not in r.stderr
    r = cli("bench", "-m", path, "--layer-split", "1,1", "-p", "8", "-n", "0", "-r", "1")
    assert r.returncode != 0 and "go with --devices" in r.stderr
    r = cli("bench", "-m", path, "--devices", "0,0", "--split", "mode:cpu>=8", "-p", "8", "-n", "0", "-r", "1")
    assert r.returncode != 0 and "several hubs split the model by layers" in r.stderr and "Traceback" not in r.stderr
    r = cli("bench", "-m", path, "--devices", "0,0", "--split", "layer", "-ts", "1,1", "-p", "8", "-n", "0")
    assert r.returncode != 0 and "both give the split over the hubs" in r.stderr
    r = cli("bench", "-m", path, "--devices", "0,0", "-p", "8", "-n", "1", "-r", "1", "-c", "32",
            "--trace", str(tmp_path / "tr.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    tr = json.loads((tmp_path / "tr.json").read_text())
    tracks = {e["args"]["name"].split(" ")[0] for e in tr["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {"hub0", "hub1"} and any(e.get("name") == "link_in" for e in tr["traceEvents"])
    r = cli("plan", "-m", path, "--devices", "0,0", "-ts", "2,1", "-t", "4", "--points")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "split: layer:2,1: layers 0-1,2-2" in r.stdout and "  hub0: " in r.stdout and "  hub1: " in r.stdout
    assert "hub1#1 [link_in .. " in r.stdout and "waits hub0#0" in r.stdout and "cpy 2" in r.stdout
    with vkxsplit.load_model(path, devices="0,0", n_ctx=32, ubatch=8) as m:
        assert isinstance(m, Model) and len(m.hubs) == 2 and len(m.shares) == 2 and str(m.split) == "layer"
    with pytest.raises(VkxError, match="no backends or device"):
        vkxsplit.load_model(path, devices="0,0", device=None)


def test_close_with_a_stuck_stage_frees_nothing_in_use(synth, caplog):
    """Closing right after a failed step whose stage-0 work is still queued behind a stuck GPU
    (a gate that never opens in time) must not free the memory, host pages, timelines or devices
    that work will use: close() logs and leaves them allocated; once the GPU moves on they can
    be freed in the usual order."""
    import logging

    from vkxsplit.vk.event import Gate

    path = synth[3]
    m = layer_model(path, devices="0,0", n_ctx=32, ubatch=8, micro_batches=2, timeout=0.5)
    gate = Gate(m.hubs[0])
    hold = gate.hold(watchdog_s=30)
    orig = m._submit
    m._submit = lambda *a, **k: orig(*a, **dict(k, waits=[*k.get("waits", ()), hold.point]))
    with pytest.raises(WaitTimeout):
        m._run([3, 1, 4, 1, 5, 9, 2, 6], all_logits=True)
    links, devices = list(m.links), list(m.hubs)
    m.timeout = 0.3
    with caplog.at_level(logging.ERROR, logger="vkxsplit.model"):
        m.close()
    assert "still queued" in caplog.text
    assert all(d.handle is not None for d in devices) and all(link.mapping is not None for link in links)
    hold.release()
    for d in devices:
        d.wait_idle()  # the held work ran (on memory still allocated)
    gate.close()
    m._free()  # now everything goes, in the usual order
    assert all(d.handle is None for d in devices) and all(link.mapping is None for link in links)
