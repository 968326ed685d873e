"""The Vulkan layer: allocator, zero-copy views, replayed sequences, timelines, selection."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from vkxsplit.errors import EnvironmentProblem, VkxError, WaitTimeout
from vkxsplit.ops.convert import record_convert
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.event import Timeline
from vkxsplit.vk.kernel import View


def test_suballocation_shares_blocks_and_frees(device):
    mem = device.memory
    before_bytes, before_live = mem.allocated_bytes, mem.live_buffers
    bufs = [mem.alloc(1000 + i, "host", f"b{i}") for i in range(200)]
    blocks = {id(b.block) for b in bufs}
    assert len(blocks) == 1, "small buffers must come from one block"
    offs = sorted((b.offset, b.offset + b.size) for b in bufs)
    assert all(e <= s2 for (_, e), (s2, _) in zip(offs, offs[1:])), "ranges overlap"
    assert all(b.offset % mem.alignment == 0 for b in bufs)
    for b in bufs:
        b.close()
        b.close()  # idempotent
    assert mem.allocated_bytes == before_bytes and mem.live_buffers == before_live


def test_large_buffer_gets_dedicated_block(device):
    mem = device.memory
    big = mem.alloc(mem.block_size, "host", "big")
    try:
        assert big.block.dedicated and big.block.size >= mem.block_size
    finally:
        big.close()


def test_numpy_view_is_zero_copy(device, seq):
    buf = device.memory.alloc(64 * 4, "host", "v")
    out = device.memory.alloc(64 * 2, "host", "o")
    try:
        view = buf.numpy(np.float32)
        view[:] = np.arange(64, dtype=np.float32)  # written through the view, read by the GPU
        record_convert(seq, buf, out, 64, "f32", "bf16")
        seq.run()
        assert np.array_equal(out.numpy(np.uint16, (64,)),
                              np.arange(64, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
        assert np.shares_memory(view, buf.numpy(np.float32))
    finally:
        buf.close()
        out.close()


def test_device_pool_roundtrip_through_staging(device, rng):
    data = rng.integers(0, 255, 10_000, dtype=np.uint8)
    buf = device.memory.alloc(data.nbytes, "device", "dev")
    try:
        buf.write(data)
        assert np.array_equal(buf.read(np.uint8), data)
    finally:
        buf.close()


def test_uploader_stages_through_reused_slots(device, rng):
    """The load's uploader: bytes across several slot refills (slots reused before the last
    copy is waited for) and at an offset land exactly; nothing around them is touched; a
    write past the end is refused. (Staged on purpose: lavapipe's memory is host-visible.)"""
    from vkxsplit.vk.command import Uploader

    data = rng.integers(0, 256, 10 * 4096 + 52, dtype=np.uint8)
    dst = device.memory.alloc(data.nbytes + 4096 + 64, "host")
    try:
        dst.numpy(np.uint8)[:] = 0xAB
        with Uploader(device, slot_bytes=4096, slots=2) as up:
            up.stage(dst, data, 4096)
            up.stage(dst, data[:100], 0)
            up.finish()
            assert up.staged_bytes == data.nbytes + 100
            with pytest.raises(VkxError, match="overflows"):
                up.stage(dst, data, 4096 + 65)
        out = dst.numpy(np.uint8)
        assert np.array_equal(out[4096:4096 + data.nbytes], data)
        assert np.array_equal(out[:100], data[:100])
        assert (out[100:4096] == 0xAB).all() and (out[4096 + data.nbytes:dst.size] == 0xAB).all()
    finally:
        dst.close()


def test_uploader_close_keeps_a_slot_a_stuck_copy_reads(device, rng, monkeypatch, caplog):
    """An upload given up on (an error mid-load) while a slot's copy is still queued behind
    something that never finishes: close() waits (bounded) as Sequence.close does, then leaves
    that slot's staging buffer allocated with its command buffer (freed with the device), never
    frees memory the copy may still read; the slots whose copies completed are freed."""
    from vkxsplit.vk.command import Uploader

    monkeypatch.setenv("VKXSPLIT_TIMEOUT_S", "0.3")
    gate = Timeline(device, name="gate")
    dst = device.memory.alloc(2 * 4096, "host")
    try:
        up = Uploader(device, slot_bytes=4096, slots=2)
        (done_buf, _), (stuck_buf, stuck_seq) = up._slots
        up.stage(dst, np.full(4096, 1, np.uint8), 0)  # slot 0: completes
        up.finish()
        submit = stuck_seq.submit
        monkeypatch.setattr(stuck_seq, "submit", lambda: submit(waits=[(gate, 1)]))
        up.stage(dst, np.full(4096, 2, np.uint8), 4096)  # slot 1: held by the gate
        up.close()
        assert "upload 1" in caplog.text and "pending" in caplog.text
        assert done_buf._closed
        assert not stuck_buf._closed, "staging memory freed under a pending copy"
    finally:
        gate.signal(1)  # let the queue drain before the device closes
        device.wait_idle()
        gate.close()
    try:
        assert (dst.numpy(np.uint8)[:4096] == 1).all() and (dst.numpy(np.uint8)[4096:] == 2).all()
    finally:
        stuck_buf.close()
        dst.close()


def test_replayed_sequence_gives_same_results(device, rng):
    n = 5000
    src = device.memory.alloc(n * 4, "host", "src")
    mid = device.memory.alloc(n * 2, "host", "mid")
    dst = device.memory.alloc(n * 4, "host", "dst")
    seq = Sequence(device, "replay")
    try:
        record_convert(seq, src, mid, n, "f32", "bf16")
        record_convert(seq, mid, dst, n, "bf16", "f32")  # reads what the first wrote: needs a barrier
        seq.end()
        assert seq.barriers >= 2  # the opening barrier plus the read-after-write one
        for _ in range(50):
            x = rng.standard_normal(n).astype(np.float32)
            src.numpy(np.float32)[:] = x
            dst.numpy(np.float32)[:] = np.nan
            seq.run()
            want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
            assert np.array_equal(dst.numpy(np.float32), want)
        assert seq.submits == 50 and seq.dispatches == 2  # replayed, never re-recorded
    finally:
        seq.close()
        for b in (src, mid, dst):
            b.close()


def test_view_binds_a_subrange(device, seq):
    buf = device.memory.alloc(4096, "host", "whole")
    out = device.memory.alloc(4096, "host", "out")
    try:
        buf.numpy(np.float32)[:] = np.arange(1024, dtype=np.float32)
        out.numpy(np.float32)[:] = -1
        record_convert(seq, View(buf, 1024, 1024), View(out, 2048, 1024), 256, "f32", "f32")
        seq.run()
        o = out.numpy(np.float32)
        assert np.array_equal(o[512:768], np.arange(256, 512, dtype=np.float32))
        assert (o[:512] == -1).all() and (o[768:] == -1).all()
    finally:
        buf.close()
        out.close()


def test_timeline_host_signal_and_wait(device):
    t = Timeline(device, name="t")
    try:
        v = t.next()
        threading.Timer(0.05, t.signal, args=(v,)).start()
        t.wait(v, timeout=5)
        assert t.value == v
    finally:
        t.close()


def test_timeline_wait_times_out_with_clear_error(device):
    t = Timeline(device, name="never")
    try:
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="never.*reach 1"):
            t.wait(1, timeout=0.2)
        assert time.monotonic() - t0 < 5
    finally:
        t.close()


def test_gpu_waits_on_host_signalled_point(device, rng):
    """A submit may wait on a value the host signals later (wait-before-signal)."""
    gate = Timeline(device, name="gate")
    n = 1000
    src = device.memory.alloc(n * 4, "host")
    dst = device.memory.alloc(n * 2, "host")
    seq = Sequence(device, "gated")
    try:
        x = rng.standard_normal(n).astype(np.float32)
        src.numpy(np.float32)[:] = x
        dst.numpy(np.uint16)[:] = 0
        record_convert(seq, src, dst, n, "f32", "bf16")
        done = seq.submit(waits=[(gate, 1)])
        time.sleep(0.05)
        assert seq.timeline.value < done, "ran before its wait was satisfied"
        gate.signal(1)
        seq.wait(timeout=10)
        assert np.array_equal(dst.numpy(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    finally:
        seq.close()
        gate.close()
        src.close()
        dst.close()


def test_exportable_memory_gives_fd(device):
    import os

    if not device.memory.export_handle_types:
        pytest.skip("device cannot export memory")
    buf = device.memory.alloc(1 << 16, "export", "shared")
    try:
        fd, size, off = buf.export_fd()
        assert fd >= 0 and size >= buf.size and off == buf.offset
        assert os.fstat(fd).st_size in (0, size) or os.fstat(fd).st_size >= size
        os.close(fd)
    finally:
        buf.close()


def test_unknown_pool_and_bad_selector(device):
    with pytest.raises(VkxError, match="unknown memory pool"):
        device.memory.alloc(16, "vram")
    with pytest.raises(EnvironmentProblem, match="does not exist"):
        device.instance.select(99)
    with pytest.raises(EnvironmentProblem, match="no device name contains"):
        device.instance.select("no-such-gpu")
    assert device.instance.select(device.physical.name[:6]).name == device.physical.name


def test_missing_required_feature_is_named(device):
    import copy

    from vkxsplit.vk.device import Device

    phys = copy.copy(device.physical)
    phys.features = dict(phys.features, timelineSemaphore=False)
    with pytest.raises(EnvironmentProblem, match="timelineSemaphore"):
        Device(device.instance, phys)


def test_out_of_device_memory_is_clear_and_recoverable(device, seq):
    from vkxsplit.errors import OutOfDeviceMemory

    before = device.memory.allocated_bytes
    with pytest.raises(OutOfDeviceMemory) as ei:
        device.memory.alloc(1 << 40, "device", "too-big")  # 1 TiB
    assert "OUT_OF_DEVICE_MEMORY" in str(ei.value) and "heap" in ei.value.hint
    assert device.memory.allocated_bytes == before
    # the device keeps working
    buf = device.memory.alloc(1024, "host")
    try:
        buf.numpy(np.float32)[:] = 1.5
        out = device.memory.alloc(512, "host")
        try:
            record_convert(seq, buf, out, 256, "f32", "bf16")
            seq.run()
            assert (out.numpy(np.uint16) == 0x3FC0).all()
        finally:
            out.close()
    finally:
        buf.close()


def test_validation_findings_from_a_too_old_layer_are_set_apart():
    """A layer older than an extension says so, then flags that extension's structures and
    SPIR-V as unknown (Debian 12's 1.3.239 layer on the H200's coopmat): those do not count;
    any other finding still does, and so does a SPIR-V finding before the layer said so. A
    structure the layer calls unknown never counts (a layer that knows a structure calls a
    misplaced one "unexpected"): `vkxsplit info` queries coopmat2 properties without creating
    the device that would make the layer name the extension."""
    from vkxsplit.vk.api import ffi, vk
    from vkxsplit.vk.instance import Instance

    inst = Instance(validation=False)
    try:
        def say(msg: str, ident: str = "VUID-x") -> None:
            keep = [ffi.new("char[]", msg.encode()), ffi.new("char[]", ident.encode())]
            data = ffi.new("VkDebugUtilsMessengerCallbackDataEXT*")
            data.pMessage, data.pMessageIdName = keep
            inst._on_message(vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
                             vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT, data, ffi.NULL)

        stype = "vkCreateDevice: pCreateInfo->pNext chain includes a structure with unknown VkStructureType (1000506000)"
        spirv = "vkCreateShaderModule(): A SPIR-V Extension (SPV_KHR_cooperative_matrix) was declared"
        spec = ("VkShaderModule 0xf[] module (stage VK_SHADER_STAGE_COMPUTE_BIT) attempted to apply "
                "specialization constants with spirv-opt but failed")
        other = "vkCmdDispatch: a real finding"
        for m in (stype, spirv, spec, other):
            say(m)
        # the unknown structure does not count; the rest does until the layer names its blind spot
        assert inst.messages == [f"VUID-x: {spirv}", f"VUID-x: {spec}", f"VUID-x: {other}"]
        say("Device Extension VK_KHR_cooperative_matrix is not supported by this layer", "VUID_Undefined")
        assert inst.layer_blind_spots == {"VK_KHR_cooperative_matrix"}
        assert inst.messages == [f"VUID-x: {other}"]
        say("unknown VkStructureType (1000593002)")  # coopmat2 properties, the extension unnamed
        say("unexpected VkStructureType (1000141000)")  # a known structure in the wrong chain
        assert inst.messages == [f"VUID-x: {other}", "VUID-x: unexpected VkStructureType (1000141000)"]
        inst.clear_messages()
        assert inst.messages == []
    finally:
        inst.close()


def test_enumerated_items_outlive_the_call():
    """enumerate_ returns items it owns: reusing the call's freed memory (zero-filled arrays of
    the same size) changes nothing. It used to return a slice of a freed array, which read
    garbage physical-device handles on the 2-GPU machine (a crash in the driver)."""
    from vkxsplit.vk.api import NULL, enumerate_, ffi, lib, string

    exts = enumerate_(lib.vkEnumerateInstanceExtensionProperties, "VkExtensionProperties", NULL)
    before = [(string(e.extensionName), e.specVersion) for e in exts]
    churn = [ffi.new(f"VkExtensionProperties[{len(exts)}]") for _ in range(64)]  # zero-filled
    assert churn and [(string(e.extensionName), e.specVersion) for e in exts] == before
    assert all(name.startswith("VK_") for name, _ in before)


def test_gate_holds_queued_work_until_released_or_the_watchdog(device, rng):
    """A gated submission does not run before release(); a gate nobody releases is opened by
    its watchdog, and release() then says it came too late."""
    from vkxsplit.vk.event import Gate

    gate = Gate(device)
    src, dst = device.memory.alloc(256, "host"), device.memory.alloc(256, "host")
    seq = Sequence(device, "gated")
    try:
        src.numpy(np.float32)[:] = rng.standard_normal(64).astype(np.float32)
        dst.numpy(np.float32)[:] = 0
        record_convert(seq, src, dst, 64, "f32", "f32")
        seq.end()
        hold = gate.hold(30.0)
        v = seq.submit(waits=[hold.point])
        time.sleep(0.1)
        assert seq.timeline.value < v and not dst.numpy(np.float32).any()  # held
        assert hold.release() is True
        seq.wait(5)
        assert (dst.numpy(np.float32) == src.numpy(np.float32)).all()
        late = gate.hold(0.05)
        v = seq.submit(waits=[late.point])
        seq.timeline.wait(v, 5)  # the watchdog released it
        assert late.release() is False
        assert gate.hold(None).point[0].value >= 3  # ungated: released at once
    finally:
        seq.close()
        src.close()
        dst.close()
        gate.close()


def test_sequence_close_waits_for_its_last_submission(device, monkeypatch, caplog):
    """close() never frees a pending command buffer: it waits (bounded) for the last submit,
    which another party may have completed without the host looking (a CUDA stream that
    waited on its point); still pending after the bound, it logs and leaves the buffer to the
    pool. The validation layer (on in the suite) fails the test if a pending one is freed."""
    monkeypatch.setenv("VKXSPLIT_TIMEOUT_S", "0.3")
    gate = Timeline(device, name="gate")
    try:
        s = Sequence(device, "late")
        s.end()
        s.submit(waits=[(gate, 1)])
        threading.Timer(0.1, gate.signal, args=(1,)).start()
        s.close()  # returns once the gate opened and the submit completed
        assert s.cb is None and s.timeline.value >= s.last_value
        stuck = Sequence(device, "stuck")
        stuck.end()
        stuck.submit(waits=[(gate, 2)])
        t0 = time.monotonic()
        stuck.close()
        assert 0.25 <= time.monotonic() - t0 < 3
        assert "stuck" in caplog.text and "pending" in caplog.text
        gate.signal(2)  # let the queue drain before the device closes
        device.wait_idle()
    finally:
        gate.close()


def test_wait_flag_dispatch_polls_memory(device, tool_kernels):
    """wait_flag (the GPU-side wait on memory of tools/bench_handoff.py): passes at once when the
    flag is at the target (set by the host, or by a fill recorded before it), the next dispatch
    sees its result, it gives up after max_spins polls when nobody writes; on a GPU a host write
    made while it runs ends the sequence either way, seen or given up (llvmpipe caps every
    shader loop at 65535 iterations, so a long wait cannot be shown there)."""
    from flags import GAVE_UP, record_wait_flag  # tools/flags.py

    from vkxsplit.ops.copy import record_copy

    tool_kernels("wait_flag")

    mem = device.memory
    flag, target, result, out = (mem.alloc(16, "host", name=n) for n in ("flag", "target", "result", "out"))
    try:
        def run(flag_value, target_value, max_spins=1 << 30, fill=None, write_later=None, unset=7):
            flag.numpy(np.uint32)[:] = flag_value
            target.numpy(np.uint32)[:] = target_value
            result.numpy(np.uint32)[:] = unset
            out.numpy(np.uint32)[:] = 0
            s = Sequence(device, "wait")
            timer = None
            try:
                if fill is not None:
                    s.fill(flag, fill)
                record_wait_flag(s, flag, target, result, max_spins)
                record_copy(s, result, out, 16)  # after the wait (reads what it wrote)
                if write_later is not None:
                    view = flag.numpy(np.uint32)
                    timer = threading.Timer(0.05, view.__setitem__, args=(0, write_later))
                    timer.start()
                s.run(timeout=20)
            finally:
                if timer is not None:
                    timer.join()
                s.close()
            r = int(result.numpy(np.uint32)[0])
            assert int(out.numpy(np.uint32)[0]) == r
            return r

        assert run(5, 5) == 0
        assert run(0, 9, fill=9) == 0
        assert run(0, 3, max_spins=1000) == GAVE_UP
        if not device.is_cpu:
            # a host write while it spins: the sequence ends (bounded: no hang) with the polls
            # taken, or GAVE_UP where the driver does not let a spinning dispatch see the write:
            # the H200 does not: after the first read its polls are served from the GPU's cache
            # (tools/bench_link.py; docs/ATTACH.md)
            spins, unset = 1 << 20, 0xFFFFFFFE  # unset: neither a poll count <= spins nor GAVE_UP
            r = run(0, 3, max_spins=spins, write_later=3, unset=unset)
            assert r == GAVE_UP or r <= spins  # the dispatch wrote its outcome (seen or given up)
        s = Sequence(device, "refused")
        try:
            with pytest.raises(VkxError, match="max_spins"):
                record_wait_flag(s, flag, target, result, 0)
            assert s.dispatches == 0
        finally:
            s.close()
    finally:
        for b in (flag, target, result, out):
            b.close()


def test_pipeline_statistics(monkeypatch):
    """Kernel.statistics(): {} unless the device was opened with VKXSPLIT_PIPELINE_STATS=1 on a
    driver with VK_KHR_pipeline_executable_properties; with both, the driver's named numbers
    (registers on NVIDIA) for a real pipeline."""
    from vkxsplit.vk.device import PIPELINE_STATS_EXT, Device
    from vkxsplit.vk.kernel import Kernel

    monkeypatch.delenv("VKXSPLIT_PIPELINE_STATS", raising=False)
    d = Device.open()
    try:
        assert not d.pipeline_stats and Kernel.get(d, "copy_vec4").statistics() == {}
    finally:
        d.close()
    monkeypatch.setenv("VKXSPLIT_PIPELINE_STATS", "1")
    d = Device.open()
    try:
        assert d.pipeline_stats == d.physical.has(PIPELINE_STATS_EXT)
        st = Kernel.get(d, "copy_vec4").statistics()
        if d.pipeline_stats:
            assert st and all(isinstance(k, str) and isinstance(v, float) for k, v in st.items())
        else:
            assert st == {}
    finally:
        d.close()


def test_kill_switches_are_one_list_read_at_device_creation(monkeypatch):
    """VKXSPLIT_DISABLE: a comma list of feature names (case and spaces ignored), read once when
    a Device is created (device.disabled; changing the variable later does not change it); an
    unknown name is refused naming the valid ones; the per-feature variables it replaced are
    refused when set, with the new spelling."""
    from vkxsplit import features
    from vkxsplit.vk.device import Device

    assert features.parse_disabled(None) == features.parse_disabled("") == frozenset()
    assert features.parse_disabled(" CoopMat2, dq16 ,,") == {"coopmat2", "dq16"}
    assert set(features.FEATURES) == {"coopmat", "coopmat2", "intdot", "dq16", "splitk", "attn_coopmat", "fusion",
                                      "bf16_reduce", "cpu_repack", "cpu_amx", "ggml_llama"}
    with pytest.raises(VkxError, match="unknown feature name.*vecq") as exc:
        features.parse_disabled("coopmat,vecq")
    assert all(n in exc.value.hint for n in features.FEATURES)
    with pytest.raises(VkxError, match="VKXSPLIT_DISABLE_VECQ is no longer read") as exc:
        features.disabled_from_env({"VKXSPLIT_DISABLE_VECQ": "1"})
    assert "VKXSPLIT_DISABLE=intdot" in exc.value.hint
    assert features.disabled_from_env({"VKXSPLIT_DISABLE_VECQ": "0", "VKXSPLIT_DISABLE": "splitk"}) == {"splitk"}
    monkeypatch.setenv("VKXSPLIT_DISABLE", "fusion,splitk")
    d = Device.open()
    try:
        monkeypatch.setenv("VKXSPLIT_DISABLE", "coopmat")
        assert d.disabled == {"fusion", "splitk"} and features.disabled(d) == d.disabled
        assert features.is_disabled(d, "splitk") and not features.is_disabled(d, "coopmat")
    finally:
        d.close()
    monkeypatch.setenv("VKXSPLIT_DISABLE", "coopmat,nonesuch")
    with pytest.raises(VkxError, match="nonesuch"):
        Device.open()


def test_kernel_config_ident_follows_the_disabled_set_and_the_kernels(monkeypatch):
    """The cost profile's kernel key (vkxsplit.features.kernel_config_ident): the same for the
    same shipped SPIR-V and disabled set, another for another set or other SPIR-V."""
    import types

    from vkxsplit import features, shaders

    def dev(*off):
        return types.SimpleNamespace(disabled=frozenset(off))

    base = features.kernel_config_ident(dev())
    assert features.kernel_config_ident(dev()) == base
    assert features.kernel_config_ident(dev("splitk", "dq16")) == features.kernel_config_ident(dev("dq16", "splitk"))
    idents = {features.kernel_config_ident(dev(f)) for f in features.FEATURES}
    assert len(idents) == len(features.FEATURES) and base not in idents
    monkeypatch.setenv("VKXSPLIT_DISABLE", "coopmat2")  # an object without a set: the process's setting
    assert features.kernel_config_ident(types.SimpleNamespace()) == features.kernel_config_ident(dev("coopmat2"))
    monkeypatch.setattr(shaders, "manifest_ident", lambda: "0" * 64)
    assert features.kernel_config_ident(dev()) != base


def test_bindings_overlap(device):
    """The one overlap rule of the op checks (vk.kernel.bindings_overlap / spans_overlap):
    bindings of one block whose byte ranges intersect; never across blocks."""
    from vkxsplit.vk.kernel import bindings_overlap, spans_overlap

    a = device.memory.alloc(4096, "host", name="a")
    b = device.memory.alloc(4096, "host", name="b")
    try:
        assert bindings_overlap(a, a) and bindings_overlap(View(a, 0, 256), View(a, 255, 1))
        assert not bindings_overlap(View(a, 0, 256), View(a, 256, 256))
        assert bindings_overlap(a, View(a, 1024, 16)) and bindings_overlap(View(a, 1024, 16), a)
        assert not bindings_overlap(a, b)  # (sub-allocated from one block or not: apart)
        assert spans_overlap((1, 0, 10), (1, 9, 12)) and not spans_overlap((1, 0, 10), (1, 10, 12))
        assert not spans_overlap((1, 0, 10), (2, 0, 10))
    finally:
        a.close()
        b.close()
