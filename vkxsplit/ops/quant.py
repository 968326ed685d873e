"""The ggml type table: every module that needs a type's block or row size asks here.

``gguf.constants.GGML_QUANT_SIZES`` / ``gguf.GGMLQuantizationType`` are the source of truth
for block sizes. This module gives them to the rest of vkxsplit (:func:`type_info`,
:func:`row_bytes` for any ggml type, :data:`ELEM_BYTES` for the float types activations use)
and says which types the hub's kernels read (:data:`TYPES`, :func:`weight_type`: raw GGUF
bytes, never repacked) and what the kernels call them (``q4_0`` in variant names, ``WTYPE`` =
the ggml enum value in the shaders).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import KernelError

TypeLike = str | int | GGMLQuantizationType

#: the float types activations and converted weights use, and their bytes per element
FLOAT_TYPES = ("f32", "f16", "bf16")
ELEM_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2}


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


_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
          "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")


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


def type_info(t: TypeLike | WeightType) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of any ggml type (a name such as ``"q4_0"`` or
    ``"IQ4_NL"``, an enum or its value), whether or not the hub has kernels for it."""
    if isinstance(t, WeightType):
        return t.block_size, t.block_bytes
    try:
        g = GGMLQuantizationType[t.upper()] if isinstance(t, str) else GGMLQuantizationType(int(t))
        return GGML_QUANT_SIZES[g]
    except (KeyError, ValueError, TypeError):
        raise KernelError(f"unknown ggml type {t!r}") from None


def block_size(t: TypeLike | WeightType) -> int:
    return type_info(t)[0]


def row_bytes(t: TypeLike | WeightType, k: int) -> int:
    """Bytes of one row of ``k`` elements of any ggml type; ``k`` must fill whole blocks."""
    bs, bb = type_info(t)
    if k < 0 or k % bs:
        name = t.name if isinstance(t, WeightType) else str(t)
        raise KernelError(f"a {name.upper()} row of {k} elements is not a whole number of {bs}-element blocks")
    return k // bs * bb
