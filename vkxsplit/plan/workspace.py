"""Memory the planner inserts: per-step shadows of activations in a backend's compute type, and
weights converted once (on the hub, with its ``get_rows``/``convert`` kernels) to a type a
backend reads. :class:`Workspace` makes buffer-less tensors (dry planning, the cost model's
candidate evaluation); :class:`ArenaWorkspace` allocates in a shared arena and converts.

Imports: ``vkxsplit.graph``; the op modules and ``vkxsplit.vk.command`` when converting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph import Span, Tensor, span
from ..ops.quant import ELEM_BYTES, FLOAT_TYPES

if TYPE_CHECKING:
    from ..attach import SharedArena
    from ..vk.device import Device



class Workspace:
    """Memory the planner inserts: per-step shadows of activations in a backend's compute type
    and weights converted once. This base class makes buffer-less tensors (dry planning, the
    cost model's candidate evaluation); :class:`ArenaWorkspace` allocates and converts."""

    dry = True

    def __init__(self) -> None:
        self._shadows: dict[tuple[Span, str], Tensor] = {}
        self._weights: dict[tuple[str, int, int, str], Tensor] = {}
        self._resident: dict[str, set[tuple[Any, ...]]] = {}

    def shadow(self, x: Tensor, dtype: str) -> Tensor:
        key = (span(x), dtype)
        t = self._shadows.get(key)
        if t is None:
            t = self._shadows[key] = Tensor(f"{x.name}@{dtype}", x.shape, dtype, self._alloc_shadow(x, dtype))
        return t

    def converted_weight(self, w: Tensor, r0: int, r1: int, dtype: str) -> Tensor:
        key = (w.name, r0, r1, dtype)
        t = self._weights.get(key)
        if t is None:
            buf = self._convert(w, r0, r1, dtype)
            t = self._weights[key] = Tensor(f"{w.name}[{r0}:{r1}]@{dtype}", (r1 - r0, w.shape[-1]), dtype, buf,
                                            weight=True)
        return t

    def resident(self, backend: str) -> set[tuple[Any, ...]]:
        """Kernel keys (loaded weights) the live plans put on a capped backend."""
        return self._resident.setdefault(backend, set())

    def _alloc_shadow(self, x: Tensor, dtype: str) -> Any:
        return None

    def _convert(self, w: Tensor, r0: int, r1: int, dtype: str) -> Any:
        return None

    @property
    def converted_bytes(self) -> int:
        return sum(t.rows * t.cols * ELEM_BYTES[t.dtype] for t in self._weights.values())

    def release(self) -> None:
        """Forget everything (a new split config)."""
        self._shadows.clear()
        self._weights.clear()
        self._resident.clear()

    def close(self) -> None:
        self.release()


class ArenaWorkspace(Workspace):
    """Shadows and converted weights in a :class:`~vkxsplit.attach.SharedArena`. Weights are
    converted once, on the hub, with its kernels (``get_rows`` dequantizes quantized rows into
    f32, ``convert`` rounds them), when a plan first needs them; plans share them."""

    dry = False

    def __init__(self, device: Device, arena: SharedArena) -> None:
        super().__init__()
        self.device = device
        self.arena = arena
        self._bufs: list[Any] = []
        self.conversions = 0          # weight conversions run (each once) since the last release()
        self.shadow_bytes = 0

    def _alloc_shadow(self, x: Tensor, dtype: str) -> Any:
        n = x.rows * x.cols * ELEM_BYTES[dtype]
        sb = self.arena.alloc(n, f"{x.name}@{dtype}")
        self._bufs.append(sb)
        self.shadow_bytes += n
        return sb.view(0, n)

    def _convert(self, w: Tensor, r0: int, r1: int, dtype: str) -> Any:
        from ..ops.convert import record_convert
        from ..ops.get_rows import record_get_rows
        from ..vk.command import Sequence

        K = w.shape[-1]
        rows = r1 - r0
        n = rows * K * ELEM_BYTES[dtype]
        sb = self.arena.alloc(n, f"{w.name}[{r0}:{r1}]@{dtype}")
        self._bufs.append(sb)
        dev = self.device
        tmp = ids = None
        seqs = []
        try:
            if w.dtype in FLOAT_TYPES:
                seq = Sequence(dev, f"convert {w.name}")
                seqs.append(seq)
                record_convert(seq, w.buffer, sb.view(0, n), rows * K, w.dtype, dtype, src_offset=r0 * K)
                seq.run()
            else:
                chunk = max(1, min(rows, (16 << 20) // (K * 4), 65535))
                tmp = dev.memory.alloc(chunk * K * 4, "device", "convert-tmp")
                ids = dev.memory.alloc(rows * 4, "host", "convert-ids")
                ids.numpy(np.int32, (rows,))[:] = np.arange(r0, r1, dtype=np.int32)
                for c0 in range(0, rows, chunk):
                    c = min(chunk, rows - c0)
                    seq = Sequence(dev, f"convert {w.name}")
                    seqs.append(seq)
                    record_get_rows(seq, w.buffer, w.dtype, ids, tmp, c, K, ids_offset=c0,
                                    n_rows=w.shape[0])
                    record_convert(seq, tmp, sb.view(0, n), c * K, "f32", dtype, dst_offset=c0 * K)
                    seq.run()
        finally:
            for s in seqs:
                s.close()
            for b in (tmp, ids):
                if b is not None:
                    b.close()
        self.conversions += 1
        return sb.view(0, n)

    def release(self) -> None:
        super().release()
        for b in self._bufs:
            b.close()
        self._bufs.clear()
        self.shadow_bytes = 0
        self.conversions = 0


__all__ = ["ELEM_BYTES", "FLOAT_TYPES", "ArenaWorkspace", "Workspace"]
