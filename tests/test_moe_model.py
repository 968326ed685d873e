"""The MoE FFN of a model (vkxsplit/moe.py): hyper-parameters read from tiny qwen3moe and
Mixtral-style llama GGUF files written here (GGUFWriter), files whose expert counts disagree
with their tensors refused, and ``build_moe_ffn``'s graph (router mul_mat -> moe_topk ->
moe_group -> gate/up mul_mat_id -> swiglu -> down mul_mat_id -> moe_combine) run on the hub
against ``reference.moe_ffn`` over the file's weights dequantized by ``gguf.quants``.

Bound of the FFN check: 2e-3 * max|y_ref| (f32 accumulation over K <= 96 of Q8_0 / F16
weights: ~1e-6 relative on lavapipe; on GPUs the router product of T > 8 rows runs in f16
coopmat, which moves the expert weights by ~1e-4); inputs are drawn with the chosen experts
at least 0.05 apart in logit from the rest, so that rounding cannot flip the routing; the same
check fails for top-1 routing and for unnormalised weights, so it can tell them apart. Where
the decode's expert products read x rounded to q8_1 (ops.moe.default_path: T = 1 with
integer dot products, as the dense decode), the reference rounds their x the same way
(test_moe.moe_ffn_q8_1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from reference import moe_ffn, mul_mat_id
from test_moe import moe_ffn_q8_1, q8_1_round, separated_inputs

from vkxsplit.errors import ModelError
from vkxsplit.executor import record_graph
from vkxsplit.graph import Graph, Tensor
from vkxsplit.moe import build_moe_ffn, check_moe_tensors, is_moe, moe_act_cols, read_moe_params
from vkxsplit.ops.moe import default_path
from vkxsplit.vk.command import Sequence

Q = GGMLQuantizationType
N_EMBD, N_HEAD, N_KV, HEAD_DIM, N_VOCAB, N_LAYER = 64, 4, 2, 16, 96, 2


def write_moe_gguf(path: Path, arch: str, qtype: Q = Q.Q8_0, *, n_expert: int = 8, n_used: int = 2,
                   n_ff_exp: int = 96, tensor_experts: int | None = None, keys: dict | None = None,
                   seed: int = 0) -> Path:
    """A complete tiny random model of ``arch`` (qwen3moe: with Q/K norms) whose every FFN is a
    MoE; ``tensor_experts``: write the expert tensors with that many experts instead (a file
    that disagrees with its metadata); ``keys``: extra or replaced ``{arch}.`` keys (None
    values leave a key out)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch)
    kv = {"context_length": ("uint32", 256), "embedding_length": ("uint32", N_EMBD),
          "block_count": ("uint32", N_LAYER),
          "feed_forward_length": ("uint32", n_ff_exp if arch == "llama" else 4 * N_EMBD),
          "attention.head_count": ("uint32", N_HEAD), "attention.head_count_kv": ("uint32", N_KV),
          "attention.key_length": ("uint32", HEAD_DIM), "attention.value_length": ("uint32", HEAD_DIM),
          "rope.dimension_count": ("uint32", HEAD_DIM), "rope.freq_base": ("float32", 10000.0),
          "attention.layer_norm_rms_epsilon": ("float32", 1e-6), "vocab_size": ("uint32", N_VOCAB),
          "expert_count": ("uint32", n_expert), "expert_used_count": ("uint32", n_used)}
    if arch == "qwen3moe":
        kv["expert_feed_forward_length"] = ("uint32", n_ff_exp)
    for k, v in (keys or {}).items():
        if v is None:
            kv.pop(k, None)
        else:
            kv[k] = v
    for k, (typ, v) in kv.items():
        getattr(w, f"add_{typ}")(f"{arch}.{k}", v)
    E = n_expert if tensor_experts is None else tensor_experts

    def put(name: str, a: np.ndarray, t: Q = qtype) -> None:
        a = a.astype(np.float32)
        if t == Q.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quantize(a, t), raw_shape=None, raw_dtype=t)

    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) * (1.0 / np.sqrt(shape[-1]))

    put("token_embd.weight", mat(N_VOCAB, N_EMBD))
    put("output_norm.weight", 1 + 0.1 * rng.standard_normal(N_EMBD), Q.F32)
    put("output.weight", mat(N_VOCAB, N_EMBD))
    for il in range(N_LAYER):
        p = f"blk.{il}."
        put(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(N_EMBD), Q.F32)
        put(p + "attn_q.weight", mat(N_HEAD * HEAD_DIM, N_EMBD))
        put(p + "attn_k.weight", mat(N_KV * HEAD_DIM, N_EMBD))
        put(p + "attn_v.weight", mat(N_KV * HEAD_DIM, N_EMBD))
        put(p + "attn_output.weight", mat(N_EMBD, N_HEAD * HEAD_DIM))
        if arch == "qwen3moe":
            put(p + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(HEAD_DIM), Q.F32)
            put(p + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(HEAD_DIM), Q.F32)
        put(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(N_EMBD), Q.F32)
        put(p + "ffn_gate_inp.weight", mat(n_expert, N_EMBD), Q.F32)
        put(p + "ffn_gate_exps.weight", mat(E, n_ff_exp, N_EMBD))
        put(p + "ffn_up_exps.weight", mat(E, n_ff_exp, N_EMBD))
        put(p + "ffn_down_exps.weight", mat(E, N_EMBD, n_ff_exp))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read(path: Path):
    """(arch, get(key), {name: (ne, type)}, {name: (raw bytes, numpy shape, type)}) of a file."""
    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()

    def get(key: str):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    ne = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type) for t in r.tensors}
    raw = {t.name: t for t in r.tensors}
    return arch, get, ne, raw


def params(path: Path):
    arch, get, ne, _ = read(path)
    n_ff = get(f"{arch}.feed_forward_length")
    mp = read_moe_params(str(path), arch, get, n_ff)
    check_moe_tensors(str(path), mp, N_EMBD, N_LAYER, ne)
    return mp


def test_params_qwen3moe_and_mixtral(tmp_path):
    q = write_moe_gguf(tmp_path / "q.gguf", "qwen3moe", n_ff_exp=96,
                       keys={"expert_weights_scale": ("float32", 2.5)})
    mp = params(q)
    assert (mp.n_expert, mp.n_used, mp.n_ff_exp, mp.norm_w, mp.scale, mp.gating) == (8, 2, 96, True, 2.5, "softmax")
    assert is_moe("qwen3moe", [])
    # Mixtral: experts sized by feed_forward_length (no expert_feed_forward_length)
    m = write_moe_gguf(tmp_path / "m.gguf", "llama", n_ff_exp=4 * N_EMBD, n_expert=4, n_used=1)
    mp = params(m)
    assert (mp.n_expert, mp.n_used, mp.n_ff_exp, mp.norm_w, mp.scale) == (4, 1, 4 * N_EMBD, True, 1.0)
    assert is_moe("llama", read(m)[2]) and not is_moe("llama", ["blk.0.ffn_gate.weight"])
    # qwen3moe without expert_feed_forward_length: feed_forward_length / expert_used_count
    f = write_moe_gguf(tmp_path / "f.gguf", "qwen3moe", n_ff_exp=2 * N_EMBD,
                       keys={"expert_feed_forward_length": None})
    assert params(f).n_ff_exp == 2 * N_EMBD
    s = write_moe_gguf(tmp_path / "s.gguf", "qwen3moe", keys={"expert_gating_func": ("uint32", 2),
                                                              "expert_weights_norm": ("bool", False)})
    assert (params(s).gating, params(s).norm_w) == ("sigmoid", False)


@pytest.mark.parametrize("keys, tensor_experts, match", [
    ({}, 6, "ffn_gate_exps.weight has shape .ne. \\[64, 96, 6\\] but the expert counts"),
    ({"expert_count": ("uint32", 6)}, None, "ffn_gate_inp.weight has shape .ne. \\[64, 8\\]"),
    ({"expert_used_count": ("uint32", 9)}, None, "expert_used_count = 9 must be in 1..expert_count"),
    ({"expert_used_count": None}, None, "no qwen3moe.expert_count / qwen3moe.expert_used_count"),
    ({"expert_shared_count": ("uint32", 1)}, None, "no shared experts"),
    ({"expert_gating_func": ("uint32", 3)}, None, "expert_gating_func = 3"),
    ({"expert_count": ("uint32", 1000)}, None, "runs 1..512 experts"),
    ({"expert_count": ("float32", float("inf"))}, None, "expert_count = inf is not a finite number"),
    ({"expert_used_count": ("float32", float("nan"))}, None, "expert_used_count = nan is not a finite number"),
    ({"expert_feed_forward_length": ("uint32", 64)}, None, "ffn_gate_exps.weight has shape"),
])
def test_refused(tmp_path, keys, tensor_experts, match):
    p = write_moe_gguf(tmp_path / "bad.gguf", "qwen3moe", keys=keys, tensor_experts=tensor_experts)
    with pytest.raises(ModelError, match=match) as ei:
        params(p)
    assert ei.value.hint


def _upload(device, made, name: str, t, as3d: bool = False) -> Tensor:
    data = np.asarray(t.data).view(np.uint8).ravel()
    b = device.memory.alloc(max(data.nbytes, 16), "host", name="test")
    made.append(b)
    b.numpy(np.uint8, (data.nbytes,))[:] = data
    ne = tuple(int(d) for d in t.shape)
    shape = tuple(reversed(ne)) if as3d else (int(np.prod(ne[1:])), ne[0])
    return Tensor(name, shape, t.tensor_type.name.lower(), b, weight=True)


def _deq(t) -> np.ndarray:
    a = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64)
    return a.reshape(tuple(reversed([int(d) for d in t.shape])))


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_moe_ffn_graph(device, tmp_path, rng, arch, T):
    """build_moe_ffn of layer 1 of a tiny file, recorded through the graph-node recorders
    (vkxsplit.ops.nodes), against reference.moe_ffn; wrong routings fail the same check."""
    path = write_moe_gguf(tmp_path / "m.gguf", arch, Q.Q8_0 if arch == "llama" else Q.F16,
                          n_ff_exp=96, n_expert=8, n_used=2 if arch == "llama" else 3, seed=T)
    mp = params(path)
    _, _, _, raw = read(path)

    made: list = []
    try:
        p = "blk.1."
        W = {n: _upload(device, made, n, raw[n], as3d=n.endswith("_exps.weight"))
             for n in raw if n.startswith(p + "ffn_gate_inp") or n.endswith("_exps.weight") and n.startswith(p)}
        bufs: dict[str, object] = {}

        def act(name: str, cols: int) -> Tensor:
            if name not in bufs:
                b = device.memory.alloc(4 * T * moe_act_cols(mp, N_EMBD, T)[name], "host", name=name)
                made.append(b)
                bufs[name] = b
            return Tensor(name, (T, cols), "f32", bufs[name])

        h_np = separated_inputs(rng, _deq(raw[p + "ffn_gate_inp.weight"]), T, mp.n_used)
        hb = device.memory.alloc(h_np.nbytes, "host", name="h")
        ob = device.memory.alloc(h_np.nbytes, "host", name="out")
        made += [hb, ob]
        hb.numpy(np.float32, h_np.shape)[:] = h_np
        ob.numpy(np.float32, h_np.shape)[:] = np.nan
        h = Tensor("h", (T, N_EMBD), "f32", hb)
        out = Tensor("o", (T, N_EMBD), "f32", ob)
        g = Graph("moe", T=T)

        def mul_mat(name, w, x, y):
            return g.add("mul_mat", name, [w, x], y)

        build_moe_ffn(g, p, W, h, out, mp, act, mul_mat)
        ops = [n.op for n in g.nodes]
        assert ops == ["mul_mat", "moe_topk", *(["moe_group"] if T * mp.n_used >= 64 else []), "mul_mat_id",
                       "mul_mat_id",
                       "swiglu", "mul_mat_id", "moe_combine"]
        seq = Sequence(device, "moe-graph")
        try:
            record_graph(seq, g)
            seq.run()
        finally:
            seq.close()
        got = ob.numpy(np.float32, h_np.shape).astype(np.float64)
        R, G, U, D = (_deq(raw[p + n + ".weight"]) for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                                               "ffn_down_exps"))
        h64 = h_np.astype(np.float64)
        # the decode's expert products may read x rounded to q8_1 (as the dense decode): then
        # the reference rounds it the same way
        wtype = "q8_0" if arch == "llama" else "f16"
        ffn = moe_ffn_q8_1 if default_path(device, wtype, T, mp.n_used, mp.n_expert) == "vec_q8_1" else moe_ffn
        ref = ffn(h64, R, G, U, D, mp.n_used)
        bound = 2e-3 * np.abs(ref).max()
        assert np.abs(got - ref).max() <= bound
        assert np.abs(got - ffn(h64, R, G, U, D, 1)).max() > bound
        assert np.abs(got - ffn(h64, R, G, U, D, mp.n_used, norm=False)).max() > bound
    finally:
        for b in made:
            b.close()


# ---------------------------------------------------------------------------------------------
# the whole model: load_model of the tiny files, logits against a float64 forward written here


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, neox: bool, base: float = 10000.0) -> np.ndarray:
    """x (T, heads, D): pairs (i, i + D/2) (neox) or (2i, 2i + 1) turned by pos * base^(-2i/D)."""
    D = x.shape[-1]
    th = pos[:, None] * base ** (-np.arange(0, D, 2) / D)[None, :]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    a, b = (x[..., : D // 2], x[..., D // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * c - b * s, a * s + b * c
    out = np.empty_like(x)
    if neox:
        out[..., : D // 2], out[..., D // 2:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def forward64(path: Path, ids: list[int], n_used_override: int | None = None, norm: bool = True,
              q8: bool = False) -> np.ndarray:
    """float64 logits (T, n_vocab) of a tiny MoE file: llama.cpp's qwen3moe / llama graphs
    (qwen3moe: per-head RMSNorm of Q and K, NeoX RoPE; llama: adjacent-pair RoPE), every FFN a
    MoE (reference.moe_ffn). ``n_used_override`` / ``norm``: deliberately wrong variants.
    ``q8``: the x of every product of a quantized weight rounded to q8_1 blocks first (the
    decode's integer-dot-product path, as llama.cpp's MMVQ: Q/K/V, the attention output, the
    experts (test_moe.moe_ffn_q8_1) and the output; the f32 router reads x as is)."""
    arch, get, _, raw = read(path)
    rq = q8_1_round if q8 else (lambda a: a)
    ffn = moe_ffn_q8_1 if q8 else moe_ffn
    W = {n: _deq(t) for n, t in raw.items()}
    eps = float(get(f"{arch}.attention.layer_norm_rms_epsilon"))
    n_used = n_used_override or int(get(f"{arch}.expert_used_count"))
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(N_LAYER):
        p = f"blk.{il}."
        h = rq(_rms(x, W[p + "attn_norm.weight"], eps))
        q = (h @ W[p + "attn_q.weight"].T).reshape(T, N_HEAD, HEAD_DIM)
        k = (h @ W[p + "attn_k.weight"].T).reshape(T, N_KV, HEAD_DIM)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, N_KV, HEAD_DIM)
        if arch == "qwen3moe":
            q = _rms(q, W[p + "attn_q_norm.weight"], eps)
            k = _rms(k, W[p + "attn_k_norm.weight"], eps)
        q, k = _rope(q, pos, arch == "qwen3moe"), _rope(k, pos, arch == "qwen3moe")
        a = np.empty((T, N_HEAD, HEAD_DIM))
        for hh in range(N_HEAD):
            kv = hh // (N_HEAD // N_KV)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(HEAD_DIM) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            a[:, hh] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kv]
        x = x + rq(a.reshape(T, -1)) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        x = x + ffn(h, W[p + "ffn_gate_inp.weight"], W[p + "ffn_gate_exps.weight"],
                    W[p + "ffn_up_exps.weight"], W[p + "ffn_down_exps.weight"], n_used, norm=norm)
    return rq(_rms(x, W["output_norm.weight"], eps)) @ W["output.weight"].T


def top1_agrees(got: np.ndarray, ref: np.ndarray) -> bool:
    """The same top-1 token at every position whose reference top-2 gap exceeds twice the
    largest error seen (where rounding could not have swapped them: a near-tie, e.g. from the
    f16 coopmat products of a GPU hub, may go either way)."""
    srt = np.sort(ref, axis=-1)
    clear = srt[:, -1] - srt[:, -2] > 2 * np.abs(got - ref).max()
    return bool(clear.mean() > 0.75 and (got.argmax(-1) == ref.argmax(-1))[clear].all())


@pytest.mark.parametrize("arch, qtype", [("qwen3moe", Q.Q8_0), ("qwen3moe", Q.F16), ("llama", Q.Q4_0),
                                         ("llama", Q.BF16)])
def test_model_logits(device, tmp_path, arch, qtype):
    """load_model of a tiny qwen3moe / Mixtral-style llama file: prefill (one step of 40 tokens:
    80 (token, slot) pairs over 8 experts, the grouped expert products; and one of 11: the
    mat-vec path) and, for float weights, decode (11 steps of 1) logits against forward64:
    top-1 equal at every position where no near-tie could swap it (:func:`top1_agrees`) and
    max-abs error within 1% of max|logit| (measured: 0.03% on lavapipe, 0.1% on the H200);
    the same check fails against top-1 routing and against unnormalised weights. (Quantized
    decode reads x rounded to q8_1 in the attention, expert and output mat-vecs, as llama.cpp's
    MMVQ: at these tiny widths that moves logits by ~1.5%; checked per op in test_moe.py and
    against forward64(q8=True) with the q8_1 bound in
    test_decode_experts_read_the_q8_1_their_producers_write.)"""
    from vkxsplit.model import load_model
    from vkxsplit.ops.moe import use_grouped

    n_ff = 96 if arch == "qwen3moe" else 64
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", arch, qtype, n_expert=8, n_used=2, n_ff_exp=n_ff, seed=3)
    long = [(37 * i + 5) % N_VOCAB for i in range(40)]
    short = [5, 17, 3, 90, 42, 42, 7, 0, 63, 11, 29]
    assert use_grouped(len(long), 2, 8) and not use_grouped(len(short), 2, 8)
    runs = [(long, 64), (short, 16)] + ([(short, 1)] if qtype in (Q.F16, Q.BF16) else [])
    for ids, ubatch in runs:
        ref = forward64(path, ids)
        bound = 0.01 * np.abs(ref).max()

        def ok(got: np.ndarray, r: np.ndarray, bound: float = bound) -> bool:
            return top1_agrees(got, r) and bool(np.abs(got - r).max() <= bound)

        with load_model(path, device=device, n_ctx=64, ubatch=ubatch) as m:
            assert m.hp.moe is not None and m.hp.moe.n_used == 2
            got = m.logits(ids).astype(np.float64)
        assert ok(got, ref), (len(ids), ubatch, np.abs(got - ref).max(), bound)
        assert not ok(got, forward64(path, ids, n_used_override=1))
        assert not ok(got, forward64(path, ids, norm=False))


def _decode_graph_and_counts(m) -> tuple[Graph, int, int]:
    """The decode graph (T = 1) of model ``m`` and the levels (barriers) and dispatches of its
    hub segments as the executor recorded them."""
    ex = m._executor(1, False)
    return ex.plan.graph, sum(s.barriers for s in ex._seqs), sum(s.dispatches for s in ex._seqs)


def test_decode_experts_read_the_q8_1_their_producers_write(device, tmp_path, monkeypatch):
    """Decode (T = 1) of a Q8_0 qwen3moe file: the q8_1 pass (vkxsplit.fusion) gives every
    routed product the q8_1 x its producer writes: the experts' gate and up one q8_1 x, the
    FFN norm's, the down product the MoE SwiGLU's (T * n_used rows), so no product records a
    quantize dispatch of its own: per layer 3 dispatches and 2 dependent levels fewer than the
    graph in which they quantize their own x (ops.moe.vecq_id_decode giving nothing: the pass
    leaves them alone, as before it took them). The wiring, exactly: after the last step the
    last layer's down outputs equal the float64 product of the dequantized experts with a
    q8_1-rounded copy of the SwiGLU output they read (1e-5; unrounded is off by more than
    1e-3). The logits: those of that graph within
    LOGIT_BOUND of the logit scale (lavapipe: bit-identical, the same q8_1 bits), and against
    forward64 with every quantized product's x rounded to q8_1 (q8=True) within Q8_DECODE_BOUND
    of max|logit| with the same top-1; the same check fails against top-1 routing and against
    unnormalised weights."""
    from vkxsplit.model import load_model
    from vkxsplit.ops import moe as ops_moe

    if "q8_0" not in ops_moe.vecq_id_decode(device):
        pytest.skip(f"{device.name}: the routed decode of Q8_0 does not take the q8_1 path")
    path = write_moe_gguf(tmp_path / "q8.gguf", "qwen3moe", Q.Q8_0, n_expert=8, n_used=2, n_ff_exp=96, seed=3)
    ids = [5, 17, 3, 90, 42, 42, 7, 0, 63, 11, 29]
    got: dict[bool, tuple[np.ndarray, Graph, int, int]] = {}
    for fused in (False, True):
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(ops_moe, "vecq_id_decode", lambda dev: {})
            with load_model(path, device=device, n_ctx=32, ubatch=1) as m:
                got[fused] = (m.logits(ids).astype(np.float64), *_decode_graph_and_counts(m))
                if fused:  # the wiring, exactly: the last down product read its SwiGLU's output as q8_1
                    U, F = m.hp.moe.n_used, m.hp.moe.n_ff_exp
                    act = m.act["moe_gate"].read()[:4 * U * F].view(np.float32).reshape(1, U, F)
                    eo = m.act["moe_out"].read()[:4 * U * N_EMBD].view(np.float32).reshape(1, U, N_EMBD)
                    sel = m.act["moe_ids"].read()[:4 * U].view(np.int32).reshape(1, U)
    w_down = _deq(read(path)[3][f"blk.{N_LAYER - 1}.ffn_down_exps.weight"])
    want_eo = mul_mat_id(w_down, q8_1_round(act.astype(np.float64)), sel)
    assert np.abs(eo - want_eo).max() <= 1e-5 * np.abs(want_eo).max()
    assert np.abs(eo - mul_mat_id(w_down, act.astype(np.float64), sel)).max() > 1e-3 * np.abs(want_eo).max()
    (before, g0, lv0, nd0), (after, g, lv, nd) = got[False], got[True]
    assert lv == lv0 - 2 * N_LAYER and nd == nd0 - 3 * N_LAYER, (lv0, lv, nd0, nd)
    # the graph: every routed product reads q8_1, written by the FFN norm / the MoE SwiGLU
    assert all("xq" not in n.params for n in g0.nodes if n.op == "mul_mat_id")
    assert g.ops().get("quantize_q8_1", 0) == g0.ops().get("quantize_q8_1", 0)
    for il in range(N_LAYER):
        p = f"blk.{il}."
        norm, gate, up, sw, down = (g.node(p + k) for k in ("ffn_norm", "ffn_gate_exps", "ffn_up_exps",
                                                            "ffn_moe_swiglu", "ffn_down_exps"))
        assert norm.params["xq"] is gate.params["xq"] is up.params["xq"] and norm.params["q8"] == 1
        assert sw.params["xq"] is down.params["xq"] and sw.params["q8"] == 1
        assert down.params["xq"].buffer is not None and gate.params["vecq"] == ops_moe.vecq_id_decode(device)["q8_0"]
    assert _far(after, before) <= LOGIT_BOUND, _far(after, before)
    ref = forward64(path, ids, q8=True)
    bound = Q8_DECODE_BOUND * np.abs(ref).max()

    def ok(a: np.ndarray, r: np.ndarray) -> bool:
        return top1_agrees(a, r) and bool(np.abs(a - r).max() <= bound)

    assert ok(after, ref), (np.abs(after - ref).max(), bound)
    assert not ok(after, forward64(path, ids, n_used_override=1, q8=True))
    assert not ok(after, forward64(path, ids, norm=False, q8=True))
    # the equality with the self-quantizing graph can fail: the experts' gate and up reading the
    # q8_1 x quantized last (the attention output's, of the same size) instead of the FFN norm's
    from vkxsplit import fusion

    right = fusion.DecodeQ8._stale
    monkeypatch.setattr(fusion.DecodeQ8, "_stale",
                        lambda self, x: right(self, x) and not (self._cur is not None and len(x.shape) == 3
                                                                and x.name == "h"))
    with load_model(path, device=device, n_ctx=32, ubatch=1) as m:
        wrong = m.logits(ids).astype(np.float64)
        assert m._build_graph(1, True).node("blk.0.ffn_gate_exps").params["xq"].name == "xq:attn"
    assert _far(wrong, before) > 10 * LOGIT_BOUND, _far(wrong, before)


#: decode logits of a Q8_0 file against forward64(q8=True), as a fraction of max|logit|: the
#: q8_1 bound of the dense decode (test_model.test_decode_integer_dot_products). The reference
#: cannot round exactly like the runtime: the f16 KV cache perturbs the attention output, and
#: rounding to 8 bits turns that into whole steps (a 127th of a block's largest value) that
#: move what follows; at these tiny widths about a percent (measured 1.4% on lavapipe, 2.3%
#: against the unrounded forward64, the same with the products' own quantize dispatches as
#: with the producers' q8_1: the same bits). Wrong routings (top-1, unnormalised weights) are
#: 38-46% off.
Q8_DECODE_BOUND = 0.03

#: the decode graph with its routed products reading their producers' q8_1 against the one
#: whose products quantize their own x: the same q8_1 bits (the producers write what
#: quantize_q8_1 would), so bit-identical logits on lavapipe; room for another device's
#: reduction order in a norm that also quantizes
LOGIT_BOUND = 1e-4


def _far(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_model_refuses_disagreeing_experts(tmp_path):
    from vkxsplit.gguf_model import load_model as load_file

    p = write_moe_gguf(tmp_path / "bad.gguf", "qwen3moe", tensor_experts=6)
    with pytest.raises(ModelError, match="expert counts"):
        load_file(p)
    p = write_moe_gguf(tmp_path / "bad2.gguf", "llama", n_ff_exp=4 * N_EMBD, keys={"expert_count": ("uint32", 4)})
    with pytest.raises(ModelError, match="ffn_gate_inp.weight has shape"):
        load_file(p)


def test_synth_qwen3moe(device, tmp_path):
    """vkxsplit.synth's qwen3moe shapes: the 30B-A3B table entry as Qwen3-30B-A3B, and a tiny
    file written, loaded (its MoE checked) and run: prefill and decode give the same top-1."""
    from vkxsplit.gguf_model import load_model as load_file
    from vkxsplit.model import load_model
    from vkxsplit.synth import SHAPES, synthetic_tensor_types, write_synthetic

    s = SHAPES["qwen3moe30b"]
    assert (s.n_layer, s.n_expert, s.n_expert_used, s.n_embd, s.n_ff_exp, s.n_head, s.n_head_kv, s.hd,
            s.n_vocab) == (48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    types = synthetic_tensor_types("qwen3moe30b", "q4_k", n_layer=1)
    assert "blk.0.ffn_down_exps.weight" in types and "blk.0.ffn_gate.weight" not in types
    path = write_synthetic(tmp_path / "t.gguf", "qwen3moe_tiny", "q4_k")
    mf = load_file(path)
    assert mf.architecture == "qwen3moe" and (mf.hparams.moe.n_expert, mf.hparams.moe.n_used) == (8, 2)
    assert mf.tensors["blk.1.ffn_up_exps.weight"].ne[:3] == (256, 256, 8)
    mf.close()
    ids = [3, 40, 41, 200, 7]
    with load_model(path, device=device, n_ctx=16, ubatch=8) as m:
        pre = m.logits(ids)
    with load_model(path, device=device, n_ctx=16, ubatch=1) as m:
        dec = m.logits(ids)
    assert np.isfinite(pre).all() and np.isfinite(dec).all()
    assert (pre.argmax(-1) == dec.argmax(-1)).all()


# ---------------------------------------------------------------------------------------------
# expert placement in the planner (dry planning: graphs without memory, stand-in backends)


class _Backend:
    """A stand-in backend: a name, capabilities, and whether it has the mul_mat_id hook."""

    routed = True

    def __init__(self, name: str, **caps):
        from vkxsplit.backend import Capabilities

        self.name = name
        self.caps = Capabilities(**caps)

    @classmethod
    def implements(cls, hook: str) -> bool:
        return hook == "mul_mat_id" and cls.routed


class _NoHook(_Backend):
    routed = False


def _cpu(cls=_Backend, **kw):
    caps = dict(ops={"mul_mat", "mul_mat_id"}, weight_types={"f32", "q4_0", "q8_0"}, compute_dtypes={"f32"})
    return cls("cpu", **{**caps, **kw})


def moe_graph(T: int, n_layer: int = 2, E: int = 64, F: int = 96, n_expert: int = 8, n_used: int = 2,
              wtype: str = "q4_0") -> Graph:
    """A qwen3moe-shaped FFN stack as build_moe_ffn makes it, without memory."""
    from vkxsplit.moe import MoeParams

    g = Graph(f"moe:T{T}", T=T)
    mp = MoeParams(n_expert, n_used, F)
    x = Tensor("x", (T, E), "f32")

    def act(name: str, cols: int) -> Tensor:
        return Tensor(name, (T, cols), "f32")

    def mul_mat(name, w, xx, y):
        return g.add("mul_mat", name, [w, xx], y)

    for il in range(n_layer):
        p = f"blk.{il}."
        W = {p + "ffn_gate_inp.weight": Tensor(p + "ffn_gate_inp.weight", (n_expert, E), "f32", weight=True),
             p + "ffn_gate_exps.weight": Tensor(p + "ffn_gate_exps.weight", (n_expert, F, E), wtype, weight=True),
             p + "ffn_up_exps.weight": Tensor(p + "ffn_up_exps.weight", (n_expert, F, E), wtype, weight=True),
             p + "ffn_down_exps.weight": Tensor(p + "ffn_down_exps.weight", (n_expert, E, F), wtype, weight=True)}
        h = g.add("rms_norm", p + "ffn_norm", [x, Tensor(p + "ffn_norm.weight", (E,), "f32", weight=True)],
                  act("h", E), eps=1e-6)
        o = build_moe_ffn(g, p, W, h, act("o", E), mp, act, mul_mat)
        g.add("add", p + "ffn_residual", [x, o], x)
    return g


def _plan(spec, *backends, T=5, **kw):
    from vkxsplit.plan.planner import Planner

    return Planner(backends, require_shared=False).plan(moe_graph(T, **kw), spec)


@pytest.mark.parametrize("T", [1, 5])
def test_plan_layer_override_experts(T):
    """layer:blk\\..*\\.ffn_.*_exps=cpu puts the three routed products of every layer on the
    backend (its mul_mat_id jobs read the ids moe_topk wrote); router, top-k, grouping,
    SwiGLU and combine stay on the hub."""
    from vkxsplit.plan.schedule import BackendIdOp

    plan = _plan(r"layer:blk\..*\.ffn_.*_exps=cpu", _cpu(), T=T)
    g = plan.graph
    for n in g.nodes:
        want = ["cpu"] if n.op == "mul_mat_id" else ["hub"]
        assert plan.runs_on(n) == want, n.name
    jobs = [j.op for j in plan.schedule.jobs]
    assert len(jobs) == 6 and all(isinstance(op, BackendIdOp) for op in jobs)
    op = jobs[0]
    assert (op.n_expert, op.N, op.K, op.M, op.n_used, op.n_xb) == (8, 96, 64, T, 2, 1)
    assert jobs[2].n_xb == 2 and jobs[2].N == 64  # down: one x row per slot
    assert op.ids is g.node("blk.0.ffn_moe_topk").output
    # each job waits for the hub segment that holds the top-k its ids come from
    topk_seg = next(s.index for s in plan.schedule.segments if any(it.name == "blk.0.ffn_moe_topk" for it in s.ops))
    assert plan.schedule.jobs[0].wait >= topk_seg
    assert "ffn_gate_exps" in plan.describe() and "6 backend jobs" in plan.describe()


class _Glue(_Backend):
    """A stand-in backend with the routed product and the glue ops (run_op), like cpu."""

    @classmethod
    def implements(cls, hook: str) -> bool:
        return hook in ("mul_mat_id", "run_op")


def test_plan_keeps_the_q8_1_producers_of_hub_experts():
    """The decode graph after the q8_1 pass (fusion.decode_q8_x with a routed variant): the FFN
    norm writes the q8_1 x of the experts' gate/up, the MoE SwiGLU that of down. With the
    experts on the hub, both producers are refused to a backend that runs the glue (the hub's
    products read what they write); with the experts on the backend nobody on the hub reads
    it, so they may go, and lowered on the hub they run without that output."""
    from vkxsplit import fusion
    from vkxsplit.plan.lowering import hub_xq_reads, lower
    from vkxsplit.plan.planner import Planner
    from vkxsplit.plan.result import Part
    from vkxsplit.plan.schedule import HubOp
    from vkxsplit.plan.workspace import Workspace

    g = moe_graph(1)
    assert fusion.decode_q8_x(g, {"q4_0": "vq"}, lambda nbytes: None, id_variants={"q4_0": "vq_id"}) == 6
    for i, n in enumerate(g.nodes):
        n.index = i
    b = _cpu(_Glue, ops={"mul_mat", "mul_mat_id", "rms_norm", "add_rms_norm", "swiglu", "add"})
    p = Planner([b], require_shared=False)
    producers = [n for n in g.nodes if n.op in ("rms_norm", "swiglu")]
    assert len(producers) == 4 and all("xq" in n.params for n in producers)
    experts = [n for n in g.nodes if n.op == "mul_mat_id"]
    on_cpu = {n.index: [Part("cpu", 0, n.inputs[0].shape[1])] for n in experts}
    for n in producers:
        why = p.why_not(b, n, hub_xq=hub_xq_reads(g, {}))
        assert why is not None and why[0] == "hard" and "q8_1 x of the hub's mat-vecs" in why[1], n.name
        assert p.why_not(b, n, hub_xq=hub_xq_reads(g, on_cpu)) is None, n.name
    assert not hub_xq_reads(g, on_cpu) and len(hub_xq_reads(g, {})) == 4
    lowered = {it.node.name: it.node for it in lower(p, g, on_cpu, Workspace()) if isinstance(it, HubOp)}
    assert all("xq" not in lowered[n.name].params for n in producers)
    lowered = {it.node.name: it.node for it in lower(p, g, {}, Workspace()) if isinstance(it, HubOp)}
    assert all(lowered[n.name].params["xq"] is n.params["xq"] for n in producers)


def test_plan_backend_without_routed_product():
    """A backend without the mul_mat_id hook (or without it in caps.ops) gets a PlanError
    naming it, at plan time."""
    from vkxsplit.errors import PlanError

    for b in (_cpu(_NoHook), _cpu(ops={"mul_mat"})):
        with pytest.raises(PlanError, match="cpu has no routed expert product .mul_mat_id."):
            _plan(r"layer:ffn_.*_exps=cpu", b)
    with pytest.raises(PlanError, match="converts no expert tensors"):
        _plan(r"layer:ffn_.*_exps=cpu", _cpu(weight_types={"f32", "bf16"}))


def test_plan_tensor_and_mode_split_experts():
    """tensor split: every expert's rows cut at the same boundaries (hub rows read the ids
    too); mode: the experts of the batch sizes a rule takes."""
    from vkxsplit.plan.schedule import BackendIdOp, HubOp

    plan = _plan("tensor:1,1@_exps", _cpu(), T=5)
    parts = plan.parts("blk.1.ffn_up_exps")
    assert [(p.participant, p.r0, p.r1) for p in parts] == [("hub", 0, 48), ("cpu", 48, 96)]
    assert [(p.participant, p.r0, p.r1) for p in plan.parts("blk.1.ffn_down_exps")] == [("hub", 0, 32),
                                                                                         ("cpu", 32, 64)]
    hub_rows = [it for it in plan.items if isinstance(it, HubOp) and it.kind == "rows"]
    assert len(hub_rows) == 6 and all(any(t.name == "moe_ids" for t in it.reads) for it in hub_rows)
    jobs = [j.op for j in plan.schedule.jobs]
    assert all(isinstance(op, BackendIdOp) and (op.r0, op.r1) == (op.N // 2, op.N) for op in jobs)
    plan = _plan("mode:cpu>=4@_exps", _cpu(), T=5)
    assert plan.runs_on("blk.0.ffn_gate_exps") == ["cpu"] and plan.runs_on("blk.0.ffn_gate_inp") == ["hub"]
    plan = _plan("mode:cpu>=4@_exps", _cpu(), T=1)
    assert plan.runs_on("blk.0.ffn_gate_exps") == ["hub"]


def test_plan_kernel_cap_counts_experts():
    """A routed product needs one resident kernel per expert: 8 experts do not fit a backend
    holding 6, one layer's gate (8) does fit 8."""
    from vkxsplit.errors import PlanError

    with pytest.raises(PlanError, match="puts 8 weight matrices on cpu, which holds at most 6"):
        _plan(r"layer:blk\.0\.ffn_gate_exps=cpu", _cpu(max_kernels=6))
    plan = _plan(r"layer:blk\.0\.ffn_gate_exps=cpu", _cpu(max_kernels=8))
    assert plan.runs_on("blk.0.ffn_gate_exps") == ["cpu"]
    with pytest.raises(PlanError, match="puts 16 weight matrices"):
        _plan(r"layer:blk\.0\.ffn_(gate|up)_exps=cpu", _cpu(max_kernels=8))


def test_plan_cost_of_routed_jobs():
    """The cost model prices a routed job as the mul_mat of the same bytes and flops: at
    T = 1 the n_used experts' rows, at T = 37 (74 pairs over 8 experts) all 8 experts."""
    from vkxsplit.plan.cost import CostModel, simulate
    from vkxsplit.plan.planner import Planner

    for T, touched in ((1, 2), (37, 8)):
        plan = Planner([_cpu()], require_shared=False).plan(moe_graph(T), r"layer:ffn_.*_exps=cpu")
        op = plan.schedule.jobs[0].op
        N, K, M = op.mul_mat_shape()
        assert (N, K) == (96 * touched, 64) and 2 * M * N * K >= 2 * T * 2 * 96 * 64
        assert simulate(plan.schedule, CostModel()).total_s > 0


@pytest.mark.parametrize("spec", [r"layer:blk\..*\.ffn_.*_exps=cpu", "tensor:1,1@_exps"])
def test_model_experts_on_cpu_backend(device, tmp_path, spec):
    """A qwen3moe file with its experts on the cpu backend (whole, or half the rows of every
    expert): prefill and decode logits against forward64 as test_model_logits (F16 weights:
    no q8_1 decode path), and the plan does hand the routed products to the backend."""
    from vkxsplit.backend import backend_availability
    from vkxsplit.model import load_model

    avail = backend_availability(["cpu"])["cpu"]
    if not avail:
        pytest.skip(f"the cpu backend is not available here: {avail.reason}")
    path = write_moe_gguf(tmp_path / "m.gguf", "qwen3moe", Q.F16, n_expert=8, n_used=2, n_ff_exp=96, seed=3)
    ids = [5, 17, 3, 90, 42, 42, 7, 0, 63, 11, 29]
    ref = forward64(path, ids)
    bound = 0.01 * np.abs(ref).max()
    for ubatch in (16, 1):
        with load_model(path, device=device, n_ctx=32, ubatch=ubatch, split=spec, backends="cpu",
                        profile_dir=tmp_path / "profile") as m:
            got = m.logits(ids).astype(np.float64)
            plans = [ex.plan for ex in m._execs.values()]
        assert plans and all(any(p == "cpu" for p in pl.runs_on("blk.1.ffn_down_exps")) for pl in plans)
        assert top1_agrees(got, ref) and np.abs(got - ref).max() <= bound, \
            (ubatch, np.abs(got - ref).max(), bound)


@pytest.mark.parametrize("spec", [r"layer:blk\..*\.ffn_.*_exps=cpu", "tensor:1,1@_exps"])
def test_decode_experts_on_cpu_backend_with_q8_1_producers(device, tmp_path, spec):
    """Decode of a Q8_0 qwen3moe file with its experts on the cpu backend: the q8_1 pass still
    gives the routed products their producers' q8_1 x. Whole experts on the backend (layer):
    no hub product reads it, so the planner lowers the FFN norm and the MoE SwiGLU without
    that output (the backend's jobs read x in f32); half the rows of every expert (tensor):
    the hub's rows read it, so they keep it. The logits against forward64(q8=True) as on the
    hub alone (Q8_DECODE_BOUND, top-1; ggml-cpu rounds the experts' x to its q8_0 blocks)."""
    from vkxsplit.backend import backend_availability
    from vkxsplit.model import load_model
    from vkxsplit.ops.moe import vecq_id_decode
    from vkxsplit.plan.schedule import HubOp

    avail = backend_availability(["cpu"])["cpu"]
    if not avail:
        pytest.skip(f"the cpu backend is not available here: {avail.reason}")
    if "q8_0" not in vecq_id_decode(device):
        pytest.skip(f"{device.name}: the routed decode of Q8_0 does not take the q8_1 path")
    path = write_moe_gguf(tmp_path / "m.gguf", "qwen3moe", Q.Q8_0, n_expert=8, n_used=2, n_ff_exp=96, seed=3)
    ids = [5, 17, 3, 90, 42, 42, 7, 0, 63, 11, 29]
    with load_model(path, device=device, n_ctx=32, ubatch=1, split=spec, backends="cpu",
                    profile_dir=tmp_path / "profile") as m:
        got = m.logits(ids).astype(np.float64)
        plan = m._executor(1, False).plan
    g = plan.graph
    whole = spec.startswith("layer")
    assert all(sorted(plan.runs_on(n)) == (["cpu"] if whole else ["cpu", "hub"]) and "xq" in n.params
               for n in g.nodes if n.op == "mul_mat_id")
    lowered = {it.node.name: it.node for it in plan.items if isinstance(it, HubOp) and it.node is not None}
    for il in range(N_LAYER):
        for k in ("ffn_norm", "ffn_moe_swiglu"):
            assert "xq" in g.node(f"blk.{il}.{k}").params
            assert ("xq" in lowered[f"blk.{il}.{k}"].params) is not whole
        assert "xq" in lowered[f"blk.{il}.attn_norm"].params  # (the hub's Q/K/V read that one)
    ref = forward64(path, ids, q8=True)
    bound = Q8_DECODE_BOUND * np.abs(ref).max()
    assert top1_agrees(got, ref) and np.abs(got - ref).max() <= bound, (np.abs(got - ref).max(), bound)
