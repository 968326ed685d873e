"""The tokenizer of a GGUF model, built from the file's ``tokenizer.ggml.*`` metadata.

Encoding uses a HuggingFace ``tokenizers.Tokenizer`` assembled from the vocabulary:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` + ``merges``, with the
  pre-tokenizer regexes llama.cpp uses for ``tokenizer.ggml.pre`` (gpt2, smollm/starcoder
  digit splitting, llama3, qwen2; unknown names fall back to the GPT-2 regex and set
  :attr:`Tokenizer.pre_exact` to False).
- ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE: merges derived from the
  token ``scores`` (a higher score merges first, like llama.cpp's SPM tokenizer), ``<0xXX>``
  byte fallback, spaces escaped to ``▁`` and a ``▁`` prefix when ``add_space_prefix``.

CONTROL tokens (token type 3) are special added tokens: they are recognised in the text
(``"<|im_start|>"`` encodes to its id) and left out of decoded text unless ``special=True``.

Decoding is done here (not by HuggingFace) on raw bytes, so that :meth:`Tokenizer.decode` and the
streaming :class:`StreamDecoder` agree exactly, including across multi-byte UTF-8 characters
split over several tokens.

Chat: the file's ``tokenizer.chat_template``; a file without one gets Gemma's turn format
(:data:`GEMMA_TEMPLATE`) when its vocabulary has Gemma's ``<start_of_turn>``/``<end_of_turn>``
control tokens (Gemma 3 GGUFs repackaged without their template: ChatML's markers are not
tokens there and would reach the model as plain text), else ChatML.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .chat_template import (
    CHATML_TEMPLATE,
    TEMPLATE_MAX_CHARS,
    TEMPLATE_MAX_STEPS,
    TEMPLATE_TIME_LIMIT_S,
    compile_template,
    render_template,
)
from .errors import Closable, ModelError

if TYPE_CHECKING:
    import tokenizers as hf

    from .gguf_model import ModelFile

__all__ = [
    "CHATML_TEMPLATE",
    "GEMMA_TEMPLATE",
    "TEMPLATE_MAX_CHARS",
    "TEMPLATE_MAX_STEPS",
    "TEMPLATE_TIME_LIMIT_S",
    "TOKEN_BYTE",
    "TOKEN_CONTROL",
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_UNUSED",
    "TOKEN_USER_DEFINED",
    "StreamDecoder",
    "Tokenizer",
    "bytes_to_unicode",
]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPM_SPACE = "\u2581"  # ▁

#: Gemma's chat format (google/gemma-3 tokenizer_config's template, text content only): an
#: optional system message folded into the first user turn, roles user/model.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_UNK_PIECE = "\u2585".encode()  # what llama.cpp prints for an UNKNOWN token

# Pre-tokenizer regexes, as llama.cpp applies them for each tokenizer.ggml.pre value.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_GROUPS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("gpt2", "gpt-2", "default", "mpt", "olmo", "jais", "phi-2", "poro-chat", "viking", "bloom"): (_GPT2_RE,),
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"): (r"\p{N}", _GPT2_RE),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe"): (_LLAMA3_RE,),
    ("qwen2", "qwen2.5", "qwen-2.5", "deepseek-r1-qwen", "stablelm2", "megrez"): (_QWEN2_RE,),
}
#: tokenizer.ggml.pre -> list of regexes applied in order (each splits the previous pieces)
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    n: rs for names, rs in _PRE_GROUPS.items() for n in names
}
#: pre-tokenizers whose BPE matches whole words against the vocabulary first (HF ignore_merges)
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe"})

#: Texts of tokens that end a turn in the common chat formats (llama.cpp's EOG heuristics).
EOT_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<|return|>",
        "<|call|>",
        "<｜end▁of▁sentence｜>",
    }
)

@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (byte-level BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level_decode(text: str) -> bytes:
    table = _unicode_to_bytes()
    out = bytearray()
    for ch in text:
        b = table.get(ch)
        if b is None:  # not a byte-level character: keep it as UTF-8
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _spm_byte(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _spm_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece/llama.cpp SPM: merge the pair whose result scores highest."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED) and t not in vocab:
            vocab[t] = i
    found: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            lid = vocab.get(left)
            if lid is not None and right in vocab:
                found.append((-float(scores[pid]), pid, lid, left, right))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


class Tokenizer(Closable):
    """Encode/decode text for one GGUF model. Build it with :meth:`from_model_file`.
    ``close()`` (the model's close calls it) makes every method raise ClosedError."""

    def close(self) -> None:
        """Mark the tokenizer closed (it holds no device resources; use after close is refused
        the same as for the model it came from)."""

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str = "",
        bos_id: int | None = None,
        eos_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool = False,
        add_space_prefix: bool | None = None,
        chat_template: str | None = None,
        source: str = "tokenizer",
    ) -> None:
        if model not in ("gpt2", "llama"):
            raise ModelError(
                f"{source}: tokenizer model {model!r} is not supported (supported: gpt2, llama)",
                hint="use a model whose GGUF has a byte-level BPE (gpt2) or SentencePiece (llama) vocabulary",
            )
        n = len(tokens)
        if n == 0:
            raise ModelError(f"{source} has an empty tokenizer.ggml.tokens", hint="re-convert the model")
        self.model = model
        self.source = source
        self.tokens: list[str] = list(tokens)
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * n
        if len(types) != n:
            raise ModelError(
                f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens",
                hint="the file's tokenizer metadata is corrupt; re-convert the model",
            )
        self.token_types: list[int] = [int(t) for t in types]
        self.pre = pre or ""

        def _valid(i: int | None) -> int | None:
            return int(i) if i is not None and 0 <= int(i) < n else None

        self.bos_id = _valid(bos_id)
        self.eos_id = _valid(eos_id)
        self.unk_id = _valid(unk_id)
        self.pad_id = _valid(pad_id)
        self.add_bos = bool(
            add_bos if add_bos is not None else model == "llama" or self.pre in _IGNORE_MERGES_PRE
        )
        self.add_eos = bool(add_eos)
        self.add_space_prefix = bool(add_space_prefix if add_space_prefix is not None else model == "llama")
        self.chat_template = chat_template
        self.pre_exact = True

        eot = {i for i in (self.eos_id, _valid(eot_id), _valid(eom_id)) if i is not None}
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)):
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and t in EOT_TEXTS:
                eot.add(i)
        self.eot_ids: frozenset[int] = frozenset(eot)

        self._special_bytes: list[bytes] = []  # piece with special=True
        self._plain_bytes: list[bytes] = []  # piece with special=False (control tokens empty)
        for t, ty in zip(self.tokens, self.token_types):
            if ty == TOKEN_CONTROL:
                b = t.encode("utf-8")
                self._special_bytes.append(b)
                self._plain_bytes.append(b"")
                continue
            if ty == TOKEN_UNUSED:
                b = b""
            elif ty == TOKEN_UNKNOWN:
                b = _UNK_PIECE
            elif ty == TOKEN_USER_DEFINED:
                b = t.encode("utf-8")
            elif model == "gpt2":
                b = _byte_level_decode(t)
            else:
                byte = _spm_byte(t) if ty == TOKEN_BYTE else None
                b = bytes([byte]) if byte is not None else t.replace(SPM_SPACE, " ").encode("utf-8")
            self._special_bytes.append(b)
            self._plain_bytes.append(b)

        self._hf = self._build_hf(scores, merges)
        self._template: Any = None

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_model_file(cls, mf: ModelFile) -> Tokenizer:
        """Build the tokenizer of a loaded :class:`~vkxsplit.gguf_model.ModelFile`."""
        source = f"GGUF file {str(mf.path)!r}"
        model = mf.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError(
                f"{source} has no tokenizer (tokenizer.ggml.model is missing)",
                hint="re-convert the model with llama.cpp's convert_hf_to_gguf.py, which embeds the vocabulary",
            )
        tokens = mf.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelError(
                f"{source} has no tokenizer.ggml.tokens", hint="re-convert the model with llama.cpp"
            )
        return cls(
            model=str(model),
            tokens=tokens,
            token_types=mf.get("tokenizer.ggml.token_type"),
            scores=mf.get("tokenizer.ggml.scores"),
            merges=mf.get("tokenizer.ggml.merges"),
            pre=str(mf.get("tokenizer.ggml.pre", "") or ""),
            bos_id=mf.get("tokenizer.ggml.bos_token_id"),
            eos_id=mf.get("tokenizer.ggml.eos_token_id"),
            unk_id=mf.get("tokenizer.ggml.unknown_token_id"),
            pad_id=mf.get("tokenizer.ggml.padding_token_id"),
            eot_id=mf.get("tokenizer.ggml.eot_token_id"),
            eom_id=mf.get("tokenizer.ggml.eom_token_id"),
            add_bos=mf.get("tokenizer.ggml.add_bos_token"),
            add_eos=bool(mf.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=mf.get("tokenizer.ggml.add_space_prefix"),
            chat_template=mf.get("tokenizer.chat_template"),
            source=source,
        )

    def _build_hf(self, scores: Sequence[float] | None, merges: Sequence[str] | None) -> hf.Tokenizer:
        import tokenizers as hf
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)
        try:
            if self.model == "gpt2":
                if merges is None:
                    raise ModelError(
                        f"{self.source}: a gpt2 tokenizer needs tokenizer.ggml.merges, which is missing",
                        hint="re-convert the model with llama.cpp",
                    )
                pairs: list[tuple[str, str]] = []
                for m in merges:
                    k = m.find(" ", 1)
                    if k > 0:
                        pairs.append((m[:k], m[k + 1 :]))
                regexes = PRE_TOKENIZER_REGEXES.get(self.pre)
                if regexes is None:
                    regexes = (_GPT2_RE,)
                    self.pre_exact = False
                tok = hf.Tokenizer(
                    models.BPE(vocab=vocab, merges=pairs, ignore_merges=self.pre in _IGNORE_MERGES_PRE)
                )
                tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Split(hf.Regex(r), behavior="isolated") for r in regexes]
                    + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
                )
                tok.decoder = decoders.ByteLevel()
            else:
                sc = list(scores) if scores is not None else [-float(i) for i in range(len(self.tokens))]
                if len(sc) != len(self.tokens):
                    raise ModelError(
                        f"{self.source}: tokenizer.ggml.scores has {len(sc)} entries for {len(self.tokens)} tokens",
                        hint="the file's tokenizer metadata is corrupt; re-convert the model",
                    )
                unk = self.tokens[self.unk_id] if self.unk_id is not None else None
                tok = hf.Tokenizer(
                    models.BPE(
                        vocab=vocab,
                        merges=_spm_merges(self.tokens, sc, self.token_types),
                        unk_token=unk,
                        fuse_unk=True,
                        byte_fallback=True,
                    )
                )
                norms = [normalizers.Prepend(SPM_SPACE)] if self.add_space_prefix else []
                tok.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", SPM_SPACE)])
                tok.decoder = decoders.Sequence(
                    [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                    + ([decoders.Strip(" ", 1, 0)] if self.add_space_prefix else [])
                )
        except ModelError:
            raise
        except Exception as e:  # tokenizers raises plain Exception for bad vocab/merges
            raise ModelError(
                f"{self.source}: could not build the tokenizer from its metadata ({e})",
                hint="the file's tokenizer metadata is corrupt; re-convert the model",
            ) from e
        special = [
            hf.AddedToken(t, special=True, normalized=False)
            for t, ty in zip(self.tokens, self.token_types)
            if ty == TOKEN_CONTROL
        ]
        user = [
            hf.AddedToken(t, special=False, normalized=False)
            for t, ty in zip(self.tokens, self.token_types)
            if ty == TOKEN_USER_DEFINED
        ]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        return tok

    # ---- vocabulary -------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def hf_tokenizer(self) -> hf.Tokenizer:
        """The underlying HuggingFace tokenizer (used for encoding)."""
        return self._hf

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary entry (e.g. ``"Ġworld"`` or ``"▁world"``)."""
        return self.tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self.token_types[token_id]

    def is_control(self, token_id: int) -> bool:
        return self.token_types[token_id] == TOKEN_CONTROL

    def token_to_id(self, text: str) -> int | None:
        tid = self._hf.token_to_id(text)
        return None if tid is None else int(tid)

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for (control tokens: their text, or b"" if not ``special``)."""
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} out of range for a vocabulary of {len(self.tokens)}")
        return (self._special_bytes if special else self._plain_bytes)[token_id]

    def token_piece(self, token_id: int, special: bool = True) -> str:
        """The text of one token, e.g. ``" Paris"`` (an incomplete UTF-8 piece shows as U+FFFD)."""
        return self.token_bytes(token_id, special).decode("utf-8", errors="replace")

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (e.g. ``<|im_start|>``) are
        recognised; ``add_special`` adds BOS/EOS as the file's add_bos_token/add_eos_token say."""
        ids = [int(i) for i in self._hf.encode(text, add_special_tokens=False).ids]
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def _lstrip_default(self) -> bool:
        return self.model == "llama" and self.add_space_prefix

    def decode(self, ids: Iterable[int], special: bool = False, lstrip: bool | None = None) -> str:
        """Text of a token sequence. ``special`` renders control tokens; ``lstrip`` (default: on for
        SentencePiece vocabularies with a space prefix) drops the space the encoder prefixed."""
        data = b"".join(self.token_bytes(int(i), special) for i in ids)
        if (self._lstrip_default() if lstrip is None else lstrip) and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def stream(self, special: bool = False, lstrip: bool = False) -> StreamDecoder:
        """A streaming detokenizer: push ids one by one, get text as soon as it is complete UTF-8.

        ``lstrip`` defaults to False because a stream usually continues a prompt (``" Paris"``
        keeps its space); pass True to decode a whole sequence like :meth:`decode` does.
        """
        return StreamDecoder(self, special=special, lstrip=lstrip)

    def decode_stream(self, ids: Iterable[int], special: bool = False, lstrip: bool = False) -> Iterator[str]:
        """Yield the non-empty text pieces of ``ids`` as they become complete."""
        dec = self.stream(special=special, lstrip=lstrip)
        for i in ids:
            piece = dec.push(i)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    # ---- chat -------------------------------------------------------------------------------
    @property
    def bos_text(self) -> str:
        return self.tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_text(self) -> str:
        return self.tokens[self.eos_id] if self.eos_id is not None else ""

    def _compiled_template(self) -> Any:
        if self._template is None:
            self._template = compile_template(self.chat_template or self._fallback_template(), self.source)
        return self._template

    def _fallback_template(self) -> str:
        """The template of a file without one: Gemma's turns where the vocabulary has their
        control tokens, else ChatML."""
        turns = {"<start_of_turn>", "<end_of_turn>"}
        found = {t for t, ty in zip(self.tokens, self.token_types) if ty == TOKEN_CONTROL and t in turns}
        return GEMMA_TEMPLATE if found == turns else CHATML_TEMPLATE

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's chat template
        (Gemma's or ChatML when the file has none), in the bounded sandbox of :mod:`vkxsplit.chat_template`:
        a template past its time, size or recursion limits, or failing in any other way, raises
        :class:`ModelError`."""
        tmpl = self._compiled_template()
        ctx: dict[str, Any] = {
            "bos_token": self.bos_text,
            "eos_token": self.eos_text,
            "unk_token": self.tokens[self.unk_id] if self.unk_id is not None else "",
            "pad_token": self.tokens[self.pad_id] if self.pad_id is not None else "",
        }
        ctx.update(kwargs)
        ctx["messages"] = [dict(m) for m in messages]
        ctx["add_generation_prompt"] = add_generation_prompt
        return render_template(tmpl, ctx, self.source)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render the chat template and encode it, adding BOS only if the template did not."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        ids = self.encode(text, add_special=False)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids


class StreamDecoder:
    """Incremental detokenizer: :meth:`push` returns the text completed by one more token.

    Bytes of a character split across tokens (emoji, CJK, byte-fallback tokens) are held back
    until the character is complete; invalid bytes become U+FFFD, the same as :meth:`Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False, lstrip: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._lstrip = lstrip
        self._started = False
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self._tok.token_bytes(int(token_id), self._special)
        if not self._started and data:
            self._started = True
            if self._lstrip and data.startswith(b" "):
                data = data[1:]
        return self._dec.decode(data)

    def flush(self) -> str:
        """Text of any incomplete trailing bytes (as U+FFFD); the decoder is reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
