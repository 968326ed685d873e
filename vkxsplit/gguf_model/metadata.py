"""GGUF metadata values, read from the header walk (:mod:`vkxsplit.gguf_header`) without
gguf-py's reader: :class:`Metadata` (scalars and strings kept, arrays decoded from the file's
mapping when asked), and integer keys that must exist and be uniform across layers refused with
a :class:`~vkxsplit.errors.ModelError` naming the key.
"""

from __future__ import annotations

import math
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
        try:  # (within the bytes the walk found it in: the file may have been rewritten since)
            value, end = read_value(self.buf, self.header.value_pos[key], vt[0], self.header.value_end[key])
            if end != self.header.value_end[key]:
                raise ValueError(f"it now ends at byte {end}, not {self.header.value_end[key]}")
            return value
        except (struct.error, ValueError, IndexError) as e:  # the bytes changed under the mapping
            raise ModelError(
                f"{describe_path(self.path)}: the value of {key!r} no longer reads ({e}); the file was changed "
                "after it was loaded",
                hint="do not rewrite a model file while it is loaded; load it again",
            ) from e

    def scalars(self) -> dict[str, Any]:
        """Every scalar and string value (arrays left out)."""
        return dict(self._values)


def _number(v: Any, integer: bool) -> int | float | None:
    """``v`` as a Python int (``integer``: an integer type, or a whole finite float) or float (any
    integer or float type), else None: a bool, a string, a list (of strings or arrays) are not
    numbers, though ``int()``/``float()`` would read some of them."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if not integer:
            return f
        return int(f) if math.isfinite(f) and f.is_integer() else None
    return None


def _shown(v: Any) -> str:
    """A value for a message: a list by its first elements, at most ~80 characters."""
    r = repr(v[:4]) if isinstance(v, list) else repr(v[:81]) if isinstance(v, str) else repr(v)
    return r if len(r) <= 80 else r[:80] + "..."


def _per_layer(where: str, key: str, v: Any, empty_ok: bool) -> Any:
    """A per-layer array (e.g. head_count) as its one value: the layers must agree (models with
    non-uniform layers are refused); an empty array is refused unless ``empty_ok`` (then it is
    returned as is); any other value as it is."""
    if not isinstance(v, np.ndarray):
        return v
    if (not len(v) and not empty_ok) or (len(v) and bool((v != v[0]).any())):
        raise ModelError(f"{where} has per-layer values for {key!r} ({v[:8].tolist()}...)",
                         hint="models with non-uniform layers are not supported")
    return v[0] if len(v) else v


def _get_int(path: Path, md: Metadata, key: str, default: int | None = None) -> int:
    if key not in md:
        if default is None:
            raise ModelError(
                f"{describe_path(path)} lacks the metadata key {key!r}",
                hint="the file is incomplete or was written by an old converter; re-convert it with llama.cpp",
            )
        return default
    v = _per_layer(describe_path(path), key, md.get(key), empty_ok=False)
    n = _number(v, integer=True)
    if n is None:
        raise ModelError(
            f"{describe_path(path)} has a non-integer value {_shown(v)} for {key!r}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    return int(n)


def _get_float(md: Metadata, key: str, default: float, path: Path | None = None) -> float:
    if key not in md:
        return default
    where = describe_path(path if path is not None else md.path)
    v = _per_layer(where, key, md.get(key), empty_ok=True)
    n = _number(v, integer=False)
    if n is None:
        raise ModelError(
            f"{where} has a non-numeric value {_shown(v)} for {key!r}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    return float(n)


def _get_str(md: Metadata, key: str, default: str) -> str:
    return default if key not in md else str(md.get(key))
