"""wait_flag: a GPU-side wait on a word of memory (``shaders/wait_flag.comp``).

Timeline semaphores are how the hub waits for other backends. This is the alternative a
hand-off benchmark measures against them: a one-invocation dispatch that polls a flag another
agent writes (a CUDA stream's ``cuStreamWriteValue32``, the host), bounded by ``max_spins`` so
it never hangs the queue. Not used by plans (a spinning dispatch holds a GPU core while it
waits); ``tools/bench_handoff.py`` times it.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, as_range

VARIANTS = [Variant(name="wait_flag", source="wait_flag.comp", bindings=3, writes=(2,), push="I",
                    local_size=(1, 1, 1))]

GAVE_UP = 0xFFFFFFFF  # result[0] when the flag never reached the target


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
