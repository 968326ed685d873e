"""The tensors of a GGUF file: :class:`TensorInfo` (ggml type, shape in both orders, byte range,
a zero-copy view of the raw bytes in the file's memory map) and their reading from the header
walk's tensor table (:mod:`vkxsplit.gguf_header`), each checked (shape, a weight type the kernels have, whole blocks per row, bytes
inside the file, alignment) before any GPU work starts. :data:`SUPPORTED_TYPES` are the weight
types the kernel library runs (the type table: :mod:`vkxsplit.ops.quant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import ModelError
from ..gguf_header import HeaderInfo, describe_path
from ..ops.quant import TYPES, type_info

Q = GGMLQuantizationType

#: The weight types the kernel library has kernels for (the type table: vkxsplit.ops.quant).
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(t.ggml for t in TYPES.values())


_SUPPORTED_NAMES = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
_REQUANT_HINT = (
    f"re-quantize the model to one of {_SUPPORTED_NAMES} "
    "(e.g. `llama-quantize in.gguf out.gguf Q4_K_M` from llama.cpp)"
)




@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: where its raw bytes are and how to read them."""

    name: str
    #: ggml storage type
    ggml_type: GGMLQuantizationType
    #: shape in ggml order (ne0 = contiguous row length), padded with 1 to four entries
    ne: tuple[int, int, int, int]
    #: number of dimensions the file declares (1 for norms, 2 for matrices)
    n_dims: int
    #: absolute byte offset of the tensor data in the file
    offset: int
    #: size of the tensor data in bytes
    nbytes: int
    #: zero-copy ``uint8`` view of the raw bytes (backed by the file's memory map)
    data: np.ndarray = field(repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """Numpy-order shape of the (dequantized) tensor, e.g. ``(rows, cols)`` for a matrix."""
        return tuple(reversed(self.ne[: self.n_dims]))

    @property
    def cols(self) -> int:
        """Row length (= ``ne0``), the contiguous dimension."""
        return self.ne[0]

    @property
    def rows(self) -> int:
        """Number of rows (``ne1 * ne2 * ne3``)."""
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def n_elements(self) -> int:
        return self.rows * self.cols

    @property
    def block_size(self) -> int:
        """Elements per quantization block (1 for float types)."""
        return type_info(self.ggml_type)[0]

    @property
    def type_size(self) -> int:
        """Bytes per quantization block (per element for float types)."""
        return type_info(self.ggml_type)[1]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of ``cols`` elements."""
        return self.cols // self.block_size * self.type_size

    def raw_rows(self) -> np.ndarray:
        """The raw bytes as a ``(rows, row_bytes)`` ``uint8`` view (zero-copy)."""
        return self.data.reshape(self.rows, self.row_bytes)

    def dequantize(self) -> np.ndarray:
        """Dequantize with ``gguf.quants.dequantize`` to float32 of numpy shape :attr:`shape`."""
        from gguf.quants import dequantize

        out = dequantize(self.raw_rows(), self.ggml_type)
        return np.asarray(out, dtype=np.float32).reshape(self.shape)


def _build_tensors(path: Path, header: HeaderInfo, data: np.ndarray, size: int) -> dict[str, TensorInfo]:
    """The tensors of the walked header, each a view of ``data`` (the whole file's ``uint8``
    mapping)."""
    tensors: dict[str, TensorInfo] = {}
    for name, (type_id, ne4, offset, _nbytes) in header.tensors.items():
        qt = GGMLQuantizationType(type_id)
        n_dims = header.n_dims[name]
        dims = list(ne4[:n_dims])
        if n_dims < 1 or n_dims > 4 or any(d <= 0 for d in dims):
            raise ModelError(
                f"{describe_path(path)}: tensor {name!r} has an invalid shape {dims}",
                hint="the file is corrupt; fetch or re-convert it",
            )
        ne = (dims + [1, 1, 1, 1])[:4]
        if qt not in SUPPORTED_TYPES:
            raise ModelError(
                f"{describe_path(path)}: tensor {name!r} has weight type {qt.name}, which vkxsplit has no "
                f"kernel for (supported: {_SUPPORTED_NAMES})",
                hint=_REQUANT_HINT,
            )
        block, tsize = type_info(qt)
        if ne[0] % block:
            raise ModelError(
                f"{describe_path(path)}: tensor {name!r} has rows of {ne[0]} elements, not a multiple of the "
                f"{qt.name} block size {block}",
                hint="the file is corrupt; fetch or re-convert it",
            )
        nbytes = math.prod(ne) // block * tsize
        if offset < header.data_offset or offset + nbytes > size:
            raise ModelError(
                f"{describe_path(path)} is truncated: tensor {name!r} needs bytes {offset}..{offset + nbytes} "
                f"but the file has {size} bytes",
                hint="the download or copy was cut short; fetch the file again",
            )
        if (offset - header.data_offset) % header.alignment:
            raise ModelError(
                f"{describe_path(path)}: tensor {name!r} data at offset {offset} is not aligned to "
                f"{header.alignment} bytes",
                hint="the file is corrupt; fetch or re-convert it",
            )
        tensors[name] = TensorInfo(
            name=name,
            ggml_type=qt,
            ne=(ne[0], ne[1], ne[2], ne[3]),
            n_dims=n_dims,
            offset=offset,
            nbytes=nbytes,
            data=data[offset : offset + nbytes],
        )
    return tensors
