"""Cross-device link kernels: the sum of a partial and the other device's partial read from
host pages (vkxsplit.ops.link: the tensor split's all-reduce), and the flag rendezvous that
tools/bench_link.py measures (tools/flags.py, built on demand; on the H200 its polls do not see
the other GPU's write: the tensor split relays on the host instead). Here on one device, against numpy; two VkDevices
sharing host pages run them in tests/test_hubs_row.py and tools/bench_link.py
(tests/test_tools.py)."""

from __future__ import annotations

import numpy as np
import pytest
from flags import FINAL, SIGNAL, WAIT, record_link  # tools/flags.py

from vkxsplit.errors import KernelError
from vkxsplit.ops.link import record_link_sum
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.kernel import View


@pytest.mark.parametrize("parts", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [4, 1024, 256 * 4 * 1024 + 12])  # (the last: more vec4s than one pass of the grid)
def test_link_sum_is_the_elementwise_sum(device, n, parts):
    import ml_dtypes

    rng = np.random.default_rng(n)
    dt = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[parts]
    a, p = rng.standard_normal(n).astype(dt), rng.standard_normal(n).astype(dt)
    mem = device.memory
    ba, bp, bd = (mem.alloc(4 * n, "host", nm) for nm in ("a", "peer", "dst"))
    try:
        ba.numpy(dt)[:n] = a
        bp.numpy(dt)[:n] = p
        bd.numpy(np.float32)[:n] = np.nan  # poisoned: a skipped element fails
        s = Sequence(device, "sum")
        record_link_sum(s, ba, bp, bd, n, parts=parts)
        s.run(timeout=60)
        s.close()
        # one f32 add of two exactly widened values: exact
        assert np.array_equal(bd.numpy(np.float32)[:n], a.astype(np.float32) + p.astype(np.float32))
        s = Sequence(device, "bad")
        for bad in (0, 6):
            with pytest.raises(KernelError, match="multiple of 4"):
                record_link_sum(s, ba, bp, bd, bad)
        with pytest.raises(KernelError, match="aligned f32"):
            record_link_sum(s, View(ba, 4, 64), bp, bd, 16)
        s.close()
    finally:
        for b in (ba, bp, bd):
            b.close()


def test_link_flag_signal_wait_and_give_up(device, tool_kernels):
    """signal stores base + offset into its own word; a wait on a word already there passes at
    once; a wait nobody answers gives up after its polls and records its target in status[0],
    and a later wait of the same step returns at once (status already set) without polling."""
    tool_kernels("link_flag_atomic", "link_flag_volatile")
    mem = device.memory
    peer, mine, base, status = (mem.alloc(256, "host", nm) for nm in ("peer", "mine", "base", "status"))
    try:
        def run(peer_value, offset, mode, max_spins=1 << 12, repeats=None, status0=0, base_value=100):
            peer.numpy(np.uint32)[0] = peer_value
            mine.numpy(np.uint32)[0] = 0
            base.numpy(np.uint32)[0] = base_value
            status.numpy(np.uint32)[:2] = (status0, 0)
            s = Sequence(device, "flag")
            record_link(s, peer, mine, base, status, offset=offset, mode=mode, max_spins=max_spins,
                        repeats=repeats)
            s.run(timeout=60)
            s.close()
            return int(mine.numpy(np.uint32)[0]), status.numpy(np.uint32)[:2].tolist()

        assert run(0, 5, SIGNAL) == (105, [0, 0])
        assert run(107, 7, SIGNAL | WAIT) == (107, [0, 0])  # reached: no poll
        # the flags only grow and may wrap: "reached" is a wrap-safe comparison
        assert run(2**32 - 1, 7, WAIT, max_spins=64)[1][0] == 107  # far behind, not "above"
        assert run(5, 10, WAIT, base_value=2**32 - 10)[1] == [0, 0]  # target wrapped to 0: 5 is past it
        mine_v, st = run(50, 7, WAIT, max_spins=256, repeats=2)
        assert mine_v == 0 and st[0] == 107 and st[1] >= 256  # gave up after both repeats' polls
        assert run(50, 7, WAIT, status0=99) == (0, [99, 0])  # an earlier give-up: no wait at all
        s = Sequence(device, "bad")
        with pytest.raises(KernelError, match="mode"):
            record_link(s, peer, mine, base, status, offset=1, mode=FINAL)
        with pytest.raises(KernelError, match="2 aligned"):
            record_link(s, peer, mine, base, View(status, 0, 4), offset=1)
        with pytest.raises(KernelError, match="repeats"):
            record_link(s, peer, mine, base, status, offset=1, repeats=0)
        s.close()
    finally:
        for b in (peer, mine, base, status):
            b.close()
