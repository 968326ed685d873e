"""The vulkan peer backend (vkxsplit/backends/vulkan_peer.py) on lavapipe.

The peer is a second logical device on the one lavapipe physical device: ``shared`` memory
(the hub's export-pool blocks imported by opaque fd, zero copies) and the host bridge (lavapipe
exports no semaphore fds). The ``split`` mode of two different GPUs (weights copied into the
peer, activations through host pages both devices import) runs here on a peer whose
PhysicalDeviceInfo carries a faked deviceUUID. Chains are submitted in one go; the caller never
waits in between. The GPU-side event path (imported timelines) is skipped with its reason here.

Error bound of a product (elementwise, as tests/test_mul_mat.py): (K + 4) 2^-24 (|x| @ |W|^T)
for f32 and the symmetric quants used here (q8_0: W = d * q).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
from conftest import WAIT_S
from gguf import quants
from gguf.constants import GGMLQuantizationType

from vkxsplit.attach import SharedArena, stats
from vkxsplit.backend import MatMulJob, available_backends, backend_availability, create_backend, row_bytes
from vkxsplit.backends.vulkan_peer import (
    PeerTraffic,
    VulkanPeerBackend,
    _empty_submit,
    k_slice_job,
    k_slice_rows,
    k_split_bounds,
    peer_timeline_support,
    record_reduce_add,
    uuid_mismatch,
)
from vkxsplit.errors import EnvironmentProblem, KernelError
from vkxsplit.ops.convert import record_convert
from vkxsplit.ops.mul_mat import record_mul_mat
from vkxsplit.vk.event import Timeline

TIMEOUT = WAIT_S  # (conftest: first dispatches compile inside the wait on lavapipe)
U = 2.0 ** -24
FAKE_UUID = bytes(range(0xA0, 0xB0))


@pytest.fixture(scope="module")
def peer(device):
    """A peer on the hub's own physical device (shared memory), also on a multi-GPU host, where
    the default peer is another GPU (split mode: tests/test_vulkan_peer.py's split_peer covers
    that path on any machine)."""
    b = create_backend("vulkan-peer", device, device=device.physical.index, timeout=TIMEOUT, traffic=PeerTraffic())
    yield b
    b.close()


@pytest.fixture(scope="module")
def split_peer(device):
    """A peer that believes it is another GPU: its deviceUUID differs from the hub's."""
    fake = dataclasses.replace(device.physical, device_uuid=FAKE_UUID)
    b = VulkanPeerBackend(device, device=fake, timeout=TIMEOUT, traffic=PeerTraffic())
    yield b
    b.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_targets() -> dict[str, str]:
    from vkxsplit.native import open_fd_targets

    return open_fd_targets()


def put(arena, a, name=""):
    """A shared buffer holding ``a`` (written through the hub buffer: device-local export
    memory on a discrete GPU gets a staging copy)."""
    a = np.ascontiguousarray(a)
    sb = arena.alloc(a.nbytes, name)
    sb.buffer.write(a)
    return sb


def get(sb, *shape):
    return sb.buffer.read(np.float32)[:int(np.prod(shape))].reshape(shape)


def poison(sb):
    sb.buffer.write(np.full(sb.size // 4, np.nan, np.float32))


def weights(rng, wtype, N, K):
    """(raw ggml rows, float64 values) of a random N x K weight."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    if wtype == "f32":
        return w, w.astype(np.float64)
    t = GGMLQuantizationType[wtype.upper()]
    raw = quants.quantize(w, t)
    return raw, np.asarray(quants.dequantize(raw, t), np.float64)


def check(got, ref, x, w, device=None):
    """f32-accumulate bound; where ``device`` would take the coopmat path (M > 8 on a GPU with
    cooperative matrices: f16 operands) the bound of test_mul_mat's coopmat test."""
    assert not np.isnan(got).any(), "an element was not written"
    from vkxsplit.ops.mul_mat import MAX_VEC_M, coopmat_available

    terms = np.abs(x).astype(np.float64) @ np.abs(w).T
    if device is not None and x.shape[0] > MAX_VEC_M and coopmat_available(device):
        bound = (2.0 ** -10 + 2 * x.shape[1] * 2.0 ** -23) * terms
    else:
        bound = (x.shape[1] + 4) * U * terms
    err = np.abs(got.astype(np.float64) - ref)
    assert (err <= bound).all(), f"worst error {err.max():.3g}, ratio {np.max(err / bound):.3g}"


# --------------------------------------------------------------------------------------------
# construction, negotiation, refusal


def test_registered_and_negotiated_on_lavapipe(device, peer):
    assert backend_availability(["vulkan-peer"])["vulkan-peer"]
    assert "vulkan-peer" in available_backends()
    assert peer.name == "vulkan-peer"  # "vulkan" is the planner's name for the hub itself
    assert peer.mode == "shared" and peer.mismatch is None
    assert peer.peer is not device and peer.peer.physical.device_uuid == device.physical.device_uuid
    assert peer.caps.memory_handles == ("opaque_fd", "host_allocation")
    # lavapipe exports no semaphore fds: the host bridge, with the reason recorded
    why = peer_timeline_support(device, peer.peer.physical)
    if why is not None:
        assert peer.events.kind == "host" and "semaphore" in why
    arena = SharedArena(device, [peer])
    assert arena.kind == "opaque_fd", arena.choice.describe()


def test_the_planner_accepts_the_name_and_rates(device, peer):
    plan = pytest.importorskip("vkxsplit.plan")
    assert peer.name not in getattr(plan, "HUB_ALIASES", ("hub", "vulkan"))
    rate = peer.calibrate()["mul_mat_gflops"]
    assert rate > 0 and peer.calibrate()["mul_mat_gflops"] == rate  # measured once


def test_empty_batches_wait_and_signal_on_the_peer_queue(device, peer):
    """The GPU-event path's command-less batch (its refusals use it), on the peer's own timelines."""
    a, b = Timeline(peer.peer, name="a"), Timeline(peer.peer, name="b")
    try:
        _empty_submit(peer.peer, [(a, 1)], [(b, 5)])  # waits before the signal exists: legal
        assert b.value == 0
        a.signal(1)
        b.wait(5, TIMEOUT)
    finally:
        a.close()
        b.close()


def test_foreign_uuid_is_refused_with_the_reason(device, split_peer):
    fake = dataclasses.replace(device.physical, device_uuid=FAKE_UUID)
    why = uuid_mismatch(device.physical, fake)
    assert why is not None and "deviceUUID" in why and "a0a1a2a3-" in why
    with pytest.raises(EnvironmentProblem, match="cannot share the hub's memory in place.*deviceUUID"):
        VulkanPeerBackend(device, device=fake, memory="shared")
    with pytest.raises(EnvironmentProblem, match="GPU-side events .*deviceUUID"):
        VulkanPeerBackend(device, device=fake, events="timeline_opaque_fd")
    # the default falls back to the two-GPU data path, which never imports opaque fds
    assert split_peer.mode == "split" and split_peer.caps.memory_handles == ("host_allocation",)
    assert split_peer.events.kind == "host"
    arena = SharedArena(device, wants=[("opaque_fd",)])
    try:
        w, x, y = arena.alloc(64 * 32 * 4), arena.alloc(32 * 4), arena.alloc(64 * 4)
        p = split_peer.next_point()
        with pytest.raises(EnvironmentProblem, match="refusing to import .* by opaque fd.*deviceUUID"):
            split_peer.mul_mat(MatMulJob(w.view(), "f32", x.view(), y.view(), 1, 64, 32), None, p)
        split_peer.wait(p, TIMEOUT)  # refused, yet signalled: hub work behind it is not stranded
        assert split_peer.imports == 0
    finally:
        arena.close()


def test_refused_jobs_still_signal_their_point(device, peer, seqs):
    arena = SharedArena(device, [peer])
    staged = SharedArena(device, force="staged")
    try:
        w, x, y = arena.alloc(64 * 32 * 4), arena.alloc(32 * 4), arena.alloc(64 * 4)
        after = seqs("after")
        record_convert(after, y.view(), y.view(0, 16), 1, "f32", "f32")
        p = peer.next_point()
        with pytest.raises(KernelError, match="computes in f32"):
            peer.mul_mat(MatMulJob(w.view(), "f32", x.view(), y.view(), 1, 64, 16, x_type="bf16"), None, p)
        v = after.submit(waits=[p])
        sx = staged.alloc(32 * 4)
        p2 = peer.next_point()
        with pytest.raises(KernelError, match="cannot reach staged memory"):
            peer.mul_mat(MatMulJob(w.view(), "f32", sx.view(), y.view(), 1, 64, 32), None, p2)
        v2 = after.submit(waits=[p2])
        after.timeline.wait(max(v, v2), TIMEOUT)
        peer.check()
    finally:
        arena.close()
        staged.close()


# --------------------------------------------------------------------------------------------
# hub -> peer -> hub


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_hub_peer_hub_zero_copy(device, peer, seqs, rng, wtype, caller_waits):
    arena = SharedArena(device, [peer])
    try:
        M, N, K, r0 = 5, 96, 256, 16
        raw, wd = weights(rng, wtype, N, K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        xs, ys = K + 8, N + 3  # strided rows
        x_in, xa = put(arena, np.pad(x, ((0, 0), (0, 8)))), arena.alloc(M * xs * 4)
        wb, y, out = put(arena, raw), arena.alloc(M * ys * 4), arena.alloc(M * ys * 4)
        poison(y)
        s1, s2 = seqs("hub-in"), seqs("hub-out")
        record_convert(s1, x_in.view(), xa.view(), M * xs, "f32", "f32")
        record_convert(s2, y.view(), out.view(), M * ys, "f32", "f32")
        job = MatMulJob(wb.view(), wtype, xa.view(), y.view(), M, N, K, x_stride=xs, y_stride=ys, r0=r0)
        t0 = peer.traffic.snapshot()
        staged0 = stats.staged_bytes
        for scale in (1.0, -2.0):  # the second step sees new x: the peer reads the hub's memory in place
            x_in.buffer.write(np.pad(x * scale, ((0, 0), (0, 8))))
            caller_waits.clear()
            stats.begin_step()
            peer.traffic.begin_step()
            v1 = s1.submit()
            p = peer.next_point()
            peer.mul_mat(job, (s1.timeline, v1), p)
            v2 = s2.submit(waits=[p])
            assert stats.host_waits_in_step == 0 and caller_waits == []
            step = peer.traffic.step()
            assert step["crossed_bytes"] == 0  # one physical device: nothing crossed
            assert step["inplace_bytes"] == ((M - 1) * xs + K) * 4 + M * (N - r0) * 4
            s2.wait(TIMEOUT)
            peer.check()
            assert s2.timeline.value >= v2
            got = get(out, M, ys)
            check(got[:, r0:N], (x * scale).astype(np.float64) @ wd[r0:].T, x, wd[r0:])
            assert np.isnan(got[:, :r0]).all() and np.isnan(got[:, N:]).all()  # only the job's columns
        assert stats.staged_bytes == staged0 == 0
        t1 = peer.traffic.snapshot()
        assert t1["recorded"] - t0["recorded"] == 1 and t1["replays"] - t0["replays"] == 1
        assert t1["loaded_bytes"] == t0["loaded_bytes"]  # nothing copied into the peer
        assert peer.imports >= 1
    finally:
        arena.close()
    assert peer.imports == 0  # freeing the hub memory released the peer's imports


def test_two_peer_jobs_in_one_chain_without_caller_waits(device, peer, seqs, rng, caller_waits):
    """hub -> peer -> hub -> peer -> hub, two steps, all submitted before anything is collected."""
    arena = SharedArena(device, [peer])
    try:
        M, K, N1, N2 = 4, 128, 64, 32
        x = rng.standard_normal((M, K)).astype(np.float32)
        raw1, w1 = weights(rng, "q8_0", N1, K)
        raw2, w2 = weights(rng, "f32", N2, N1)
        x_in, xa = put(arena, x), arena.alloc(x.nbytes)
        b1, b2 = put(arena, raw1), put(arena, raw2)
        y1, h1, y2 = arena.alloc(M * N1 * 4), arena.alloc(M * N1 * 4), arena.alloc(M * N2 * 4)
        outs = [arena.alloc(M * N2 * 4) for _ in range(2)]
        s1, s2 = seqs("a"), seqs("b")
        s3 = [seqs("c0"), seqs("c1")]
        record_convert(s1, x_in.view(), xa.view(), M * K, "f32", "f32")
        record_convert(s2, y1.view(), h1.view(), M * N1, "f32", "f32")
        for s, o in zip(s3, outs):
            record_convert(s, y2.view(), o.view(), M * N2, "f32", "f32")
        j1 = MatMulJob(b1.view(), "q8_0", xa.view(), y1.view(), M, N1, K)
        j2 = MatMulJob(b2.view(), "f32", h1.view(), y2.view(), M, N2, N1)
        caller_waits.clear()
        stats.begin_step()
        t = time.monotonic()
        for step in range(2):
            v1 = s1.submit()
            p1 = peer.next_point()
            peer.mul_mat(j1, (s1.timeline, v1), p1)
            v2 = s2.submit(waits=[p1])
            p2 = peer.next_point()
            peer.mul_mat(j2, (s2.timeline, v2), p2)
            s3[step].submit(waits=[p2])
        assert time.monotonic() - t < 2.0
        assert stats.host_waits_in_step == 0 and caller_waits == []
        s3[1].wait(TIMEOUT)
        peer.check()
        ref1 = x.astype(np.float64) @ w1.T
        a = get(h1, M, N1)
        check(a, ref1, x, w1)
        for o in outs:
            check(get(o, M, N2), a.astype(np.float64) @ w2.T, a, w2, device)
    finally:
        arena.close()


# --------------------------------------------------------------------------------------------
# tensor split and K split


@pytest.mark.parametrize("mode", ["shared", "split"])
def test_tensor_split_hub_rows_and_peer_rows_into_one_y(device, peer, split_peer, seqs, rng, mode, caller_waits):
    """Hub rows [0, r) and peer rows [r, N) of one q8_0 matrix; M=16 (the tiled kernels)."""
    b = peer if mode == "shared" else split_peer
    arena = SharedArena(device, [b])
    assert arena.kind == ("opaque_fd" if mode == "shared" else "host_allocation")
    try:
        M, N, K, r = 16, 160, 128, 96
        raw, wd = weights(rng, "q8_0", N, K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        x_in, xa, wb = put(arena, x), arena.alloc(x.nbytes), put(arena, raw)
        y, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4)
        poison(y)
        s1, s2 = seqs("split-in"), seqs("split-out")
        record_convert(s1, x_in.view(), xa.view(), M * K, "f32", "f32")
        record_mul_mat(s1, wb.view(), "q8_0", xa.view(), y.view(), M, r, K, y_stride=N)  # hub: rows [0, r)
        record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
        job = MatMulJob(wb.view(), "q8_0", xa.view(), y.view(), M, N, K, r0=r, r1=N)
        l0 = b.traffic.loaded_bytes
        for _step in range(2):
            caller_waits.clear()
            stats.begin_step()
            b.traffic.begin_step()
            v1 = s1.submit()
            p = b.next_point()
            b.mul_mat(job, (s1.timeline, v1), p)
            s2.submit(waits=[p])
            assert stats.host_waits_in_step == 0 and caller_waits == []
            step = b.traffic.step()
            s2.wait(TIMEOUT)
            b.check()
            check(get(out, M, N), x.astype(np.float64) @ wd.T, x, wd, device)
            act = M * K * 4 + M * (N - r) * 4
            if mode == "shared":
                assert step["crossed_bytes"] == 0 and step["inplace_bytes"] == act
            else:  # another GPU: x in, its y columns out, per step
                assert step["crossed_bytes"] == act and step["inplace_bytes"] == 0
        rows_bytes = (N - r) * row_bytes("q8_0", K)
        if mode == "split":  # it holds its row slice, loaded once
            assert b.traffic.loaded_bytes - l0 == rows_bytes
            assert b.resident_weight_bytes == rows_bytes
            b.unload(wb.view())
            assert b.resident_weight_bytes == 0
        else:
            assert b.traffic.loaded_bytes == l0 and b.resident_weight_bytes == 0
        assert stats.staged_bytes == 0
    finally:
        arena.close()
    assert b.imports == 0 and b.resident_weight_bytes == 0


def test_split_mode_reloads_a_weight_whose_buffer_was_replaced(device, split_peer, rng):
    """The peer's copy of a weight dies with the hub buffer, even when the chunk lives on and
    the next buffer lands in the same place."""
    arena = SharedArena(device, [split_peer])
    try:
        M, N, K = 2, 32, 64
        x = rng.standard_normal((M, K)).astype(np.float32)
        xb, y = put(arena, x), arena.alloc(M * N * 4)
        keep = arena.alloc(16)  # keeps the chunk alive
        places = []
        for _ in range(2):
            raw, wd = weights(rng, "f32", N, K)
            wb = put(arena, raw)
            places.append((wb.chunk.id, wb.chunk_offset))
            p = split_peer.next_point()
            split_peer.mul_mat(MatMulJob(wb.view(), "f32", xb.view(), y.view(), M, N, K), None, p)
            split_peer.wait(p, TIMEOUT)
            check(get(y, M, N), x.astype(np.float64) @ wd.T, x, wd, device)
            assert split_peer.resident_weight_bytes == N * K * 4
            wb.close()
            assert split_peer.resident_weight_bytes == 0
        assert places[0] == places[1]  # same chunk, same offset: only the buffer's close tells
        keep.close()
    finally:
        arena.close()


def test_k_split_bounds_and_slices(rng):
    assert k_split_bounds(256, "q8_0") == [(0, 128), (128, 256)]
    assert k_split_bounds(1024, "q4_k", (1, 2, 1)) == [(0, 256), (256, 768), (768, 1024)]
    assert k_split_bounds(64, "f32", (0.9, 0.1)) == [(0, 58), (58, 64)]
    with pytest.raises(KernelError):
        k_split_bounds(32, "q8_0", (1, 1))  # one block cannot be split in two
    raw, wd = weights(rng, "q8_0", 8, 256)
    part = k_slice_rows(raw, "q8_0", 256, 64, 192)
    got = quants.dequantize(part, GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(got, wd[:, 64:192])


@pytest.mark.parametrize("mode", ["shared", "split"])
def test_k_split_partials_reduced_on_the_hub(device, peer, split_peer, seqs, rng, mode, caller_waits):
    """A down projection split along K: the hub's partial over [0, k) and the peer's over [k, K)
    run concurrently and the hub adds them (record_reduce_add) on the GPU."""
    b = peer if mode == "shared" else split_peer
    arena = SharedArena(device, [b])
    try:
        M, N, K = 4, 64, 512
        raw, wd = weights(rng, "q8_0", N, K)
        (k0, k1), (k2, k3) = k_split_bounds(K, "q8_0", (0.5, 0.5))
        assert k1 == k2 and k0 == 0 and k3 == K
        x = rng.standard_normal((M, K)).astype(np.float32)
        x_in, xa = put(arena, x), arena.alloc(x.nbytes)
        w_hub = put(arena, k_slice_rows(raw, "q8_0", K, k0, k1))   # each GPU holds its K slice
        w_peer = put(arena, k_slice_rows(raw, "q8_0", K, k2, k3))
        y_hub, y_peer, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4), arena.alloc(M * N * 4)
        s0, s1, s2 = seqs("x"), seqs("hub-partial"), seqs("reduce")
        record_convert(s0, x_in.view(), xa.view(), M * K, "f32", "f32")
        record_mul_mat(s1, w_hub.view(), "q8_0", xa.view(), y_hub.view(), M, N, k1 - k0, x_stride=K, x_offset=k0)
        record_reduce_add(s2, [y_hub.view(), y_peer.view()], out.view(), M, N)
        job = k_slice_job(w_peer.view(), "q8_0", xa.view(), y_peer.view(), M, N, K, k2, k3)
        caller_waits.clear()
        stats.begin_step()
        b.traffic.begin_step()
        v0 = s0.submit()
        p = b.next_point()
        b.mul_mat(job, (s0.timeline, v0), p)  # the peer's partial ...
        s1.submit()                             # ... while the hub computes its own
        s2.submit(waits=[p])
        assert stats.host_waits_in_step == 0 and caller_waits == []
        s2.wait(TIMEOUT)
        b.check()
        yh, yp = get(y_hub, M, N), get(y_peer, M, N)
        x64 = x.astype(np.float64)
        check(yp, x64[:, k2:] @ wd[:, k2:].T, x[:, k2:], wd[:, k2:])
        got = get(out, M, N)
        np.testing.assert_array_equal(got, yh + yp)  # the reduction is one f32 add
        check(got, x64 @ wd.T, x, wd)
        moved = b.traffic.step()["crossed_bytes" if mode == "split" else "inplace_bytes"]
        assert moved == ((M - 1) * K + (k3 - k2)) * 4 + M * N * 4
    finally:
        arena.close()


def test_reduce_add_of_three_partials_in_place(device, seqs, rng):
    arena = SharedArena(device, force="staged")
    try:
        M, N = 3, 40
        parts = [rng.standard_normal((M, N)).astype(np.float32) for _ in range(3)]
        bufs = [put(arena, p) for p in parts]
        s = seqs("reduce3")
        record_reduce_add(s, [b.buffer for b in bufs], bufs[0].buffer, M, N)  # accumulate into the first
        s.run(TIMEOUT)
        np.testing.assert_array_equal(bufs[0].buffer.read(np.float32).reshape(M, N),
                                      (parts[0] + parts[1]) + parts[2])
        with pytest.raises(KernelError, match="at least two"):
            record_reduce_add(s, [bufs[0].buffer], bufs[1].buffer, M, N)
    finally:
        arena.close()


# --------------------------------------------------------------------------------------------
# through the planner and executor (vkxsplit/plan/, executor.py, model.py)


@pytest.mark.parametrize("mode", ["shared", "split"])
def test_planner_places_layers_and_rows_on_the_peer(device, tmp_path, mode):
    """A 2-layer synthetic q4_0 model: layer:1,1 (layer 1's mul_mats on the peer) and tensor:1,1
    (half the rows of every mul_mat) against the hub-only logits, two steps each (the second
    replays every recorded peer sequence). Bound: 2E with E = 2e-3 max|ref| + 1e-3, as
    tests/test_model_split.py for an f32 backend."""
    pytest.importorskip("vkxsplit.plan")
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp_path / "tiny-q4_0.gguf", "smol135m", "q4_0", seed=3, n_vocab=2000, n_layer=2)
    ids = [int(i) for i in np.random.default_rng(5).integers(0, 2000, 16)]
    with load_model(path, device=device, n_ctx=64, ubatch=16) as m:
        ref = m.logits(ids)
    bound = 2 * (2e-3 * np.abs(ref).max() + 1e-3)
    for spec in ("layer:1,1", "tensor:1,1"):
        # shared: a second logical device on the hub's own GPU (the default peer would be the
        # second GPU where there is one, which is split mode)
        peer = dataclasses.replace(device.physical, device_uuid=FAKE_UUID) if mode == "split" else device.physical
        b = VulkanPeerBackend(device, device=peer, timeout=TIMEOUT, traffic=PeerTraffic(), name="gpu1")
        try:
            with load_model(path, device=device, n_ctx=64, ubatch=16, profile_dir=tmp_path, backends=[b],
                            split=spec) as m:
                # split mode loads its own rows (from the file's bytes): the weights stay in the
                # hub's device memory, never in the shared host pages the hub would read over a bus
                assert all(t.shared != (mode == "split") for t in m.weights.values())
                # and so do the activations: the plan stages each job's x and y through shadows
                from vkxsplit.attach import SharedBuffer

                assert all(isinstance(a, SharedBuffer) != (mode == "split") for a in m.act.values())
                for step in range(2):
                    b.traffic.begin_step()
                    out = m.logits(ids)
                    st = b.traffic.step()
                    assert np.abs(out - ref).max() <= bound, spec
                    assert st["jobs"] > 0 and st["recorded" if step == 0 else "replays"] == st["jobs"]
                    moved = st["crossed_bytes" if mode == "split" else "inplace_bytes"]
                    assert moved > 0 and st["crossed_bytes" if mode == "shared" else "inplace_bytes"] == 0
                    assert m.stats["host_waits_in_step"] == 0
                if mode == "split":
                    assert b.resident_weight_bytes > 0
            assert b.imports == 0  # the model's arena is gone: so are the peer's imports
            assert b.resident_weight_bytes == 0  # and its copies of the model's weights
        finally:
            b.close()


# --------------------------------------------------------------------------------------------
# lifetime


def test_close_leaves_no_fds_or_hub_memory(device, seqs, rng):
    """Twice (a driver may cache device-node fds it opens the first time): each round must
    leave the fd count where it found it, and memory where it was. On the H200 every round
    left two fds to /dev/nvidia0 once: the backend's stream timeline and the peer's relay
    timeline lived until the hub closed (tools/diag_peer_fds.py found it); closing a backend
    retires them."""
    for _round in range(2):
        fds0, bytes0 = fd_targets(), device.memory.allocated_bytes
        _peer_round(device, rng, bytes0)
    new = {fd: t for fd, t in fd_targets().items() if fds0.get(fd) != t}
    assert not new, f"fds left open by a second peer round: {sorted(new.values())}"


def _peer_round(device, rng, bytes0):
    b = create_backend("vulkan-peer", device, device=device.physical.index, timeout=TIMEOUT, traffic=PeerTraffic())
    peer_dev = b.peer
    arena = SharedArena(device, [b])
    M, N, K = 2, 64, 64
    raw, wd = weights(rng, "f32", N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    wb, xb = put(arena, raw), put(arena, x)
    ys = [arena.alloc(M * N * 4) for _ in range(3)]
    for y in ys:
        p = b.next_point()
        b.mul_mat(MatMulJob(wb.view(), "f32", xb.view(), y.view(), M, N, K), None, p)
    b.wait(p, TIMEOUT)
    for y in ys:
        check(get(y, M, N), x.astype(np.float64) @ wd.T, x, wd, device)
    assert b.imports == 1 and len(b._plans) == 3
    b.unload(wb.view())
    assert len(b._plans) == 0
    p = b.next_point()  # handed out, never enqueued: close() still signals it
    b.mul_mat(MatMulJob(wb.view(), "f32", xb.view(), ys[0].view(), M, N, K), None, b.next_point())
    b.close()
    assert b.timeline.handle is None  # retired: only once every value handed out (p too) is signalled
    assert peer_dev.handle is None  # the owned peer device is gone ...
    assert b.imports == 0 and b._plans == {}
    arena.close()                   # ... and the hub's memory with the arena
    assert device.memory.allocated_bytes == bytes0
    b.close()  # twice is harmless


# --------------------------------------------------------------------------------------------
# GPU-side events (imported timelines): NVIDIA; never on lavapipe


def test_gpu_side_events_chain(device, seqs, rng, caller_waits):
    why = peer_timeline_support(device, device.physical)
    if why is not None:
        pytest.skip(f"no GPU-side events between two devices here: {why}")
    b = create_backend("vulkan-peer", device, device=device.physical.index, events="timeline_opaque_fd",
                       timeout=TIMEOUT, traffic=PeerTraffic())
    arena = SharedArena(device, [b])
    try:
        assert b.events.kind == "timeline_opaque_fd" and b.bridge is None
        M, N, K = 8, 128, 256
        raw, wd = weights(rng, "q8_0", N, K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        x_in, xa, wb = put(arena, x), arena.alloc(x.nbytes), put(arena, raw)
        y, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4)
        s1, s2 = seqs("gpu-in"), seqs("gpu-out")
        record_convert(s1, x_in.view(), xa.view(), M * K, "f32", "f32")
        record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
        caller_waits.clear()
        stats.begin_step()
        bridged = stats.bridged_jobs
        for _ in range(2):
            v1 = s1.submit()
            p = b.next_point()
            b.mul_mat(MatMulJob(wb.view(), "q8_0", xa.view(), y.view(), M, N, K), (s1.timeline, v1), p)
            v2 = s2.submit(waits=[p])
        assert stats.host_waits_in_step == 0 and caller_waits == []
        s2.wait(TIMEOUT)
        b.check()
        assert s2.timeline.value >= v2
        assert stats.bridged_jobs == bridged  # no host bridge involved
        check(get(out, M, N), x.astype(np.float64) @ wd.T, x, wd, device)
    finally:
        b.close()
        arena.close()
