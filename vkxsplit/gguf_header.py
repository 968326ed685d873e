"""The GGUF header checked before anything else reads it: a bounded walk over every count,
length and offset.

gguf-py's ``GGUFReader`` trusts the counts it reads (an array claiming 2^40 elements in a
small file makes it read and allocate without end), so :func:`preparse_header` walks the
header first, as llama.cpp's own parser (``ggml/src/gguf.cpp``) does: every count and size
checked against the bytes that remain before anything is allocated, llama.cpp's limits on
strings, arrays, names and dimensions, tensor data in the file, aligned, each tensor at the
running total of the ones before it. Every refusal is a :class:`~vkxsplit.errors.ModelError`.

The walk is also the loader's reader (:mod:`vkxsplit.gguf_model`): it keeps every scalar and
string value and where each value starts, and :func:`read_value` decodes an array from the
mapping when asked, so no per-element Python objects live longer than the caller needs them.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelError

Q = GGMLQuantizationType

GGUF_MAGIC_BYTES = b"GGUF"
HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, kv count

# Limits of the header pre-parse (:func:`preparse_header`). Those of llama.cpp's own parser
# (ggml/src/gguf.cpp, ggml/include/ggml.h) are mirrored; the last four are vkxsplit's own.
#: longest metadata string (gguf.cpp GGUF_MAX_STRING_LENGTH)
GGUF_MAX_STRING_LENGTH = 1 << 30
#: most elements of one metadata array (gguf.cpp GGUF_MAX_ARRAY_ELEMENTS)
GGUF_MAX_ARRAY_ELEMENTS = 1 << 30
#: a tensor name is shorter than this (ggml.h GGML_MAX_NAME)
GGML_MAX_NAME = 64
#: most dimensions of a tensor (ggml.h GGML_MAX_DIMS)
GGML_MAX_DIMS = 4
#: GGUF versions read (gguf.cpp refuses 0, 1 and above 3)
GGUF_VERSIONS = (2, 3)
#: array nesting: 1 = arrays of scalars or strings only (gguf.cpp's limit: it refuses any array of
#: arrays), 2 = also arrays of such arrays (gguf-py reads those); deeper is refused
GGUF_MAX_ARRAY_DEPTH = 2
#: most metadata array elements in all (vkxsplit's own: a decoded string element costs ~60-100
#: bytes of Python objects while a caller holds it, so this bounds a file that is valid in every
#: other way at a few hundred MB; vocabularies: SmolLM2 0.15 M elements (tokens + types +
#: merges), Llama 3 ~0.54 M, a 262k-token vocabulary with scores and types ~0.79 M, with merges
#: ~1.3 M)
GGUF_MAX_METADATA_ELEMENTS = 1 << 21
#: most key-value pairs (vkxsplit's own: each costs ~200 bytes of Python objects for as long as the
#: model is loaded; models have ~30-60, so a file claiming more is not a model)
GGUF_MAX_KV = 1 << 16
#: most tensors (vkxsplit's own, as for the keys: ~400 bytes each while the model is loaded; the
#: largest models have a few thousand)
GGUF_MAX_TENSORS = 1 << 16
#: most arrays inside arrays of arrays, in all (vkxsplit's own: llama.cpp reads none, and each is
#: a numpy array of ~100 bytes once read, against 12 in the file)
GGUF_MAX_NESTED_ARRAYS = 1 << 16

# GGUF value type -> bytes of one scalar (8 = string and 9 = array are variable)
_VALUE_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_T_STRING, _T_ARRAY, _T_UINT32 = 8, 9, 4
#: GGUF value type -> struct format of one scalar (little-endian, as gguf-py reads it)
_STRUCT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: GGUF value type -> numpy dtype of an array of scalars (gguf-py's GGUFReader.gguf_scalar_to_np)
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: np.bool_,
             10: "<u8", 11: "<i8", 12: "<f8"}
#: the fewest bytes an element of each value type takes (a string: its length; an array: type + count)
_MIN_SIZE = {**_VALUE_SIZE, _T_STRING: 8, _T_ARRAY: 12}
#: the fewest bytes of one key-value pair (key length, a 1-byte key, type, a 1-byte value)
_MIN_KV_BYTES = 8 + 1 + 4 + 1
#: the fewest bytes of one tensor info (name length, n_dims, type, offset)
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


def describe_path(path: Path) -> str:
    return f"GGUF file {str(path)!r}"


# ---------------------------------------------------------------------------------------------
# header pre-parse: every count, length and offset checked against the bytes that remain


CORRUPT_HINT = "the file is corrupt, truncated or not made by a GGUF writer; fetch or re-convert it"


@dataclass(frozen=True)
class HeaderInfo:
    """What the pre-parse learnt: enough to check the vocabulary without gguf-py."""

    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int
    #: key -> (value type, element type or None, element count or None)
    kv_types: dict[str, tuple[int, int | None, int | None]]
    #: tensor name -> (ggml type id, ne (4 entries), absolute data offset, bytes)
    tensors: dict[str, tuple[int, tuple[int, ...], int, int]]
    #: tensor name -> the number of dimensions the file declares (``ne`` is padded with 1)
    n_dims: dict[str, int] = field(default_factory=dict)
    #: key -> its value, for scalars (Python int, float, bool) and strings (UTF-8, invalid bytes
    #: replaced); arrays are left out (:func:`read_value` at ``value_pos``)
    values: dict[str, Any] = field(default_factory=dict)
    #: key -> the byte offset of its value in the file
    value_pos: dict[str, int] = field(default_factory=dict)
    #: key -> the byte offset just past its value (the bound :func:`read_value` keeps to)
    value_end: dict[str, int] = field(default_factory=dict)


class _Header:
    """A bounded cursor over the file's bytes: no read or skip past ``size``, no allocation
    larger than what the file holds."""

    def __init__(self, path: Path, buf: Any, size: int) -> None:
        # (never past the bytes there are, whatever size the caller read before)
        self.path, self.buf, self.size, self.pos = path, buf, min(size, len(buf)), 0
        self.elements = self.nested = 0

    def fail(self, cause: str, hint: str = CORRUPT_HINT) -> ModelError:
        return ModelError(f"{describe_path(self.path)} {cause}", hint=hint)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"is truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, but only "
                f"{self.size - self.pos} remain of the file's {self.size}",
            )

    def unpack(self, fmt: str, n: int, what: str) -> int:
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return int(v)

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str, limit: int = GGUF_MAX_STRING_LENGTH) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.fail(f"is corrupt: {what} claims {n} bytes (at most {limit} allowed)")
        self.need(n, what)
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def skip_string(self, what: str) -> None:
        n = self.u64(f"the length of {what}")
        if n > GGUF_MAX_STRING_LENGTH:
            raise self.fail(f"is corrupt: {what} claims {n} bytes (at most {GGUF_MAX_STRING_LENGTH} allowed)")
        self.need(n, what)
        self.pos += n

    def text(self, what: str, limit: int = GGUF_MAX_STRING_LENGTH) -> str:
        raw = self.string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"is corrupt: {what} is not UTF-8 ({raw[:40]!r})") from None

    def value(self, vtype: int, key: str, depth: int) -> int | None:
        """Skip one value of type ``vtype``; return the element count when it is an array."""
        what = f"the value of {key!r}"
        if vtype in _VALUE_SIZE:
            self.need(_VALUE_SIZE[vtype], what)
            self.pos += _VALUE_SIZE[vtype]
            return None
        if vtype == _T_STRING:
            self.skip_string(what)
            return None
        if vtype != _T_ARRAY:
            raise self.fail(f"is corrupt: key {key!r} has an invalid value type {vtype}")
        if depth >= GGUF_MAX_ARRAY_DEPTH:
            raise self.fail(
                f"is corrupt: key {key!r} nests arrays deeper than {GGUF_MAX_ARRAY_DEPTH} levels "
                "(llama.cpp reads no arrays of arrays at all)",
            )
        etype = self.u32(f"the element type of {key!r}")
        count = self.u64(f"the element count of {key!r}")
        if etype not in _MIN_SIZE:
            raise self.fail(f"is corrupt: array {key!r} has an invalid element type {etype}")
        if count > GGUF_MAX_ARRAY_ELEMENTS:
            raise self.fail(
                f"is corrupt: array {key!r} claims {count} elements (at most {GGUF_MAX_ARRAY_ELEMENTS} allowed)"
            )
        if count * _MIN_SIZE[etype] > self.size - self.pos:
            raise self.fail(
                f"is truncated or corrupt: array {key!r} claims {count} elements of at least "
                f"{_MIN_SIZE[etype]} bytes each, but only {self.size - self.pos} bytes remain "
                f"of the file's {self.size}",
            )
        self.elements += count
        if self.elements > GGUF_MAX_METADATA_ELEMENTS:
            raise self.fail(
                f"has more than {GGUF_MAX_METADATA_ELEMENTS} metadata array elements (at {key!r}), more than "
                "vkxsplit reads",
                hint="no supported model needs that many; the file is corrupt or not a language model",
            )
        if etype in _VALUE_SIZE:
            self.pos += count * _VALUE_SIZE[etype]
        elif etype == _T_STRING:
            for _ in range(count):
                self.skip_string(f"an element of {key!r}")
        else:
            self.nested += count
            if self.nested > GGUF_MAX_NESTED_ARRAYS:
                raise self.fail(
                    f"has more than {GGUF_MAX_NESTED_ARRAYS} arrays inside arrays of arrays (at {key!r}), more "
                    "than vkxsplit reads",
                    hint="no supported model has arrays of arrays (llama.cpp reads none); the file is corrupt "
                    "or not a language model",
                )
            for _ in range(count):
                self.value(_T_ARRAY, key, depth + 1)
        return count


def read_value(buf: Any, pos: int, vtype: int, end: int | None = None, _depth: int = 0) -> tuple[Any, int]:
    """Decode the value of type ``vtype`` at byte ``pos`` of ``buf`` (a header that passed
    :func:`preparse_header`): a scalar as a Python scalar, a string as ``str`` (invalid UTF-8
    replaced), an array of scalars as a read-only numpy array (a compact copy, not a view of the
    mapping), an array of strings as ``list[str]``, an array of arrays as a list of those.
    Returns the value and the offset just past it. Every count and length is checked to stay
    before ``end`` (default: the end of ``buf``; the walk's ``value_end`` for a mapping that may
    have been rewritten since the walk) and to be of a type the walk accepts: ValueError
    otherwise, before anything of that size is built."""
    end = len(buf) if end is None else end
    if vtype in _STRUCT:
        if pos + _VALUE_SIZE[vtype] > end:
            raise ValueError(f"a value of type {vtype} at {pos} runs past {end}")
        return struct.unpack_from(_STRUCT[vtype], buf, pos)[0], pos + _VALUE_SIZE[vtype]
    if vtype == _T_STRING:
        n = struct.unpack_from("<Q", buf, pos)[0] if pos + 8 <= end else end
        if pos + 8 + n > end:
            raise ValueError(f"a string at {pos} runs past {end}")
        return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n
    if vtype != _T_ARRAY:
        raise ValueError(f"invalid GGUF value type {vtype}")
    if _depth >= GGUF_MAX_ARRAY_DEPTH:
        raise ValueError(f"arrays at {pos} nest deeper than {GGUF_MAX_ARRAY_DEPTH} levels")
    if pos + 12 > end:
        raise ValueError(f"an array at {pos} runs past {end}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype not in _MIN_SIZE or count * _MIN_SIZE[etype] > end - pos:
        raise ValueError(f"an array of {count} elements of type {etype} at {pos} does not fit before {end}")
    if etype in _NP_DTYPE:
        dt = np.dtype(_NP_DTYPE[etype])
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos).copy() if count else np.empty(0, dt)
        arr.flags.writeable = False
        return arr, pos + count * dt.itemsize
    out: list[Any] = []
    if etype == _T_STRING:
        unpack, raw = struct.unpack_from, buf
        for _ in range(count):
            n = unpack("<Q", raw, pos)[0] if pos + 8 <= end else end
            if pos + 8 + n > end:
                raise ValueError(f"a string at {pos} runs past {end}")
            out.append(bytes(raw[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
            pos += 8 + n
        return out, pos
    for _ in range(count):
        v, pos = read_value(buf, pos, etype, end, _depth + 1)
        out.append(v)
    return out, pos


def preparse_header(path: Path, size: int) -> HeaderInfo:
    """Walk the whole GGUF header (key-value pairs and tensor infos) without allocating more than
    the file holds, checking what llama.cpp's ``gguf_init_from_file`` checks (ggml/src/gguf.cpp):
    every count and length against the bytes that remain (and vkxsplit's own limits on the numbers
    of keys, tensors and array elements), non-empty and unique keys, unique
    tensor names shorter than GGML_MAX_NAME, at most GGML_MAX_DIMS dimensions, a known type, rows
    a whole number of blocks, an element count below 2^63, a power-of-two ``general.alignment``
    of type uint32 and every tensor's data at the running total of the padded sizes before it
    (so aligned, in order, not overlapping) and inside the file. Raises :class:`ModelError`."""
    with path.open("rb") as fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelError(f"{describe_path(path)} cannot be mapped ({e})", hint="pass a regular .gguf file") from e
    try:
        return walk_header(path, buf, size)
    finally:
        buf.close()


def walk_header(path: Path, buf: Any, size: int) -> HeaderInfo:
    """:func:`preparse_header` over ``buf`` (the file's bytes, e.g. its mapping, ``size`` long),
    which the caller keeps open (to read arrays with :func:`read_value`, tensor data)."""
    return _walk_header(_Header(path, buf, size))


def _walk_header(h: _Header) -> HeaderInfo:
    h.pos = 4  # magic, checked by the caller
    version = h.u32("the version")
    if version not in GGUF_VERSIONS:
        if version & 0xFFFF == 0 and version:
            cause = (f"has GGUF version {version:#x}: a big-endian file (byte order of another machine), "
                     "which vkxsplit does not read")
        elif version == 1:
            cause = "is a GGUFv1 file, which is no longer supported (llama.cpp refuses it too)"
        else:
            cause = f"has an unsupported GGUF version {version} (supported: {', '.join(map(str, GGUF_VERSIONS))})"
        raise h.fail(cause, hint="re-convert the model with a current llama.cpp")
    n_tensors = h.u64("the tensor count")
    n_kv = h.u64("the key-value count")
    if n_kv * _MIN_KV_BYTES > h.size - h.pos:
        raise h.fail(f"is truncated or corrupt: it declares {n_kv} key-value pairs, more than its "
                     f"{h.size} bytes can hold")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > h.size - h.pos:
        raise h.fail(f"is truncated or corrupt: it declares {n_tensors} tensors, more than its "
                     f"{h.size} bytes can hold")
    for n, most, what in ((n_kv, GGUF_MAX_KV, "key-value pairs"), (n_tensors, GGUF_MAX_TENSORS, "tensors")):
        if n > most:
            raise h.fail(f"declares {n} {what}, more than vkxsplit reads (at most {most})",
                         hint="no supported model has that many; the file is corrupt or not a language model")
    kv_types: dict[str, tuple[int, int | None, int | None]] = {}
    values: dict[str, Any] = {}
    value_pos: dict[str, int] = {}
    value_end: dict[str, int] = {}
    alignment = 32
    for i in range(n_kv):
        key = h.text(f"key #{i}")
        if not key:
            raise h.fail(f"is corrupt: key #{i} is empty")
        if key in kv_types:
            raise h.fail(f"is corrupt: key {key!r} appears twice")
        vtype = h.u32(f"the value type of {key!r}")
        start = h.pos
        count = h.value(vtype, key, 0)
        etype = struct.unpack_from("<I", h.buf, start)[0] if vtype == _T_ARRAY else None
        kv_types[key] = (vtype, etype, count)
        value_pos[key], value_end[key] = start, h.pos
        if vtype != _T_ARRAY:  # (checked to fit by h.value)
            values[key] = read_value(h.buf, start, vtype)[0]
        if key == "general.alignment":
            if vtype != _T_UINT32:
                raise h.fail(f"is corrupt: general.alignment has value type {vtype}, not uint32")
            alignment = struct.unpack_from("<I", h.buf, start)[0]
            if alignment == 0 or alignment & (alignment - 1):
                raise h.fail(f"is corrupt: general.alignment {alignment} is not a power of two")
    infos: list[tuple[str, int, tuple[int, ...], int, int]] = []
    n_dims_of: dict[str, int] = {}
    names: set[str] = set()
    for i in range(n_tensors):
        name = h.text(f"the name of tensor #{i}", limit=GGML_MAX_NAME - 1)
        if name in names:
            raise h.fail(f"is corrupt: tensor name {name!r} appears twice")
        names.add(name)
        n_dims = h.u32(f"the dimension count of tensor {name!r}")
        if n_dims > GGML_MAX_DIMS:
            raise h.fail(f"is corrupt: tensor {name!r} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        n_dims_of[name] = n_dims
        ne = [h.u64(f"dimension {j} of tensor {name!r}") for j in range(n_dims)] + [1] * (GGML_MAX_DIMS - n_dims)
        n_elem = math.prod(ne)
        if any(d >= 1 << 63 for d in ne) or n_elem >= 1 << 63:
            raise h.fail(f"is corrupt: tensor {name!r} has shape {ne[:n_dims]}, whose element count "
                         "does not fit in 63 bits")
        type_id = h.u32(f"the type of tensor {name!r}")
        try:
            block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise h.fail(f"is corrupt or too new: tensor {name!r} has ggml type id {type_id}, which "
                         "this gguf version does not know",
                         hint="update the gguf package, or re-convert the model") from None
        if ne[0] % block:
            raise h.fail(f"is corrupt: tensor {name!r} has rows of {ne[0]} elements, not a multiple of "
                         f"the {GGMLQuantizationType(type_id).name} block size {block}")
        offset = h.u64(f"the data offset of tensor {name!r}")
        infos.append((name, type_id, tuple(ne), offset, n_elem // block * tsize))
    data_offset = -(-h.pos // alignment) * alignment
    if n_tensors and data_offset > h.size:
        raise h.fail(f"is truncated: its tensor data would start at byte {data_offset}, past the end of "
                     f"the file ({h.size} bytes)", hint="the download or copy was cut short; fetch the file again")
    tensors: dict[str, tuple[int, tuple[int, ...], int, int]] = {}
    expected, prev = 0, None
    for name, type_id, ne, offset, nbytes in infos:
        if offset % alignment:
            raise h.fail(f"is corrupt: tensor {name!r} data at relative offset {offset} is not aligned to "
                         f"{alignment} bytes")
        if data_offset + offset + nbytes > h.size:
            raise h.fail(f"is truncated: tensor {name!r} needs bytes {data_offset + offset}.."
                         f"{data_offset + offset + nbytes} but the file has {h.size} bytes (its data runs "
                         "past the end)", hint="the download or copy was cut short; fetch the file again")
        if offset < expected:
            raise h.fail(f"is corrupt: tensor {name!r} at relative offset {offset} overlaps tensor {prev!r} "
                         f"(which ends at {expected}, padded); llama.cpp refuses any tensor that is not at the "
                         "running total of the sizes before it")
        if offset > expected:
            raise h.fail(f"is corrupt: tensor {name!r} is at relative offset {offset}, expected {expected} "
                         "(the running total of the padded sizes before it, which llama.cpp requires)")
        expected = offset + -(-nbytes // alignment) * alignment
        prev = name
        tensors[name] = (type_id, ne, data_offset + offset, nbytes)
    return HeaderInfo(version=version, n_tensors=n_tensors, n_kv=n_kv, alignment=alignment,
                       data_offset=data_offset, kv_types=kv_types, tensors=tensors, n_dims=n_dims_of,
                       values=values, value_pos=value_pos, value_end=value_end)



