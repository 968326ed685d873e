"""Write llama-shaped GGUF files with random weights, for tests and benchmarks.

Weights are not quantized from floats: each block is written directly as random valid bytes
(random quants, a finite f16 scale picked so that every weight type has a standard deviation
of about :data:`WEIGHT_STD`, and for the types with a minimum/offset one that centres the block
on zero). Tensors are streamed to the file one bounded chunk at a time, so an 8B-shaped
file needs little memory and is written at disk speed.

The file carries a small byte-level BPE vocabulary (the 256 byte tokens, three ChatML control
tokens and synthetic merges up to ``n_vocab``) and a ChatML chat template, so it loads through
:mod:`vkxsplit.gguf_model` and :mod:`vkxsplit.tokenizer` like a real model.

Row lengths that are not a multiple of 256 cannot hold K-quant blocks; like llama.cpp's
quantizer, such tensors fall back to Q5_0 (for Q4_K), Q5_1 (for Q5_K), Q8_0 (for Q6_K) or
IQ4_NL (for Q2_K, Q3_K and IQ4_XS).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType

from .tokenizer import CHATML_TEMPLATE, TOKEN_CONTROL, TOKEN_NORMAL, bytes_to_unicode

__all__ = ["MIXES", "QTYPES", "SHAPES", "WEIGHT_STD", "SynthShape", "llama3_rope_freqs", "synthetic_tensor_types",
           "write_synthetic"]

Q = GGMLQuantizationType

#: Target standard deviation of every random weight matrix (a typical init scale: it keeps
#: activations of 32 random layers well inside f16 range).
WEIGHT_STD = 0.02

_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class SynthShape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool
    n_ctx: int = 4096
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-5
    #: general.architecture: "llama", or "qwen3moe" (per-head Q/K norms, experts in every layer)
    arch: str = "llama"
    #: per-head size (0: n_embd // n_head)
    head_dim: int = 0
    #: mixture of experts (vkxsplit/moe.py): experts, experts per token, each one's FFN width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    #: sliding window of the SWA layers (gemma3: every 6th layer global)
    n_swa: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES: dict[str, SynthShape] = {
    "smol135m": SynthShape(576, 30, 9, 3, 1536, 49152, tied=True, n_ctx=8192, rope_freq_base=100000.0),
    "llama1b": SynthShape(2048, 16, 32, 8, 8192, 32000, tied=False),
    "llama8b": SynthShape(4096, 32, 32, 8, 14336, 32000, tied=False, n_ctx=8192, rope_freq_base=500000.0),
    # small, with heads and FFN width that split over two GPUs (tests of the tensor split)
    "tiny": SynthShape(256, 4, 4, 2, 1024, 512, tied=False),
    # Qwen3-30B-A3B's shape (128 experts, 8 per token), and a tiny one for tests
    "qwen3moe30b": SynthShape(2048, 48, 32, 4, 6144, 151936, tied=False, n_ctx=40960, rope_freq_base=1000000.0,
                              rms_norm_eps=1e-6, arch="qwen3moe", head_dim=128, n_expert=128, n_expert_used=8,
                              n_ff_exp=768),
    "qwen3moe_tiny": SynthShape(256, 2, 4, 2, 512, 512, tied=False, rms_norm_eps=1e-6, arch="qwen3moe",
                                head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256),
    # dense shapes of the other architectures (vkxsplit.archs): Qwen3-8B (per-head Q/K norms,
    # n_head * head_dim = n_embd here), Gemma 3 1B (head_dim 256, one KV head, post-norms, GeGLU,
    # a 512-token window on 5 layers of 6, tied output)
    "qwen3_8b": SynthShape(4096, 36, 32, 8, 12288, 151936, tied=False, n_ctx=40960, rope_freq_base=1000000.0,
                           rms_norm_eps=1e-6, arch="qwen3", head_dim=128),
    "gemma3_1b": SynthShape(1152, 26, 4, 1, 6912, 262144, tied=True, n_ctx=32768, rope_freq_base=1000000.0,
                            rms_norm_eps=1e-6, arch="gemma3", head_dim=256, n_swa=512),
}

#: Weight-type mixes (``--type``): a base type and the types of some tensors (by the name after
#: ``blk.N.``, or ``output``). ``q4_k_m`` approximates llama.cpp's Q4_K_M: Q4_K everywhere, Q6_K
#: for attn_v, ffn_down and the output projection (token_embd when the output is tied; llama.cpp
#: gives attn_v / ffn_down Q6_K only in some layers).
MIXES: dict[str, tuple[str, dict[str, str]]] = {
    "q4_k_m": ("q4_k", {"attn_v": "q6_k", "ffn_down": "q6_k", "output": "q6_k"}),
}

QTYPES: dict[str, GGMLQuantizationType] = {
    "f32": Q.F32,
    "f16": Q.F16,
    "bf16": Q.BF16,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q8_0": Q.Q8_0,
    "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "q2_k": Q.Q2_K,
    "q3_k": Q.Q3_K,
    "iq4_nl": Q.IQ4_NL,
    "iq4_xs": Q.IQ4_XS,
}

_FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    Q.F32: LlamaFileType.ALL_F32,
    Q.F16: LlamaFileType.MOSTLY_F16,
    Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    Q.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    Q.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    Q.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    Q.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    Q.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    Q.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
}

#: what a K-quant becomes for rows that are not a multiple of 256 (llama.cpp's fallback)
_K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.IQ4_NL, Q.Q3_K: Q.IQ4_NL,
               Q.IQ4_XS: Q.IQ4_NL}


def _matrix_type(qtype: GGMLQuantizationType, ne0: int) -> GGMLQuantizationType:
    block = GGML_QUANT_SIZES[qtype][0]
    if ne0 % block == 0:
        return qtype
    fb = _K_FALLBACK.get(qtype, Q.F16)
    return fb if ne0 % GGML_QUANT_SIZES[fb][0] == 0 else Q.F16


# ---- random valid blocks --------------------------------------------------------------------


class _Rand:
    """Fast random bytes (Philox raw output) plus a Generator for the few floats needed."""

    def __init__(self, seed: int) -> None:
        self.gen = np.random.Generator(np.random.Philox(seed))

    def bytes(self, n: int) -> np.ndarray:
        words = self.gen.bit_generator.random_raw((n + 7) // 8)
        return words.view(np.uint8)[:n]

    def scales(self, n: int, base: float) -> np.ndarray:
        """``n`` f16 scales in ``base * [0.75, 1.25)`` (finite, normal)."""
        return (base * (0.75 + 0.5 * self.gen.random(n, dtype=np.float32))).astype(np.float16)

    def ints(self, lo: int, hi: int, shape: tuple[int, ...]) -> np.ndarray:
        return self.gen.integers(lo, hi + 1, size=shape, dtype=np.uint8)


# Standard deviations of the uniform quant codes, used to pick the scales.
def _uniform_std(levels: int) -> float:
    return float(np.sqrt((levels * levels - 1) / 12.0))


_SC_LO, _SC_HI = 4, 15  # K-quant sub-block scales are drawn from this range
_SC_RMS = float(np.sqrt(np.mean(np.arange(_SC_LO, _SC_HI + 1, dtype=np.float64) ** 2)))


def _put_f16(blocks: np.ndarray, at: int, values: np.ndarray) -> None:
    blocks[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into ggml's 12-byte K-quant layout."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _k_scales_mins(rnd: _Rand, n: int, qmean: float, dmin_over_d: float) -> tuple[np.ndarray, np.ndarray]:
    sc = rnd.ints(_SC_LO, _SC_HI, (n, 8))
    mn = np.clip(np.rint(sc.astype(np.float32) * qmean / dmin_over_d), 0, 63).astype(np.uint8)
    return sc, mn


def _blocks_q4_0(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 18).reshape(n, 18)
    _put_f16(b, 0, rnd.scales(n, WEIGHT_STD / _uniform_std(16)))
    return b


def _blocks_q4_1(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 20).reshape(n, 20)
    d = rnd.scales(n, WEIGHT_STD / _uniform_std(16))
    _put_f16(b, 0, d)
    _put_f16(b, 2, -7.5 * d.astype(np.float32))
    return b


def _blocks_q5_0(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 22).reshape(n, 22)
    _put_f16(b, 0, rnd.scales(n, WEIGHT_STD / _uniform_std(32)))
    return b


def _blocks_q5_1(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 24).reshape(n, 24)
    d = rnd.scales(n, WEIGHT_STD / _uniform_std(32))
    _put_f16(b, 0, d)
    _put_f16(b, 2, -15.5 * d.astype(np.float32))
    return b


def _blocks_q8_0(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 34).reshape(n, 34)
    _put_f16(b, 0, rnd.scales(n, WEIGHT_STD / _uniform_std(256)))
    return b


def _blocks_q4_k(rnd: _Rand, n: int) -> np.ndarray:
    # value = d * sc * q - dmin * m, q in 0..15 (mean 7.5); m ~ sc * 7.5 * d / dmin centres it
    b = rnd.bytes(n * 144).reshape(n, 144)
    d = rnd.scales(n, WEIGHT_STD / (_SC_RMS * _uniform_std(16)))
    _put_f16(b, 0, d)
    _put_f16(b, 2, 2.0 * d.astype(np.float32))
    b[:, 4:16] = _pack_k_scales(*_k_scales_mins(rnd, n, 7.5, 2.0))
    return b


def _blocks_q5_k(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 176).reshape(n, 176)
    d = rnd.scales(n, WEIGHT_STD / (_SC_RMS * _uniform_std(32)))
    _put_f16(b, 0, d)
    _put_f16(b, 2, 4.0 * d.astype(np.float32))
    b[:, 4:16] = _pack_k_scales(*_k_scales_mins(rnd, n, 15.5, 4.0))
    return b


def _blocks_q6_k(rnd: _Rand, n: int) -> np.ndarray:
    # ql[128] qh[64] scales[16] (int8) d (f16); value = d * sc * (q - 32)
    b = rnd.bytes(n * 210).reshape(n, 210)
    b[:, 192:208] = rnd.ints(_SC_LO, _SC_HI, (n, 16))
    _put_f16(b, 208, rnd.scales(n, WEIGHT_STD / (_SC_RMS * _uniform_std(64))))
    return b


def _blocks_q2_k(rnd: _Rand, n: int) -> np.ndarray:
    # scales[16] (scale | min << 4) qs[64] d dmin; value = d * sc * q - dmin * m, q in 0..3
    # (mean 1.5); m ~ sc * 1.5 * d / dmin centres it
    b = rnd.bytes(n * 84).reshape(n, 84)
    d = rnd.scales(n, WEIGHT_STD / (_SC_RMS * _uniform_std(4)))
    _put_f16(b, 80, d)
    _put_f16(b, 82, 2.0 * d.astype(np.float32))
    sc = rnd.ints(_SC_LO, _SC_HI, (n, 16))
    b[:, 0:16] = sc | (np.clip(np.rint(sc * 0.75), 0, 15).astype(np.uint8) << 4)
    return b


def _blocks_q3_k(rnd: _Rand, n: int) -> np.ndarray:
    # hmask[32] qs[64] scales[12] d; value = d * (s - 32) * (q - 4), q in 0..7; the 6-bit
    # scales s = 32 + sc packed as ggml does (low nibbles in bytes 0-7, high 2 bits in 8-11)
    b = rnd.bytes(n * 110).reshape(n, 110)
    s = rnd.ints(_SC_LO, _SC_HI, (n, 16)) + np.uint8(32)
    lo, hi = s & 15, s >> 4
    b[:, 96:104] = lo[:, 0:8] | (lo[:, 8:16] << 4)
    b[:, 104:108] = hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6)
    _put_f16(b, 108, rnd.scales(n, WEIGHT_STD / (_SC_RMS * _uniform_std(8))))
    return b


# kvalues_iq4nl, the levels IQ4_NL / IQ4_XS codes stand for, and their root mean square
_IQ4_RMS = float(np.sqrt(np.mean(np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                                           1, 13, 25, 38, 53, 69, 89, 113], np.float64) ** 2)))


def _blocks_iq4_nl(rnd: _Rand, n: int) -> np.ndarray:
    b = rnd.bytes(n * 18).reshape(n, 18)
    _put_f16(b, 0, rnd.scales(n, WEIGHT_STD / _IQ4_RMS))
    return b


def _blocks_iq4_xs(rnd: _Rand, n: int) -> np.ndarray:
    # d scales_h scales_l[4] qs[128]; value = d * (ls - 32) * level with ls = 32 + sc: the high
    # 2 bits of every ls are 0b10 (sc < 16), the low nibbles sc
    b = rnd.bytes(n * 136).reshape(n, 136)
    _put_f16(b, 0, rnd.scales(n, WEIGHT_STD / (_SC_RMS * _IQ4_RMS)))
    b[:, 2:4] = 0xAA
    sc = rnd.ints(_SC_LO, _SC_HI, (n, 8))
    b[:, 4:8] = sc[:, 0::2] | (sc[:, 1::2] << 4)
    return b


def _uniform_floats(rnd: _Rand, n: int) -> np.ndarray:
    """``n`` float32 uniform in +-sqrt(3)*WEIGHT_STD (std WEIGHT_STD), from random int16s."""
    ints = rnd.bytes(2 * n).view(np.int16)
    return ints.astype(np.float32) * np.float32(WEIGHT_STD * np.sqrt(3.0) / 32768.0)


def _blocks_f32(rnd: _Rand, n: int) -> np.ndarray:
    return _uniform_floats(rnd, n).view(np.uint8).reshape(n, 4)


def _blocks_f16(rnd: _Rand, n: int) -> np.ndarray:
    return _uniform_floats(rnd, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def _blocks_bf16(rnd: _Rand, n: int) -> np.ndarray:
    bits = _uniform_floats(rnd, n).view(np.uint32)
    return (bits >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2)  # truncation: always finite


_BLOCKS: dict[GGMLQuantizationType, Callable[[_Rand, int], np.ndarray]] = {
    Q.F32: _blocks_f32,
    Q.F16: _blocks_f16,
    Q.BF16: _blocks_bf16,
    Q.Q4_0: _blocks_q4_0,
    Q.Q4_1: _blocks_q4_1,
    Q.Q5_0: _blocks_q5_0,
    Q.Q5_1: _blocks_q5_1,
    Q.Q8_0: _blocks_q8_0,
    Q.Q4_K: _blocks_q4_k,
    Q.Q5_K: _blocks_q5_k,
    Q.Q6_K: _blocks_q6_k,
    Q.Q2_K: _blocks_q2_k,
    Q.Q3_K: _blocks_q3_k,
    Q.IQ4_NL: _blocks_iq4_nl,
    Q.IQ4_XS: _blocks_iq4_xs,
}


# ---- vocabulary -----------------------------------------------------------------------------

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _synthetic_vocab(n_vocab: int, seed: int) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE vocabulary: 3 control tokens, 256 byte tokens, then random letter merges."""
    b2u = bytes_to_unicode()
    tokens = list(_SPECIALS) + [b2u[b] for b in range(256)]
    if n_vocab < len(tokens):
        raise ValueError(
            f"n_vocab must be at least {len(tokens)} (3 control + 256 byte tokens), got {n_vocab}"
        )
    types = [TOKEN_CONTROL] * len(_SPECIALS) + [TOKEN_NORMAL] * 256
    letters = [b2u[c] for c in b"etaoinshrdlcumwfgypbvkjxqz"]
    space = b2u[ord(" ")]
    pool = [space, *letters]
    known = set(tokens)
    merges: list[str] = []
    rng = random.Random(seed)
    while len(tokens) < n_vocab:
        left = (
            pool[min(int(rng.expovariate(1.0 / 300.0)), len(pool) - 1)]
            if rng.random() < 0.7
            else rng.choice(pool)
        )
        right = rng.choice(letters)
        new = left + right
        if new in known or len(new) > 12:
            continue
        known.add(new)
        tokens.append(new)
        types.append(TOKEN_NORMAL)
        merges.append(f"{left} {right}")
        pool.append(new)
    return tokens, types, merges


# ---- writer ---------------------------------------------------------------------------------


def synthetic_tensor_types(
    shape: str, qtype: str, n_layer: int | None = None
) -> dict[str, GGMLQuantizationType]:
    """The tensor names and ggml types :func:`write_synthetic` writes (after K-quant fallback)."""
    return {name: t for name, t, _ in _plan(_shape(shape, None, n_layer), _qtype(qtype), _mix(qtype))}


def _shape(shape: str, n_vocab: int | None, n_layer: int | None) -> SynthShape:
    try:
        s = SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown synthetic shape {shape!r} (choose from {', '.join(SHAPES)})") from None
    if n_vocab is not None:
        s = replace(s, n_vocab=int(n_vocab))
    if n_layer is not None:
        if n_layer < 1:
            raise ValueError(f"n_layer must be >= 1, got {n_layer}")
        s = replace(s, n_layer=int(n_layer))
    return s


def _mix(qtype: str) -> dict[str, GGMLQuantizationType]:
    """The per-tensor types of a mix (:data:`MIXES`), {} for a plain type."""
    mix = MIXES.get(qtype.lower())
    return {} if mix is None else {k: QTYPES[v] for k, v in mix[1].items()}


def _qtype(qtype: str) -> GGMLQuantizationType:
    """The base type of ``qtype`` (a type of :data:`QTYPES` or a mix of :data:`MIXES`)."""
    qtype = MIXES[qtype.lower()][0] if qtype.lower() in MIXES else qtype
    try:
        return QTYPES[qtype.lower()]
    except KeyError:
        raise ValueError(f"unknown weight type {qtype!r} (choose from {', '.join(QTYPES)})") from None


def _plan(s: SynthShape, qt: GGMLQuantizationType, mix: dict[str, GGMLQuantizationType] | None = None,
          ) -> list[tuple[str, GGMLQuantizationType, tuple[int, ...]]]:
    """(name, type, ggml ne) of every tensor in file order (``mix``: types by short name)."""
    e, hd = s.n_embd, s.hd
    kv = s.n_head_kv * hd
    q = s.n_head * hd
    mix = mix or {}

    def mat(name: str, ne0: int, ne1: int, *more: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...]]:
        short = name.split(".")[-2]
        if name == "token_embd.weight" and s.tied:
            short = "output"  # (the tied embedding is the output projection too)
        return (name, _matrix_type(mix.get(short, qt), ne0), (ne0, ne1, *more))

    plan = [mat("token_embd.weight", e, s.n_vocab), ("output_norm.weight", Q.F32, (e,))]
    if not s.tied:
        plan.append(mat("output.weight", e, s.n_vocab))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", Q.F32, (e,)),
            mat(p + "attn_q.weight", e, q),
            mat(p + "attn_k.weight", e, kv),
            mat(p + "attn_v.weight", e, kv),
            mat(p + "attn_output.weight", q, e),
        ]
        if s.arch in ("qwen3moe", "qwen3", "gemma3"):
            plan += [(p + "attn_q_norm.weight", Q.F32, (hd,)), (p + "attn_k_norm.weight", Q.F32, (hd,))]
        plan.append((p + "ffn_norm.weight", Q.F32, (e,)))
        if s.arch == "gemma3":
            plan += [(p + "post_attention_norm.weight", Q.F32, (e,)), (p + "post_ffw_norm.weight", Q.F32, (e,))]
        if s.n_expert:  # the router (F32, as llama.cpp's converter keeps it) and the 3-D experts
            E, F = s.n_expert, s.n_ff_exp
            plan += [(p + "ffn_gate_inp.weight", Q.F32, (e, E)), mat(p + "ffn_gate_exps.weight", e, F, E),
                     mat(p + "ffn_up_exps.weight", e, F, E), mat(p + "ffn_down_exps.weight", F, e, E)]
        else:
            plan += [mat(p + "ffn_gate.weight", e, s.n_ff), mat(p + "ffn_up.weight", e, s.n_ff),
                     mat(p + "ffn_down.weight", s.n_ff, e)]
    return plan


def llama3_rope_freqs(n_rot: int, base: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                      high_freq_factor: float = 4.0, original_context: int = 8192) -> np.ndarray:
    """Llama 3.1's RoPE frequency factors (``rope_scaling.rope_type = "llama3"``), one per
    rotated pair, as llama.cpp's converter writes them into ``rope_freqs.weight``: 1 for short
    wavelengths, ``factor`` for long ones, smoothly between."""
    freqs = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                   np.where(wavelen > original_context / low_freq_factor, factor, mid))
    return out.astype(np.float32)


def write_synthetic(
    path: str | Path,
    shape: str,
    qtype: str,
    seed: int = 0,
    n_vocab: int | None = None,
    n_layer: int | None = None,
    rope_freqs: bool | Sequence[float] = False,
) -> Path:
    """Write a llama-architecture GGUF with random weights; returns the path.

    ``rope_freqs``: also write ``rope_freqs.weight``, RoPE frequency factors as llama.cpp's
    converter does for Llama 3.x models: ``True`` for Llama 3.1's (:func:`llama3_rope_freqs`),
    or the n_rot/2 factors themselves.

    ``shape`` is one of :data:`SHAPES` (``smol135m``, ``llama1b``, ``llama8b``, ``tiny``), ``qtype`` one of
    :data:`QTYPES` (the type of every weight matrix; norms are F32). ``n_vocab`` and ``n_layer``
    override the shape's values (small models for tests). The same arguments give the same bytes.
    """
    s = _shape(shape, n_vocab, n_layer)
    qt = _qtype(qtype)
    path = Path(path)
    plan = _plan(s, qt, _mix(qtype))
    hd = s.hd
    ff: np.ndarray | None = None
    if rope_freqs is True:
        ff = llama3_rope_freqs(hd, s.rope_freq_base)
    elif rope_freqs is not False:
        ff = np.asarray(rope_freqs, np.float32)
        if ff.shape != (hd // 2,):
            raise ValueError(f"rope_freqs: {ff.shape} factors for {hd // 2} rotated pairs")
    if ff is not None:
        plan.insert(0, ("rope_freqs.weight", Q.F32, (hd // 2,)))
    tokens, types, merges = _synthetic_vocab(s.n_vocab, seed)

    w = GGUFWriter(path, s.arch)
    w.add_name(f"vkxsplit synthetic {shape} {qtype.lower()}")
    w.add_string("general.type", "model")
    w.add_bool("vkxsplit.synthetic", True)
    w.add_uint32("vkxsplit.synthetic.seed", int(seed))
    w.add_file_type(int(_FILE_TYPES[qt]))
    w.add_quantization_version(2)
    w.add_vocab_size(s.n_vocab)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(hd)
    if s.head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    if s.n_swa:
        w.add_sliding_window(s.n_swa)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")  # the name llama.cpp knows for plain GPT-2 splitting
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    sizes: list[int] = []
    for name, t, ne in plan:
        block, tsize = GGML_QUANT_SIZES[t]
        n_elem = int(np.prod(ne))
        nbytes = n_elem // block * tsize
        # numpy-order shape with the row length in bytes (what add_tensor_info expects for raw data)
        byte_shape = (*reversed(ne[1:]), ne[0] // block * tsize)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t)
        sizes.append(nbytes)

    rnd = _Rand(seed)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        for (name, t, ne), nbytes in zip(plan, sizes):
            w.write_padding(fout, fout.tell())
            if name == "rope_freqs.weight" and ff is not None:
                fout.write(ff.astype(np.float32).tobytes())
            elif name.endswith("norm.weight"):
                # RMSNorm gains around 1 so the random model stays well conditioned
                g = 1.0 + 0.1 * (rnd.gen.random(ne[0], dtype=np.float32) - 0.5)
                fout.write(g.astype(np.float32).tobytes())
            else:
                block, tsize = GGML_QUANT_SIZES[t]
                make = _BLOCKS[t]
                n_blocks = nbytes // tsize
                step = max(1, _CHUNK_BYTES // tsize)
                for start in range(0, n_blocks, step):
                    chunk = make(rnd, min(step, n_blocks - start))
                    fout.write(np.ascontiguousarray(chunk).data)
            w.write_padding(fout, nbytes)
        w.flush()
    finally:
        w.close()
    return path


def register(sub: Any) -> None:
    """``vkxsplit synth --shape SHAPE --type TYPE -o FILE``."""

    def run(args: Any) -> int:
        import time

        t0 = time.perf_counter()
        try:
            p = write_synthetic(args.output, args.shape, args.type, seed=args.seed, n_layer=args.n_layer,
                                rope_freqs=args.rope_freqs)
        except ValueError as exc:
            from .errors import VkxError

            raise VkxError(str(exc)) from exc
        print(f"wrote {p} ({p.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
        return 0

    p = sub.add_parser("synth", help="write a llama-shaped GGUF with random weights (for benchmarks)")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--type", default="q4_0",
                   help="weight type of the matrices (q4_0, q4_1, q8_0, q4_k, q6_k, f16, bf16, ...), or q4_k_m: "
                        "Q4_K with Q6_K for attn_v, ffn_down and the output (about llama.cpp's Q4_K_M mix)")
    p.add_argument("--n-layer", type=int, default=None, help="override the layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rope-freqs", action="store_true",
                   help="also write rope_freqs.weight (Llama 3.1's RoPE frequency factors)")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=run)
