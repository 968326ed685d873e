"""The file's tensors checked against its hyper-parameters: every tensor the architecture's graph
uses present with the shape it needs, biases and RoPE factors of the right size and type, no
tensor the forward would skip, and a vocabulary of one token per embedding row.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFValueType

from ..errors import ModelError
from ..gguf_header import describe_path
from .hparams import ARCHS, HParams
from .metadata import Metadata
from .tensors import Q, TensorInfo

#: Per-layer tensors every supported architecture must have (``blk.{i}.{name}.weight``).
LAYER_TENSORS: tuple[str, ...] = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
#: Optional per-layer bias tensors (``blk.{i}.{name}.bias``), present in qwen2.
LAYER_BIASES: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")


def _expected_shapes(hp: HParams, tied: bool, fused_qkv: bool = False) -> dict[str, tuple[int, ...]]:
    """ggml-order shapes (ne0, ne1) of the tensors the architecture's graph uses."""
    e = hp.n_embd
    arch = ARCHS[hp.arch]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (e, hp.n_vocab),
        "output_norm.weight": (e,),
    }
    if not tied:
        shapes["output.weight"] = (e, hp.n_vocab)
    per_layer: dict[str, tuple[int, ...]] = {"attn_norm.weight": (e,)}
    if fused_qkv:
        per_layer["attn_qkv.weight"] = (e, hp.n_embd_q + hp.n_embd_k_gqa + hp.n_embd_v_gqa)
    else:
        per_layer.update({"attn_q.weight": (e, hp.n_embd_q), "attn_k.weight": (e, hp.n_embd_k_gqa),
                          "attn_v.weight": (e, hp.n_embd_v_gqa)})
    if arch.qk_norm:
        per_layer.update({"attn_q_norm.weight": (hp.head_dim,), "attn_k_norm.weight": (hp.head_dim,)})
    per_layer.update({"attn_output.weight": (hp.n_head * hp.head_dim_v, e), "ffn_norm.weight": (e,)})
    if arch.post_norms:
        per_layer.update({"post_attention_norm.weight": (e,), "post_ffw_norm.weight": (e,)})
    if hp.moe is not None:  # the experts and their router instead of ffn_gate/up/down
        from ..moe import expected_moe_shapes

        per_layer.update(expected_moe_shapes(hp.moe, e))
    elif arch.fused_gate_up:
        per_layer["ffn_up.weight"] = (e, 2 * hp.n_ff)
    else:
        per_layer.update({"ffn_gate.weight": (e, hp.n_ff), "ffn_up.weight": (e, hp.n_ff)})
    if hp.moe is None:
        per_layer["ffn_down.weight"] = (hp.n_ff, e)
    for i in range(hp.n_layer):
        for k, v in per_layer.items():
            shapes[f"blk.{i}.{k}"] = v
    return shapes


def _check_tensors(path: Path, hp: HParams, tensors: dict[str, TensorInfo], tied: bool) -> None:
    arch = ARCHS[hp.arch]
    if hp.moe is not None:  # the experts first, with a message naming the expert counts
        from ..moe import check_moe_tensors

        check_moe_tensors(describe_path(path), hp.moe, hp.n_embd, hp.n_layer,
                          {n: (t.ne, t.ggml_type) for n, t in tensors.items()})
    # phi3: a fused attn_qkv, or (as llama.cpp's create_tensor_qkv falls back) attn_q/k/v
    expected = _expected_shapes(hp, tied, fused_qkv=arch.fused_qkv and "blk.0.attn_qkv.weight" in tensors)
    missing = [n for n in expected if n not in tensors]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ModelError(
            f"{describe_path(path)} lacks required tensors: {shown}",
            hint=f"the file is incomplete or not a {hp.arch} model; re-convert it with llama.cpp",
        )
    for name, want in expected.items():
        t = tensors[name]
        got = tuple(d for d in t.ne[: max(t.n_dims, len(want))])
        if got != want:
            raise ModelError(
                f"{describe_path(path)}: tensor {name!r} has shape (ne) {list(got)} but the hyperparameters "
                f"need {list(want)}",
                hint="the file's metadata and tensors disagree; re-convert it with llama.cpp",
            )
    for i in range(hp.n_layer if arch.qkv_bias else 0):
        for b, width in zip(LAYER_BIASES, (hp.n_embd_q, hp.n_embd_k_gqa, hp.n_embd_v_gqa)):
            t = tensors.get(f"blk.{i}.{b}.bias")
            if t is not None and t.n_elements != width:
                raise ModelError(
                    f"{describe_path(path)}: bias {t.name!r} has {t.n_elements} elements, expected {width}",
                    hint="the file's metadata and tensors disagree; re-convert it with llama.cpp",
                )
    factor_names = (["rope_freqs.weight"] if arch.rope_freqs else []) + (
        ["rope_factors_long.weight", "rope_factors_short.weight"] if arch.rope_factors else [])
    for name in factor_names:
        rf = tensors.get(name)
        if rf is not None and rf.n_elements != hp.n_rot // 2:
            raise ModelError(
                f"{describe_path(path)}: {name} has {rf.n_elements} elements, expected {hp.n_rot // 2}",
                hint="the file's metadata and tensors disagree; re-convert it with llama.cpp",
            )
        if rf is not None and rf.ggml_type != Q.F32:
            raise ModelError(
                f"{describe_path(path)}: {name} is {rf.ggml_type.name}, not F32 (RoPE reads f32 factors)",
                hint="re-convert the model with llama.cpp (its converter writes the factors as F32)",
            )
    if arch.rope_factors and ("rope_factors_long.weight" in tensors) != ("rope_factors_short.weight" in tensors):
        raise ModelError(
            f"{describe_path(path)} has only one of rope_factors_long.weight / rope_factors_short.weight",
            hint="the file is incomplete; re-convert it with llama.cpp",
        )
    # every tensor must be one the forward reads: one it would skip (an output-projection or FFN
    # bias, Q/K norms, ...) would make the model run silently wrong
    used = set(expected) | set(factor_names) | {
        f"blk.{i}.{b}.bias" for i in range(hp.n_layer if arch.qkv_bias else 0) for b in LAYER_BIASES}
    unused = sorted(n for n in tensors if n not in used)
    if unused:
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise ModelError(
            f"{describe_path(path)} has tensors the {hp.arch} forward of vkxsplit does not use: {shown}",
            hint="the model needs something vkxsplit does not implement; run it with llama.cpp",
        )


_INTS = frozenset({GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                   GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64})
_NUMBERS = _INTS | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_STR = frozenset({GGUFValueType.STRING})
#: tokenizer key -> (value types, element types of an array value or None for a scalar): what the
#: tokenizer reads (llama.cpp's llama-vocab.cpp reads each with a getter of one type)
_TOKENIZER_TYPES: dict[str, tuple[frozenset[int], frozenset[int] | None]] = {
    "tokenizer.ggml.model": (_STR, None),
    "tokenizer.ggml.pre": (_STR, None),
    "tokenizer.chat_template": (_STR, None),
    "tokenizer.ggml.token_type": (frozenset({GGUFValueType.ARRAY}), _INTS),
    "tokenizer.ggml.scores": (frozenset({GGUFValueType.ARRAY}), _NUMBERS),
    "tokenizer.ggml.merges": (frozenset({GGUFValueType.ARRAY}), _STR),
    "tokenizer.ggml.add_bos_token": (_INTS | {GGUFValueType.BOOL}, None),
    "tokenizer.ggml.add_eos_token": (_INTS | {GGUFValueType.BOOL}, None),
    "tokenizer.ggml.add_space_prefix": (_INTS | {GGUFValueType.BOOL}, None),
}


def _check_tokenizer_types(path: Path, md: Metadata) -> None:
    """Each tokenizer key the tokenizer reads has a type it can read (token ids: any integer
    type): a string "1" for an id or "false" for a flag would otherwise be read as 1 / True, an
    array of strings or arrays fail inside the tokenizer."""
    for key in md.keys():
        if key in _TOKENIZER_TYPES:
            want, want_elem = _TOKENIZER_TYPES[key]
        elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            want, want_elem = _INTS, None
        else:
            continue
        vtype, etype, _ = md.value_type(key)
        if vtype not in want or (want_elem is not None and etype not in want_elem):
            got = GGUFValueType(vtype).name + (f" of {GGUFValueType(etype).name}" if etype is not None else "")
            need = " or ".join(sorted(GGUFValueType(t).name for t in want)) + (
                f" of {' or '.join(sorted(GGUFValueType(t).name for t in want_elem))}" if want_elem else "")
            raise ModelError(
                f"{describe_path(path)}: {key} is {got}, not {need}",
                hint="the file's tokenizer metadata is corrupt; re-convert the model with llama.cpp",
            )


def _check_vocab(path: Path, md: Metadata, tensors: dict[str, TensorInfo], tied: bool) -> None:
    """The vocabulary (``tokenizer.ggml.tokens``) must have one token per row of the embedding and
    output matrices, as llama.cpp requires: a token id with no text (a smaller vocabulary) cannot
    be printed, and a text whose id has no row (a larger one) cannot be embedded. The other
    tokenizer keys must have types the tokenizer reads."""
    _check_tokenizer_types(path, md)
    key = "tokenizer.ggml.tokens"
    if key not in md:
        return  # no tokenizer: load_model works, Tokenizer.from_model_file says what is missing
    vtype, etype, _ = md.value_type(key)
    if vtype != GGUFValueType.ARRAY or etype != GGUFValueType.STRING:
        types = [GGUFValueType(vtype).name] + ([GGUFValueType(etype).name] if etype is not None else [])
        raise ModelError(
            f"{describe_path(path)}: tokenizer.ggml.tokens is not an array of strings ({'/'.join(types)})",
            hint="the file's tokenizer metadata is corrupt; re-convert the model with llama.cpp",
        )
    n_tokens = md.array_len(key)
    for name in ("token_embd.weight",) + (() if tied else ("output.weight",)):
        t = tensors.get(name)
        if t is not None and t.n_dims >= 2 and t.rows != n_tokens:
            less = "fewer" if n_tokens < t.rows else "more"
            raise ModelError(
                f"{describe_path(path)} has {n_tokens} tokens in tokenizer.ggml.tokens, {less} than the "
                f"{t.rows} rows of {name}: the vocabulary does not match the model",
                hint="the file's tokenizer and weights come from different models, or it is corrupt "
                "(llama.cpp refuses it too); re-convert the model with llama.cpp",
            )
