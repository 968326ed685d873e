"""Cross-device links through host pages two devices import (``shaders/link_sum.comp``,
``shaders/link_flag.comp``).

Two GPUs have different deviceUUIDs, so Vulkan lets neither import the other's memory or
timeline semaphores; host pages (``VK_EXT_external_memory_host``) are what both can map.

- :func:`record_link_sum` is the second half of the tensor split's all-reduce
  (:mod:`vkxsplit.tensor_split`): ``dst = a + peer``, ``peer`` read with volatile loads. The
  other GPU's partial is there because the step's segment that reads it was submitted with a
  wait on a timeline the host relay signals after the other GPU's segment completed; each
  segment is its own ``vkQueueSubmit`` (measured on two H200s: a segment queued in the same call
  as an earlier one that read the same pages got stale lines).
- :func:`record_link` is a rendezvous on flag words without the host: the producer publishes
  its data (:meth:`Sequence.publish_barrier`, destination HOST), stores ``base + offset`` into
  its own flag (a volatile store), and the consumer polls the producer's flag until it reaches
  ``base + offset`` (bounded by ``max_spins``; a give-up is recorded in ``status`` and every later
  wait of the step returns at once). ``base`` is a word the host writes before a step, so
  recorded sequences replay unchanged. **On the H200 it does not work**: after the first read a
  GPU's polls are served from its cache and never see the other GPU's later write (both volatile
  loads and atomics; ``tools/bench_link.py``, docs/MULTI_GPU.md), which is also outside what the
  Vulkan memory model promises (one device). It stays for that benchmark, for drivers whose polls
  reach memory, and for lavapipe, where the tests check it.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, as_range

SIGNAL = 1
WAIT = 2
FINAL = 4  # (set by record_link on the last dispatch of a wait)
LLVMPIPE_LOOP_CAP = 65535  # llvmpipe ends a shader's loops after this many iterations in all
SUM_WG = 256

VARIANTS = [
    Variant(name="link_flag_atomic", source="link_flag.comp", defines={"POLL_ATOMIC": "1"}, bindings=4,
            writes=(1, 3), push="III", local_size=(1, 1, 1)),
    Variant(name="link_flag_volatile", source="link_flag.comp", bindings=4, writes=(1, 3), push="III",
            local_size=(1, 1, 1)),
    Variant(name="link_sum_f32", source="link_sum.comp", bindings=3, writes=(2,), push="I",
            local_size=(SUM_WG, 1, 1)),
    Variant(name="link_sum_f16", source="link_sum.comp", defines={"PARTS_F16": "1"}, bindings=3, writes=(2,),
            push="I", local_size=(SUM_WG, 1, 1)),
]


def link_poll(device: object) -> str:
    """How a wait polls on ``device``: ``volatile`` loads on GPUs, ``atomic`` reads on CPU
    drivers (llvmpipe folds a loop of volatile loads away)."""
    from ..vk.api import vk

    return "atomic" if device.physical.device_type == vk.VK_PHYSICAL_DEVICE_TYPE_CPU else "volatile"  # type: ignore[attr-defined]


def _word(what: str, b: Bindable, words: int = 1) -> None:
    _, off, size, _ = as_range(b)
    if off % 4 or size < 4 * words:
        raise KernelError(f"link_flag: the {what} binding must hold {words} aligned 32-bit word(s)")


def record_link(seq: Sequence, peer: Bindable, mine: Bindable, base: Bindable, status: Bindable, *,
                offset: int, mode: int = SIGNAL | WAIT, max_spins: int = 1 << 30,
                poll: str | None = None, repeats: int | None = None) -> None:
    """One invocation: ``signal`` stores ``base + offset`` into ``mine``; ``wait`` polls
    ``peer`` until it reaches ``base + offset`` (at most ``max_spins`` polls; a give-up goes
    to ``status[0]``, ``status[1]`` sums the polls). ``mine``/``peer`` are flag words in host
    pages; record :meth:`Sequence.publish_barrier` before a signal that publishes data.

    ``repeats``: dispatches the wait is recorded as (default: 1; on a CPU driver enough
    dispatches of at most 65535 polls, llvmpipe's cap on a shader's loops, for ``max_spins``);
    once the flag is seen the rest return at once."""
    for what, b, n in (("peer", peer, 1), ("mine", mine, 1), ("base", base, 1), ("status", status, 2)):
        _word(what, b, n)
    if mode not in (SIGNAL, WAIT, SIGNAL | WAIT):
        raise KernelError(f"link_flag: mode {mode} is not SIGNAL, WAIT or both")
    if not 0 < max_spins < 1 << 32 or not 0 <= offset < 1 << 31:
        raise KernelError(f"link_flag: max_spins {max_spins} or offset {offset} out of range")
    poll = poll or link_poll(seq.device)
    if poll not in ("atomic", "volatile"):
        raise KernelError(f"link_flag: poll {poll!r} is not 'atomic' or 'volatile'")
    kernel = Kernel.get(seq.device, f"link_flag_{poll}")
    if repeats is None:
        cpu = link_poll(seq.device) == "atomic"
        repeats = -(-max_spins // (LLVMPIPE_LOOP_CAP - 1023)) if cpu else 1
    if not 1 <= repeats <= 4096:
        raise KernelError(f"link_flag: {repeats} repeats is outside 1..4096")
    if not mode & WAIT:
        repeats = 1
    spins = -(-max_spins // repeats)
    for r in range(repeats):
        m = mode if r == 0 else WAIT
        if r == repeats - 1:
            m |= FINAL
        seq.dispatch(kernel, [peer, mine, base, status], (offset, spins, m), 1)


def record_link_sum(seq: Sequence, a: Bindable, peer: Bindable, dst: Bindable, n: int,
                    max_groups: int = 1024, parts: str = "f32") -> None:
    """``dst[:n] = a[:n] + peer[:n]`` (``n`` a multiple of 4), ``peer`` read with volatile loads
    (another device wrote it); ``a`` and ``peer`` in ``parts`` (f32 or f16), ``dst`` f32."""
    name = f"link_sum_{parts}"
    if parts not in ("f32", "f16"):
        raise KernelError(f"link_sum: partials in {parts!r}: f32 or f16")
    if n % 4 or n <= 0:
        raise KernelError(f"{name}: {n} elements is not a positive multiple of 4")
    isz = 4 if parts == "f32" else 2
    for what, b, sz, al in (("a", a, isz, 4 * isz), ("peer", peer, isz, 4 * isz), ("dst", dst, 4, 16)):
        _, off, size, _ = as_range(b)
        if off % al or size < sz * n:
            raise KernelError(f"{name}: the {what} binding must hold {n} aligned {'f32' if sz == 4 else 'f16'}")
    groups = max(1, min(max_groups, -(-n // (4 * SUM_WG))))
    seq.dispatch(Kernel.get(seq.device, name), [a, peer, dst], (n // 4,), groups)
