"""The ggml weight types the hub's kernels read (raw GGUF bytes, never repacked).

``gguf.constants.GGML_QUANT_SIZES`` / ``gguf.GGMLQuantizationType`` are the source of truth
for block sizes; this module only says which of them have kernels and what the kernels call
them (``q4_0`` in variant names, ``WTYPE`` = the ggml enum value in the shaders).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import KernelError

TypeLike = str | int | GGMLQuantizationType


@dataclass(frozen=True)
class WeightType:
    name: str             # lower-case, as in kernel variant names: "q4_0", "f16"
    ggml: GGMLQuantizationType
    block_size: int       # elements per block (1 for float types)
    block_bytes: int      # bytes per block

    @property
    def id(self) -> int:
        """The ggml enum value (the ``WTYPE`` define of the shaders)."""
        return int(self.ggml)

    @property
    def quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, k: int) -> int:
        return row_bytes(self, k)


_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _make(name: str) -> WeightType:
    g = GGMLQuantizationType[name]
    bs, bb = GGML_QUANT_SIZES[g]
    return WeightType(name.lower(), g, bs, bb)


#: every supported weight type, by lower-case name, in a fixed order
TYPES: dict[str, WeightType] = {t.name: t for t in map(_make, _NAMES)}
_BY_ID = {t.id: t for t in TYPES.values()}


def weight_type(t: TypeLike | WeightType) -> WeightType:
    """The :class:`WeightType` for a name (``"Q4_K"``, ``"q4_k"``), a ggml enum or its value."""
    if isinstance(t, WeightType):
        return t
    if isinstance(t, str):
        wt = TYPES.get(t.lower())
        if wt is None:
            raise KernelError(f"weight type {t.upper()} has no vkxsplit kernel (supported: "
                              f"{', '.join(x.upper() for x in TYPES)})",
                              "re-quantize the model to one of the supported types")
        return wt
    try:
        wt = _BY_ID.get(int(t))
    except (TypeError, ValueError):
        wt = None
    if wt is None:
        try:
            name = GGMLQuantizationType(int(t)).name
        except (TypeError, ValueError):
            name = repr(t)
        raise KernelError(f"weight type {name} has no vkxsplit kernel (supported: "
                          f"{', '.join(x.upper() for x in TYPES)})",
                          "re-quantize the model to one of the supported types")
    return wt


def block_size(t: TypeLike | WeightType) -> int:
    return weight_type(t).block_size


def row_bytes(t: TypeLike | WeightType, k: int) -> int:
    """Bytes of one row of ``k`` elements; ``k`` must be a multiple of the block size."""
    wt = weight_type(t)
    if k < 0 or k % wt.block_size:
        raise KernelError(f"a {wt.name.upper()} row of {k} elements is not a whole number of "
                          f"{wt.block_size}-element blocks")
    return k // wt.block_size * wt.block_bytes
