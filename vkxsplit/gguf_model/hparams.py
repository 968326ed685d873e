"""The hyper-parameters of a model, per architecture: :data:`ARCHS` (what each architecture's
forward reads, :class:`ArchInfo`), :class:`HParams`, and their reading from the metadata as
llama.cpp's ``load_hparams`` does (RoPE scaling and YaRN, sliding windows, soft caps, the
mixture-of-experts FFN), refusing whatever the forward would not apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError
from ..gguf_header import describe_path
from .metadata import Metadata, _get_float, _get_int, _get_str
from .tensors import TensorInfo


@dataclass(frozen=True)
class ArchInfo:
    """What an architecture's forward reads (llama.cpp's graph builder of the same name): the
    loader checks a file's tensors against it, :mod:`vkxsplit.archs` builds the graph from it."""

    #: "norm" rotates adjacent pairs (2i, 2i+1) (GGUF llama Q/K weights are already permuted by
    #: the converter for this); "neox" rotates (i, i + n_rot/2)
    rope: str
    #: optional ``blk.N.attn_{q,k,v}.bias`` (qwen2)
    qkv_bias: bool = False
    #: ``blk.N.attn_{q,k}_norm.weight``: RMSNorm of each Q/K head before RoPE (qwen3, gemma3)
    qk_norm: bool = False
    #: ``blk.N.post_attention_norm`` / ``post_ffw_norm``: RMSNorm of the attention and FFN outputs
    #: before their residual adds (gemma3)
    post_norms: bool = False
    #: ``blk.N.attn_qkv.weight`` (Q, K, V rows one after another) instead of attn_q/k/v (phi3)
    fused_qkv: bool = False
    #: ``blk.N.ffn_up.weight`` of 2 n_ff rows, gate first, then up, and no ffn_gate (phi3)
    fused_gate_up: bool = False
    #: FFN activation: "silu" (SwiGLU, silu(gate) * up) or "gelu" (gelu_tanh(gate) * up)
    ffn_act: str = "silu"
    #: token embeddings scaled by sqrt(n_embd) (gemma)
    embd_scale: bool = False
    #: the file may hold ``rope_freqs.weight`` (llama 3.x frequency factors)
    rope_freqs: bool = True
    #: the file may hold ``rope_factors_long/short.weight`` (phi3 LongRoPE factors)
    rope_factors: bool = False


#: The architectures this runtime runs (llama.cpp's ``LLM_ARCH_*`` of the same names).
ARCHS: dict[str, ArchInfo] = {
    "llama": ArchInfo("norm", qkv_bias=True),
    "mistral": ArchInfo("norm", qkv_bias=True),
    "qwen2": ArchInfo("neox", qkv_bias=True),
    "qwen3": ArchInfo("neox", qk_norm=True, rope_freqs=False),
    "gemma3": ArchInfo("neox", qk_norm=True, post_norms=True, ffn_act="gelu", embd_scale=True, rope_freqs=False),
    # (llama.cpp's phi3 has no rope_freqs tensor: its long/short factors only)
    "phi3": ArchInfo("neox", fused_qkv=True, fused_gate_up=True, rope_freqs=False, rope_factors=True),
    # qwen3 attention + a mixture-of-experts FFN in every layer (vkxsplit/moe.py; llama files
    # with blk.0.ffn_gate_inp.weight are Mixtral-style MoE too)
    "qwen3moe": ArchInfo("neox", qk_norm=True, rope_freqs=False),
}

#: Architectures and their RoPE flavour (see :class:`ArchInfo`).
SUPPORTED_ARCHS: dict[str, str] = {name: a.rope for name, a in ARCHS.items()}

#: ``{arch}.rope.scaling.type`` values the forward implements ("linear": freq_scale = 1/factor;
#: "yarn": ggml's YaRN ramp and magnitude terms on top; "none": freq_scale 1, as llama.cpp).
SUPPORTED_ROPE_SCALING: tuple[str, ...] = ("none", "linear", "yarn")


@dataclass(frozen=True)
class HParams:
    """The hyperparameters of a llama-family model, as the file declares them."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    #: per-head dimension of Q and K (``{arch}.attention.key_length``, default n_embd / n_head)
    head_dim: int
    #: per-head dimension of V (``{arch}.attention.value_length``, default head_dim)
    head_dim_v: int
    #: number of leading dimensions of each head that RoPE rotates
    n_rot: int
    rope_freq_base: float
    #: position multiplier (1 / scaling factor); 1.0 when the model is not scaled
    rope_freq_scale: float
    #: "none", "linear" or "yarn" (``{arch}.rope.scaling.type``; the loader refuses the others)
    rope_scaling_type: str
    #: "norm" (pairs 2i, 2i+1: llama, mistral) or "neox" (pairs i, i + n_rot/2: qwen2)
    rope_type: str
    rms_norm_eps: float
    #: ggml's RoPE parameters beyond freq_base/freq_scale, as llama.cpp fills them for this file
    #: (llama-context.cpp): ``n_ctx_orig_yarn`` (``{arch}.rope.scaling.original_context_length``,
    #: else n_ctx_train), ``yarn_ext_factor`` (1 for scaling type yarn, else 0),
    #: ``yarn_attn_factor`` (for yarn: get_mscale(1/freq_scale) / (1 + 0.1 ln(1/freq_scale)),
    #: which cancels the kernel's own magnitude correction; times ``rope.scaling.attn_factor``)
    #: and ``yarn_beta_fast`` / ``yarn_beta_slow`` (llama.cpp's defaults for these architectures)
    rope_n_ctx_orig: int = 0
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    #: ``general.architecture`` (a key of :data:`ARCHS`)
    arch: str = "llama"
    #: sliding-window size of the SWA layers (``{arch}.attention.sliding_window``; 0: none)
    n_swa: int = 0
    #: SWA layer pattern as llama.cpp's ``set_swa_pattern(n)`` (with ``n_swa`` > 0): layer il
    #: uses the window iff ``n == 0`` or ``il % n < n - 1`` (gemma3: 6, every 6th layer global;
    #: the file's ``attention.sliding_window_pattern`` when it has one)
    swa_pattern: int = 0
    #: RoPE base and scale of the SWA layers (llama.cpp's ``rope_freq_base/scale_train_swa``)
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    #: the attention's Q scale (None: 1/sqrt(head_dim))
    attn_scale: float | None = None
    #: multiplier of the token embeddings (gemma: sqrt(n_embd))
    embd_scale: float = 1.0
    #: final-logit soft cap, ``cap * tanh(logits / cap)`` (``{arch}.final_logit_softcapping``; 0: none)
    final_logit_softcap: float = 0.0
    #: the mixture-of-experts FFN (:class:`vkxsplit.moe.MoeParams`: expert counts, expert FFN
    #: length, weight normalisation, gating) of a qwen3moe / Mixtral-style file; None: dense FFN
    moe: Any = None

    def is_swa(self, il: int) -> bool:
        """Whether layer ``il`` attends through the sliding window (llama.cpp's ``is_swa``)."""
        n = self.swa_pattern
        return self.n_swa > 0 and (n == 0 or il % n < n - 1)

    def rope_base_scale(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer ``il``'s RoPE (SWA layers have their own)."""
        if self.is_swa(il):
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_head_kv * self.head_dim_v


def _read_hparams(path: Path, md: Metadata, arch: str, tensors: dict[str, TensorInfo]) -> HParams:
    p = arch + "."
    n_embd = _get_int(path, md, p + "embedding_length")
    n_layer = _get_int(path, md, p + "block_count")
    n_head = _get_int(path, md, p + "attention.head_count")
    n_head_kv = _get_int(path, md, p + "attention.head_count_kv", n_head)
    n_ff = _get_int(path, md, p + "feed_forward_length")
    n_ctx = _get_int(path, md, p + "context_length", 2048)
    if min(n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx) <= 0 or n_head % n_head_kv:
        raise ModelError(
            f"{describe_path(path)} has inconsistent hyperparameters (n_embd={n_embd}, n_layer={n_layer}, "
            f"n_head={n_head}, n_head_kv={n_head_kv}, n_ff={n_ff}, n_ctx_train={n_ctx})",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    # every layer has tensors of its own: a block_count above the tensor count is refused here,
    # before the per-layer checks would loop over it (2^32 - 1 layers: hours and gigabytes)
    if n_layer > len(tensors):
        raise ModelError(
            f"{describe_path(path)} declares {n_layer} layers ({p}block_count) but holds only "
            f"{len(tensors)} tensors",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    if p + "vocab_size" in md:
        n_vocab = _get_int(path, md, p + "vocab_size")
    elif md.is_array("tokenizer.ggml.tokens"):
        n_vocab = md.array_len("tokenizer.ggml.tokens")
    elif "token_embd.weight" in tensors:
        n_vocab = tensors["token_embd.weight"].ne[1]
    else:
        n_vocab = 0
    head_dim = _get_int(path, md, p + "attention.key_length", n_embd // n_head)
    head_dim_v = _get_int(path, md, p + "attention.value_length", head_dim)
    n_rot = _get_int(path, md, p + "rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot < 0 or n_rot % 2:
        raise ModelError(
            f"{describe_path(path)} has rope.dimension_count={n_rot} for heads of {head_dim}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    # llama.cpp: rope.scaling.factor, else the old rope.scale_linear; freq_scale = 1/factor
    factor = _get_float(md, p + "rope.scaling.factor", 0.0)
    if factor == 0.0:
        factor = _get_float(md, p + "rope.scale_linear", 0.0)
    scaling_type = _get_str(md, p + "rope.scaling.type", "linear" if factor not in (0.0, 1.0) else "none")
    if not (math.isfinite(factor) and factor >= 0.0):
        raise ModelError(
            f"{describe_path(path)} has rope.scaling.factor={factor}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    # Only what the forward does may run: RoPE with freq_scale (linear), YaRN, the attention
    # factor and frequency factors (rope_freqs.weight); no LongRoPE, one head size.
    if scaling_type not in SUPPORTED_ROPE_SCALING:
        raise ModelError(
            f"{describe_path(path)} asks for RoPE scaling {scaling_type!r} (rope.scaling.type), which vkxsplit "
            f"does not implement (it does: {', '.join(SUPPORTED_ROPE_SCALING)}; llama 3.x frequency factors)",
            hint="use a build of the model without that context extension, or llama.cpp",
        )
    if scaling_type == "none":
        freq_scale = 1.0  # llama.cpp: "never scale if scaling type is none"
    attn_factor = _get_float(md, p + "rope.scaling.attn_factor", 1.0)
    n_ctx_orig = _get_int(path, md, p + "rope.scaling.original_context_length", 0)
    if not (math.isfinite(attn_factor) and attn_factor > 0.0) or n_ctx_orig < 0:
        raise ModelError(
            f"{describe_path(path)} has rope.scaling.attn_factor={attn_factor}, "
            f"rope.scaling.original_context_length={n_ctx_orig}",
            hint="the file's metadata is corrupt; re-convert it with llama.cpp",
        )
    # llama.cpp (llama-context.cpp): yarn_ext_factor 1 for yarn, else 0; for yarn the attention
    # factor get_mscale(factor) is divided by the 1 + 0.1 ln(factor) the kernel multiplies in
    # again; then times rope.scaling.attn_factor. In float32, as there.
    f32 = np.float32
    ext_factor, yarn_attn = (1.0 if scaling_type == "yarn" else 0.0), f32(1.0)
    if ext_factor != 0.0:
        fac = f32(1.0) / f32(freq_scale)
        mscale = f32(1.0) if fac <= 1.0 else f32(f32(0.1) * np.log(fac) + f32(1.0))
        yarn_attn = f32(mscale * (f32(1.0) / (f32(1.0) + f32(0.1) * np.log(fac))))
    yarn_attn = f32(yarn_attn * f32(attn_factor))
    # keys llama.cpp reads only for other architectures (DeepSeek-style, Grok): refused unless
    # they hold what llama.cpp uses for this one (a negative yarn_ext_factor means "not set")
    for key, used in (("yarn_log_multiplier", 0.0), ("yarn_ext_factor", ext_factor), ("yarn_attn_factor", 1.0),
                      ("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0)):
        v = _get_float(md, p + "rope.scaling." + key, used)
        if v != used and not (key == "yarn_ext_factor" and v < 0.0):
            raise ModelError(
                f"{describe_path(path)} has rope.scaling.{key}={v}, which llama.cpp does not read for "
                f"architecture {arch!r} (it uses {used}); vkxsplit refuses it rather than guess",
                hint="remove the key if the model does not need it (gguf-py's gguf_set_metadata / a re-convert), "
                     "or use llama.cpp",
            )
    if head_dim_v != head_dim:
        raise ModelError(
            f"{describe_path(path)} has V heads of {head_dim_v} (attention.value_length) and K heads of "
            f"{head_dim} (attention.key_length); vkxsplit's attention needs them equal",
            hint="use a model whose K and V heads have one size, or llama.cpp",
        )
    return HParams(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_ctx_train=n_ctx,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
        rope_freq_base=_get_float(md, p + "rope.freq_base", 10000.0),
        rope_freq_scale=freq_scale,
        rope_scaling_type=scaling_type,
        rope_type=SUPPORTED_ARCHS[arch],
        rms_norm_eps=_get_float(md, p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_n_ctx_orig=n_ctx_orig or n_ctx,
        rope_ext_factor=ext_factor,
        rope_attn_factor=float(yarn_attn),
        **_arch_hparams(path, md, arch, n_embd, n_head, n_layer, head_dim),
        moe=_moe_hparams(path, md, arch, tensors, n_ff),
    )


def _moe_hparams(path: Path, md: Metadata, arch: str, tensors: dict[str, TensorInfo], n_ff: int) -> Any:
    """The MoE FFN's hyperparameters (vkxsplit/moe.py) of a qwen3moe / Mixtral-style file, else None."""
    from ..moe import is_moe, read_moe_params  # (lazily: the graph layer is not needed to read a file)

    if not is_moe(arch, tensors):
        return None

    return read_moe_params(describe_path(path), arch, md.get, n_ff)


def _arch_hparams(path: Path, md: Metadata, arch: str, n_embd: int, n_head: int, n_layer: int,
                  head_dim: int) -> dict[str, Any]:
    """The per-architecture hyperparameters, as llama.cpp's ``load_hparams`` sets them."""
    p = arch + "."
    out: dict[str, Any] = {"arch": arch}
    n_swa = _get_int(path, md, p + "attention.sliding_window", 0)
    if n_swa < 0:
        raise ModelError(f"{describe_path(path)} has attention.sliding_window={n_swa}",
                         hint="the file's metadata is corrupt; re-convert it with llama.cpp")
    cap = _get_float(md, p + "final_logit_softcapping", 0.0)
    if not (math.isfinite(cap) and cap >= 0.0):
        raise ModelError(f"{describe_path(path)} has final_logit_softcapping={cap}",
                         hint="the file's metadata is corrupt; re-convert it with llama.cpp")
    if arch == "gemma3":
        # llama.cpp: with a sliding window, SWA_TYPE_STANDARD, pattern
        # attention.sliding_window_pattern (default 6: layers 5, 11, ... global), SWA layers
        # with RoPE base rope.freq_base_swa (default 10000) and scale 1; without one, no SWA
        # layers. Q scaled by 1/sqrt(head_dim) (27B, 62 layers: 1/sqrt(n_embd / n_head), an
        # integer division there); embeddings by sqrt(n_embd)
        pattern, base_swa = 6, 10000.0
        if n_swa > 0:
            if md.is_array(p + "attention.sliding_window_pattern"):
                raise ModelError(
                    f"{describe_path(path)} has a per-layer attention.sliding_window_pattern array; vkxsplit (as "
                    "llama.cpp for gemma3) reads only a period (every n-th layer global)",
                    hint="run the model with llama.cpp, or re-convert it with a period")
            pattern = _get_int(path, md, p + "attention.sliding_window_pattern", 6)
            base_swa = _get_float(md, p + "rope.freq_base_swa", 10000.0)
            if pattern < 0 or not (math.isfinite(base_swa) and base_swa > 0.0):
                raise ModelError(f"{describe_path(path)} has attention.sliding_window_pattern={pattern}, "
                                 f"rope.freq_base_swa={base_swa}",
                                 hint="the file's metadata is corrupt; re-convert it with llama.cpp")
            # llama.cpp's gemma3 graph for files with a window (llm_build_gemma3<iswa = true>)
            # has no final-logit soft cap; HF's Gemma 3 applies a configured one: which one the
            # file means cannot be told, so it is refused rather than guessed
            if cap:
                raise ModelError(
                    f"{describe_path(path)} is a gemma3 model with a sliding window ({n_swa}) and "
                    f"final_logit_softcapping={cap}: llama.cpp's gemma3 graph ignores the cap for such files, "
                    "HF applies it; vkxsplit does not guess which",
                    hint="remove the key (gguf-py's gguf_set_metadata / a re-convert) to run it as llama.cpp does")
        out.update(n_swa=n_swa, swa_pattern=pattern if n_swa > 0 else 0, rope_freq_base_swa=base_swa,
                   rope_freq_scale_swa=1.0, embd_scale=math.sqrt(n_embd),
                   attn_scale=1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_dim))
    # phi3: llama.cpp reads attention.sliding_window and turns SWA off (its PR 13676: the
    # converters do not give the layer pattern), so the window is not applied here either
    if cap and arch != "gemma3":
        raise ModelError(f"{describe_path(path)} asks for final_logit_softcapping={cap}, which vkxsplit applies "
                         "to gemma3 only", hint="run the model with llama.cpp")
    # gemma3 without a window (llm_build_gemma3<iswa = false>): the file's cap
    out["final_logit_softcap"] = cap
    if _get_float(md, p + "attn_logit_softcapping", 0.0):
        raise ModelError(f"{describe_path(path)} asks for attn_logit_softcapping, which vkxsplit's attention "
                         "does not apply", hint="run the model with llama.cpp")
    return out
