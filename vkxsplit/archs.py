"""The forward pass of each architecture as a :class:`~vkxsplit.graph.Graph`, built from shared pieces.

:func:`build_graph` is what :meth:`vkxsplit.model.Model._build_graph` runs: the embedding, then
per layer the attention block and the FFN block with their norms and residual adds, then the
output norm and projection, over the model's buffers. The pieces, each as llama.cpp's graph
builders (``src/models/*.cpp``) define them:

- :meth:`Builder.attention`: Q/K/V projections (with qwen2's biases), per-head RMSNorm of Q and
  K (qwen3, gemma3), RoPE (each layer's base and scale: gemma3's sliding-window layers have
  their own; llama 3.x ``rope_freqs`` or phi3's ``rope_factors_long/short`` as frequency
  factors), the KV-cache store, attention (gemma3's Q scale and sliding window), the output
  projection;
- an FFN block (:data:`FfnBlock`, chosen per layer by :func:`ffn_block`): SwiGLU
  ``down(silu(gate(h)) * up(h))`` or Gemma's GeGLU ``down(gelu_tanh(gate(h)) * up(h))``;
- :meth:`Builder.layer`: pre-norms, gemma3's post-norms of both blocks' outputs, the residual
  adds.

This is the plain graph, every op as llama.cpp's builders write it (mat-vecs read f32 x);
:func:`build_graph` ends with the hub's fusion passes (:func:`vkxsplit.fusion.optimize`:
residual add + RMSNorm, RoPE of K + KV store, the q8_1 x of decode mat-vecs), each with its
kill switch.

Architectures differ only by :class:`~vkxsplit.gguf_model.ArchInfo` flags and hyperparameters;
phi3's fused ``attn_qkv`` and gate/up ``ffn_up`` are split into row ranges at upload
(:func:`weight_tensors`), so its graph is the llama one. Tensor-split shards
and layer ranges of a model over several hubs (:mod:`vkxsplit.hubs`) reuse the builder
through the model's hooks (``_reduce``, ``layers``, ``first``/``last``, links).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import ModelError
from .fusion import DecodeQ8, optimize
from .gguf_model import ARCHS, ModelFile, TensorInfo
from .graph import Graph, Tensor

if TYPE_CHECKING:
    from .model import Model

# (DecodeQ8 lives in vkxsplit.fusion, the q8_1 pass; re-exported here, its older home)
__all__ = ["Builder", "DecodeQ8", "FfnBlock", "build_graph", "dense_ffn", "ffn_block", "weight_tensors"]


def weight_tensors(file: ModelFile) -> dict[str, TensorInfo]:
    """The weights the graph reads, by name: the file's tensors, with phi3's fused matrices
    split into row ranges (zero-copy views of the same bytes): ``attn_qkv`` into ``attn_q``,
    ``attn_k``, ``attn_v`` (Q rows, then K, then V, as llama.cpp's ``build_qkv`` views them) and
    a ``ffn_up`` of ``2 n_ff`` rows into ``ffn_gate`` (the first half: ggml's ``swiglu`` applies
    silu to the first half of each row) and ``ffn_up`` (the second)."""
    hp = file.hparams
    out: dict[str, TensorInfo] = {}
    for name, ti in file.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
            p = f"blk.{parts[1]}."
            if parts[2] == "attn_qkv":
                sizes = [("attn_q", hp.n_embd_q), ("attn_k", hp.n_embd_k_gqa), ("attn_v", hp.n_embd_v_gqa)]
                out.update(_row_parts(ti, p, sizes))
                continue
            if parts[2] == "ffn_up" and ARCHS[hp.arch].fused_gate_up and ti.rows == 2 * hp.n_ff:
                out.update(_row_parts(ti, p, [("ffn_gate", hp.n_ff), ("ffn_up", hp.n_ff)]))
                continue
        out[name] = ti
    return out


def _row_parts(ti: TensorInfo, prefix: str, sizes: list[tuple[str, int]]) -> dict[str, TensorInfo]:
    out, r0 = {}, 0
    if sum(n for _, n in sizes) != ti.rows or ti.n_dims != 2:
        raise ModelError(f"{ti.name} has {ti.rows} rows; its parts need {sum(n for _, n in sizes)}",
                         "the file's metadata and tensors disagree; re-convert it with llama.cpp")
    rb = ti.row_bytes
    for short, n in sizes:
        name = f"{prefix}{short}.weight"
        out[name] = dataclasses.replace(ti, name=name, ne=(ti.cols, n, 1, 1), offset=ti.offset + r0 * rb,
                                        nbytes=n * rb, data=ti.data[r0 * rb:(r0 + n) * rb])
        r0 += n
    return out


#: An FFN block: ``fn(builder, prefix, h, out) -> y``: the FFN of layer ``prefix`` (``"blk.N."``)
#: applied to the normed hidden state ``h`` (T x n_embd), its result in ``out`` (T x n_embd,
#: returned, or the tensor a tensor-split shard's reduction leaves it in). A mixture-of-experts
#: FFN plugs in here (:func:`ffn_block` chooses the block of a layer).
FfnBlock = Callable[["Builder", str, Tensor, Tensor], Tensor]


def dense_ffn(b: Builder, p: str, h: Tensor, out: Tensor) -> Tensor:
    """``down(act(gate(h)) * up(h))``: SwiGLU (act = silu; llama.cpp's ``LLM_FFN_SILU`` +
    ``LLM_FFN_PAR``, and phi3's ``LLM_FFN_SWIGLU`` of its split ffn_up) or GeGLU (act = GELU,
    tanh form: gemma's ``LLM_FFN_GELU`` + ``LLM_FFN_PAR``)."""
    W, hp = b.W, b.hp
    gate = b.mul_mat(p + "ffn_gate", W[p + "ffn_gate.weight"], h, b.act("gate", hp.n_ff))
    up = b.mul_mat(p + "ffn_up", W[p + "ffn_up.weight"], h, b.act("up", hp.n_ff))
    if ARCHS[hp.arch].ffn_act == "gelu":
        b.g.add("geglu", p + "ffn_geglu", [gate, up], gate)
    else:
        b.g.add("swiglu", p + "ffn_swiglu", [gate, up], gate)
    o = b.mul_mat(p + "ffn_down", W[p + "ffn_down.weight"], gate, out)
    return b.model._reduce(b.g, p + "ffn_down", o)


def ffn_block(b: Builder, il: int) -> FfnBlock:
    """The FFN block of layer ``il``: the mixture of experts of a qwen3moe / Mixtral-style file
    (:func:`vkxsplit.moe.moe_ffn_block`), else dense."""
    if b.hp.moe is not None:
        from .moe import moe_ffn_block

        return moe_ffn_block
    return dense_ffn


class Builder:
    """One graph of ``T`` tokens over a model's buffers (:func:`build_graph`): the shared pieces
    and the state they share (the graph, the weights, activations, positions)."""

    def __init__(self, m: Model, T: int, all_logits: bool, slot: int = 0) -> None:
        self.model, self.T, self.all_logits, self.slot = m, T, all_logits, slot
        self.hp, self.W, self.A = m.hp, m.weights, m.act
        self.arch = ARCHS[self.hp.arch]
        self.g = Graph(f"{m.file.name}:T{T}" + (f":s{slot}" if slot else ""), T=T)
        self.row0 = slot * m.slot_rows  # this slot's rows of ids, positions, links, logits
        self.V = m._view
        self.ids = Tensor("ids", (T,), "i32", self.V(m.ids_buf, self.row0 * 4, T * 4))
        self.pos = Tensor("positions", (T,), "i32", self.V(m.pos_buf, self.row0 * 4, T * 4))
        self.split_kv: dict[str, Any] = {}
        if T == 1:
            self.split_kv = {"n_splits": m.decode_splits,
                             "scratch": Tensor("attn_scratch", (1,), "f32", m.attn_scratch)}
        # RoPE frequency factors: llama 3.x's rope_freqs, else phi3's long factors when the
        # context exceeds the original one (rope.scaling.original_context_length, else
        # context_length), its short ones otherwise (llama.cpp's get_rope_factors)
        W, hp = self.W, self.hp
        ff = W.get("rope_freqs.weight")
        if ff is None and "rope_factors_long.weight" in W:
            ff = W["rope_factors_long.weight" if m.n_ctx > hp.rope_n_ctx_orig else "rope_factors_short.weight"]
        self.freq_factors = [] if ff is None else [ff]

    def act(self, name: str, cols: int) -> Tensor:
        """Activation ``name`` as a T x cols f32 tensor (buffers shared by every graph)."""
        T = self.T
        return Tensor(name, (T, cols), "f32", self.V(self.A[name], 0, T * cols * 4))

    def mul_mat(self, name: str, w: Tensor, x: Tensor, out: Tensor) -> Tensor:
        """``out = x w^T`` (f32 x; the fusion passes choose a q8_1 x for decode)."""
        return self.g.add("mul_mat", name, [w, x], out)

    def rms_norm(self, name: str, x: Tensor, weight: str, out: Tensor) -> Tensor:
        return self.g.add("rms_norm", name, [x, self.W[weight]], out, eps=self.hp.rms_norm_eps)

    def rope_params(self, il: int) -> dict[str, Any]:
        """ggml's rope_ext parameters of layer ``il``."""
        hp = self.hp
        base, scale = hp.rope_base_scale(il)
        rope = {"n_dims": hp.n_rot, "freq_base": base, "freq_scale": scale, "mode": hp.rope_type,
                "head_dim": hp.head_dim}
        if hp.rope_ext_factor != 0.0 or hp.rope_attn_factor != 1.0:  # YaRN / attention factor (ggml's rope_ext)
            rope.update(n_ctx_orig=hp.rope_n_ctx_orig, ext_factor=hp.rope_ext_factor,
                        attn_factor=hp.rope_attn_factor, beta_fast=hp.rope_beta_fast,
                        beta_slow=hp.rope_beta_slow)
        return rope

    # -- pieces ---------------------------------------------------------------------------

    def embed(self) -> Tensor:
        """The hidden state x: the token embeddings (gemma: times sqrt(n_embd)), or on a pipeline
        stage after the first, the previous GPU's hidden state from the host pages both map."""
        m, hp, g, T = self.model, self.hp, self.g, self.T
        x = self.act("x", hp.n_embd)
        if m.first:
            g.add("get_rows", "embd", [self.W["token_embd.weight"], self.ids], x)
            if self.arch.embd_scale:
                g.add("scale", "embd_scale", [x], x, scale=hp.embd_scale)
        else:
            nb = T * hp.n_embd * 4
            src = Tensor("link_in", (T, hp.n_embd), "f32", self.V(m.link_in, self.row0 * hp.n_embd * 4, nb))
            g.add("cpy", "link_in", [src], x)
        return x

    def attention(self, il: int, h: Tensor) -> Tensor:
        """Self-attention of layer ``il`` on the normed hidden state ``h``; returns the output
        projection (summed over tensor-split shards)."""
        m, hp, g, W, T = self.model, self.hp, self.g, self.W, self.T
        p = f"blk.{il}."
        q = self.mul_mat(p + "attn_q", W[p + "attn_q.weight"], h, self.act("q", hp.n_embd_q))
        k = self.mul_mat(p + "attn_k", W[p + "attn_k.weight"], h, self.act("k", hp.n_embd_k_gqa))
        v = self.mul_mat(p + "attn_v", W[p + "attn_v.weight"], h, self.act("v", hp.n_embd_v_gqa))
        for t, nm in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")):
            bias = W.get(p + nm + ".bias")
            if bias is not None:
                g.add("add", p + nm + "_bias", [t, bias], t)
        if self.arch.qk_norm:  # RMSNorm of each head (rows of head_dim), in place, before RoPE
            for t, nm, nh in ((q, "attn_q_norm", hp.n_head), (k, "attn_k_norm", hp.n_head_kv)):
                heads = Tensor(t.name, (T * nh, hp.head_dim), "f32", t.buffer)
                self.rms_norm(p + nm, heads, p + nm + ".weight", heads)
        rope = self.rope_params(il)
        ff = self.freq_factors
        g.add("rope", p + "rope_q", [q, self.pos, *ff], q, n_heads=hp.n_head, **rope)
        g.add("rope", p + "rope_k", [k, self.pos, *ff], k, n_heads=hp.n_head_kv, **rope)
        ck, cv = m.kv[il]
        cache_k = Tensor(f"cache_k.{il}", (m.n_ctx, hp.n_embd_k_gqa), "f16", ck)
        cache_v = Tensor(f"cache_v.{il}", (m.n_ctx, hp.n_embd_v_gqa), "f16", cv)
        # (rope_k: None, K comes roped; the fusion pass that folds the RoPE of K in sets it)
        g.add("kv_store", p + "kv_store", [k, v, self.pos], cache_k, cache_v=cache_v,
              n_kv_heads=hp.n_head_kv, head_dim=hp.head_dim, rope_k=None)
        extra: dict[str, Any] = {}
        if hp.attn_scale is not None:
            extra["scale"] = hp.attn_scale
        if hp.is_swa(il):
            extra["window"] = hp.n_swa
        a = g.add("attention", p + "attn", [q, cache_k, cache_v, self.pos],
                  self.act("attn", hp.n_head * hp.head_dim_v), n_heads=hp.n_head, n_kv_heads=hp.n_head_kv,
                  head_dim=hp.head_dim, n_ctx=m.n_ctx, **self.split_kv, **extra)
        o = self.mul_mat(p + "attn_output", W[p + "attn_output.weight"], a, self.act("o", hp.n_embd))
        return m._reduce(g, p + "attn_output", o)

    def layer(self, il: int, x: Tensor) -> None:
        """Decoder layer ``il``: x (the residual stream) updated in place."""
        hp, post, g = self.hp, self.arch.post_norms, self.g
        p = f"blk.{il}."
        h = self.rms_norm(p + "attn_norm", x, p + "attn_norm.weight", self.act("h", hp.n_embd))
        o = self.attention(il, h)
        if post:  # gemma3: the attention output normed before the residual add
            o = self.rms_norm(p + "post_attention_norm", o, p + "post_attention_norm.weight", o)
        g.add("add", p + "attn_residual", [x, o], x)
        h = self.rms_norm(p + "ffn_norm", x, p + "ffn_norm.weight", self.act("h", hp.n_embd))
        o = ffn_block(self, il)(self, p, h, self.act("o", hp.n_embd))
        if post:
            o = self.rms_norm(p + "post_ffw_norm", o, p + "post_ffw_norm.weight", o)
        g.add("add", p + "ffn_residual", [x, o], x)

    def output(self, x: Tensor) -> None:
        """The output norm and projection of the rows whose logits are wanted (gemma3: the
        file's final-logit soft cap), and their GPU argmax."""
        m, hp, g, T = self.model, self.hp, self.g, self.T
        V, W = self.V, self.W
        rows = T if self.all_logits else 1
        out0 = self.row0 if self.all_logits else 0  # one row: slot 0's, the last writer wins (steps run in order)
        xl = Tensor("x_out", (rows, hp.n_embd), "f32", V(self.A["x"], (T - rows) * hp.n_embd * 4, rows * hp.n_embd * 4))
        hl = Tensor("h_out", (rows, hp.n_embd), "f32", V(self.A["h"], 0, rows * hp.n_embd * 4))
        self.rms_norm("output_norm", xl, "output_norm.weight", hl)
        out_w = W["output.weight"] if "output.weight" in W else W["token_embd.weight"]
        logits = Tensor("logits", (rows, hp.n_vocab), "f32",
                        V(m.logits_buf, out0 * hp.n_vocab * 4, rows * hp.n_vocab * 4))
        self.mul_mat("output", out_w, hl, logits)
        if hp.final_logit_softcap:
            g.add("softcap", "output_softcap", [logits], logits, cap=hp.final_logit_softcap)
        g.add("argmax", "argmax", [logits],
              Tensor("argmax", (rows,), "i32", V(m.argmax_buf, out0 * 4, rows * 4)))

    def build(self) -> Graph:
        m, hp, g, T = self.model, self.hp, self.g, self.T
        x = self.embed()
        for il in m.layers:
            self.layer(il, x)
        if not m.last:  # the hidden state goes on to the next GPU
            nb = T * hp.n_embd * 4
            dst = Tensor("link_out", (T, hp.n_embd), "f32", self.V(m.link_out, self.row0 * hp.n_embd * 4, nb))
            g.add("cpy", "link_out", [x], dst)
            return g
        if m.makes_logits:
            self.output(x)
        return g


def build_graph(m: Model, T: int, all_logits: bool, slot: int = 0) -> Graph:
    """The forward pass of ``m``'s architecture for ``T`` tokens (all rows' logits when
    ``all_logits``, else the last row's) in slot ``slot``'s rows of the per-step buffers: the
    plain graph, then the hub's fusion passes (all q8_1 x of decode in the model's ``xq_buf``)."""
    b = Builder(m, T, all_logits, slot)
    return optimize(b.build(), m.device, lambda nbytes: b.V(m.xq_buf, 0, nbytes))
