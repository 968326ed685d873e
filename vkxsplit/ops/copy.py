"""copy: a compute-shader memcpy of 16-byte vectors (``shaders/copy.comp``).

Used where a copy must sit among dispatches without a transfer barrier, and by the kernel
benchmark as the device's achievable read+write bandwidth.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, as_range

WG = 256
MAX_GROUPS = 65535

VARIANTS = [Variant(name="copy_vec4", source="copy.comp", bindings=2, writes=(1,), push="I", local_size=(WG, 1, 1))]


def record_copy(seq: Sequence, src: Bindable, dst: Bindable, nbytes: int) -> None:
    """Record ``dst[:nbytes] = src[:nbytes]``; ``nbytes`` must be a multiple of 16."""
    if nbytes % 16:
        raise KernelError(f"copy_vec4: {nbytes} bytes is not a multiple of 16")
    if nbytes > as_range(src)[2] or nbytes > as_range(dst)[2]:
        raise KernelError(f"copy_vec4: {nbytes} bytes do not fit the buffers")
    n = nbytes // 16
    if n:
        seq.dispatch(Kernel.get(seq.device, "copy_vec4"), [src, dst], (n,), min(MAX_GROUPS, (n + WG - 1) // WG))
