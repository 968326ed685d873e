"""Reading GGUF metadata values out of gguf-py's fields: scalars, strings (UTF-8 with
replacement) and arrays decoded, and integer keys that must exist and be uniform across layers
refused with a :class:`~vkxsplit.errors.ModelError` naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from ..errors import ModelError
from ..gguf_header import describe_path


def _decode_str(part: np.ndarray) -> str:
    return bytes(part).decode("utf-8", errors="replace")


def _field_value(f: Any) -> Any:
    if not f.types:
        return None
    main = f.types[0]
    if main == GGUFValueType.ARRAY:
        sub = f.types[-1] if len(f.types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [_decode_str(f.parts[i]) for i in f.data]
        if sub == GGUFValueType.ARRAY:
            return [f.parts[i].tolist() for i in f.data]  # nested arrays: raw, rarely used
        if not f.data:
            return []
        # numeric elements are contiguous one-element parts; gather them in one go
        return np.concatenate([f.parts[i] for i in f.data]).tolist()
    if main == GGUFValueType.STRING:
        return _decode_str(f.parts[-1])
    return f.parts[-1].tolist()[0]


def _scalar_metadata(reader: GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] != GGUFValueType.ARRAY:
            out[key] = _field_value(f)
    return out


def _get_int(path: Path, reader: GGUFReader, key: str, default: int | None = None) -> int:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ModelError(
                f"{describe_path(path)} lacks the metadata key {key!r}",
                hint="the file is incomplete or was written by an old converter; re-convert it with llama.cpp",
            )
        return default
    v = _field_value(f)
    if isinstance(v, list):  # per-layer arrays (e.g. head_count): must be uniform here
        if not v or any(x != v[0] for x in v):
            raise ModelError(
                f"{describe_path(path)} has per-layer values for {key!r} ({v[:8]}...)",
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


def _get_float(reader: GGUFReader, key: str, default: float) -> float:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = _field_value(f)
    return float(v[0] if isinstance(v, list) else v)


def _get_str(reader: GGUFReader, key: str, default: str) -> str:
    f = reader.fields.get(key)
    return default if f is None else str(_field_value(f))
