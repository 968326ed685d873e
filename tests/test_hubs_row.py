"""A model's matrices split by rows over two hubs (``Model(devices=..., split="tensor:1,1")``,
vkxsplit.hubs), an all-reduce of the output projections' partial sums on the GPUs, the relay
submitting each hub's next segment. On lavapipe both hubs are VkDevices on the one CPU
device (devices "0,0"); on a machine with two devices also one hub per GPU. Checked against the
float64 reference forward pass (tests/reference.py), a one-hub model, and, for the weight
slices, gguf's own dequantization of the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from reference import reference_logits

from vkxsplit.errors import ModelError, PlanError, VkxError, WaitTimeout
from vkxsplit.gguf_model import load_model as load_gguf
from vkxsplit.hubs import shard_hparams, shard_slices, slice_weight
from vkxsplit.model import Model
from vkxsplit.ops.link import record_link_sum
from vkxsplit.vk.command import Sequence


def row_model(path, devices=(0, 1), **kw):
    """The row split over ``devices`` as the one Model builds it."""
    return Model(path, devices=devices, split="tensor:1,1", **kw)


def _device_lists():
    from vkxsplit.vk.instance import Instance

    with Instance(validation=False) as inst:
        n = len(inst.physical_devices())
    return ["0,0"] + (["0,1"] if n > 1 else [])


def _bound(want):
    # the models' own bound (test_model.test_synthetic_model_matches_reference): q8_0 weights,
    # f32 accumulation, f16 KV cache
    return 2e-3 * np.abs(want).max() + 1e-3


def _bound_rounded(want, n_reduce, bits):
    """The bound with partials rounded to a float of ``bits`` significant bits (bf16: 8, the
    implicit one and 7 stored; f16: 11) before each of ``n_reduce`` all-reduces. Round to
    nearest even is off by at most half a unit in the last place, 2^-bits of the value, so an
    all-reduce adds p0 + p1 to the residual stream off by at most 2^-bits (|p0| + |p1|). To first
    order that relative error reaches the logits unchanged (the final RMSNorm is scale-invariant,
    the output projection linear), taking the partials no larger than the hidden state they are
    added to (a residual update, not a replacement): the f32 bound plus n_reduce 2^-bits
    max|logits|."""
    return _bound(want) + n_reduce * 2.0 ** -bits * np.abs(want).max()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vkxsplit.synth import write_synthetic

    d = tmp_path_factory.mktemp("tsplit")
    return write_synthetic(d / "tiny.gguf", "tiny", "q8_0", seed=7, n_layer=3)


class _TI:
    """A stand-in for gguf_model.TensorInfo: raw bytes of a (rows, cols) matrix of ``qtype``."""

    def __init__(self, name, qtype, a, raw=None):
        self.name, self.ggml_type, self.n_dims = name, qtype, a.ndim
        if raw is not None:  # random valid blocks, for types gguf cannot quantize
            self.data = raw
        elif qtype == Q.F32:
            self.data = a.reshape(-1).view(np.uint8)
        else:
            self.data = quantize(a, qtype).reshape(-1).view(np.uint8)
        self.nbytes = self.data.nbytes
        self.cols = a.shape[-1]
        self.rows = a.shape[0] if a.ndim == 2 else 1
        self.shape = a.shape


def test_shard_dimensions_and_slices():
    """llama8b's numbers by hand: 32 query heads of 128 and 8 KV heads -> 16 and 4 per shard,
    FFN 14336 -> 7168; shard 1 holds the second half of each row range and column range."""
    import dataclasses

    hp = dataclasses.make_dataclass("HP", ["n_head", "n_head_kv", "n_ff", "head_dim", "head_dim_v"])(32, 8, 14336, 128, 128)
    sh = shard_hparams(hp)
    assert (sh.n_head, sh.n_head_kv, sh.n_ff, sh.head_dim) == (16, 4, 7168, 128)
    sl = shard_slices(hp, 1)
    assert sl["attn_q"] == ("rows", 2048, 4096) and sl["attn_k"] == ("rows", 512, 1024)
    assert sl["attn_v"] == ("rows", 512, 1024) and sl["ffn_gate"] == ("rows", 7168, 14336)
    assert sl["attn_output"] == ("cols", 2048, 4096) and sl["ffn_down"] == ("cols", 7168, 14336)
    with pytest.raises(ModelError, match="(?s)n_head 9.*layer split"):
        shard_hparams(dataclasses.replace(hp, n_head=9))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K])
def test_weight_slices_decode_to_the_slices_of_the_whole(qtype):
    """Rows and whole-block column ranges of a quantized matrix, as raw bytes, dequantize (gguf)
    to the same rows and columns of the whole matrix; a range that cuts a block is refused."""
    rng = np.random.default_rng(int(qtype))
    a = rng.standard_normal((6, 1024)).astype(np.float32)
    raw = None
    if qtype in (Q.Q4_K, Q.Q6_K):  # gguf has no quantizer for them: random blocks, f16 scales kept finite
        from gguf.constants import GGML_QUANT_SIZES

        blk, tsz = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (6 * 1024 // blk, tsz), dtype=np.uint8)
        scales = slice(0, 4) if qtype == Q.Q4_K else slice(tsz - 2, tsz)
        raw[:, scales] = np.frombuffer(rng.uniform(0.01, 0.1, raw.shape[0] * (scales.stop - scales.start) // 2)
                                       .astype(np.float16).tobytes(), np.uint8).reshape(raw.shape[0], -1)
        raw = raw.reshape(-1)
    ti = _TI("blk.0.ffn_down.weight", qtype, a, raw)
    whole = dequantize(ti.data.reshape(ti.rows, -1), qtype) if qtype != Q.F32 else a
    assert np.isfinite(whole).all()
    shape, data = slice_weight(ti, "rows", 2, 5)
    assert shape == (3, 1024)
    got = dequantize(data.reshape(3, -1), qtype) if qtype != Q.F32 else data.view(np.float32).reshape(3, -1)
    assert np.array_equal(got, whole[2:5])
    shape, data = slice_weight(ti, "cols", 512, 1024)
    assert shape == (6, 512) and data.flags.c_contiguous
    got = dequantize(data.reshape(6, -1), qtype) if qtype != Q.F32 else data.view(np.float32).reshape(6, -1)
    assert np.array_equal(got, whole[:, 512:])
    if qtype in (Q.Q8_0, Q.Q4_K):
        with pytest.raises(ModelError, match="cut its"):
            slice_weight(ti, "cols", 16 if qtype == Q.Q8_0 else 128, 1024)


def _hidden(shard, T):
    from vkxsplit.vk.command import staged_download

    return staged_download(shard.act["x"], 0, T * shard.hp.n_embd * 4).view(np.float32)


@pytest.mark.parametrize("devices", _device_lists())
@pytest.mark.parametrize("partials", ["f32", "f16", "bf16"])
def test_tensor_split_matches_the_reference_and_one_hub(device, tiny, devices, partials):
    """Teacher-forced logits of a 21-token prompt in steps of 16 and 5 against the float64 forward
    pass and a one-hub model; both shards end each step with bit-identical hidden states; greedy
    decode gives the one-hub model's tokens (both shards' KV caches carry over); the traffic
    counts both partials of every all-reduce; no validation message on either device. f16 and
    bf16 partials: each rounded once (2^-11, 2^-8 relative) before the f32 sum, so a wider bound
    (:func:`_bound_rounded`, 6 all-reduces)."""
    from vkxsplit.model import load_model

    isz = 4 if partials == "f32" else 2
    bound = {"f32": _bound, "f16": lambda w: 4e-3 * np.abs(w).max() + 1e-3,
             "bf16": lambda w: _bound_rounded(w, 2 * 3, 8)}[partials]

    ids = [int(i) for i in np.random.default_rng(5).integers(0, 512, 21)]
    with load_gguf(tiny) as mf:
        want = reference_logits(mf, ids)
    with load_model(tiny, device=device, n_ctx=64, ubatch=16) as one:
        hub = one.logits(ids)
        hub_tokens = list(one.generate_ids(ids[:6], 8, stop_ids=set()))
    with row_model(tiny, devices=devices, n_ctx=64, ubatch=16, partials=partials) as m:
        got = m.logits(ids)
        assert np.abs(got - want).max() <= bound(want)
        assert np.abs(got - hub).max() <= bound(want)
        assert np.array_equal(_hidden(m.shares[0], 5), _hidden(m.shares[1], 5))
        # each shard holds half of every split matrix (and whole norms and embeddings)
        names = m.shares[1].weights
        assert names["blk.0.attn_q.weight"].shape == (128, 256) and names["blk.0.ffn_down.weight"].shape == (256, 512)
        assert "output.weight" not in names and m.shares[1].logits_buf is None
        assert m.traffic["all_reduces"] == 2 * 2 * 3  # two steps, attention and FFN of 3 layers
        assert m.traffic["crossed_bytes"] == (16 + 5) * 256 * isz * 2 * 2 * 3
        assert list(m.generate_ids(ids[:6], 8, stop_ids=set())) == hub_tokens
        assert m.last_traffic == 256 * isz * 2 * 2 * 3  # a decode step: one row per all-reduce
        assert np.array_equal(_hidden(m.shares[0], 1), _hidden(m.shares[1], 1))
        msgs = [msg for d in m.hubs for msg in d.instance.messages]
    assert not msgs, msgs


def test_bad_input_is_refused(tiny, tmp_path):
    """Heads that do not divide (smol135m: 9 heads), a device count other than two, split_mode
    without devices: refused with the reason, nothing left open."""
    import vkxsplit
    from vkxsplit.synth import write_synthetic

    odd = write_synthetic(tmp_path / "odd.gguf", "smol135m", "q8_0", seed=1, n_vocab=300, n_layer=1)
    with pytest.raises(ModelError, match="n_head 9"):
        row_model(odd, devices="0,0", n_ctx=32, ubatch=8)
    with pytest.raises(PlanError, match="over two hubs"):
        row_model(tiny, devices="0,0,0", n_ctx=32, ubatch=8)
    with pytest.raises(PlanError, match="give equal shares over two hubs"):
        Model(tiny, devices="0,0", split="tensor:3,1", n_ctx=32, ubatch=8)
    with pytest.raises(VkxError, match="go with --split-mode layer"):
        vkxsplit.load_model(tiny, devices="0,0", split_mode="row", layer_split="1,1")
    with pytest.raises(VkxError, match="go with devices"):
        vkxsplit.load_model(tiny, split_mode="row")
    with pytest.raises(VkxError, match="cross as f32, f16, bf16, or auto"):
        row_model(tiny, devices="0,0", n_ctx=32, ubatch=8, partials="q8_0")
    with pytest.raises(VkxError, match="is not 'layer' or 'row'"):
        vkxsplit.load_model(tiny, devices="0,0", split_mode="rows")
    with vkxsplit.load_model(tiny, devices="0,0", split_mode="row", n_ctx=32, ubatch=8) as m:
        assert isinstance(m, Model) and str(m.split) == "tensor:1,1" and len(m.shares) == 2
        with pytest.raises(VkxError, match="more than ubatch"):
            m._run(list(range(9)), all_logits=False)
        with pytest.raises(VkxError, match="not supported"):
            m.set_split("layer")


class _HeldQueue:
    """``dev``'s queue held behind a gate: a copy submitted to wait on it, so every later submit
    on that queue waits too, until :meth:`release`."""

    def __init__(self, dev):
        from vkxsplit.ops.copy import record_copy
        from vkxsplit.vk.command import Sequence
        from vkxsplit.vk.event import Gate

        self.gate = Gate(dev)
        self.hold = self.gate.hold(watchdog_s=30)
        self.bufs = (dev.memory.alloc(256, "device", "a"), dev.memory.alloc(256, "device", "b"))
        self.blocker = Sequence(dev, "blocker")
        record_copy(self.blocker, *self.bufs, 256)
        self.blocker.submit(waits=[self.hold.point])

    def release(self):
        self.hold.release()
        self.blocker.wait(30)

    def close(self):
        self.blocker.close()
        for b in self.bufs:
            b.close()
        self.gate.close()


def test_a_stuck_shard_is_reported_not_run_silently(tiny):
    """Shard 1's queue held behind a gate: the relay gives up on shard 1's first segment and the
    step raises its WaitTimeout (naming the timeline that did not get there); the step's later
    segments are never submitted. While shard 1's held segment is pending the model refuses a new
    step (it would overwrite what that segment reads); once the gate opens the next steps run and
    match the reference."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    other = [7, 7, 2, 9, 1]
    with load_gguf(tiny) as mf:
        want = reference_logits(mf, other)
    with row_model(tiny, devices="0,0", n_ctx=32, ubatch=8, timeout=0.5) as m:
        held = _HeldQueue(m.hubs[1])  # shard 1's step queues behind it
        ex = m._executor(8, True)

        def submits():
            return [sum(q.submits for q, s in zip(ex._seqs, ex.schedule.segments) if s.hub == h) for h in (0, 1)]

        before = submits()
        with pytest.raises(WaitTimeout, match="relay: hub1 .*did not reach"):
            m._run(ids, all_logits=True)
        assert m.n_past == 0
        assert [x - y for x, y in zip(submits(), before)] == [1, 1]  # segment 0 only, on each shard
        m.timeout = 0.2
        with pytest.raises(VkxError, match="still running"):
            m.logits(other)
        held.release()
        m.timeout = 60.0
        m.relay.timeout = 60.0
        got = m.logits(other)
        assert np.abs(got - want).max() <= _bound(want)
        held.close()
        msgs = [msg for d in m.hubs for msg in d.instance.messages]
    assert not msgs, msgs


def test_command_line(tiny, tmp_path):
    """``vkxsplit bench --devices 0,0 --split-mode row`` runs the tensor split and reports the
    bytes of both partials of every all-reduce per step; it refuses --layer-split."""
    import json

    from test_tools import run_tool

    def cli(*args):
        return run_tool(["-m", "vkxsplit", *args], tmp_path)

    r = cli("bench", "-m", str(tiny), "--devices", "0,0", "-sm", "row", "-p", "8", "-n", "2", "-r", "1",
            "-c", "32", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {row["test"] for row in rows} == {"pp8", "tg2"} and all(row["tps_mean"] > 0 for row in rows)
    assert all(row["backends"] == "vulkan x2" and row["split"].startswith("tensor:1,1: tensor split") for row in rows)
    per = {row["test"]: row["crossed_bytes_per_step"] for row in rows}
    assert per == {"pp8": 8 * 256 * 4 * 2 * 6, "tg2": 256 * 4 * 2 * 6}
    r = cli("bench", "-m", str(tiny), "--devices", "0,0", "-sm", "row", "--layer-split", "1,1", "-p", "8", "-n", "0")
    assert r.returncode != 0 and "--split-mode layer" in r.stderr and "Traceback" not in r.stderr


def test_close_with_a_stuck_shard_frees_nothing_in_use(tiny, caplog):
    """Closing right after a failed step whose segment is still queued behind a stuck GPU must
    not free the memory, timeline, host pages or devices that segment will use: close() logs
    and leaves them allocated; once the GPU moves on they can be freed in the usual order."""
    import logging

    m = row_model(tiny, devices="0,0", n_ctx=32, ubatch=8, timeout=0.3)
    held = _HeldQueue(m.hubs[1])
    with pytest.raises(WaitTimeout):
        m._run([3, 1, 4], all_logits=False)
    pages, devices = m.links[0], list(m.hubs)
    with caplog.at_level(logging.ERROR, logger="vkxsplit.model"):
        m.close()
    assert "still queued" in caplog.text
    assert all(d.handle is not None for d in devices) and pages.mapping is not None  # nothing freed
    held.release()
    for d in devices:
        d.wait_idle()  # the held segment ran (on memory still allocated)
    held.close()
    m._free()  # now everything goes, in the usual order
    assert all(d.handle is None for d in devices) and pages.mapping is None


def _bf16_sum(a, b):
    """The all-reduce as specified: each partial rounded to bf16 (round to nearest even,
    ml_dtypes), widened, added in f32."""
    import ml_dtypes

    return a.astype(ml_dtypes.bfloat16).astype(np.float32) + b.astype(ml_dtypes.bfloat16).astype(np.float32)


def _truncated(x):
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def test_bf16_all_reduce_rounds_each_partial_to_nearest_even(device):
    """One all-reduce as the row split records it (vkxsplit.hubs.HubShare._reduce): each shard
    converts its f32 partial to bf16 for itself and for the other (convert_f32_bf16), then
    ``link_sum_bf16`` adds the two in f32. Both shards' sums are bit-identical and equal to
    ml_dtypes' round-to-nearest-even bf16 of each partial added in f32. The inputs hold exact
    ties (the low 16 bits 0x8000, after an even and after an odd bf16), signs, a wide range of
    exponents and subnormals; a reduction that truncated to bf16, or dropped the other shard's
    partial, is told apart by the same comparison."""
    from vkxsplit.ops.convert import record_convert

    n = 4096
    rng = np.random.default_rng(27)
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    hi = rng.integers(0, 1 << 16, 512, dtype=np.uint32) & np.uint32(0x7F7F)  # finite bf16s
    a[:512] = ((hi << np.uint32(16)) | np.uint32(0x8000)).view(np.float32)  # ties
    b[:512] = -a[:512]
    a[512:520] = np.float32(1e-40)  # subnormals
    mem = device.memory
    bufs = [mem.alloc(nb, "host", nm) for nm, nb in (("a", 4 * n), ("b", 4 * n), ("a16", 2 * n), ("b16", 2 * n),
                                                      ("pa", 2 * n), ("pb", 2 * n), ("sa", 4 * n), ("sb", 4 * n))]
    ba, bb, a16, b16, pa, pb, sa, sb = bufs
    try:
        ba.numpy(np.float32)[:] = a
        bb.numpy(np.float32)[:] = b
        for d in (sa, sb):
            d.numpy(np.float32)[:] = np.nan
        seq = Sequence(device, "all-reduce")
        for own, own16, pub in ((ba, a16, pa), (bb, b16, pb)):  # each shard: its own copy, its publish
            record_convert(seq, own, own16, n, "f32", "bf16")
            record_convert(seq, own, pub, n, "f32", "bf16")
        seq.barrier()
        record_link_sum(seq, a16, pb, sa, n, parts="bf16")
        record_link_sum(seq, b16, pa, sb, n, parts="bf16")
        seq.run(timeout=60)
        seq.close()
        got_a, got_b = sa.numpy(np.float32).copy(), sb.numpy(np.float32).copy()
    finally:
        for x in bufs:
            x.close()
    assert np.array_equal(got_a.view(np.uint32), got_b.view(np.uint32))  # both shards: the same floats
    want = _bf16_sum(a, b)
    assert np.array_equal(got_a, want)
    # deliberately wrong reductions do not pass the same comparison
    assert not np.array_equal(got_a, _truncated(a) + _truncated(b))  # truncation instead of RNE
    assert not np.array_equal(got_a, _bf16_sum(a, np.zeros_like(b)))  # the other partial dropped
    assert not np.array_equal(got_a, a + b)  # no rounding at all (f32 partials)


def test_a_dropped_partial_breaks_the_bf16_bound(tiny, monkeypatch):
    """The logits bound of the bf16 all-reduce (:func:`_bound_rounded`) is tight enough to catch
    a wrong reduction: with ``link_sum`` adding a shard's own partial twice instead of the
    other's (the other partial dropped) the logits leave it."""
    import vkxsplit.ops.nodes as nodes

    ids = [int(i) for i in np.random.default_rng(5).integers(0, 512, 12)]
    with load_gguf(tiny) as mf:
        want = reference_logits(mf, ids)
    orig = nodes.record_link_sum
    monkeypatch.setattr(nodes, "record_link_sum", lambda seq, a, peer, dst, n, **kw: orig(seq, a, a, dst, n, **kw))
    with row_model(tiny, devices="0,0", n_ctx=32, ubatch=16, partials="bf16") as m:
        got = m.logits(ids)
    assert np.abs(got - want).max() > _bound_rounded(want, 2 * 3, 8)


def test_reduce_threshold_from_the_ladder():
    """The measured threshold: the smallest size from which bf16 is no slower at it and every
    larger size; None when bf16 loses at the largest."""
    from vkxsplit.calibrate import reduce_min_bytes

    sizes = [1, 2, 3, 4]
    assert reduce_min_bytes(sizes, [5, 5, 5, 5], [6, 4, 6, 4]) == 4
    assert reduce_min_bytes(sizes, [5, 5, 5, 5], [6, 4, 4, 4]) == 2
    assert reduce_min_bytes(sizes, [5, 5, 5, 5], [1, 1, 1, 1]) == 1
    assert reduce_min_bytes(sizes, [5, 5, 5, 5], [1, 1, 1, 6]) is None


def test_auto_partials_follow_the_measured_threshold(tiny, tmp_path, monkeypatch):
    """partials='auto' (the default): the all-reduce sends a partial of at least the threshold
    (bytes as f32) in bf16, a smaller one in f32. The threshold is measured once per device and
    kept in its profile (here lavapipe, whose host pages are the same RAM: bf16 only adds
    conversions); with a threshold of 16 KiB put there, a 16-token step of the 256-wide model
    (16 KiB partials) crosses in bf16, a 5-token one and decode in f32, and the bytes counted
    per step say so; ``VKXSPLIT_DISABLE=bf16_reduce`` keeps every partial f32."""
    from vkxsplit.calibrate import REDUCE_SIZES, reduce_min_bytes
    from vkxsplit.plan.cost import REDUCE_KEY

    ids = [int(i) for i in np.random.default_rng(5).integers(0, 512, 21)]
    with load_gguf(tiny) as mf:
        want = reference_logits(mf, ids)
    per = 256 * 2 * 2 * 3  # (elements of a token's partial) x both partials x attention and FFN x layers
    with row_model(tiny, devices="0,0", n_ctx=64, ubatch=16, profile_dir=tmp_path) as m:
        assert m.partials == "auto" and "measured at the first step" in m.split_label
        m.logits([1, 2, 3, 4, 5])
        got = m.cost.profile.get("hub", REDUCE_KEY)  # measured, saved
        assert got["sizes"] == list(REDUCE_SIZES) and len(got["f32_s"]) == len(got["bf16_s"]) == len(REDUCE_SIZES)
        assert got["min_bytes"] == reduce_min_bytes(got["sizes"], got["f32_s"], got["bf16_s"])
        assert (m.reduce_dtype(16 << 20) == "bf16") == (got["min_bytes"] is not None)
    with row_model(tiny, devices="0,0", n_ctx=64, ubatch=16, profile_dir=tmp_path) as m:
        m.cost.profile.put("hub", REDUCE_KEY, {"min_bytes": 16 * 256 * 4})
        got = m.logits(ids)
        assert m.traffic["crossed_bytes"] == 16 * per * 2 + 5 * per * 4
        assert np.abs(got - want).max() <= _bound_rounded(want, 2 * 3, 8)
        text = m.plan(16).describe()
        assert "6 all-reduces per step, partials crossing as bf16 (6)" in text
        assert f"between hubs: {16 * per * 2} bytes per step" in text
        assert "crossing as f32 (6)" in m.plan(5).describe()
        list(m.generate_ids(ids[:3], 2, stop_ids=set()))
        assert m.last_traffic == 1 * per * 4
        assert "bf16 from 16384 bytes (measured)" in m.split_label
    monkeypatch.setenv("VKXSPLIT_DISABLE", "bf16_reduce")
    with row_model(tiny, devices="0,0", n_ctx=64, ubatch=16, profile_dir=tmp_path) as m:
        m.cost.profile.put("hub", REDUCE_KEY, {"min_bytes": 16 * 256 * 4})
        m.logits(ids)
        assert m.traffic["crossed_bytes"] == (16 + 5) * per * 4
        assert "VKXSPLIT_DISABLE=bf16_reduce" in m.split_label
        assert not [msg for d in m.hubs for msg in d.instance.messages]
