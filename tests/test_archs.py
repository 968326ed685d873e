"""qwen3, gemma3 and phi3 (vkxsplit.archs) against the float64 reference written from llama.cpp's
graph builders (tests/reference.py: reference_forward_arch), on tiny random-weight GGUF files
written here with gguf-py's GGUFWriter; the attention kernel's head_dim 256 and sliding window
against numpy; the loader's refusals.

Every logits check is the same function (:func:`check`): top-1 at every position and a max-abs
bound relative to the logit scale. Each architecture also has a deliberately wrong reference
(no Q/K norm, no embedding scale, no post-norms, no sliding window, gate and up swapped, short
RoPE factors for a long context) that must fail that check, so the check can tell.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from reference import reference_forward_arch

from vkxsplit.errors import KernelError, ModelError

Q = GGMLQuantizationType

# f32 arithmetic and the f16 KV cache (2^-11 relative) are the runtime's only roundings with
# f32/f16/Q8_0 weights (it reads the same dequantized values as gguf-py): a few 1e-3 of the
# logit scale; a wrong piece of the forward moves logits by a large fraction of it
REL_BOUND = 4e-3


def write_arch(path: Path, arch: str, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2,
               head_dim: int = 32, n_ff: int = 96, n_vocab: int = 64, wtype: Q = Q.F32, tied: bool = False,
               sliding_window: int = 0, ctx: int = 256, seed: int = 0, omit: tuple[str, ...] = (),
               extra_kv: dict[str, float] | None = None, factors: bool = True) -> Path:
    """A tiny ``arch`` model with every key and tensor llama.cpp's loader reads for it (norm
    weights around 1, matrices N(0, 1/sqrt(cols)), so activations stay O(1) through the layers)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    for k, v in {"embedding_length": n_embd, "block_count": n_layer, "attention.head_count": n_head,
                 "attention.head_count_kv": n_head_kv, "feed_forward_length": n_ff, "context_length": ctx,
                 "vocab_size": n_vocab, "attention.key_length": head_dim,
                 "attention.value_length": head_dim, "rope.dimension_count": head_dim}.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 1000.0)
    if sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
    for k, v in (extra_kv or {}).items():
        if isinstance(v, int):
            w.add_uint32(f"{arch}.{k}", v)
        else:
            w.add_float32(f"{arch}.{k}", v)
    nq, nkv = n_head * head_dim, n_head_kv * head_dim
    mats: dict[str, tuple[int, int]] = {"token_embd.weight": (n_vocab, n_embd)}
    norms: dict[str, int] = {"output_norm.weight": n_embd}
    if not tied:
        mats["output.weight"] = (n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        norms[p + "attn_norm.weight"] = n_embd
        norms[p + "ffn_norm.weight"] = n_embd
        if arch == "phi3":
            mats[p + "attn_qkv.weight"] = (nq + 2 * nkv, n_embd)
            mats[p + "ffn_up.weight"] = (2 * n_ff, n_embd)
        else:
            mats.update({p + "attn_q.weight": (nq, n_embd), p + "attn_k.weight": (nkv, n_embd),
                         p + "attn_v.weight": (nkv, n_embd), p + "ffn_gate.weight": (n_ff, n_embd),
                         p + "ffn_up.weight": (n_ff, n_embd)})
        mats[p + "attn_output.weight"] = (n_embd, nq)
        mats[p + "ffn_down.weight"] = (n_embd, n_ff)
        if arch in ("qwen3", "gemma3"):
            norms[p + "attn_q_norm.weight"] = head_dim
            norms[p + "attn_k_norm.weight"] = head_dim
        if arch == "gemma3":
            norms[p + "post_attention_norm.weight"] = n_embd
            norms[p + "post_ffw_norm.weight"] = n_embd
    for name, (r, c) in mats.items():
        if name in omit:
            continue
        a = (rng.standard_normal((r, c)) / (1.0 if name == "token_embd.weight" else math.sqrt(c))).astype(np.float32)
        if wtype == Q.F32:
            w.add_tensor(name, a)
        elif wtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, wtype), raw_dtype=wtype)
    for name, n in norms.items():
        if name not in omit:
            w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))
    if arch == "phi3" and factors:  # LongRoPE factors: long ones larger (slower angles)
        w.add_tensor("rope_factors_long.weight", rng.uniform(2.0, 8.0, head_dim // 2).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", rng.uniform(1.0, 1.5, head_dim // 2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check(got: np.ndarray, want: np.ndarray, rel_bound: float = REL_BOUND) -> str | None:
    """None when ``got`` matches ``want``: max |got - want| within ``rel_bound`` of the logit
    scale, and the same top-1 at every position (except where the reference's two best are
    closer than twice the largest error: a tie f32 cannot decide); else what differs."""
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 2 * err
    bad = np.flatnonzero((got.argmax(1) != want.argmax(1)) & decided)
    if len(bad):
        return f"top-1 differs at positions {bad.tolist()} (max err {err:.3g}, scale {scale:.3g})"
    if err > rel_bound * scale:
        return f"max |logits - reference| = {err:.3g} > {rel_bound} x {scale:.3g}"
    return None


def run_logits(device, path: Path, ids: list[int], n_ctx: int, ubatch: int, **kw) -> np.ndarray:
    from vkxsplit.model import load_model

    with load_model(path, device=device, n_ctx=n_ctx, ubatch=ubatch, **kw) as m:
        return m.logits(ids)


CASES = {
    # name: (arch, writer options, n_ctx, tokens, the wrong reference that must fail)
    "qwen3": ("qwen3", {}, 64, 20, "no_qk_norm"),
    "qwen3-q8_0": ("qwen3", {"wtype": Q.Q8_0, "seed": 1}, 64, 20, "no_qk_norm"),
    # head_dim 256 (attn_f16_f32_h256), 7 layers: layer 5 global, the others a window of 5
    # over 24 tokens; f16 weights, tied output
    "gemma3-h256": ("gemma3", {"n_layer": 7, "n_head": 2, "n_head_kv": 1, "head_dim": 256, "wtype": Q.F16,
                               "tied": True, "sliding_window": 5, "seed": 2}, 64, 24, "no_window"),
    "gemma3-post-norms": ("gemma3", {"n_layer": 2, "head_dim": 32, "sliding_window": 6, "seed": 3}, 64, 16,
                          "no_post_norm"),
    "gemma3-embd-scale": ("gemma3", {"n_layer": 2, "head_dim": 64, "sliding_window": 6, "seed": 4}, 64, 16,
                          "no_embd_scale"),
    # a file's attention.sliding_window_pattern (3: layers 2, 5 global) and rope.freq_base_swa
    # (llama.cpp reads both for gemma3; without them: 6 and 10000)
    "gemma3-pattern": ("gemma3", {"n_layer": 4, "head_dim": 32, "sliding_window": 4, "seed": 15,
                                  "extra_kv": {"attention.sliding_window_pattern": 3, "rope.freq_base_swa": 100.0}},
                       64, 16, "pattern_6"),
    # phi3 LongRoPE files carry rope.scaling.attn_factor (the converter's sqrt(1 + ln s / ln
    # n_orig)): llama.cpp multiplies RoPE's cos and sin by it, with the short factors too
    "phi3-short": ("phi3", {"seed": 5, "head_dim": 16, "ctx": 64,
                            "extra_kv": {"rope.scaling.original_context_length": 64, "rope.scaling.attn_factor": 1.2}},
                   64, 20, ("swap_gate_up", "no_attn_factor")),
    # n_ctx 128 > the original 32: the long factors
    "phi3-long": ("phi3", {"seed": 6, "head_dim": 16, "ctx": 128,
                           "extra_kv": {"rope.scaling.original_context_length": 32, "rope.scaling.attn_factor": 1.2}},
                  128, 20, ("short_factors", "no_attn_factor")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_arch_matches_reference(device, tmp_path, case):
    """Prefill in chunks of 8 (the tiled products) and token by token (decode: mat-vecs, the
    decode attention), both against the reference; each wrong reference fails the same check."""
    arch, opts, n_ctx, n_tok, wrongs = CASES[case]
    wrongs = (wrongs,) if isinstance(wrongs, str) else wrongs
    from vkxsplit.gguf_model import load_model as load_gguf

    path = write_arch(tmp_path / f"{case}.gguf", arch, **opts)
    n_vocab = opts.get("n_vocab", 64)
    ids = [int(i) for i in np.random.default_rng(7).integers(0, n_vocab, n_tok)]
    with load_gguf(path) as mf:
        assert mf.architecture == arch
        want = reference_forward_arch(mf, ids, n_ctx=n_ctx)
        bads = {w: reference_forward_arch(mf, ids, n_ctx=n_ctx, wrong=(w,)) for w in wrongs}
    got = run_logits(device, path, ids, n_ctx, 8)
    assert check(got, want) is None, check(got, want)
    for wrong, bad in bads.items():
        assert check(bad, want) is not None, f"the check does not catch {wrong}"
        assert check(got, bad) is not None, wrong
    step = run_logits(device, path, ids, n_ctx, 1)
    # decode with quantized weights: x goes to the integer-dot-product mat-vecs as q8_1 (8-bit
    # per 32 values, ggml's MMVQ), about 1% of the logit scale after a few layers
    bound = REL_BOUND if opts.get("wtype", Q.F32) in (Q.F32, Q.F16) else 2.5e-2
    assert check(step, want, bound) is None, check(step, want, bound)


def test_long_prefill_matches_reference(device, tmp_path):
    """One prefill of 96 tokens at head_dim 64 (192 query rows per kv head): on a device with
    cooperative matrices the attention runs attention_coopmat.comp (f16 operands), elsewhere
    the tiled f32 kernel; both within the architectures' bound of the float64 reference, which
    the wrong reference (no Q/K norm) fails."""
    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.ops.attention import CM_MIN_ROWS

    n_tok = 96
    assert n_tok * 2 >= CM_MIN_ROWS
    path = write_arch(tmp_path / "long.gguf", "qwen3", n_embd=128, head_dim=64, n_head=4, n_head_kv=2, seed=21)
    ids = [int(i) for i in np.random.default_rng(21).integers(0, 64, n_tok)]
    with load_gguf(path) as mf:
        want = reference_forward_arch(mf, ids, n_ctx=128)
        bad = reference_forward_arch(mf, ids, n_ctx=128, wrong=("no_qk_norm",))
    got = run_logits(device, path, ids, 128, n_tok)
    assert check(got, want) is None, check(got, want)
    assert check(got, bad) is not None


def test_gemma3_layers_and_hparams(device, tmp_path):
    """gemma3's per-layer attention as llama.cpp's load_hparams sets it: windowed layers
    il % 6 < 5 with RoPE base 10000, global ones with the file's base; Q scale 1/sqrt(head_dim);
    embeddings times sqrt(n_embd); the nodes that carry them."""
    from vkxsplit.model import load_model

    path = write_arch(tmp_path / "g.gguf", "gemma3", n_layer=7, n_head=2, n_head_kv=1, head_dim=64,
                      sliding_window=5)
    with load_model(path, device=device, n_ctx=32, ubatch=4) as m:
        hp = m.hp
        assert [hp.is_swa(i) for i in range(7)] == [True] * 5 + [False, True]
        assert hp.attn_scale == pytest.approx(1 / 8) and hp.embd_scale == pytest.approx(8.0)
        g = m._build_graph(4, False)
        att = {n.layer: n.params for n in g.nodes if n.op == "attention"}
        rope = {n.layer: n.params for n in g.nodes if n.op == "rope"}
        assert [att[i].get("window", 0) for i in range(7)] == [5] * 5 + [0, 5]
        assert [rope[i]["freq_base"] for i in range(7)] == [10000.0] * 5 + [1000.0, 10000.0]
        assert all(a["scale"] == pytest.approx(1 / 8) for a in att.values())
        ops = g.ops()
        assert ops["geglu"] == 7 and "swiglu" not in ops and ops["scale"] == 1
        assert ops["rms_norm"] >= 7 * 4  # q/k norms and two post-norms a layer


def test_gemma3_final_logit_softcap(device, tmp_path):
    """A final_logit_softcapping key in a gemma3 file without a sliding window (llama.cpp's
    llm_build_gemma3<iswa = false>, e.g. Rnj-1): logits = cap * tanh(logits / cap), as the
    reference. With a window llama.cpp's graph (iswa = true) has no cap while HF's applies
    it: the loader refuses such a file rather than pick one."""
    from vkxsplit.gguf_model import load_model as load_gguf

    path = write_arch(tmp_path / "cap.gguf", "gemma3", n_layer=2, head_dim=32, extra_kv={"final_logit_softcapping": 2.0})
    ids = [3, 9, 27, 1, 5, 60, 2, 8, 13]
    with load_gguf(path) as mf:
        assert mf.hparams.n_swa == 0 and not any(mf.hparams.is_swa(i) for i in range(2))
        want = reference_forward_arch(mf, ids)
        bad = reference_forward_arch(mf, ids, wrong=("no_post_norm",))
    got = run_logits(device, path, ids, 32, 8)
    assert np.abs(got).max() <= 2.0
    assert check(got, want) is None, check(got, want)
    assert check(bad, want) is not None
    p = write_arch(tmp_path / "capw.gguf", "gemma3", n_layer=2, head_dim=32, sliding_window=4,
                   extra_kv={"final_logit_softcapping": 2.0})
    with pytest.raises(ModelError, match=r"sliding window \(4\) and final_logit_softcapping=2\.0: llama\.cpp"):
        load_gguf(p)


def test_gemma3_swa_pattern_keys(tmp_path):
    """attention.sliding_window_pattern and rope.freq_base_swa, as llama.cpp's gemma3 loader
    reads them: period n (n == 0: every layer windowed), the SWA layers' RoPE base; a
    per-layer array is refused; without a window neither applies."""
    from vkxsplit.gguf_model import load_model as load_gguf

    def hp(name, **kw):
        with load_gguf(write_arch(tmp_path / name, "gemma3", n_layer=7, head_dim=32, **kw)) as mf:
            return mf.hparams

    h = hp("p3.gguf", sliding_window=4, extra_kv={"attention.sliding_window_pattern": 3, "rope.freq_base_swa": 100.0})
    assert [h.is_swa(i) for i in range(7)] == [True, True, False, True, True, False, True]
    assert [h.rope_base_scale(i) for i in (0, 2)] == [(100.0, 1.0), (1000.0, 1.0)]
    h = hp("p0.gguf", sliding_window=4, extra_kv={"attention.sliding_window_pattern": 0})
    assert all(h.is_swa(i) for i in range(7)) and h.rope_base_scale(6) == (10000.0, 1.0)
    h = hp("d.gguf", sliding_window=4)
    assert [i for i in range(7) if not h.is_swa(i)] == [5]
    h = hp("n.gguf", extra_kv={"attention.sliding_window_pattern": 3})
    assert not any(h.is_swa(i) for i in range(7)) and h.rope_base_scale(0) == (1000.0, 1.0)
    src = write_arch(tmp_path / "base.gguf", "gemma3", n_layer=7, head_dim=32, sliding_window=4)
    _rewrite_with(src, tmp_path / "arr2.gguf", lambda w: w.add_array("gemma3.attention.sliding_window_pattern",
                                                                    [True] * 6 + [False]))
    with pytest.raises(ModelError, match=r"per-layer attention\.sliding_window_pattern"):
        load_gguf(tmp_path / "arr2.gguf")


def _rewrite_with(src: Path, dst: Path, add) -> Path:
    """``src`` (an arch file written here) copied to ``dst`` with ``add(writer)`` called before
    the tensors (one more key or tensor)."""
    from gguf import GGUFReader

    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith(arch + "."):
            v = f.contents()
            (w.add_uint32 if isinstance(v, int) else w.add_float32)(f.name, v)
    add(w)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("split", ["layer:1,1", "tensor:1,1", "mode:cpu"])
def test_split_with_cpu_matches_reference(device, tmp_path, split, arch):
    """qwen3 (per-head Q/K norms) and gemma3 (embedding scale, post-norms, GeGLU, window: nodes
    no backend runs, kept on the hub) with the cpu backend taking layers / rows /
    every product: same check."""
    opts = {"sliding_window": 5} if arch == "gemma3" else {}
    path = write_arch(tmp_path / "s.gguf", arch, seed=8, **opts)
    ids = [int(i) for i in np.random.default_rng(9).integers(0, 64, 12)]
    from vkxsplit.gguf_model import load_model as load_gguf

    with load_gguf(path) as mf:
        want = reference_forward_arch(mf, ids)
    got = run_logits(device, path, ids, 32, 8, split=split, backends="cpu")
    assert check(got, want) is None, check(got, want)


def test_phi3_fused_weights_are_split_into_row_views(tmp_path):
    """attn_qkv -> attn_q/k/v and ffn_up -> ffn_gate (first half) / ffn_up (second): the same bytes."""
    from vkxsplit.archs import weight_tensors
    from vkxsplit.gguf_model import load_model as load_gguf

    path = write_arch(tmp_path / "p.gguf", "phi3", head_dim=16)
    with load_gguf(path) as mf:
        wt = weight_tensors(mf)
        qkv = mf.tensors["blk.0.attn_qkv.weight"].dequantize()
        up = mf.tensors["blk.0.ffn_up.weight"].dequantize()
        assert "blk.0.attn_qkv.weight" not in wt and "blk.0.ffn_gate.weight" in wt
        np.testing.assert_array_equal(wt["blk.0.attn_q.weight"].dequantize(), qkv[:64])
        np.testing.assert_array_equal(wt["blk.0.attn_k.weight"].dequantize(), qkv[64:96])
        np.testing.assert_array_equal(wt["blk.0.attn_v.weight"].dequantize(), qkv[96:])
        np.testing.assert_array_equal(wt["blk.0.ffn_gate.weight"].dequantize(), up[:96])
        np.testing.assert_array_equal(wt["blk.0.ffn_up.weight"].dequantize(), up[96:])


def test_loader_refusals(tmp_path):
    from vkxsplit.gguf_model import load_model as load_gguf

    p = write_arch(tmp_path / "x.gguf", "qwen3", omit=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ModelError, match=r"lacks required tensors: blk\.1\.attn_k_norm\.weight"):
        load_gguf(p)
    p = write_arch(tmp_path / "y.gguf", "gemma3", omit=("blk.0.post_ffw_norm.weight",), sliding_window=4)
    with pytest.raises(ModelError, match=r"post_ffw_norm"):
        load_gguf(p)
    # a qwen3 file with a tensor its forward does not read (llama.cpp's qwen3 has no QKV bias)
    p = write_arch(tmp_path / "z.gguf", "qwen3")
    from gguf import GGUFReader  # (re-written with one more tensor)

    r = GGUFReader(p)
    w = GGUFWriter(str(tmp_path / "z2.gguf"), "qwen3")
    for f in r.fields.values():
        if f.name.startswith("qwen3."):
            v = f.contents()
            (w.add_uint32 if isinstance(v, int) else w.add_float32)(f.name, v)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(128, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match=r"qwen3 forward of vkxsplit does not use: blk\.0\.attn_q\.bias"):
        load_gguf(tmp_path / "z2.gguf")
    # phi3 with only one of its two factor tensors
    p = write_arch(tmp_path / "f.gguf", "phi3", head_dim=16, factors=False)
    load_gguf(p).close()  # (no factors at all: fine, as llama.cpp)
    # phi3 with llama 3.x's rope_freqs: llama.cpp's phi3 does not read it (long/short factors only)
    _rewrite_with(p, tmp_path / "f2.gguf", lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)))
    with pytest.raises(ModelError, match=r"phi3 forward of vkxsplit does not use: rope_freqs\.weight"):
        load_gguf(tmp_path / "f2.gguf")
    # an architecture vkxsplit does not run: named, with the supported ones listed
    w = GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_uint32("gpt2.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match=r"architecture 'gpt2'.*supported: llama, mistral, qwen2, qwen3, gemma3, "
                                         r"phi3"):
        load_gguf(tmp_path / "gpt2.gguf")


# ---- the attention kernel: head_dim 256, sliding window, flash-decoding splits --------------


def _attention_ref(q, kc, vc, pos0, n_kv, window, scale):
    """float64: query t (position pos0 + t) over cache rows j <= pos0 + t with pos0 + t - j < window."""
    T, H, D = q.shape
    g = H // n_kv
    out = np.zeros((T, H, D))
    for t in range(T):
        i = pos0 + t
        js = np.arange(i + 1)
        if window:
            js = js[i - js < window]
        for h in range(H):
            s = kc[js, h // g].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vc[js, h // g].astype(np.float64)
    return out


@pytest.mark.parametrize("D,H,n_kv,T,pos0,window,n_splits", [
    (256, 4, 1, 5, 37, 16, 1),    # prefill-sized, windowed (the window starts mid-block)
    (256, 4, 1, 1, 90, 16, 3),    # decode, windowed, split over the KV length
    (256, 2, 2, 3, 10, 0, 1),     # no window
    (128, 4, 2, 6, 40, 7, 1),     # the tiled kernel with a window
    (128, 8, 2, 1, 200, 33, 4),   # tiled decode, windowed, splits (some entirely outside the window)
    (48, 3, 1, 4, 20, 9, 2),      # the generic kernel
])
def test_attention_window_and_head_dim_256(device, seq, rng, D, H, n_kv, T, pos0, window, n_splits):
    from vkxsplit.ops.attention import attention_scratch_bytes, record_attention

    n_ctx = 256
    mem = device.memory
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kc = (rng.standard_normal((n_ctx, n_kv, D)) * 0.5).astype(np.float16)
    vc = rng.standard_normal((n_ctx, n_kv, D)).astype(np.float16)
    # rows no query sees are NaN: never read (before the first query's window, after the last query)
    lo = max(0, pos0 + 1 - window) if window else 0
    for c in (kc, vc):
        c[:lo] = np.float16(np.nan)
        c[pos0 + T:] = np.float16(np.nan)
    bufs = []

    def buf(a):
        b = mem.alloc(max(a.nbytes, 16), "host", "t")
        b.write(a.tobytes())
        bufs.append(b)
        return b

    Qb, Kb, Vb = buf(q), buf(kc), buf(vc)
    Pb = buf(np.array([pos0], np.int32))
    Ob = buf(np.zeros(T * H * D, np.float32))
    Sb = buf(np.zeros(attention_scratch_bytes(T, H, D, n_splits) // 4 + 4, np.float32)) if n_splits > 1 else None
    scale = 0.7 / math.sqrt(D)
    try:
        record_attention(seq, Qb, Kb, Vb, Pb, Ob, T, H, n_kv, D, n_ctx, scale=scale, n_splits=n_splits,
                         scratch=Sb, window=window)
        seq.run()
        got = Ob.numpy(np.float32, (T, H, D))
        want = _attention_ref(q, kc, vc, pos0, n_kv, window, scale)
        assert np.abs(got - want).max() < 2e-4 * max(1.0, np.abs(want).max())
        if window:  # without the window the result is clearly different (the check can tell)
            assert np.abs(_attention_ref(q, np.nan_to_num(kc), np.nan_to_num(vc), pos0, n_kv, 0, scale) - want).max() > 1e-2
    finally:
        for b in bufs:
            b.close()


def test_attention_limits(device, seq):
    from vkxsplit.ops.attention import record_attention

    b = device.memory.alloc(1 << 20, "host", "t")
    try:
        with pytest.raises(KernelError, match=r"head_dim 512 is not supported \(1\.\.256"):
            record_attention(seq, b, b, b, b, b, 1, 1, 1, 512, 4)
        with pytest.raises(KernelError, match="scale"):
            record_attention(seq, b, b, b, b, b, 1, 1, 1, 64, 4, scale=float("nan"))
    finally:
        b.close()


# ---- synthetic files of these architectures (vkxsplit synth) --------------------------------


@pytest.mark.parametrize("shape", ["qwen3_8b", "gemma3_1b"])
def test_synth_dense_shapes_load_and_run(device, tmp_path, shape):
    """``vkxsplit synth --shape qwen3_8b|gemma3_1b --type q4_k_m`` (one layer, a small
    vocabulary): the loader takes them, the q4_k_m mix is Q4_K with Q6_K attn_v / ffn_down /
    output, and the runtime matches the reference (mat-vecs of Q4_K and Q6_K at decode: q8_1 x)."""
    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.synth import SHAPES, synthetic_tensor_types, write_synthetic

    types = synthetic_tensor_types(shape, "q4_k_m", n_layer=1)
    out = "token_embd.weight" if SHAPES[shape].tied else "output.weight"
    # (rows not a multiple of 256, gemma3_1b's 1152: llama.cpp's fallbacks Q6_K -> Q8_0, Q4_K -> Q5_0)
    hi, lo = (Q.Q6_K, Q.Q8_0), (Q.Q4_K, Q.Q5_0)
    for name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight", out):
        assert types[name] in hi, (name, types[name])
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"):
        assert types[name] in lo, (name, types[name])
    assert types["blk.0.ffn_down.weight"] == Q.Q6_K and types["blk.0.attn_output.weight"] == Q.Q4_K
    path = write_synthetic(tmp_path / f"{shape}.gguf", shape, "q4_k_m", seed=1, n_layer=1, n_vocab=300)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 300, 6)]
    with load_gguf(path) as mf:
        assert mf.architecture == SHAPES[shape].arch and mf.hparams.head_dim == SHAPES[shape].hd
        assert {n: t.ggml_type for n, t in mf.tensors.items()} == types
        want = reference_forward_arch(mf, ids)
    got = run_logits(device, path, ids, 16, 8)
    assert check(got, want) is None, check(got, want)


# ---- the elementwise ops of gemma3 ----------------------------------------------------------


def test_geglu_and_softcap_match_numpy(device, seq, rng):
    """``geglu``: gelu_tanh(gate) * up (not silu); ``softcap``: cap * tanh(x / cap), saturating
    without inf/inf for large |x|."""
    from vkxsplit.ops.elementwise import record_geglu, record_softcap

    rows, cols = 3, 300
    g = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    u = rng.standard_normal((rows, cols)).astype(np.float32)
    x = (rng.standard_normal((rows, cols)) * 40).astype(np.float32)
    x[0, :4] = [1e30, -1e30, 0.0, 88.0]
    mem = device.memory
    bufs = [mem.alloc(a.nbytes, "host", "t") for a in (g, u, x, g, x)]
    try:
        for b, a in zip(bufs, (g, u, x)):
            b.write(a.tobytes())
        G, U, X, Og, Ox = bufs
        record_geglu(seq, G, U, Og, rows, cols)
        record_softcap(seq, X, Ox, rows, cols, 30.0)
        seq.run()
        g64, u64, x64 = (a.astype(np.float64) for a in (g, u, x))
        gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))
        got = Og.numpy(np.float32, (rows, cols))
        assert np.abs(got - gelu * u64).max() < 1e-5 * np.abs(gelu * u64).max()
        silu = g64 / (1 + np.exp(-g64))
        assert np.abs(got - silu * u64).max() > 0.05  # (the check tells GELU from SiLU)
        cap = Ox.numpy(np.float32, (rows, cols))
        assert np.isfinite(cap).all() and np.abs(cap - 30 * np.tanh(x64 / 30)).max() < 1e-4 * 30
        with pytest.raises(KernelError, match="cap"):
            record_softcap(seq, X, Ox, rows, cols, 0.0)
    finally:
        for b in bufs:
            b.close()


@pytest.mark.parametrize("wtype,ubatch", [(Q.F32, 8), (Q.Q8_0, 1)])
def test_weights_larger_than_a_binding(device, tmp_path, monkeypatch, wtype, ubatch):
    """A weight over maxStorageBufferRange (Gemma 3's 262144 x 640 embedding on lavapipe's 128
    MiB) is bound in parts of whole rows: the tied embedding / output of a tiny model under a
    lowered limit, looked up (get_rows) and multiplied (tiled at prefill, q8_1 mat-vec at
    decode) part by part, against the reference."""
    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.ops.nodes import weight_parts

    path = write_arch(tmp_path / "big.gguf", "qwen3", n_vocab=3000, tied=True, wtype=wtype, seed=11)
    ids = [int(i) for i in np.random.default_rng(12).integers(0, 3000, 10)] + [2999, 0]
    with load_gguf(path) as mf:
        want = reference_forward_arch(mf, ids)
        emb = mf.tensors["token_embd.weight"]
    monkeypatch.setitem(device.physical.limits, "maxStorageBufferRange", 128 << 10)
    from vkxsplit.model import load_model

    with load_model(path, device=device, n_ctx=32, ubatch=ubatch) as m:
        w = m.weights["token_embd.weight"]
        parts = weight_parts(_FakeSeq(device), w, 0, w.rows)
        assert len(parts) >= 2 and parts[0][2:] == (0, parts[1][2]) and parts[-1][3] == 3000
        assert all(p[1] % 256 == 0 and p[2] == p[1] for p in parts) and emb.nbytes > 128 << 10
        got = m.logits(ids)
    bound = REL_BOUND if wtype == Q.F32 else 2.5e-2
    assert check(got, want, bound) is None, check(got, want, bound)


class _FakeSeq:
    """Just the device, for weight_parts."""

    def __init__(self, device):
        self.device = device


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3"])
def test_unfused_graph_matches_reference(device, tmp_path, monkeypatch, arch):
    """VKXSPLIT_DISABLE=fusion (separate residual adds, norms and RoPE of K) builds each
    architecture's graph without the fused kernels: the same check, and more nodes."""
    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import load_model

    opts = {"sliding_window": 4, "n_layer": 3} if arch == "gemma3" else {"head_dim": 16} if arch == "phi3" else {}
    path = write_arch(tmp_path / "u.gguf", arch, seed=13, **opts)
    ids = [int(i) for i in np.random.default_rng(14).integers(0, 64, 10)]
    with load_gguf(path) as mf:
        want = reference_forward_arch(mf, ids, n_ctx=32)
    monkeypatch.setattr(device, "disabled", device.disabled | {"fusion"})
    with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
        got = m.logits(ids)
        ops = m._build_graph(1, False).ops()
    assert "add_rms_norm" not in ops and ops["rope"] == 2 * m.hp.n_layer
    assert check(got, want) is None, check(got, want)
