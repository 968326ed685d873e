"""The cpu backend's whole-step ops (:data:`~vkxsplit.backend.STEP_OPS`: embedding rows,
RoPE, KV store, attention, argmax) as ggml graph pieces, for :class:`~vkxsplit.backends.cpu.CpuBackend`
with ``step=1``: which graph nodes the ggml forms cannot take (:func:`why_not`), the shape and
parameter checks made before a job is enqueued (:func:`check`: ggml aborts the process on a
shape it does not take), the nodes a job adds to a graph with the checks and per-step settings
that run before each compute (:func:`emit`: positions in the cache, the attention's KV length
and causal mask), and the argmax, computed on the host (:func:`host_argmax`).

The backend's products (mul_mat, mul_mat_id), its graph cache and its runs stay in
:mod:`.cpu`, which imports this module (never the other way).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..attach import SharedView
from ..backend import OpJob
from ..errors import KernelError
from ..ops.quant import TYPES, row_bytes, weight_type
from . import ggml_cpu

F32 = 0  # GGML_TYPE_F32
F16 = 1  # GGML_TYPE_F16
I32 = 26  # GGML_TYPE_I32
ROPE_MODES = {"norm": 0, "neox": 2}  # ggml's GGML_ROPE_TYPE_NORMAL / _NEOX
#: ggml's defaults for the YaRN arguments of rope_ext (as vkxsplit.ops.rope.YARN_DEFAULTS)
YARN_DEFAULTS: dict[str, float] = {"n_ctx_orig": 0, "ext_factor": 0.0, "attn_factor": 1.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0}
#: the attention mask's query rows are padded to a multiple of this: ggml builds older than the
#: removal of GGML_KQ_MASK_PAD (a llama.cpp build through VKXSPLIT_GGML_LIBDIR) assert
#: ``mask->ne[1] >= GGML_PAD(q->ne[1], GGML_KQ_MASK_PAD)`` (64; 32 before that), newer ones
#: ``mask->ne[1] >= q->ne[1]``
KQ_MASK_PAD = 64


def addr(v: SharedView, nbytes: int) -> int:
    """Address of the backend's mapping of ``v`` (checked to hold ``nbytes``)."""
    return int(v.backend_array(np.uint8, nbytes).ctypes.data)


def why_not(node: Any) -> str | None:
    """Why a graph node of the STEP_OPS cannot run here (the planner keeps it on the hub), or
    None: what the ggml form of the op lacks against the hub's kernel."""
    p = node.params
    if node.op == "attention":
        if p.get("window", 0):
            return "sliding-window attention runs on the hub (the cpu backend's attention has no window)"
        if node.inputs[1].dtype != "f16" or node.inputs[2].dtype != "f16":
            return "the cpu backend's attention reads an f16 KV cache"
    if node.op == "kv_store" and (node.output.dtype != "f16" or p["cache_v"].dtype != "f16"):
        return "the cpu backend stores into an f16 KV cache"
    if node.op in ("rope", "kv_store"):
        rope = p if node.op == "rope" else (p.get("rope_k") or {"mode": "norm"})
        if rope.get("mode") not in ROPE_MODES:
            return f"RoPE mode {rope.get('mode')!r} runs on the hub (the cpu backend has {', '.join(ROPE_MODES)})"
    if node.op == "get_rows" and node.inputs[0].dtype not in TYPES:
        return f"the cpu backend has no {node.inputs[0].dtype} rows"
    return None


def check(job: OpJob, what: str) -> None:
    """Shapes and parameters of a STEP_OPS job, checked here: ggml aborts the process on a
    shape it does not take."""
    p, R, C = job.params, job.rows, job.cols

    def need(v: SharedView, nbytes: int, name: str) -> None:
        if v.size < nbytes:
            raise KernelError(f"{what}: {name} is a {v.size}-byte view; the shape needs {nbytes} bytes")

    def ints(*names: str) -> list[int]:
        out = []
        for k in names:
            v = p.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KernelError(f"{what}: parameter {k} must be a positive integer, got {v!r}")
            out.append(v)
        return out

    def rope(r: dict[str, Any], nh: int, hd: int) -> None:
        if r.get("mode") not in ROPE_MODES:
            raise KernelError(f"{what}: RoPE mode {r.get('mode')!r} is not one of {', '.join(ROPE_MODES)}")
        nd = r.get("n_dims")
        if isinstance(nd, bool) or not isinstance(nd, int) or nd < 2 or nd % 2 or nd > hd:
            raise KernelError(f"{what}: n_dims {nd!r} must be even and in [2, head_dim {hd}]")
        for k in ("freq_base", "freq_scale", *YARN_DEFAULTS):
            v = r.get(k, YARN_DEFAULTS.get(k))
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise KernelError(f"{what}: RoPE parameter {k} must be a finite number, got {v!r}")
        if len(job.inputs) > (2 if job.op == "rope" else 3):
            need(job.inputs[-1], nd // 2 * 4, "the frequency factors")

    if job.op == "get_rows":
        wt = p.get("w_type")
        if wt not in TYPES:
            raise KernelError(f"{what}: no ggml type for table type {wt!r}")
        (n_rows,) = ints("n_rows")
        bs = weight_type(wt).block_size
        if C % bs:
            raise KernelError(f"{what}: rows of {C} are not whole {bs}-element {wt} blocks")
        need(job.inputs[0], n_rows * row_bytes(wt, C), "the table")
        need(job.inputs[1], R * 4, "the ids")
        need(job.outputs[0], R * C * 4, "the output")
    elif job.op == "rope":
        nh, hd = ints("n_heads", "head_dim")
        if nh * hd != C:
            raise KernelError(f"{what}: {nh} heads of {hd} are not the {C} columns of x")
        rope(p, nh, hd)
        need(job.inputs[0], R * C * 4, "x")
        need(job.inputs[1], R * 4, "the positions")
        need(job.outputs[0], R * C * 4, "the output")
    elif job.op == "kv_store":
        nkv, hd, n_ctx = ints("n_kv_heads", "head_dim", "n_ctx")
        if nkv * hd != C:
            raise KernelError(f"{what}: {nkv} KV heads of {hd} are not the {C} columns of k")
        if p.get("rope_k") is not None:
            rope(p["rope_k"], nkv, hd)
        need(job.inputs[0], R * C * 4, "k")
        need(job.inputs[1], R * C * 4, "v")
        need(job.inputs[2], R * 4, "the positions")
        need(job.outputs[0], n_ctx * C * 2, "the K cache")
        need(job.outputs[1], n_ctx * C * 2, "the V cache")
    elif job.op == "attention":
        nh, nkv, hd, n_ctx = ints("n_heads", "n_kv_heads", "head_dim", "n_ctx")
        if nh * hd != C or nh % nkv:
            raise KernelError(f"{what}: {nh} heads of {hd} ({C} columns of q) over {nkv} KV heads: "
                              "the heads must fill q and be a multiple of the KV heads")
        if p.get("window", 0):
            raise KernelError(f"{what}: sliding-window attention is not on the cpu backend",
                              "plan it on the hub")
        sc = p.get("scale")
        if sc is not None and not (isinstance(sc, (int, float)) and math.isfinite(sc)):
            raise KernelError(f"{what}: scale must be a finite number, got {sc!r}")
        need(job.inputs[0], R * C * 4, "q")
        need(job.inputs[1], n_ctx * nkv * hd * 2, "the K cache")
        need(job.inputs[2], n_ctx * nkv * hd * 2, "the V cache")
        need(job.inputs[3], R * 4, "the positions")
        need(job.outputs[0], R * C * 4, "the output")
    elif job.op == "argmax":
        need(job.inputs[0], R * C * 4, "the logits")
        need(job.outputs[0], R * 4, "the output")


def rope_ext(ggml: Any, g: ggml_cpu.Graph, x: Any, pos: Any, ff: SharedView | None, r: dict[str, Any]) -> Any:
    """ggml's rope_ext of ``x`` [head_dim, heads, T] with the hub's parameters ``r``."""
    r = {**YARN_DEFAULTS, **r}
    nd = int(r["n_dims"])
    F = g.strided(F32, addr(ff, nd // 2 * 4), nd // 2, 1, nd // 2 * 4) if ff is not None else ggml.ffi.NULL
    return ggml.base.ggml_rope_ext(g.ctx, x, pos, F, nd, ROPE_MODES[r["mode"]], int(r["n_ctx_orig"]),
                                        float(r["freq_base"]), float(r["freq_scale"]), float(r["ext_factor"]),
                                        float(r["attn_factor"]), float(r["beta_fast"]), float(r["beta_slow"]))


def positions(job: OpJob, n_ctx: int, consecutive: bool, who: str) -> Any:
    """A check of ``job``'s positions (the last input before the factors) for ``before``:
    each in ``[0, n_ctx)`` (ggml's set_rows aborts outside it), and for attention
    consecutive (the hub's attention reads pos[0] and counts on); returns pos[0]."""
    pv = job.inputs[3 if job.op == "attention" else (1 if job.op == "rope" else 2)]
    pos = pv.backend_array(np.int32, job.rows)
    T = job.rows
    what = f"{who}: {job.op} {job.name}".rstrip()

    def check() -> int:
        p0 = int(pos[0])
        if consecutive and T > 1 and not (pos[1:] - pos[:-1] == 1).all():
            raise KernelError(f"{what}: positions {pos.tolist()[:8]}... are not consecutive",
                              "attention takes one run of positions per step")
        lo, hi = (p0, p0 + T - 1) if consecutive else (int(pos.min()), int(pos.max()))
        if lo < 0 or hi >= n_ctx:
            raise KernelError(f"{what}: positions {lo}..{hi} outside the cache [0, {n_ctx})",
                              "the context is full: start a new sequence or load with a larger n_ctx")
        return p0

    return check


def emit(ggml: Any, g: ggml_cpu.Graph, job: OpJob, before: list[Any], keep: list[Any],
         masks: dict[tuple[int, int], tuple[np.ndarray, list[int]]], who: str) -> list[Any]:
    lib = ggml.base
    p, R, C = job.params, job.rows, job.cols
    if job.op == "get_rows":
        wt, n_rows = p["w_type"], p["n_rows"]
        rb = row_bytes(wt, C)
        table = g.strided(weight_type(wt).id, addr(job.inputs[0], n_rows * rb), C, n_rows, rb)
        ids = g.strided(I32, addr(job.inputs[1], R * 4), R, 1, R * 4)
        idv = job.inputs[1].backend_array(np.int32, R)
        what = f"{who}: get_rows {job.name}".rstrip()

        def check_ids() -> None:  # ggml aborts on a row outside the table
            if idv.min() < 0 or idv.max() >= n_rows:
                bad = int(idv[(idv < 0) | (idv >= n_rows)][0])
                raise KernelError(f"{what}: token id {bad} outside the table's {n_rows} rows",
                                  "ids must come from this model's vocabulary")

        before.append((check_ids, job.inputs[1]))
        return [g.place(lib.ggml_get_rows(g.ctx, table, ids), addr(job.outputs[0], R * C * 4), C * 4)]
    if job.op == "rope":
        nh, hd = p["n_heads"], p["head_dim"]
        x = g.strided(F32, addr(job.inputs[0], R * C * 4), hd, nh, hd * 4, R, C * 4)
        pos = g.strided(I32, addr(job.inputs[1], R * 4), R, 1, R * 4)
        y = rope_ext(ggml, g, x, pos, job.inputs[2] if len(job.inputs) > 2 else None, p)
        return [g.place(y, addr(job.outputs[0], R * C * 4), hd * 4, C * 4)]
    if job.op == "kv_store":
        nkv, hd, n_ctx = p["n_kv_heads"], p["head_dim"], p["n_ctx"]
        pos = g.strided(I32, addr(job.inputs[2], R * 4), R, 1, R * 4)
        before.append((positions(job, n_ctx, False, who), job.inputs[2]))
        k = g.strided(F32, addr(job.inputs[0], R * C * 4), C, R, C * 4)
        if p.get("rope_k") is not None:  # K roped into the backend's scratch on its way to the cache
            scratch = np.zeros(R * C, np.float32)
            keep.append(scratch)
            k3 = g.strided(F32, addr(job.inputs[0], R * C * 4), hd, nkv, hd * 4, R, C * 4)
            kr = g.place(rope_ext(ggml, g, k3, pos, job.inputs[3] if len(job.inputs) > 3 else None, p["rope_k"]),
                         scratch.ctypes.data, hd * 4, C * 4)
            k = lib.ggml_reshape_2d(g.ctx, kr, C, R)
        v = g.strided(F32, addr(job.inputs[1], R * C * 4), C, R, C * 4)
        ck = g.strided(F16, addr(job.outputs[0], n_ctx * C * 2), C, n_ctx, C * 2)
        cv = g.strided(F16, addr(job.outputs[1], n_ctx * C * 2), C, n_ctx, C * 2)
        return [lib.ggml_set_rows(g.ctx, ck, k, pos), lib.ggml_set_rows(g.ctx, cv, v, pos)]
    if job.op == "attention":
        nh, nkv, hd, n_ctx = p["n_heads"], p["n_kv_heads"], p["head_dim"], p["n_ctx"]
        kvr = nkv * hd
        q = g.strided(F32, addr(job.inputs[0], R * C * 4), hd, R, C * 4, nh, hd * 4)  # [hd, T, heads]
        K = g.strided(F16, addr(job.inputs[1], n_ctx * kvr * 2), hd, n_ctx, kvr * 2, nkv, hd * 2)
        V = g.strided(F16, addr(job.inputs[2], n_ctx * kvr * 2), hd, n_ctx, kvr * 2, nkv, hd * 2)
        mask: Any = ggml.ffi.NULL
        Rp = -(-R // KQ_MASK_PAD) * KQ_MASK_PAD  # the mask's rows (the last Rp - R unread)
        if R > 1:  # causal: query t at pos0 + t sees cache rows <= pos0 + t (f16 0 / -inf)
            mbuf, state = masks.setdefault((R, n_ctx), (np.zeros(Rp * n_ctx, np.float16), [-1]))
            keep.append(mbuf)
            mask = g.strided(F16, mbuf.ctypes.data, n_ctx, Rp, n_ctx * 2)
        else:
            state = [-1]
        check = positions(job, n_ctx, True, who)
        tri = np.triu(np.full((R, R), -np.inf, np.float16), 1) if R > 1 else None

        def set_kv() -> None:
            """The KV length of this step: pos0 + T rows of the cache (ggml reads ne[1] of K and V at
            compute time, and the mask's rows at its ne[0] stride)."""
            n_kv = check() + R
            K.ne[1] = V.ne[1] = n_kv
            if R > 1:
                mask.ne[0] = n_kv
                mask.nb[1] = n_kv * 2
                mask.nb[2] = mask.nb[3] = n_kv * 2 * Rp
                if state[0] != n_kv:  # (the same for every layer of a step)
                    m = mbuf[:Rp * n_kv].reshape(Rp, n_kv)
                    m[:, :n_kv - R] = 0
                    m[:R, n_kv - R:] = tri
                    m[R:, n_kv - R:] = 0
                    state[0] = n_kv

        before.append((set_kv, job.inputs[3]))
        sc = p.get("scale")
        out = lib.ggml_flash_attn_ext(g.ctx, q, K, V, mask, float(1.0 / math.sqrt(hd) if sc is None else sc),
                                      0.0, 0.0)  # [hd, heads, T]: the rows of the output
        return [g.place(out, addr(job.outputs[0], R * C * 4), hd * 4, C * 4)]
    raise KernelError(f"{who}: no graph for {job.op}")


def host_argmax(job: OpJob) -> Any:
    """The argmax, on the host: numpy's first maximum of each row, -1 where a row holds a NaN
    (numpy's argmax returns the first NaN) or +infinity (as the hub's argmax)."""
    x = job.inputs[0].backend_array(np.float32, job.rows * job.cols).reshape(job.rows, job.cols)
    out = job.outputs[0].backend_array(np.int32, job.rows)

    def run() -> None:
        i = x.argmax(axis=1)
        v = x[np.arange(job.rows), i]
        out[:] = np.where(np.isnan(v) | (v == np.inf), -1, i)

    return run
