"""GPU-side waits on memory flags, for the benchmarks that measure them against timeline
semaphores: ``wait_flag`` (``shaders/wait_flag.comp``, tools/bench_handoff.py) and the flag
rendezvous of a cross-device link (``shaders/link_flag.comp``, tools/bench_link.py).

Not part of vkxsplit (no plan uses a spinning dispatch: it holds a GPU core while it waits).
The variants are declared here (:data:`VARIANTS`) and built on demand with the other
experiment kernels (``tools/kernels.py``).

- :func:`record_wait_flag`: a one-invocation dispatch that polls a flag another agent writes
  (a CUDA stream's ``cuStreamWriteValue32``, the host), bounded by ``max_spins`` so it never
  hangs the queue.
- :func:`record_link`: a rendezvous on flag words without the host: the producer publishes its
  data (:meth:`Sequence.publish_barrier`, destination HOST), stores ``base + offset`` into its
  own flag (a volatile store), and the consumer polls the producer's flag until it reaches
  ``base + offset`` (bounded by ``max_spins``; a give-up is recorded in ``status`` and every
  later wait of the step returns at once). ``base`` is a word the host writes before a step, so
  recorded sequences replay unchanged. **On the H200 it does not work**: after the first read a
  GPU's polls are served from its cache and never see the other GPU's later write (both volatile
  loads and atomics; docs/MULTI_GPU.md), which is also outside what the Vulkan memory model
  promises (one device). It stays for that benchmark, for drivers whose polls reach memory,
  and for lavapipe, where the tests check it. (The tensor split's all-reduce relays through the
  host instead: ``vkxsplit.ops.link.record_link_sum``.)
"""

from __future__ import annotations

from vkxsplit.errors import KernelError
from vkxsplit.shaders import Variant
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.kernel import Bindable, Kernel, as_range

SIGNAL = 1
WAIT = 2
FINAL = 4  # (set by record_link on the last dispatch of a wait)
LLVMPIPE_LOOP_CAP = 65535  # llvmpipe ends a shader's loops after this many iterations in all
GAVE_UP = 0xFFFFFFFF  # wait_flag's result[0] when the flag never reached the target

VARIANTS = [
    Variant(name="wait_flag", source="wait_flag.comp", bindings=3, writes=(2,), push="I", local_size=(1, 1, 1)),
    Variant(name="link_flag_atomic", source="link_flag.comp", defines={"POLL_ATOMIC": "1"}, bindings=4,
            writes=(1, 3), push="III", local_size=(1, 1, 1)),
    Variant(name="link_flag_volatile", source="link_flag.comp", bindings=4, writes=(1, 3), push="III",
            local_size=(1, 1, 1)),
]


def record_wait_flag(seq: Sequence, flag: Bindable, target: Bindable, result: Bindable,
                     max_spins: int = 1 << 30) -> None:
    """Record a dispatch that polls ``flag``'s first word until it is >= ``target``'s first
    word (at most ``max_spins`` polls), then writes the polls taken (or :data:`GAVE_UP`) to
    ``result``'s first word. The flag's writer must make its write visible to the device
    (host-coherent memory, or the other API's memory write); dispatches recorded after it
    follow it in the usual way (a barrier where they touch what it wrote)."""
    for what, b in (("flag", flag), ("target", target), ("result", result)):
        _, off, size, _ = as_range(b)
        if off % 4 or size < 4:
            raise KernelError(f"wait_flag: the {what} binding must hold an aligned 32-bit word")
    if not 0 < max_spins < 1 << 32:
        raise KernelError(f"wait_flag: max_spins {max_spins} is outside 1..2^32-1")
    seq.dispatch(Kernel.get(seq.device, "wait_flag"), [flag, target, result], (max_spins,), 1)


def link_poll(device: object) -> str:
    """How a wait polls on ``device``: ``volatile`` loads on GPUs, ``atomic`` reads on CPU
    drivers (llvmpipe folds a loop of volatile loads away)."""

    return "atomic" if device.is_cpu else "volatile"  # type: ignore[attr-defined]


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


__all__ = ["FINAL", "GAVE_UP", "SIGNAL", "VARIANTS", "WAIT", "link_poll", "record_link", "record_wait_flag"]
