"""copy_vec4: the compute-shader memcpy."""

import numpy as np
import pytest

from vkxsplit.errors import KernelError
from vkxsplit.ops.copy import record_copy


def test_copy_exact_and_bounded(device, seq, rng):
    data = rng.integers(0, 256, 4096 + 48, dtype=np.uint8)
    a = device.memory.alloc(data.nbytes, "host")
    b = device.memory.alloc(data.nbytes + 64, "host")
    try:
        a.numpy(np.uint8)[:] = data
        b.numpy(np.uint8)[:] = 0xAB
        record_copy(seq, a, b, data.nbytes)
        seq.run()
        out = b.numpy(np.uint8)
        assert np.array_equal(out[:data.nbytes], data)
        assert (out[data.nbytes:b.size] == 0xAB).all()
        with pytest.raises(KernelError, match="multiple of 16"):
            record_copy(seq, a, b, 17)
        with pytest.raises(KernelError, match="do not fit"):
            record_copy(seq, a, b, data.nbytes + 64)
    finally:
        a.close()
        b.close()
