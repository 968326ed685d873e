"""Tests of vkxsplit.tokenizer: SmolLM2's byte-level BPE and a synthetic SentencePiece vocab,
each checked against a small independent implementation written here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import smol_path
from gguf import GGUFWriter
from test_gguf_model import write_tiny

from vkxsplit.errors import ModelError
from vkxsplit.gguf_model import ModelFile, load_model
from vkxsplit.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    Tokenizer,
)

TEXTS = [
    "Hello world",
    "The capital of France is",
    "Ünïcödé café naïve résumé",
    "emoji 🎉🚀 and skin tones 👍🏽 and flags 🇫🇷",
    "日本語のテキストと中文",
    "Здравствуй, мир! مرحبا",
    "def f(x):\n    return {'a': [1, 2, 3]}  # 12345\n\tpass\n",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nnewlines\n\n\n",
    "it's we'll they've I'm YOU'RE",
    "",
    " ",
    "a\u200bb zero width, \u00a0nbsp",
]

ASCII_TEXTS = [
    "Hello world",
    "The capital of France is",
    "def f(x):\n    return x**2  # 12345\n",
    "  leading and trailing spaces  ",
    "It's we'll they've I'm",
    "tabs\tand\nnewlines\n\n",
    "URL: https://example.com/a?b=c&d=e",
    "a    b     c",
    "CamelCaseWords and snake_case_words 3.14159 + 2,000,000",
]


@pytest.fixture(scope="module")
def smol_mf() -> ModelFile:
    return load_model(smol_path())


@pytest.fixture(scope="module")
def smol(smol_mf: ModelFile) -> Tokenizer:
    return Tokenizer.from_model_file(smol_mf)


# ---- an independent GPT-2 byte-level BPE for ASCII text --------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_GPT2_ASCII = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def bpe_oracle(text: str, tokens: list[str], merges: list[str], split_digits: bool) -> list[int]:
    ranks = {}
    for i, m in enumerate(merges):
        a, b = m.split(" ", 1)
        ranks[(a, b)] = i
    ids = {t: i for i, t in enumerate(tokens)}
    b2u = _bytes_to_unicode()
    chunks = [c for c in re.split(r"([0-9])", text) if c] if split_digits else [text]
    out: list[int] = []
    for chunk in chunks:
        for word in _GPT2_ASCII.findall(chunk):
            syms = [b2u[b] for b in word.encode()]
            while len(syms) > 1:
                pairs = [(ranks.get((syms[i], syms[i + 1]), 1 << 30), i) for i in range(len(syms) - 1)]
                r, i = min(pairs)
                if r == 1 << 30:
                    break
                syms[i : i + 2] = [syms[i] + syms[i + 1]]
            out += [ids[s] for s in syms]
    return out


# ---- SmolLM2 (gpt2 / byte-level BPE, pre-tokenizer "smollm") ---------------------------------


def test_smol_basic_properties(smol: Tokenizer, smol_mf: ModelFile) -> None:
    assert smol.model == "gpt2" and smol.pre == "smollm" and smol.pre_exact
    assert smol.n_vocab == smol_mf.hparams.n_vocab == 49152
    assert smol.bos_id == smol_mf.get("tokenizer.ggml.bos_token_id")
    assert smol.eos_id == smol_mf.get("tokenizer.ggml.eos_token_id")
    assert smol.add_bos == bool(smol_mf.get("tokenizer.ggml.add_bos_token"))
    tokens = smol_mf.get("tokenizer.ggml.tokens")
    assert smol.eos_id in smol.eot_ids and tokens.index("<|im_end|>") in smol.eot_ids
    types = smol_mf.get("tokenizer.ggml.token_type")
    assert all(types[i] == TOKEN_CONTROL for i in smol.eot_ids)
    assert tokens.index("<|im_start|>") not in smol.eot_ids


def test_smol_hello_world_is_two_known_tokens(smol: Tokenizer, smol_mf: ModelFile) -> None:
    tokens = smol_mf.get("tokenizer.ggml.tokens")
    ids = smol.encode("Hello world")
    assert ids == [tokens.index("Hello"), tokens.index("\u0120world")]  # Ġ marks the space
    assert "".join(smol.token_piece(i) for i in ids) == "Hello world"
    assert smol.token_text(ids[1]) == "\u0120world" and smol.token_piece(ids[1]) == " world"


@pytest.mark.parametrize("text", ASCII_TEXTS)
def test_smol_matches_independent_bpe(smol: Tokenizer, smol_mf: ModelFile, text: str) -> None:
    tokens = smol_mf.get("tokenizer.ggml.tokens")
    merges = smol_mf.get("tokenizer.ggml.merges")
    assert smol.encode(text, add_special=False) == bpe_oracle(text, tokens, merges, split_digits=True)


def test_smol_digits_are_split_individually(smol: Tokenizer) -> None:
    pieces = [smol.token_piece(i) for i in smol.encode("year 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("text", TEXTS)
def test_smol_round_trip(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    assert b"".join(smol.token_bytes(i) for i in ids) == text.encode()
    # the HuggingFace byte-level decoder is an independent implementation of the same mapping
    assert smol.hf_tokenizer.decode(ids, skip_special_tokens=False) == smol.decode(ids, special=True)


@pytest.mark.parametrize("text", TEXTS)
def test_smol_stream_matches_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    pieces = list(smol.decode_stream(ids))
    assert "".join(pieces) == text
    assert all(pieces) and not any("\ufffd" in p for p in pieces)


def test_stream_holds_back_partial_utf8(smol: Tokenizer) -> None:
    ids = smol.encode("🎉")
    assert len(ids) > 1, "the emoji should need several byte-level tokens"
    partial = [i for i in ids if smol.token_piece(i).endswith("\ufffd")]
    assert partial, "some token carries an incomplete UTF-8 sequence"
    dec = smol.stream()
    outs = [dec.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🎉"
    assert dec.flush() == ""
    # an unfinished character is flushed as one replacement character
    dec2 = smol.stream()
    assert "".join(dec2.push(i) for i in ids[:-1]) == ""
    assert dec2.flush() == "\ufffd"


def test_smol_special_tokens_in_text(smol: Tokenizer, smol_mf: ModelFile) -> None:
    tokens = smol_mf.get("tokenizer.ggml.tokens")
    text = "<|im_start|>user\nHi there<|im_end|>\n"
    ids = smol.encode(text)
    assert ids[0] == tokens.index("<|im_start|>")
    assert tokens.index("<|im_end|>") in ids
    assert smol.decode(ids) == "user\nHi there\n"  # control tokens are left out by default
    assert smol.decode(ids, special=True) == text
    assert smol.token_piece(ids[0]) == "<|im_start|>" and smol.token_piece(ids[0], special=False) == ""


def test_smol_add_special_follows_file(smol: Tokenizer) -> None:
    # SmolLM2 says add_bos_token = false and has no add_eos_token
    assert smol.encode("Hi", add_special=True) == smol.encode("Hi", add_special=False)


def test_smol_chat_template(smol: Tokenizer, smol_mf: ModelFile) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol.apply_chat_template(msgs)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not smol.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    with_sys = [{"role": "system", "content": "Be brief."}, *msgs]
    assert smol.apply_chat_template(with_sys) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smol.encode_chat(with_sys)
    tokens = smol_mf.get("tokenizer.ggml.tokens")
    assert ids.count(tokens.index("<|im_start|>")) == 3 and ids.count(tokens.index("<|im_end|>")) == 2


# ---- chat-template environment ------------------------------------------------------------------


def _tiny_tok(template: str) -> Tokenizer:
    return Tokenizer(
        model="llama",
        tokens=["<unk>", "<s>", "</s>", "\u2581"],
        token_types=[TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_NORMAL],
        scores=[0.0, 0.0, 0.0, -1.0],
        bos_id=1,
        eos_id=2,
        unk_id=0,
        chat_template=template,
    )


def test_template_variables_and_helpers() -> None:
    tok = _tiny_tok(
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ eos_token }}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>[user:x]</s>"
    tok = _tiny_tok("{{ messages | tojson }}")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'


def test_template_raise_exception() -> None:
    tok = _tiny_tok(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ModelError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed() -> None:
    tok = _tiny_tok("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ModelError):
        tok.apply_chat_template([])


def test_missing_template_falls_back_to_chatml() -> None:
    tok = _tiny_tok("")
    tok.chat_template = None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# ---- a synthetic SentencePiece ("llama") vocabulary ---------------------------------------------

_SP = "\u2581"
_PIECES = [
    # multi-character pieces, best (highest score) first
    _SP + "the", "he", _SP + "t", "ll", _SP + "hello", "llo", _SP + "he", _SP + "h", "el", "lo",
    _SP + "world", _SP + "wor", "or", _SP + "w", "ld", _SP + "is", "is", _SP + "i", "in",
    _SP + "café", _SP + "caf", _SP + "ca", "ca", "af", _SP + "c", _SP + "and", _SP + "an", "an", "nd",
    _SP + _SP, _SP + "a",
]  # fmt: skip
_CHARS = [_SP, "e", "h", "l", "o", "w", "r", "d", "t", "c", "a", "f", "é", "n", "i", "s"]


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    for k, piece in enumerate(_PIECES):
        tokens.append(piece)
        types.append(TOKEN_NORMAL)
        scores.append(-1.0 - k)
    for k, ch in enumerate(_CHARS):
        tokens.append(ch)
        types.append(TOKEN_NORMAL)
        scores.append(-100.0 - k)
    return tokens, types, scores


def spm_oracle(text: str, tokens: list[str], types: list[int], scores: list[float]) -> list[int]:
    """llama.cpp's SPM tokenizer: repeatedly merge the adjacent pair whose union scores best."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    if not text:
        return []
    syms = list((" " + text).replace(" ", _SP))
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(syms) - 1):
            j = vocab.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    out: list[int] = []
    for s in syms:
        if s in vocab:
            out.append(vocab[s])
        else:
            out += [tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return out


SPM_TEXTS = [
    "hello world",
    "the world is hello",
    "café and the world",
    "hello  world",
    " hello",
    "héllo 🎉",
    "abc xyz",
    "line\nbreak",
    "hellohello thethe",
    "",
]


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    tokens, types, scores = spm_vocab()
    return Tokenizer(
        model="llama", tokens=tokens, token_types=types, scores=scores, bos_id=1, eos_id=2, unk_id=0
    )


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_matches_llama_cpp_algorithm(spm: Tokenizer, text: str) -> None:
    tokens, types, scores = spm_vocab()
    assert spm.encode(text, add_special=False) == spm_oracle(text, tokens, types, scores)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_round_trip_and_stream(spm: Tokenizer, text: str) -> None:
    ids = spm.encode(text)
    assert ids[0] == spm.bos_id  # add_bos defaults to true for SentencePiece vocabularies
    assert spm.decode(ids) == text
    assert "".join(spm.decode_stream(ids, lstrip=True)) == text
    assert spm.hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_spm_pieces_and_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.encode("hello world", add_special=False)
    assert [spm.token_text(i) for i in ids] == [_SP + "hello", _SP + "world"]
    assert [spm.token_piece(i) for i in ids] == [" hello", " world"]
    emoji = spm.encode("🎉", add_special=False)
    assert [spm.token_text(i) for i in emoji[1:]] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    dec = spm.stream()
    assert [dec.push(i) for i in emoji] == [" ", "", "", "", "🎉"]
    assert spm.decode([spm.bos_id, *ids], special=True) == "<s> hello world"


def test_spm_from_gguf(tmp_path: Path, spm: Tokenizer) -> None:
    tokens, types, scores = spm_vocab()

    def kv(w: GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_add_eos_token(True)

    mf = load_model(write_tiny(tmp_path / "spm.gguf", n_vocab=len(tokens), extra_kv=kv))
    tok = Tokenizer.from_model_file(mf)
    assert tok.model == "llama" and not tok.add_bos and tok.add_eos
    for text in SPM_TEXTS:
        assert tok.encode(text) == spm.encode(text, add_special=False) + [2]
    assert tok.eot_ids == frozenset({2})


def test_unsupported_tokenizer_model() -> None:
    with pytest.raises(ModelError, match="'bert'"):
        Tokenizer(model="bert", tokens=["a"])


def test_model_file_without_tokenizer(tmp_path: Path) -> None:
    mf = load_model(write_tiny(tmp_path / "m.gguf"))
    with pytest.raises(ModelError) as ei:
        Tokenizer.from_model_file(mf)
    assert str(mf.path) in str(ei.value) and ei.value.hint
