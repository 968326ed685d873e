"""Cross-device links through host pages two devices import (``shaders/link_sum.comp``).

Two GPUs have different deviceUUIDs, so Vulkan lets neither import the other's memory or
timeline semaphores; host pages (``VK_EXT_external_memory_host``) are what both can map.

:func:`record_link_sum` is the second half of the tensor split's all-reduce
(the row split over hubs, :mod:`vkxsplit.hubs`): ``dst = a + peer``, ``peer`` read with volatile loads. The
other GPU's partial is there because the step's segment that reads it was submitted with a
wait on a timeline the host relay signals after the other GPU's segment completed; each
segment is its own ``vkQueueSubmit`` (on two H200s a segment queued in the same call as an
earlier one that read the same pages got stale lines). (A GPU-side rendezvous on flag words,
without the host, is what ``tools/bench_link.py`` measures: ``tools/flags.py``; on the H200 a
GPU's polls never see the other GPU's writes, docs/MULTI_GPU.md.)
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, as_range

SUM_WG = 256

VARIANTS = [
    Variant(name="link_sum_f32", source="link_sum.comp", bindings=3, writes=(2,), push="I",
            local_size=(SUM_WG, 1, 1)),
    Variant(name="link_sum_f16", source="link_sum.comp", defines={"PARTS_F16": "1"}, bindings=3, writes=(2,),
            push="I", local_size=(SUM_WG, 1, 1)),
    Variant(name="link_sum_bf16", source="link_sum.comp", defines={"PARTS_BF16": "1"}, bindings=3, writes=(2,),
            push="I", local_size=(SUM_WG, 1, 1)),
]
#: the element types the partials of an all-reduce may cross in
PARTS = ("f32", "f16", "bf16")


def record_link_sum(seq: Sequence, a: Bindable, peer: Bindable, dst: Bindable, n: int,
                    max_groups: int = 1024, parts: str = "f32") -> None:
    """``dst[:n] = a[:n] + peer[:n]`` (``n`` a multiple of 4), ``peer`` read with volatile loads
    (another device wrote it); ``a`` and ``peer`` in ``parts`` (f32, f16 or bf16), ``dst`` f32."""
    name = f"link_sum_{parts}"
    if parts not in PARTS:
        raise KernelError(f"link_sum: partials in {parts!r}: f32, f16 or bf16")
    if n % 4 or n <= 0:
        raise KernelError(f"{name}: {n} elements is not a positive multiple of 4")
    isz = 4 if parts == "f32" else 2
    for what, b, sz, al in (("a", a, isz, 4 * isz), ("peer", peer, isz, 4 * isz), ("dst", dst, 4, 16)):
        _, off, size, _ = as_range(b)
        if off % al or size < sz * n:
            raise KernelError(f"{name}: the {what} binding must hold {n} aligned {'f32' if sz == 4 else parts}")
    groups = max(1, min(max_groups, -(-n // (4 * SUM_WG))))
    seq.dispatch(Kernel.get(seq.device, name), [a, peer, dst], (n // 4,), groups)
