"""Tests of vkxsplit.synth: random-but-valid GGUF models that load, tokenize and run."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from reference import reference_logits

from vkxsplit.gguf_model import SUPPORTED_TYPES, load_model
from vkxsplit.synth import QTYPES, SHAPES, WEIGHT_STD, synthetic_tensor_types, write_synthetic
from vkxsplit.tokenizer import Tokenizer

Q = GGMLQuantizationType
TINY = {"n_layer": 2, "n_vocab": 512}


def _raw_rows(path: Path) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    """Tensor bytes read with the gguf package's own reader (independent of vkxsplit)."""
    r = GGUFReader(path)
    return {t.name: (GGMLQuantizationType(int(t.tensor_type)), np.array(t.data)) for t in r.tensors}


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_tiny_smol_loads_and_dequantizes_sanely(tmp_path: Path, qtype: str) -> None:
    path = write_synthetic(tmp_path / f"s_{qtype}.gguf", "smol135m", qtype, seed=1, **TINY)
    mf = load_model(path)
    hp = mf.hparams
    shape = SHAPES["smol135m"]
    assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff) == (
        shape.n_embd,
        shape.n_head,
        shape.n_head_kv,
        shape.n_ff,
    )
    assert hp.n_layer == 2 and hp.n_vocab == 512 and mf.tied_embeddings
    assert mf.metadata["vkxsplit.synthetic"] is True

    raw = _raw_rows(path)
    assert set(raw) == set(mf.tensors) == set(synthetic_tensor_types("smol135m", qtype, n_layer=2))
    want = QTYPES[qtype]
    for name, (qt, data) in raw.items():
        assert qt in SUPPORTED_TYPES
        values = np.asarray(dequantize(data, qt), dtype=np.float64)
        assert np.isfinite(values).all(), name
        if name.endswith("norm.weight"):
            assert qt == Q.F32 and np.all((values > 0.9) & (values < 1.1))
            continue
        # matrices: the requested type unless the row length cannot hold its blocks
        if mf.tensors[name].cols % 256 == 0 or want not in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_XS):
            assert qt == want, name
        else:
            assert qt == {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.IQ4_NL, Q.Q3_K: Q.IQ4_NL,
                          Q.IQ4_XS: Q.IQ4_NL}[want], name
        std, mean = float(values.std()), float(values.mean())
        assert 0.7 * WEIGHT_STD < std < 1.3 * WEIGHT_STD, (name, std)
        assert abs(mean) < 0.25 * WEIGHT_STD, (name, mean)
        assert float(np.abs(values).max()) < 5 * WEIGHT_STD


def test_k_quants_with_aligned_rows() -> None:
    # llama-shaped rows (2048, 8192) hold K blocks, so every matrix keeps the requested type
    types = synthetic_tensor_types("llama1b", "q6_k", n_layer=1)
    assert {t for n, t in types.items() if not n.endswith("norm.weight")} == {Q.Q6_K}
    assert "output.weight" in types


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_blocks_are_centred(tmp_path: Path, qtype: str) -> None:
    # a 256-wide tiny model is not available as a shape, so check the ffn_down of smol (1536 wide)
    path = write_synthetic(tmp_path / "k.gguf", "smol135m", qtype, **TINY)
    qt, data = _raw_rows(path)["blk.0.ffn_down.weight"]
    assert qt == QTYPES[qtype]
    values = np.asarray(dequantize(data, qt), dtype=np.float64)
    per_block = values.reshape(-1, 32).mean(axis=1)  # sub-blocks of 32 share a scale/min
    assert abs(per_block.mean()) < 0.1 * WEIGHT_STD
    assert np.abs(per_block).max() < 2 * WEIGHT_STD


def test_deterministic_and_seeded(tmp_path: Path) -> None:
    a = write_synthetic(tmp_path / "a.gguf", "smol135m", "q4_0", seed=3, **TINY)
    b = write_synthetic(tmp_path / "b.gguf", "smol135m", "q4_0", seed=3, **TINY)
    c = write_synthetic(tmp_path / "c.gguf", "smol135m", "q4_0", seed=4, **TINY)

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest(a) == digest(b) != digest(c)


def test_tokenizer_of_synthetic_model(tmp_path: Path) -> None:
    mf = load_model(write_synthetic(tmp_path / "t.gguf", "smol135m", "q8_0", **TINY))
    tok = Tokenizer.from_model_file(mf)
    assert tok.n_vocab == 512 and tok.model == "gpt2"
    for text in ["hello there world", "Ünïcode 🎉 and 12345\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_id in tok.eot_ids and tok.token_text(tok.eos_id) == "<|im_end|>"


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k", "bf16"])
def test_synthetic_model_runs_through_reference(tmp_path: Path, qtype: str) -> None:
    mf = load_model(write_synthetic(tmp_path / "r.gguf", "smol135m", qtype, **TINY))
    logits = reference_logits(mf, [5, 100, 300, 7, 511])
    assert logits.shape == (5, 512)
    assert np.isfinite(logits).all()
    assert 0.05 < float(logits.std()) < 20.0  # bounded activations, not degenerate


def test_untied_llama_shape(tmp_path: Path) -> None:
    mf = load_model(write_synthetic(tmp_path / "l.gguf", "llama1b", "q4_0", n_layer=1, n_vocab=300))
    hp = mf.hparams
    assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab) == (2048, 32, 8, 8192, 300)
    assert not mf.tied_embeddings and mf.output.name == "output.weight"
    assert mf.file_size == pytest.approx(mf.tensor_bytes, rel=0.01)


def test_8b_tensor_plan_size() -> None:
    # the plan alone (no writing): ~8.0e9 parameters like Llama-3-8B with a 32000 vocabulary
    types = synthetic_tensor_types("llama8b", "q4_0")
    assert len(types) == 2 + 1 + 32 * 9
    s = SHAPES["llama8b"]
    kv = s.n_head_kv * s.n_embd // s.n_head
    per_layer = 2 * s.n_embd * s.n_embd + 2 * s.n_embd * kv + 3 * s.n_embd * s.n_ff
    n_params = 32 * per_layer + 2 * s.n_embd * s.n_vocab
    assert 7.0e9 < n_params < 8.1e9


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown synthetic shape"):
        write_synthetic(tmp_path / "x.gguf", "gpt5", "q4_0")
    with pytest.raises(ValueError, match="unknown weight type"):
        write_synthetic(tmp_path / "x.gguf", "smol135m", "iq2_xxs")
    with pytest.raises(ValueError, match="n_vocab"):
        write_synthetic(tmp_path / "x.gguf", "smol135m", "q4_0", n_vocab=100, n_layer=1)
