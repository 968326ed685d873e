"""Sanity checks of the float64 reference forward pass (tests/reference.py).

The reference is the oracle for the GPU runtime, so it is checked two ways: against what the
real SmolLM2 model is known to answer (it knows the capital of France, and it predicts English
text well), and against a second, loop-by-loop implementation of the same equations on small
models (which catches head-mapping, masking and RoPE-ordering mistakes).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import smol_path
from reference import (
    KVCache,
    reference_forward,
    reference_greedy,
    reference_logits,
    rope,
)
from test_gguf_model import write_tiny

from vkxsplit.gguf_model import ModelFile, load_model
from vkxsplit.synth import write_synthetic
from vkxsplit.tokenizer import Tokenizer

PASSAGE = (
    "Paris is the capital and most populous city of France. It is located on the Seine River, in the "
    "north of the country. The city is known for its museums, its architecture and the Eiffel Tower, "
    "which was built for the 1889 World Fair."
)


@pytest.fixture(scope="module")
def smol() -> ModelFile:
    return load_model(smol_path())


@pytest.fixture(scope="module")
def tok(smol: ModelFile) -> Tokenizer:
    return Tokenizer.from_model_file(smol)


# ---- the real model ---------------------------------------------------------------------------


def test_next_token_after_capital_of_france_is_paris(smol: ModelFile, tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is")
    logits = reference_logits(smol, ids)
    assert logits.shape == (len(ids), smol.hparams.n_vocab) and logits.dtype == np.float64
    assert tok.token_piece(int(np.argmax(logits[-1]))) == " Paris"


def test_chat_greedy_answer_mentions_paris(smol: ModelFile, tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = reference_greedy(smol, prompt, 24, stop_ids=tok.eot_ids)
    assert "Paris" in tok.decode(out)


def test_english_passage_is_predicted_well(smol: ModelFile, tok: Tokenizer) -> None:
    # a broken forward pass (wrong RoPE pairing, head mapping or mask) costs several nats/token;
    # the correct one stays well under 2.5 on plain encyclopedic English
    ids = tok.encode(PASSAGE)
    logits = reference_logits(smol, ids)
    logp = logits - logits.max(axis=-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=-1, keepdims=True))
    nll = -float(np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))
    assert nll < 2.5, nll


def test_greedy_with_kv_cache_equals_full_recompute(smol: ModelFile, tok: Tokenizer) -> None:
    ids = tok.encode("Once upon a time")
    out = reference_greedy(smol, ids, 5)
    seq = list(ids)
    for want in out:
        assert int(np.argmax(reference_logits(smol, seq)[-1])) == want
        seq.append(want)
    # and the cached logits themselves agree with a fresh pass
    cache = KVCache.empty(smol.hparams.n_layer)
    reference_forward(smol, seq[:-2], cache)
    step = reference_forward(smol, seq[-2:], cache)
    np.testing.assert_allclose(step, reference_logits(smol, seq)[-2:], rtol=1e-9, atol=1e-9)


# ---- building blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("neox", [False, True])
def test_rope_is_complex_rotation_of_pairs(neox: bool) -> None:
    rng = np.random.default_rng(0)
    d, n_rot, base = 16, 12, 10000.0
    x = rng.standard_normal((5, 3, d))
    pos = np.array([0, 1, 2, 7, 100])
    y = rope(x, pos, n_rot, base, scale=0.5, neox=neox)
    half = n_rot // 2
    for t in range(5):
        for i in range(half):
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            theta = 0.5 * pos[t] * base ** (-2 * i / n_rot)
            z = (x[t, :, a] + 1j * x[t, :, b]) * np.exp(1j * theta)
            np.testing.assert_allclose(y[t, :, a], z.real, atol=1e-12)
            np.testing.assert_allclose(y[t, :, b], z.imag, atol=1e-12)
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])


def test_rope_scores_depend_only_on_relative_position() -> None:
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((1, 1, 64)), rng.standard_normal((1, 1, 64))

    def score(m: int, n: int) -> float:
        return float(np.sum(rope(q, np.array([m]), 64, 1e4) * rope(k, np.array([n]), 64, 1e4)))

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-9)


# ---- a second, loop-by-loop implementation ------------------------------------------------------


def naive_logits(mf: ModelFile, ids: list[int]) -> np.ndarray:
    hp = mf.hparams

    def w(name: str) -> np.ndarray:
        return mf.tensors[name].dequantize().astype(np.float64)

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / math.sqrt(float(v @ v) / v.size + hp.rms_norm_eps) * g

    def rot(v: np.ndarray, p: int) -> np.ndarray:
        out = v.copy()
        half = hp.n_rot // 2
        for i in range(half):
            a, b = (i, i + half) if hp.rope_type == "neox" else (2 * i, 2 * i + 1)
            th = p * hp.rope_freq_scale * hp.rope_freq_base ** (-2.0 * i / hp.n_rot)
            out[a] = v[a] * math.cos(th) - v[b] * math.sin(th)
            out[b] = v[a] * math.sin(th) + v[b] * math.cos(th)
        return out

    emb = w("token_embd.weight")
    xs = [emb[i].copy() for i in ids]
    d, per_kv = hp.head_dim, hp.n_head // hp.n_head_kv
    for layer in range(hp.n_layer):
        p = f"blk.{layer}."
        wq, wk, wv, wo = (w(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v", "attn_output"))
        bias = {
            n: (w(p + n + ".bias") if p + n + ".bias" in mf.tensors else 0.0)
            for n in ("attn_q", "attn_k", "attn_v")
        }
        hs = [norm(x, w(p + "attn_norm.weight")) for x in xs]
        qs = [wq @ h + bias["attn_q"] for h in hs]
        ks = [wk @ h + bias["attn_k"] for h in hs]
        vs = [wv @ h + bias["attn_v"] for h in hs]
        new_xs = []
        for t in range(len(ids)):
            heads = []
            for hq in range(hp.n_head):
                hk = hq // per_kv
                qv = rot(qs[t][hq * d : (hq + 1) * d], t)
                sc = [float(qv @ rot(ks[s][hk * d : (hk + 1) * d], s)) / math.sqrt(d) for s in range(t + 1)]
                mx = max(sc)
                e = [math.exp(c - mx) for c in sc]
                tot = sum(e)
                heads.append(sum((e[s] / tot) * vs[s][hk * d : (hk + 1) * d] for s in range(t + 1)))
            x = xs[t] + wo @ np.concatenate(heads)
            h = norm(x, w(p + "ffn_norm.weight"))
            g = w(p + "ffn_gate.weight") @ h
            u = w(p + "ffn_up.weight") @ h
            x = x + w(p + "ffn_down.weight") @ (g / (1 + np.exp(-g)) * u)
            new_xs.append(x)
        xs = new_xs
    out_w = w("output.weight") if "output.weight" in mf.tensors else emb
    return np.stack([out_w @ norm(x, w("output_norm.weight")) for x in xs])


def test_reference_matches_loop_implementation_llama(tmp_path: Path) -> None:
    mf = load_model(write_synthetic(tmp_path / "s.gguf", "smol135m", "q4_k", seed=2, n_layer=2, n_vocab=300))
    ids = [3, 250, 17, 17, 99]
    np.testing.assert_allclose(reference_logits(mf, ids), naive_logits(mf, ids), rtol=1e-9, atol=1e-9)


def test_reference_matches_loop_implementation_qwen2_bias_neox(tmp_path: Path) -> None:
    mf = load_model(
        write_tiny(tmp_path / "q.gguf", arch="qwen2", bias=True, tied=False, n_vocab=50, scale=0.3)
    )
    assert mf.hparams.rope_type == "neox"
    ids = [1, 7, 3, 49, 0, 7]
    np.testing.assert_allclose(reference_logits(mf, ids), naive_logits(mf, ids), rtol=1e-9, atol=1e-9)
