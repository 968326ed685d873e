"""An independent float64 numpy reference forward pass for llama-family GGUF models.

This is the oracle the GPU runtime is compared against, so it is deliberately plain: every
weight is dequantized with ``gguf.quants.dequantize`` (the gguf package's own implementation,
not ours) and upcast to float64, and the transformer is written out step by step:

    x = token_embd[ids]
    for each layer:
        h = rmsnorm(x) * attn_norm
        q, k, v = h @ Wq.T (+bq), h @ Wk.T (+bk), h @ Wv.T (+bv)
        q, k = rope(q), rope(k)          # llama/mistral: pairs (2i, 2i+1); qwen2: (i, i+n_rot/2)
        a = causal GQA softmax(q k^T / sqrt(head_dim)) v     (float64 softmax)
        x = x + a @ Wo.T
        h = rmsnorm(x) * ffn_norm
        x = x + (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T
    logits = (rmsnorm(x) * output_norm) @ Wout.T           # Wout = token_embd when tied

GGUF llama Q/K weights are already permuted by llama.cpp's converter, so the adjacent-pair
("normal") RoPE ordering is the right one for arch llama; qwen2 files are not permuted and use
NeoX ordering. Dequantized weights are cached per model file (keyed by path, size and mtime).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.quants import dequantize

from vkxsplit.gguf_model import ModelFile, TensorInfo

__all__ = [
    "KVCache",
    "RefLayer",
    "RefWeights",
    "clear_cache",
    "dequant64",
    "reference_forward",
    "reference_greedy",
    "reference_logits",
    "reference_weights",
    "rms_norm",
    "rope",
]

_CACHE_MAX = 3
_CACHE: OrderedDict[tuple[str, int, int], RefWeights] = OrderedDict()


def dequant64(t: TensorInfo) -> np.ndarray:
    """A tensor's values as float64 in numpy order (rows, cols), via gguf.quants.dequantize."""
    raw = np.asarray(t.data, dtype=np.uint8).reshape(t.rows, t.row_bytes)
    w = np.asarray(dequantize(raw, t.ggml_type), dtype=np.float64)
    return w.reshape(t.shape) if t.n_dims > 1 else w.reshape(-1)


@dataclass
class RefLayer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None


@dataclass
class RefWeights:
    n_vocab: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_rot: int
    rope_base: float
    rope_scale: float
    neox: bool
    eps: float
    tok_embd: np.ndarray  # (n_vocab, n_embd)
    out_norm: np.ndarray
    output: np.ndarray  # (n_vocab, n_embd); the same array as tok_embd when tied
    layers: list[RefLayer] = field(default_factory=list)
    rope_freq_factors: np.ndarray | None = None


def _cache_key(mf: ModelFile) -> tuple[str, int, int]:
    p = Path(mf.path).resolve()
    st = p.stat()
    return (str(p), st.st_size, st.st_mtime_ns)


def clear_cache() -> None:
    _CACHE.clear()


def reference_weights(mf: ModelFile) -> RefWeights:
    """All weights of ``mf`` dequantized to float64 (cached per file)."""
    key = _cache_key(mf)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    hp = mf.hparams
    if hp.rope_scaling_type not in ("none", "linear"):
        raise NotImplementedError(f"reference: RoPE scaling {hp.rope_scaling_type!r} is not implemented")
    tensors = mf.tensors

    def w(name: str) -> np.ndarray:
        return dequant64(tensors[name])

    def opt(name: str) -> np.ndarray | None:
        return dequant64(tensors[name]) if name in tensors else None

    tok = w("token_embd.weight")
    out = tok if "output.weight" not in tensors else w("output.weight")
    layers = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        layers.append(
            RefLayer(
                attn_norm=w(p + "attn_norm.weight"),
                wq=w(p + "attn_q.weight"),
                wk=w(p + "attn_k.weight"),
                wv=w(p + "attn_v.weight"),
                wo=w(p + "attn_output.weight"),
                ffn_norm=w(p + "ffn_norm.weight"),
                w_gate=w(p + "ffn_gate.weight"),
                w_up=w(p + "ffn_up.weight"),
                w_down=w(p + "ffn_down.weight"),
                bq=opt(p + "attn_q.bias"),
                bk=opt(p + "attn_k.bias"),
                bv=opt(p + "attn_v.bias"),
            )
        )
    rw = RefWeights(
        n_vocab=tok.shape[0],
        n_embd=hp.n_embd,
        n_head=hp.n_head,
        n_head_kv=hp.n_head_kv,
        head_dim=hp.head_dim,
        head_dim_v=hp.head_dim_v,
        n_rot=hp.n_rot,
        rope_base=float(hp.rope_freq_base),
        rope_scale=float(hp.rope_freq_scale),
        neox=mf.architecture == "qwen2",
        eps=float(hp.rms_norm_eps),
        tok_embd=tok,
        out_norm=w("output_norm.weight"),
        output=out,
        layers=layers,
        rope_freq_factors=opt("rope_freqs.weight"),
    )
    _CACHE[key] = rw
    while len(_CACHE) > _CACHE_MAX:
        _CACHE.popitem(last=False)
    return rw


# ---- building blocks ------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(
    x: np.ndarray,
    pos: np.ndarray,
    n_rot: int,
    base: float,
    scale: float = 1.0,
    neox: bool = False,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    """Rotary embedding of ``x`` (T, n_heads, head_dim) at positions ``pos`` (T,).

    Pair i (0 <= i < n_rot/2) turns by ``scale * pos * base**(-2i/n_rot) / freq_factors[i]``.
    Normal ordering pairs dims (2i, 2i+1); NeoX ordering pairs (i, i + n_rot/2). Dims at and
    beyond n_rot pass through.
    """
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    theta = (scale * np.asarray(pos, dtype=np.float64))[:, None] * inv[None, :]  # (T, half)
    cos = np.cos(theta)[:, None, :]
    sin = np.sin(theta)[:, None, :]
    if neox:
        i0 = np.arange(half)
        i1 = i0 + half
    else:
        i0 = np.arange(0, n_rot, 2)
        i1 = i0 + 1
    x0 = x[..., i0]
    x1 = x[..., i1]
    out = np.array(x, dtype=np.float64, copy=True)
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


@dataclass
class KVCache:
    """Post-RoPE keys and values of the positions seen so far, per layer."""

    k: list[np.ndarray | None]
    v: list[np.ndarray | None]
    n: int = 0

    @classmethod
    def empty(cls, n_layer: int) -> KVCache:
        return cls([None] * n_layer, [None] * n_layer, 0)


def reference_forward(
    mf: ModelFile,
    ids: Sequence[int],
    cache: KVCache | None = None,
    last_only: bool = False,
    matmul: Callable[[str, np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Logits (float64) for ``ids`` continuing ``cache`` (positions cache.n, cache.n+1, ...).

    Returns (len(ids), n_vocab), or (1, n_vocab) for the last position when ``last_only``.
    The cache, if given, is extended in place. ``matmul(name, x, W)``, when given, computes
    every ``x @ W.T`` (``name``: the runtime's node name, e.g. ``blk.0.ffn_up`` or ``output``),
    e.g. to model a backend that rounds its inputs to bf16.
    """
    mm = matmul or (lambda _name, a, w: a @ w.T)
    rw = reference_weights(mf)
    ids_arr = np.asarray(list(ids), dtype=np.int64)
    if ids_arr.ndim != 1 or ids_arr.size == 0:
        raise ValueError("ids must be a non-empty sequence of token ids")
    if ids_arr.min() < 0 or ids_arr.max() >= rw.n_vocab:
        raise ValueError(f"token id out of range for a vocabulary of {rw.n_vocab}")
    if cache is None:
        cache = KVCache.empty(len(rw.layers))
    t_new = ids_arr.size
    past = cache.n
    pos = np.arange(past, past + t_new)
    h_q, h_kv, d, dv = rw.n_head, rw.n_head_kv, rw.head_dim, rw.head_dim_v
    g = h_q // h_kv
    n_total = past + t_new
    # causal mask: query at position past+t sees keys at positions <= past+t
    mask = np.arange(n_total)[None, :] > pos[:, None]  # (T, S)
    kq_scale = 1.0 / math.sqrt(d)

    x = rw.tok_embd[ids_arr]  # (T, n_embd) float64
    for li, L in enumerate(rw.layers):
        h = rms_norm(x, L.attn_norm, rw.eps)
        p = f"blk.{li}."
        q = mm(p + "attn_q", h, L.wq)
        k = mm(p + "attn_k", h, L.wk)
        v = mm(p + "attn_v", h, L.wv)
        if L.bq is not None:
            q = q + L.bq
        if L.bk is not None:
            k = k + L.bk
        if L.bv is not None:
            v = v + L.bv
        q = rope(
            q.reshape(t_new, h_q, d),
            pos,
            rw.n_rot,
            rw.rope_base,
            rw.rope_scale,
            rw.neox,
            rw.rope_freq_factors,
        )
        k = rope(
            k.reshape(t_new, h_kv, d),
            pos,
            rw.n_rot,
            rw.rope_base,
            rw.rope_scale,
            rw.neox,
            rw.rope_freq_factors,
        )
        v = v.reshape(t_new, h_kv, dv)
        ck, cv = cache.k[li], cache.v[li]
        k_all = k if ck is None else np.concatenate([ck, k], axis=0)  # (S, h_kv, d)
        v_all = v if cv is None else np.concatenate([cv, v], axis=0)
        cache.k[li], cache.v[li] = k_all, v_all

        qg = q.reshape(t_new, h_kv, g, d)  # query head j uses kv head j // g
        scores = np.einsum("tkgd,skd->kgts", qg, k_all) * kq_scale  # (h_kv, g, T, S)
        scores = np.where(mask[None, None], -np.inf, scores)
        probs = _softmax(scores, axis=-1)
        attn = np.einsum("kgts,skd->tkgd", probs, v_all).reshape(t_new, h_q * dv)
        x = x + mm(p + "attn_output", attn, L.wo)

        h = rms_norm(x, L.ffn_norm, rw.eps)
        x = x + mm(p + "ffn_down", _silu(mm(p + "ffn_gate", h, L.w_gate)) * mm(p + "ffn_up", h, L.w_up), L.w_down)
    cache.n = n_total
    if last_only:
        x = x[-1:]
    x = rms_norm(x, rw.out_norm, rw.eps)
    return mm("output", x, rw.output)


def reference_logits(mf: ModelFile, ids: Sequence[int]) -> np.ndarray:
    """float64 logits, shape (len(ids), n_vocab), of a fresh forward pass over ``ids``."""
    return reference_forward(mf, ids)


def reference_greedy(
    mf: ModelFile, prompt_ids: Sequence[int], n: int, stop_ids: Collection[int] = ()
) -> list[int]:
    """Greedy (argmax, lowest id on ties) continuation of ``prompt_ids``: the ``n`` new ids.

    Stops early right after emitting one of ``stop_ids`` (which is included). Uses a KV cache;
    each step's logits equal those of a full forward pass over the whole sequence.
    """
    cache = KVCache.empty(mf.hparams.n_layer)
    logits = reference_forward(mf, prompt_ids, cache, last_only=True)
    out: list[int] = []
    for _ in range(n):
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        if nxt in stop_ids or len(out) == n:
            break
        logits = reference_forward(mf, [nxt], cache, last_only=True)
    return out
