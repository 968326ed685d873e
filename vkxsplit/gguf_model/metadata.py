"""GGUF metadata values, read from the header walk (:mod:`vkxsplit.gguf_header`) without
gguf-py's reader: :class:`Metadata` (scalars and strings kept, arrays decoded from the file's
mapping when asked), and integer keys that must exist and be uniform across layers refused with
a :class:`~vkxsplit.errors.ModelError` naming the key.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError
from ..gguf_header import HeaderInfo, describe_path, read_value

_T_UINT32, _T_ARRAY, _T_UINT64 = 4, 9, 10


class Metadata:
    """The key-value pairs of one GGUF file. Scalars are Python scalars and strings ``str``
    (invalid UTF-8 replaced), both kept; an array is decoded from ``buf`` (the file's mapping)
    on each :meth:`get`: numbers as a read-only numpy array, strings as ``list[str]``, arrays of
    arrays as lists of those. Nothing per element is kept, so a caller that needs a vocabulary
    once (the tokenizer) pays for it only while it holds it."""

    def __init__(self, path: Path, header: HeaderInfo, buf: Any) -> None:
        self.path, self.header, self.buf = path, header, buf
        # the header's counts, under the names gguf-py's reader gives them (a key of the file
        # with one of these names wins)
        pseudo = {k: v for k, v in (("GGUF.version", header.version), ("GGUF.tensor_count", header.n_tensors),
                                    ("GGUF.kv_count", header.n_kv)) if k not in header.kv_types}
        self._values: dict[str, Any] = {**pseudo, **header.values}
        self._types: dict[str, tuple[int, int | None, int | None]] = {
            **{k: (_T_UINT32 if k == "GGUF.version" else _T_UINT64, None, None) for k in pseudo},
            **header.kv_types}

    def __contains__(self, key: str) -> bool:
        return key in self._types

    def keys(self) -> list[str]:
        """Every key, in file order after the three ``GGUF.*`` header counts."""
        return list(self._types)

    def value_type(self, key: str) -> tuple[int, int | None, int | None]:
        """``(GGUF value type, element type or None, element count or None)`` of a present key."""
        return self._types[key]

    def is_array(self, key: str) -> bool:
        return key in self._types and self._types[key][0] == _T_ARRAY

    def array_len(self, key: str) -> int:
        """Elements of an array-valued key without decoding it (0 when absent or not an array)."""
        vt = self._types.get(key)
        return int(vt[2] or 0) if vt is not None and vt[0] == _T_ARRAY else 0

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._values:
            return self._values[key]
        vt = self._types.get(key)
        if vt is None:
            return default
        try:
            return read_value(self.buf, self.header.value_pos[key], vt[0])[0]
        except (struct.error, ValueError, IndexError) as e:  # the bytes changed under the mapping
            raise ModelError(
                f"{describe_path(self.path)}: the value of {key!r} no longer reads ({e}); the file was changed "
                "after it was loaded",
                hint="do not rewrite a model file while it is loaded; load it again",
            ) from e

    def scalars(self) -> dict[str, Any]:
        """Every scalar and string value (arrays left out)."""
        return dict(self._values)


def _get_int(path: Path, md: Metadata, key: str, default: int | None = None) -> int:
    if key not in md:
        if default is None:
            raise ModelError(
                f"{describe_path(path)} lacks the metadata key {key!r}",
                hint="the file is incomplete or was written by an old converter; re-convert it with llama.cpp",
            )
        return default
    v = md.get(key)
    if isinstance(v, (list, np.ndarray)):  # per-layer arrays (e.g. head_count): must be uniform here
        if not len(v) or any(x != v[0] for x in v):
            shown = list(v[:8]) if isinstance(v, list) else v[:8].tolist()
            raise ModelError(
                f"{describe_path(path)} has per-layer values for {key!r} ({shown}...)",
                hint="models with non-uniform layers are not supported",
            )
        v = v[0]
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ModelError(
            f"{describe_path(path)} has a non-integer value {v!r} for {key!r}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        ) from None


def _get_float(md: Metadata, key: str, default: float, path: Path | None = None) -> float:
    if key not in md:
        return default
    v = md.get(key)
    if isinstance(v, (list, np.ndarray)) and len(v):
        v = v[0]
    try:
        return float(v)
    except (TypeError, ValueError):
        where = describe_path(path if path is not None else md.path)
        raise ModelError(
            f"{where} has a non-numeric value {v!r} for {key!r}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        ) from None


def _get_str(md: Metadata, key: str, default: str) -> str:
    return default if key not in md else str(md.get(key))
