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
    "moe_ffn",
    "moe_route",
    "mul_mat_id",
    "reference_forward",
    "reference_greedy",
    "reference_forward_yarn",
    "reference_logits",
    "reference_weights",
    "rms_norm",
    "rope",
    "rope_yarn",
    "yarn_params",
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


# ---------------------------------------------------------------------------------------------
# mixture of experts (llama.cpp's build_moe_ffn), float64


def moe_route(logits: np.ndarray, n_used: int, *, gating: str = "softmax", norm: bool = True,
              scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The router of a MoE FFN over ``logits`` (T, n_expert): (ids int (T, n_used), weights
    float64 (T, n_used)). probs = softmax or sigmoid of the logits; ids = the n_used largest
    probs in decreasing order, equal probs in increasing index (a stable sort of -probs);
    weights = probs[ids], divided by max(sum, 6.103515625e-5) when ``norm``, times ``scale``."""
    lg = np.asarray(logits, dtype=np.float64)
    probs = _softmax(lg) if gating == "softmax" else 1.0 / (1.0 + np.exp(-lg))
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :n_used]
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), 6.103515625e-5)
    return ids, w * scale


def mul_mat_id(W: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ggml's mul_mat_id in float64: W (n_expert, N, K), x (T, n_xb, K) with n_xb 1 or n_used,
    ids (T, n_used) -> (T, n_used, N): out[t, s] = W[ids[t, s]] @ x[t, s if n_xb > 1 else 0]."""
    T, n_used = ids.shape
    out = np.empty((T, n_used, W.shape[1]))
    for t in range(T):
        for s in range(n_used):
            out[t, s] = W[ids[t, s]] @ x[t, s if x.shape[1] > 1 else 0]
    return out


def moe_ffn(h: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
            n_used: int, *, gating: str = "softmax", norm: bool = True, scale: float = 1.0) -> np.ndarray:
    """The MoE FFN of ``h`` (T, n_embd): router (n_expert, n_embd), gate/up (n_expert, n_ff,
    n_embd), down (n_expert, n_embd, n_ff), all float64 -> (T, n_embd)
    = sum_s w[t, s] * down[e] @ (silu(gate[e] @ h[t]) * (up[e] @ h[t])), e = ids[t, s]."""
    ids, w = moe_route(h @ router.T, n_used, gating=gating, norm=norm, scale=scale)
    x = h[:, None, :]
    a = mul_mat_id(gate, x, ids)
    act = _silu(a) * mul_mat_id(up, x, ids)
    e = mul_mat_id(down, act, ids)
    return np.einsum("ts,tsn->tn", w, e)


# ---------------------------------------------------------------------------------------------
# RoPE with ggml's YaRN terms and llama.cpp's attention factor, float64


def rope_yarn(
    x: np.ndarray,
    pos: np.ndarray,
    n_rot: int,
    base: float,
    freq_scale: float = 1.0,
    neox: bool = False,
    freq_factors: np.ndarray | None = None,
    *,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    corr_dims: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
    """ggml's ``rope_ext`` of ``x`` (T, n_heads, head_dim) at ``pos`` (T,), written from its
    definition (ggml-cpu ``rope_yarn``): pair i has ``theta_extrap = pos base^(-2i/n_rot) / ff_i``
    and ``theta_interp = freq_scale theta_extrap``; when ``ext_factor != 0`` the angle is
    ``theta_interp (1 - m) + theta_extrap m`` with ``m = ext_factor (1 - clamp((i - lo) /
    max(0.001, hi - lo), 0, 1))`` (``(lo, hi) = corr_dims``) and the magnitude ``attn_factor (1 +
    0.1 ln(1/freq_scale))``, else the angle is ``theta_interp`` and the magnitude ``attn_factor``;
    cos and sin are multiplied by the magnitude. Pairs and pass-through as :func:`rope`."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    extrap = np.asarray(pos, dtype=np.float64)[:, None] * base ** (-2.0 * i / n_rot)[None, :]  # (T, half)
    if freq_factors is not None:
        extrap = extrap / np.asarray(freq_factors, dtype=np.float64)[None, :]
    interp = freq_scale * extrap
    theta, mag = interp, float(attn_factor)
    if ext_factor != 0.0:
        lo, hi = corr_dims
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
        m = ext_factor * ramp[None, :]
        theta = interp * (1.0 - m) + extrap * m
        mag *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    cos = (mag * np.cos(theta))[:, None, :]
    sin = (mag * np.sin(theta))[:, None, :]
    i0 = np.arange(half) if neox else np.arange(0, n_rot, 2)
    i1 = i0 + half if neox else i0 + 1
    x0, x1 = x[..., i0], x[..., i1]
    out = np.array(x, dtype=np.float64, copy=True)
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


def yarn_params(mf: ModelFile) -> dict[str, float | tuple[float, float]]:
    """``ext_factor``, ``attn_factor`` and ``corr_dims`` of :func:`rope_yarn` for ``mf``, as
    llama.cpp fills them, from the file's metadata keys (not the loader's hparams):

    - ``ext_factor``: 1 when ``{arch}.rope.scaling.type`` is yarn, else 0;
    - ``attn_factor``: for yarn, with ``s = rope.scaling.factor``, get_mscale(s) = ``1 + 0.1
      ln s`` (1 when s <= 1) divided by ``1 + 0.1 ln s`` (llama-context.cpp cancels the factor
      rope_yarn multiplies in again), else 1; times ``rope.scaling.attn_factor`` (default 1);
    - ``corr_dims``: ggml_rope_yarn_corr_dims(n_rot, n_ctx_orig, base, 32, 1) with n_ctx_orig
      = ``rope.scaling.original_context_length``, else ``context_length``:
      ``dim(beta) = n_rot ln(n_ctx_orig / (2 pi beta)) / (2 ln base)``, ``(max(0,
      floor(dim(32))), min(n_rot - 1, ceil(dim(1))))``.
    """
    a = mf.architecture + "."
    md = mf.metadata
    kind = md.get(a + "rope.scaling.type", "linear")
    s = float(md.get(a + "rope.scaling.factor", 0.0) or 1.0)
    n_rot = int(md.get(a + "rope.dimension_count", mf.hparams.head_dim))
    base = float(md.get(a + "rope.freq_base", 10000.0))
    n_orig = int(md.get(a + "rope.scaling.original_context_length", 0) or md.get(a + "context_length", 2048))
    ext = 1.0 if kind == "yarn" else 0.0
    attn = 1.0
    if ext:
        attn = (1.0 + 0.1 * math.log(s) if s > 1.0 else 1.0) / (1.0 + 0.1 * math.log(s))
    attn *= float(md.get(a + "rope.scaling.attn_factor", 1.0))

    def dim(beta: float) -> float:
        return n_rot * math.log(n_orig / (2.0 * math.pi * beta)) / (2.0 * math.log(base))

    corr = (max(0.0, math.floor(dim(32.0))), min(n_rot - 1.0, math.ceil(dim(1.0))))
    return {"ext_factor": ext, "attn_factor": attn, "corr_dims": corr}


def reference_forward_yarn(
    mf: ModelFile,
    ids: Sequence[int],
    cache: KVCache | None = None,
    last_only: bool = False,
    *,
    ramp: bool = True,
    mscale: bool = True,
) -> np.ndarray:
    """:func:`reference_forward` with every RoPE as :func:`rope_yarn` with :func:`yarn_params`
    of ``mf`` (YaRN and the attention factor). ``ramp=False`` / ``mscale=False``: deliberately
    wrong variants (every pair interpolated, no YaRN ramp; cos/sin not scaled) a test can show
    its check rejects."""
    import dataclasses

    yp = yarn_params(mf)
    if not ramp:
        yp["corr_dims"] = (-1e9, -1e9 + 0.001)  # the ramp is 0 for every pair: theta_interp only
    if not mscale:
        yp["attn_factor"] = 1.0 / (1.0 + 0.1 * math.log(1.0 / mf.hparams.rope_freq_scale)) if yp["ext_factor"] else 1.0

    def yarn(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, scale: float = 1.0, neox: bool = False,
             freq_factors: np.ndarray | None = None) -> np.ndarray:
        return rope_yarn(x, pos, n_rot, base, scale, neox, freq_factors, **yp)  # type: ignore[arg-type]

    # reference_forward, its RoPE replaced for this call; its weights read as those of a file
    # without the scaling type (reference_weights refuses types it does not know)
    plain = dataclasses.replace(mf, hparams=dataclasses.replace(mf.hparams, rope_scaling_type="linear"))
    g = globals()
    saved = g["rope"]
    g["rope"] = yarn
    try:
        return reference_forward(plain, ids, cache, last_only)
    finally:
        g["rope"] = saved


# ---------------------------------------------------------------------------------------------
# qwen3, gemma3, phi3 (and the llama family), float64, from llama.cpp's graph builders


_ARCH_W: OrderedDict[tuple[str, int, int], dict[str, np.ndarray]] = OrderedDict()


def _arch_weight(mf: ModelFile, name: str) -> np.ndarray:
    """``name`` dequantized by gguf-py (float32 holds every dequantized value exactly; the
    arithmetic upcasts to float64), cached per file."""
    st = mf.path.stat()
    key = (str(mf.path), st.st_size, st.st_mtime_ns)
    ws = _ARCH_W.get(key)
    if ws is None:
        ws = _ARCH_W[key] = {}
        while len(_ARCH_W) > 2:
            _ARCH_W.popitem(last=False)
    if name not in ws:
        t = mf.tensors[name]
        ws[name] = np.asarray(dequantize(t.raw_rows(), t.ggml_type), np.float32).reshape(t.shape)
    return ws[name]


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_forward_arch(mf: ModelFile, ids: Sequence[int], n_ctx: int | None = None,
                           wrong: Collection[str] = ()) -> np.ndarray:
    """float64 logits (len(ids), n_vocab) of a forward pass from an empty context, for
    ``general.architecture`` llama, mistral, qwen2, qwen3, gemma3 or phi3, written from
    llama.cpp's graph builders (``src/models/{llama,qwen2,qwen3,gemma3,phi3}.cpp``) and its
    ``load_hparams`` with the metadata read here from the file:

    - qwen3/gemma3: RMSNorm of each Q and K head (``attn_q_norm``/``attn_k_norm``) before RoPE;
    - gemma3: embeddings times sqrt(n_embd); attention and FFN outputs RMS-normed
      (``post_attention_norm``, ``post_ffw_norm``) before their residual adds; FFN
      ``gelu_tanh(gate) * up``; Q scaled by 1/sqrt(head_dim) (62 layers: 1/sqrt(n_embd//n_head));
      with ``attention.sliding_window`` > 0, the layers with ``il % n < n - 1`` (every layer
      when n is 0), n = ``attention.sliding_window_pattern`` (default 6), attend through the
      sliding window (query i sees key j iff ``i - j < sliding_window``) with RoPE base
      ``rope.freq_base_swa`` (default 10000) and scale 1, and there is no final-logit soft cap
      (llama.cpp's ``llm_build_gemma3<iswa = true>``); without a window, the file's soft cap;
    - every architecture: cos and sin of RoPE times ``rope.scaling.attn_factor`` (llama.cpp's
      ``yarn_attn_factor *= rope_attn_factor``; phi3's LongRoPE files carry one);
    - phi3: ``attn_qkv`` rows Q, K, V; ``ffn_up`` rows gate (first n_ff) then up;
      ``rope_factors_long`` when ``n_ctx`` > ``rope.scaling.original_context_length`` (else
      context_length), else ``rope_factors_short``; no sliding window (llama.cpp turns it off).

    ``wrong``: deliberate mistakes, for showing that a check catches them: ``"no_qk_norm"``,
    ``"no_embd_scale"``, ``"no_post_norm"``, ``"swap_gate_up"``, ``"no_window"``,
    ``"short_factors"`` (phi3's short factors whatever the context), ``"pattern_6"`` (the
    window on ``il % 6 < 5`` and RoPE base 10000 whatever the file says), ``"cap_with_window"``
    (the soft cap applied with a window too), ``"no_attn_factor"``."""
    arch = str(mf.get("general.architecture"))

    def key(k: str, default: object = None) -> object:
        return mf.get(f"{arch}.{k}", default)

    def w(name: str) -> np.ndarray:
        return _arch_weight(mf, name)

    def has(name: str) -> bool:
        return name in mf.tensors

    E, n_layer = int(key("embedding_length")), int(key("block_count"))
    H = int(key("attention.head_count"))
    Hkv = int(key("attention.head_count_kv", H))
    hd = int(key("attention.key_length", E // H))
    n_rot = int(key("rope.dimension_count", hd))
    n_ff = int(key("feed_forward_length"))
    eps = float(key("attention.layer_norm_rms_epsilon", 1e-5))
    base = float(key("rope.freq_base", 10000.0))
    factor = float(key("rope.scaling.factor", 0.0) or 0.0)
    scale = 1.0 / factor if factor and key("rope.scaling.type", "linear") == "linear" else 1.0
    neox = arch not in ("llama", "mistral")
    n_swa = int(key("attention.sliding_window", 0) or 0) if arch == "gemma3" else 0
    period, base_swa = 6, 10000.0
    if n_swa and "pattern_6" not in wrong:
        period = int(key("attention.sliding_window_pattern", 6))
        base_swa = float(key("rope.freq_base_swa", 10000.0))
    cap = float(key("final_logit_softcapping", 0.0) or 0.0)
    if n_swa and "cap_with_window" not in wrong:
        cap = 0.0
    attn_factor = 1.0 if "no_attn_factor" in wrong else float(key("rope.scaling.attn_factor", 1.0))
    ff = None
    if has("rope_freqs.weight"):
        ff = w("rope_freqs.weight")
    elif has("rope_factors_long.weight"):
        orig = int(key("rope.scaling.original_context_length", key("context_length")))
        long = n_ctx is not None and n_ctx > orig and "short_factors" not in wrong
        ff = w("rope_factors_long.weight" if long else "rope_factors_short.weight")
    if arch == "gemma3":
        kq_scale = 1.0 / math.sqrt(E // H if n_layer == 62 else hd)
    else:
        kq_scale = 1.0 / math.sqrt(hd)

    ids_arr = np.asarray(list(ids), dtype=np.int64)
    T = ids_arr.size
    pos = np.arange(T)
    x = w("token_embd.weight")[ids_arr].astype(np.float64)
    if arch == "gemma3" and "no_embd_scale" not in wrong:
        x = x * math.sqrt(E)
    causal = pos[None, :] > pos[:, None]  # (query, key): key after query
    for il in range(n_layer):
        p = f"blk.{il}."
        h = rms_norm(x, w(p + "attn_norm.weight"), eps)
        if has(p + "attn_qkv.weight"):
            qkv = h @ w(p + "attn_qkv.weight").T
            q, k, v = qkv[:, :H * hd], qkv[:, H * hd:(H + Hkv) * hd], qkv[:, (H + Hkv) * hd:]
        else:
            q, k, v = (h @ w(p + n + ".weight").T for n in ("attn_q", "attn_k", "attn_v"))
            if has(p + "attn_q.bias"):
                q, k, v = q + w(p + "attn_q.bias"), k + w(p + "attn_k.bias"), v + w(p + "attn_v.bias")
        q, k, v = q.reshape(T, H, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if has(p + "attn_q_norm.weight") and "no_qk_norm" not in wrong:
            q = rms_norm(q, w(p + "attn_q_norm.weight"), eps)
            k = rms_norm(k, w(p + "attn_k_norm.weight"), eps)
        swa = n_swa > 0 and (period == 0 or il % period < period - 1)
        b_l, s_l = (base_swa, 1.0) if swa else (base, scale)
        q = rope_yarn(q, pos, n_rot, b_l, s_l, neox, ff, attn_factor=attn_factor)
        k = rope_yarn(k, pos, n_rot, b_l, s_l, neox, ff, attn_factor=attn_factor)
        mask = causal
        if swa and "no_window" not in wrong:
            mask = causal | (pos[:, None] - pos[None, :] >= n_swa)
        g = H // Hkv
        s = np.einsum("tkgd,skd->kgts", q.reshape(T, Hkv, g, hd), k) * kq_scale
        s = np.where(mask[None, None], -np.inf, s)
        a = np.einsum("kgts,skd->tkgd", _softmax(s, axis=-1), v).reshape(T, H * hd)
        o = a @ w(p + "attn_output.weight").T
        post = has(p + "post_attention_norm.weight") and "no_post_norm" not in wrong
        if post:
            o = rms_norm(o, w(p + "post_attention_norm.weight"), eps)
        x = x + o
        h = rms_norm(x, w(p + "ffn_norm.weight"), eps)
        if has(p + "ffn_gate.weight"):
            gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        else:  # phi3: one ffn_up, gate rows first
            gu = h @ w(p + "ffn_up.weight").T
            gate, up = gu[:, :n_ff], gu[:, n_ff:]
        if "swap_gate_up" in wrong:
            gate, up = up, gate
        act = _gelu_tanh(gate) if arch == "gemma3" else _silu(gate)
        f = (act * up) @ w(p + "ffn_down.weight").T
        if post:
            f = rms_norm(f, w(p + "post_ffw_norm.weight"), eps)
        x = x + f
    x = rms_norm(x, w("output_norm.weight"), eps)
    out_w = w("output.weight" if has("output.weight") else "token_embd.weight")
    logits = np.empty((T, out_w.shape[0]))
    for r in range(0, out_w.shape[0], 32768):  # (a float64 copy of a large vocabulary at a time)
        logits[:, r:r + 32768] = x @ out_w[r:r + 32768].astype(np.float64).T
    if cap:
        logits = cap * np.tanh(logits / cap)
    return logits
