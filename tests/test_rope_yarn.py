"""YaRN and the RoPE attention factor (issue 28), as ggml's ``rope_ext`` / llama.cpp:

- the rope op and the RoPE of K fused into the KV store with ggml's YaRN parameters
  (ext_factor 1, freq_scale 1/4, correction dims from n_ctx_orig), normal and NeoX ordering,
  decode and prefill, with and without frequency factors, against ``reference.rope_yarn``
  (float64, written from ggml's definition); the deliberately wrong variants (no ramp, no
  magnitude correction) are far outside the same bound;
- ext_factor 0 with attn_factor 1 through the YaRN kernels is bit-identical to the plain
  kernels (which every model without YaRN runs); attn_factor 2 is exactly twice them;
- the loader: ``rope.scaling.type`` yarn with its keys and ``rope.scaling.attn_factor``
  accepted and filled in as llama.cpp does; keys it would not read for the architecture refused;
- tiny llama (normal) and qwen2 (NeoX) files with YaRN, and one with a linear scaling and an
  attention factor, whose logits match the float64 reference forward, prefill and decode,
  fused and unfused, and are far from the wrong variants.

Error bound of the ops (elementwise): (2e-6 + 8 |theta|max 2^-24) max|x| times the magnitude:
the angle is formed in f32 (as ggml), the YaRN mix adds a few roundings of it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from reference import reference_forward_yarn, rope_yarn

from vkxsplit.errors import KernelError, ModelError
from vkxsplit.ops.attention import record_kv_store
from vkxsplit.ops.rope import record_rope
from vkxsplit.vk.command import Sequence

BASE = 10000.0
FSCALE = 0.25
N_CTX_ORIG = 4096


@pytest.fixture
def bufs(device):
    made = []

    def make(n, dtype=np.float32):
        b = device.memory.alloc(max(1, n) * np.dtype(dtype).itemsize, "host", name="t")
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def put(buf, arr):
    arr = np.ascontiguousarray(arr)
    buf.numpy(arr.dtype, arr.size)[:] = arr.reshape(-1)


def get(buf, n, dtype=np.float32):
    return buf.numpy(dtype, n).copy()


def corr_dims64(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float = 32.0,
                beta_slow: float = 1.0) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float64: the pair where 2 pi beta turns fit n_ctx_orig."""
    def dim(beta: float) -> float:
        return n_dims * math.log(n_ctx_orig / (2.0 * math.pi * beta)) / (2.0 * math.log(base))

    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def _positions(rng, T: int) -> np.ndarray:
    if T == 1:
        return np.array([2999], np.int32)  # decode far into the extended context
    return np.sort(rng.choice(3000, T, replace=False)).astype(np.int32)


def _yarn_ref(x, pos, n_dims, neox, ff, *, ramp=True, mscale=True):
    lo, hi = corr_dims64(n_dims, N_CTX_ORIG, BASE) if ramp else (-1e9, -1e9 + 0.001)
    attn = 1.0 if mscale else 1.0 / (1.0 + 0.1 * math.log(1.0 / FSCALE))
    return rope_yarn(x, pos, n_dims, BASE, FSCALE, neox, ff, ext_factor=1.0, attn_factor=attn, corr_dims=(lo, hi))


YARN = dict(n_ctx_orig=N_CTX_ORIG, ext_factor=1.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)


def test_corr_dims_are_ggml_s() -> None:
    """The op's float32 correction dims equal the float64 ones here (no boundary case), and
    sit inside the pairs so the ramp runs over some of them."""
    from vkxsplit.ops.rope import yarn_corr_dims, yarn_mscale

    for n_dims in (16, 64, 96, 128):
        assert yarn_corr_dims(n_dims, N_CTX_ORIG, BASE, 32.0, 1.0) == corr_dims64(n_dims, N_CTX_ORIG, BASE)
    assert corr_dims64(64, N_CTX_ORIG, BASE) == (10.0, 23.0)
    assert yarn_mscale(FSCALE, 1.0, 1.0) == pytest.approx(1.0 + 0.1 * math.log(4.0), rel=1e-7)
    assert yarn_mscale(FSCALE, 0.0, 1.5) == 1.5


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_tokens", [1, 5])
@pytest.mark.parametrize("n_dims,factors", [(64, False), (48, True)])
def test_rope_yarn_op(seq, bufs, rng, mode, n_tokens, n_dims, factors):
    H, D = 3, 64
    x = rng.standard_normal((n_tokens, H, D)).astype(np.float32)
    pos = _positions(rng, n_tokens)
    X, P, Dst = bufs(x.size), bufs(n_tokens, np.int32), bufs(x.size)
    put(X, x)
    put(P, pos)
    Dst.numpy(np.float32)[:] = np.nan
    ff = F = None
    if factors:
        ff = rng.uniform(1.0, 4.0, n_dims // 2).astype(np.float32)
        F = bufs(n_dims // 2)
        put(F, ff)
    record_rope(seq, X, P, Dst, n_tokens, H, D, n_dims=n_dims, mode=mode, freq_base=BASE, freq_scale=FSCALE,
                freq_factors=F, **YARN)
    seq.run()
    got = get(Dst, x.size).reshape(x.shape).astype(np.float64)
    x64 = x.astype(np.float64)
    neox = mode == "neox"
    ref = _yarn_ref(x64, pos, n_dims, neox, ff)
    mag = 1.0 + 0.1 * math.log(1.0 / FSCALE)
    bound = (2e-6 + 8 * float(pos.max()) * 2.0**-24) * np.abs(x64).max() * mag
    err = np.abs(got - ref).max()
    assert err <= bound, (err, bound)
    # the check can fail: without the ramp (every pair interpolated) or without the magnitude
    # correction the result is far outside the bound
    for wrong in (dict(ramp=False), dict(mscale=False)):
        assert np.abs(got - _yarn_ref(x64, pos, n_dims, neox, ff, **wrong)).max() > 50 * bound, wrong
    np.testing.assert_array_equal(got[:, :, n_dims:], x64[:, :, n_dims:])


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_tokens", [1, 5])
def test_kv_store_rope_yarn(device, bufs, rng, mode, n_tokens):
    """The RoPE of K fused into the KV store, with YaRN and frequency factors: the f16 cache
    rows equal the float64 reference within half an f16 ulp plus the rotation bound; V is
    stored exactly; the wrong variants are far off."""
    n_kv, D, n_dims, n_ctx = 2, 64, 64, 3072
    row = n_kv * D
    k = rng.standard_normal((n_tokens, row)).astype(np.float32)
    v = rng.standard_normal((n_tokens, row)).astype(np.float32)
    pos = _positions(rng, n_tokens)
    ff = rng.uniform(1.0, 4.0, n_dims // 2).astype(np.float32)
    Kin, Vin, P, F = bufs(k.size), bufs(v.size), bufs(n_tokens, np.int32), bufs(n_dims // 2)
    Kc, Vc = bufs(n_ctx * row, np.float16), bufs(n_ctx * row, np.float16)
    for b, a in ((Kin, k), (Vin, v), (P, pos), (F, ff)):
        put(b, a)
    rope = {"n_dims": n_dims, "mode": mode, "freq_base": BASE, "freq_scale": FSCALE, "freq_factors": F, **YARN}
    s = Sequence(device, "kv")
    try:
        record_kv_store(s, Kin, Vin, P, Kc, Vc, n_tokens, n_kv, D, n_ctx, rope=rope)
        s.run()
    finally:
        s.close()
    got = get(Kc, n_ctx * row, np.float16).reshape(n_ctx, row)[pos].astype(np.float64)
    k64 = k.reshape(n_tokens, n_kv, D).astype(np.float64)
    neox = mode == "neox"
    ref = _yarn_ref(k64, pos, n_dims, neox, ff).reshape(n_tokens, row)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    mag = 1.0 + 0.1 * math.log(1.0 / FSCALE)
    rot = (2e-6 + 8 * float(pos.max()) * 2.0**-24) * np.abs(k).max() * mag
    bad = np.argwhere(np.abs(got - ref) > 0.5 * ulp + rot)
    assert bad.size == 0, (bad[:5], got[tuple(bad[0])], ref[tuple(bad[0])])
    for wrong in (dict(ramp=False), dict(mscale=False)):
        assert np.abs(got - _yarn_ref(k64, pos, n_dims, neox, ff, **wrong).reshape(n_tokens, row)).max() > 0.05
    np.testing.assert_array_equal(get(Vc, n_ctx * row, np.uint16).reshape(n_ctx, row)[pos],
                                  v.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("factors", [False, True])
def test_ext_factor_0_matches_plain(device, bufs, rng, mode, factors):
    """ext_factor 0, attn_factor 1 through the YaRN kernels (forced) gives the plain kernels'
    values, rope op and fused KV store; attn_factor 2 (picked automatically) gives twice them.
    Same bits on lavapipe; a GPU compiler may round the angle differently in the two kernels
    (the H200 does: contracted multiply-adds, division as a reciprocal), and an angle of up to
    pos * freq_scale / min(ff) radians carries that rounding into cos and sin, so the bound is
    a few f32 roundings of the largest angle times |x|, and one f16 step more for the cache."""
    T, H, D, n_dims, n_ctx = 5, 2, 64, 48, 1024
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.sort(rng.choice(1000, T, replace=False)).astype(np.int32)
    X, P = bufs(x.size), bufs(T, np.int32)
    put(X, x)
    put(P, pos)
    F = None
    if factors:
        F = bufs(n_dims // 2)
        put(F, rng.uniform(0.5, 8.0, n_dims // 2).astype(np.float32))
    common = dict(n_dims=n_dims, mode=mode, freq_base=BASE, freq_scale=FSCALE, freq_factors=F)
    outs = {}
    for what, kw in (("plain", {}), ("yarn0", dict(yarn_kernel=True, n_ctx_orig=N_CTX_ORIG)),
                     ("attn2", dict(attn_factor=2.0))):
        Out = bufs(x.size)
        Kc, Vc = bufs(n_ctx * H * D, np.float16), bufs(n_ctx * H * D, np.float16)
        s = Sequence(device, what)
        try:
            record_rope(s, X, P, Out, T, H, D, **common, **kw)
            record_kv_store(s, X, X, P, Kc, Vc, T, H, D, n_ctx, rope={**common, **kw})
            s.run()
        finally:
            s.close()
        outs[what] = (get(Out, x.size), get(Kc, n_ctx * H * D, np.float16))
    ff_min = float(get(F, n_dims // 2).min()) if factors else 1.0
    theta_max = float(pos.max()) * FSCALE / ff_min
    err = 8 * 2.0**-23 * (theta_max + 1.0) * float(np.abs(x).max()) * 2  # attn_factor up to 2
    f32_tol = dict(rtol=0, atol=err)
    f16_tol = dict(rtol=2.0**-10, atol=err + 2.0**-24)  # and one f16 step (subnormals: 2^-24)
    np.testing.assert_allclose(outs["yarn0"][0], outs["plain"][0], **f32_tol)
    np.testing.assert_allclose(outs["yarn0"][1].astype(np.float32), outs["plain"][1].astype(np.float32), **f16_tol)
    # the rotated dims scaled by 2, the others copied exactly (as ggml)
    (a_op, a_kc), (p_op, p_kc) = outs["attn2"], outs["plain"]
    a_op, p_op = a_op.reshape(T, H, D), p_op.reshape(T, H, D)
    a_kc, p_kc = a_kc.reshape(n_ctx, H, D)[pos], p_kc.reshape(n_ctx, H, D)[pos]
    np.testing.assert_allclose(a_op[..., :n_dims], 2 * p_op[..., :n_dims], **f32_tol)
    np.testing.assert_array_equal(a_op[..., n_dims:], p_op[..., n_dims:])
    np.testing.assert_allclose(a_kc[..., :n_dims].astype(np.float32), 2 * p_kc[..., :n_dims].astype(np.float32),
                               rtol=2.0**-9, atol=2 * f16_tol["atol"])
    np.testing.assert_array_equal(a_kc[..., n_dims:], p_kc[..., n_dims:])
    # a wrong attention factor (1% off) is far outside these bounds
    assert err < 0.01
    assert not np.allclose(a_op[..., :n_dims], 2.02 * p_op[..., :n_dims], **f32_tol)


def test_bad_yarn_parameters_are_refused(seq, bufs):
    A, P = bufs(64), bufs(1, np.int32)
    for kw, match in ((dict(ext_factor=float("nan")), "ext_factor = nan"),
                      (dict(attn_factor="2"), "attn_factor = '2'"),
                      (dict(ext_factor=1.0, n_ctx_orig=0), "n_ctx_orig > 0"),
                      (dict(ext_factor=1.0, n_ctx_orig=4096, beta_fast=0.0), "beta_fast > 0"),
                      (dict(ext_factor=1.0, n_ctx_orig=4096.5), "n_ctx_orig = 4096.5")):
        with pytest.raises(KernelError, match=match.replace("(", r"\(")):
            record_rope(seq, A, P, A, 1, 1, 64, **kw)
        with pytest.raises(KernelError, match=match.replace("(", r"\(")):
            record_kv_store(seq, A, A, P, bufs(64, np.float16), bufs(64, np.float16), 1, 1, 64, 1,
                            rope={"n_dims": 64, "mode": "normal", **kw})


# ---- the loader -----------------------------------------------------------------------------


def _kv(arch: str, **keys):
    def add(w: GGUFWriter) -> None:
        for k, v in keys.items():
            full = f"{arch}.rope.scaling.{k}"
            if isinstance(v, str):
                w.add_string(full, v)
            elif isinstance(v, int):
                w.add_uint32(full, v)
            else:
                w.add_float32(full, v)
    return add


def test_loader_fills_yarn_as_llama_cpp(tmp_path: Path) -> None:
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model

    path = write_tiny(tmp_path / "y.gguf", extra_kv=_kv("llama", type="yarn", factor=4.0, original_context_length=64))
    with load_model(path) as mf:
        hp = mf.hparams
        assert (hp.rope_scaling_type, hp.rope_freq_scale, hp.rope_ext_factor) == ("yarn", 0.25, 1.0)
        assert (hp.rope_n_ctx_orig, hp.rope_beta_fast, hp.rope_beta_slow) == (64, 32.0, 1.0)
        # get_mscale(4) / (1 + 0.1 ln 4): 1 up to float32 rounding
        assert hp.rope_attn_factor == pytest.approx(1.0, abs=3e-7)
    path = write_tiny(tmp_path / "y2.gguf", extra_kv=_kv("llama", type="yarn", factor=4.0, attn_factor=0.5))
    with load_model(path) as mf:  # no original_context_length: the training context (256)
        assert mf.hparams.rope_n_ctx_orig == 256
        assert mf.hparams.rope_attn_factor == pytest.approx(0.5, rel=1e-6)
    path = write_tiny(tmp_path / "a.gguf", extra_kv=_kv("llama", type="linear", factor=2.0, attn_factor=1.5))
    with load_model(path) as mf:
        assert (mf.hparams.rope_ext_factor, mf.hparams.rope_attn_factor, mf.hparams.rope_freq_scale) == (0.0, 1.5, 0.5)
    path = write_tiny(tmp_path / "n.gguf", extra_kv=_kv("llama", type="none", factor=4.0))
    with load_model(path) as mf:  # llama.cpp: "never scale if scaling type is none"
        assert mf.hparams.rope_freq_scale == 1.0
    # what llama.cpp would use anyway is accepted
    path = write_tiny(tmp_path / "d.gguf", extra_kv=_kv("llama", type="yarn", factor=4.0, yarn_beta_fast=32.0,
                                                        yarn_ext_factor=-1.0))
    with load_model(path) as mf:
        assert mf.hparams.rope_ext_factor == 1.0


@pytest.mark.parametrize("keys,match", [
    (dict(type="longrope", factor=4.0), "RoPE scaling 'longrope' (rope.scaling.type)"),
    (dict(type="yarn", factor=4.0, yarn_log_multiplier=0.1), "rope.scaling.yarn_log_multiplier=0.1"),
    (dict(type="yarn", factor=4.0, yarn_beta_fast=64.0), "rope.scaling.yarn_beta_fast=64.0"),
    (dict(type="linear", factor=4.0, yarn_ext_factor=1.0), "rope.scaling.yarn_ext_factor=1.0"),
    (dict(attn_factor=float("nan")), "rope.scaling.attn_factor=nan"),
    (dict(attn_factor=0.0), "rope.scaling.attn_factor=0.0"),
])
def test_loader_refuses_what_is_not_done(tmp_path: Path, keys, match) -> None:
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model

    with pytest.raises(ModelError, match=match.replace("(", r"\(").replace(")", r"\)")) as ei:
        load_model(write_tiny(tmp_path / "m.gguf", extra_kv=_kv("llama", **keys)))
    assert "hint" in str(ei.value)


# ---- a whole model --------------------------------------------------------------------------


@pytest.mark.parametrize("arch,keys", [
    ("llama", dict(type="yarn", factor=4.0, original_context_length=64)),
    ("qwen2", dict(type="yarn", factor=4.0, original_context_length=64)),
    ("llama", dict(type="linear", factor=2.0, attn_factor=1.5)),
])
def test_model_yarn_matches_reference(device, tmp_path, monkeypatch, arch, keys):
    """Tiny f32 files with YaRN (head_dim 16: correction dims (0, 3) of 8 pairs for
    n_ctx_orig 64) or a linear scaling with an attention factor: logits of prefill (T = 8, 4)
    and decode (T = 1) steps, fused and unfused, against the float64 reference; the reference
    without the ramp or without the magnitude term is far outside the bound."""
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import load_model

    path = write_tiny(tmp_path / f"{arch}.gguf", arch=arch, bias=arch == "qwen2", tied=False, n_vocab=64, scale=0.3,
                      extra_kv=_kv(arch, **keys))
    ids = list(np.random.default_rng(1).integers(0, 64, 20))
    with load_gguf(path) as mf:
        want = reference_forward_yarn(mf, ids)
        wrongs = [reference_forward_yarn(mf, ids, mscale=False)]
        if keys["type"] == "yarn":
            wrongs.append(reference_forward_yarn(mf, ids, ramp=False))
    scale = np.abs(want).max()
    bound = 2e-3 * scale + 1e-4
    for w in wrongs:
        assert np.abs(w - want).max() > 10 * bound
    for fused in (True, False):
        monkeypatch.setattr(device, "disabled", device.disabled - {"fusion"} if fused else device.disabled | {"fusion"})
        with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
            g = m._build_graph(1, False)
            ropes = [n.params.get("rope_k", n.params) for n in g.nodes
                     if n.op == "rope" or (n.op == "kv_store" and n.params.get("rope_k"))]
            assert len(ropes) == 2 * m.hp.n_layer
            assert all(r["ext_factor"] == m.hp.rope_ext_factor and r["attn_factor"] == m.hp.rope_attn_factor
                       for r in ropes)
            pp = m.logits(ids)
            m.reset()
            m.ubatch = 1
            dec = m.logits(ids)
        for what, got in (("prefill", pp), ("decode", dec)):
            err = np.abs(got - want).max()
            assert err <= bound, (fused, what, err, scale)


@pytest.mark.parametrize("mode", ["tensor:cpu", "layer", "row"])
def test_split_modes_apply_yarn(device, tmp_path, mode):
    """The YaRN file split: a planner tensor split with the cpu backend (its matrix rows on
    the backend, RoPE on the hub: no backend runs RoPE, ``backend.NODE_OPS``), and ``--devices
    0,0`` as a pipeline (``layer``) and as a row split (``row``, each shard ropes its heads):
    prefill and decode logits against the float64 reference."""
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import Model, load_model

    path = write_tiny(tmp_path / "y.gguf", tied=False, n_vocab=64, scale=0.3,
                      extra_kv=_kv("llama", type="yarn", factor=4.0, original_context_length=64))
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 64, 14)]
    with load_gguf(path) as mf:
        want = reference_forward_yarn(mf, ids)
    bound = 2e-3 * np.abs(want).max() + 1e-4
    if mode == "tensor:cpu":
        m = load_model(path, split="tensor:1,1", backends="cpu", device=device, n_ctx=32, ubatch=8)
    else:
        m = Model(path, devices="0,0", split="layer" if mode == "layer" else "tensor:1,1", n_ctx=32, ubatch=8)
    with m:
        pp = m.logits(ids)
        m.reset()
        m.ubatch = 1  # decode steps
        dec = m.logits(ids)
    for what, got in (("prefill", pp), ("decode", dec)):
        assert np.abs(got - want).max() <= bound, (mode, what, np.abs(got - want).max())
