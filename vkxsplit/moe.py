"""The mixture-of-experts FFN of a model: its hyper-parameters read from the GGUF file and
checked against the tensors, and :func:`build_moe_ffn`, which adds it to a forward graph.

Files: ``qwen3moe`` (qwen3 attention + this FFN in every layer) and Mixtral-style ``llama``
(a ``llama`` file with ``blk.N.ffn_gate_inp.weight``). Per layer the FFN reads
``ffn_gate_inp.weight`` (the router, ggml shape (n_embd, n_expert)), and the 3-D
``ffn_{gate,up}_exps.weight`` (n_embd, n_ff_exp, n_expert) and ``ffn_down_exps.weight``
(n_ff_exp, n_embd, n_expert), stored byte for byte in any hub weight type. As llama.cpp's
``build_moe_ffn`` (qwen3moe and llama builders)::

    probs = softmax(h @ router^T)                    (sigmoid if expert_gating_func = 2)
    ids   = top n_used experts of probs              (ties: lower expert index first)
    w     = probs[ids] / max(sum, 6.103515625e-5)    (when normalised) * expert_weights_scale
    y     = sum_s w[s] * down[ids[s]] @ (silu(gate[ids[s]] @ h) * (up[ids[s]] @ h))

Keys: ``{arch}.expert_count`` (1..512), ``expert_used_count`` (1..expert_count),
``expert_feed_forward_length`` (qwen3moe; else llama.cpp's fallbacks: ``feed_forward_length``
for llama, ``feed_forward_length / expert_used_count`` for qwen3moe), ``expert_weights_norm``
(absent: normalised, the value both builders pass), ``expert_gating_func`` (absent or 1:
softmax, 2: sigmoid, anything else refused), ``expert_weights_scale`` (absent, 0 or 1: no
scaling), ``expert_shared_count`` (refused unless absent or 0: no shared experts here).

Imports: errors, graph, ops.moe (and gguf's constants); nothing above the model layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import KernelError, ModelError
from .graph import Graph, Tensor
from .ops.moe import GATING_BY_ID, MAX_EXPERTS, group_words, use_grouped
from .ops.quant import weight_type

#: the architectures whose every layer's FFN is a MoE (``llama`` files are MoE when they hold
#: ``blk.0.ffn_gate_inp.weight``: Mixtral)
MOE_ARCHS = ("qwen3moe",)
#: the per-layer tensors of the MoE FFN (``blk.N.<name>.weight``)
MOE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_HINT = "the file's metadata and tensors disagree; re-convert it with llama.cpp"


@dataclass(frozen=True)
class MoeParams:
    n_expert: int
    n_used: int
    n_ff_exp: int
    norm_w: bool = True
    scale: float = 1.0
    gating: str = "softmax"


def is_moe(arch: str, tensor_names: Any) -> bool:
    """Whether a file of ``arch`` holding ``tensor_names`` has a MoE FFN."""
    return arch in MOE_ARCHS or (arch in ("llama", "mistral") and "blk.0.ffn_gate_inp.weight" in tensor_names)


def read_moe_params(where: str, arch: str, get: Callable[[str], Any], n_ff: int | None) -> MoeParams:
    """The MoE hyper-parameters of a file of ``arch`` (``get(key)``: the metadata value or None;
    ``n_ff``: its ``feed_forward_length``, None when absent), checked; ModelError naming the key
    otherwise. ``where``: the file, for messages."""
    p = f"{arch}."

    def num(key: str, default: Any = None) -> Any:
        v = get(p + key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            raise ModelError(f"{where}: {p}{key} = {v!r} is not a finite number", hint=_HINT)
        return v

    n_expert = num("expert_count")
    n_used = num("expert_used_count")
    if n_expert is None or n_used is None:
        raise ModelError(f"{where} has MoE tensors but no {p}expert_count / {p}expert_used_count",
                         hint=_HINT)
    if n_expert != int(n_expert) or not 1 <= n_expert <= MAX_EXPERTS:
        raise ModelError(f"{where}: {p}expert_count = {n_expert}; vkxsplit runs 1..{MAX_EXPERTS} experts",
                         hint="run the model with llama.cpp")
    if n_used != int(n_used) or not 1 <= n_used <= n_expert:
        raise ModelError(f"{where}: {p}expert_used_count = {n_used} must be in 1..expert_count ({n_expert})",
                         hint=_HINT)
    n_expert, n_used = int(n_expert), int(n_used)
    shared = num("expert_shared_count", 0)
    if shared:
        raise ModelError(f"{where}: {p}expert_shared_count = {shared}; vkxsplit's MoE FFN has no shared experts",
                         hint="run the model with llama.cpp")
    n_ff_exp = num("expert_feed_forward_length")
    if n_ff_exp is None:
        # llama.cpp's fallbacks: llama sizes its experts by feed_forward_length, qwen3moe by
        # feed_forward_length / expert_used_count
        if n_ff is None:
            raise ModelError(f"{where} has neither {p}expert_feed_forward_length nor {p}feed_forward_length",
                             hint=_HINT)
        n_ff_exp = n_ff if arch in ("llama", "mistral") else n_ff // n_used
    if n_ff_exp != int(n_ff_exp) or n_ff_exp < 1:
        raise ModelError(f"{where}: expert FFN length {n_ff_exp} is not a positive integer", hint=_HINT)
    norm = get(p + "expert_weights_norm")
    if norm is not None and not isinstance(norm, (bool, int)):
        raise ModelError(f"{where}: {p}expert_weights_norm = {norm!r} is not a boolean", hint=_HINT)
    gating_id = num("expert_gating_func", 1)
    if gating_id not in GATING_BY_ID:
        raise ModelError(f"{where}: {p}expert_gating_func = {gating_id}; the router runs 1 (softmax) and "
                         "2 (sigmoid)", hint="run the model with llama.cpp")
    scale = float(num("expert_weights_scale", 0.0))
    if not math.isfinite(scale):
        raise ModelError(f"{where}: {p}expert_weights_scale = {scale} is not finite", hint=_HINT)
    return MoeParams(n_expert, n_used, int(n_ff_exp), norm_w=True if norm is None else bool(norm),
                     scale=1.0 if scale == 0.0 else scale, gating=GATING_BY_ID[int(gating_id)])


def expected_moe_shapes(mp: MoeParams, n_embd: int) -> dict[str, tuple[int, ...]]:
    """ggml-order shapes (ne) of one layer's MoE tensors, by name without ``blk.N.``."""
    E, F = mp.n_expert, mp.n_ff_exp
    return {"ffn_gate_inp.weight": (n_embd, E), "ffn_gate_exps.weight": (n_embd, F, E),
            "ffn_up_exps.weight": (n_embd, F, E), "ffn_down_exps.weight": (F, n_embd, E)}


def check_moe_tensors(where: str, mp: MoeParams, n_embd: int, n_layer: int,
                      tensors: Mapping[str, tuple[tuple[int, ...], Any]]) -> list[str]:
    """Every layer's MoE tensors present with the shapes ``mp`` implies and a type the hub
    reads (``tensors``: name -> (ne, ggml type)); ModelError naming the first that is not.
    Returns the names checked (the loader's set of used tensors)."""
    names: list[str] = []
    for il in range(n_layer):
        for name, want in expected_moe_shapes(mp, n_embd).items():
            full = f"blk.{il}.{name}"
            t = tensors.get(full)
            if t is None:
                raise ModelError(f"{where} lacks {full} (expert_count {mp.n_expert}, expert FFN {mp.n_ff_exp})",
                                 hint=_HINT)
            ne, gtype = t
            got = tuple(ne[:len(want)]) + tuple(d for d in ne[len(want):] if d != 1)
            if got != want:
                what = "expert counts" if name != "ffn_gate_inp.weight" or got[:1] == want[:1] else "shapes"
                raise ModelError(f"{where}: {full} has shape (ne) {list(got)} but the {what} of the metadata "
                                 f"(expert_count {mp.n_expert}, expert_used_count {mp.n_used}, expert FFN "
                                 f"{mp.n_ff_exp}, n_embd {n_embd}) need {list(want)}", hint=_HINT)
            try:
                weight_type(gtype)
            except KernelError as exc:
                raise ModelError(f"{where}: {full}: {exc.args[0]}",
                                 hint="re-quantize the model to a type vkxsplit reads") from None
            names.append(full)
    return names


def moe_act_cols(mp: MoeParams, n_embd: int, T_max: int) -> dict[str, int]:
    """The activation buffers :func:`build_moe_ffn` asks ``act`` for, in f32 columns per token
    for steps of up to ``T_max`` tokens (the model allocates ``T_max * cols`` f32 each)."""
    E, U, F = mp.n_expert, mp.n_used, mp.n_ff_exp
    # the grouping's words grow with T; any T <= T_max fits words(T_max) + T_max words
    grp = -(-(group_words(T_max, U, E) + T_max) // T_max)
    return {"moe_logits": E, "moe_ids": U, "moe_w": U, "moe_groups": grp, "moe_gate": U * F, "moe_up": U * F,
            "moe_out": U * n_embd}


def _as(t: Tensor, shape: tuple[int, ...], dtype: str = "f32") -> Tensor:
    """``t``'s memory seen with another shape / 32-bit type."""
    return Tensor(t.name, shape, dtype, t.buffer)


def build_moe_ffn(g: Graph, prefix: str, W: Mapping[str, Tensor], h: Tensor, out: Tensor, hp: MoeParams,
                  act: Callable[[str, int], Tensor], mul_mat: Callable[[str, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """Add layer ``prefix``'s (``blk.N.``) MoE FFN of ``h`` (T, n_embd) to ``g``, writing ``out``
    (T, n_embd): router ``mul_mat`` (the model's, e.g. with its q8_1 decode) -> ``moe_topk`` ->
    (``moe_group`` for the grouped path, :func:`vkxsplit.ops.moe.use_grouped`: the pairs
    grouped by expert once for the three products) ->
    gate / up ``mul_mat_id`` -> ``swiglu`` over T * n_used rows -> down ``mul_mat_id`` ->
    ``moe_combine``. ``act(name, cols)``: a (T, cols) f32 activation tensor (names and
    sizes: :func:`moe_act_cols`). Returns ``out``."""
    T, n_embd = h.shape
    E, U, F = hp.n_expert, hp.n_used, hp.n_ff_exp
    logits = mul_mat(prefix + "ffn_gate_inp", W[prefix + "ffn_gate_inp.weight"], h, act("moe_logits", E))
    ids = _as(act("moe_ids", U), (T, U), "i32")
    weights = act("moe_w", U)
    g.add("moe_topk", prefix + "ffn_moe_topk", [logits], ids, weights=weights, n_expert=E, n_used=U,
          gating=hp.gating, norm=hp.norm_w, scale=hp.scale)
    grp: list[Tensor] = []
    if use_grouped(T, U, E):
        gt = act("moe_groups", -(-group_words(T, U, E) // T))
        grp = [g.add("moe_group", prefix + "ffn_moe_group", [ids], _as(gt, (group_words(T, U, E),), "u32"),
                     n_expert=E)]
    x3 = _as(h, (T, 1, n_embd))
    gate = _as(act("moe_gate", U * F), (T, U, F))
    up = _as(act("moe_up", U * F), (T, U, F))

    def wexp(name: str) -> Tensor:
        w = W[prefix + name + ".weight"]
        if len(w.shape) != 3:  # a weight tensor given 2-D (rows of all experts): the expert view
            raise ModelError(f"{w.name}: expected a 3-D expert tensor, got shape {list(w.shape)}")
        return w

    g.add("mul_mat_id", prefix + "ffn_gate_exps", [wexp("ffn_gate_exps"), x3, ids, *grp], gate)
    g.add("mul_mat_id", prefix + "ffn_up_exps", [wexp("ffn_up_exps"), x3, ids, *grp], up)
    g.add("swiglu", prefix + "ffn_moe_swiglu", [gate, up], gate)
    eo = _as(act("moe_out", U * n_embd), (T, U, n_embd))
    g.add("mul_mat_id", prefix + "ffn_down_exps", [wexp("ffn_down_exps"), gate, ids, *grp], eo)
    return g.add("moe_combine", prefix + "ffn_moe_combine", [eo, weights], out)


def moe_ffn_block(b: Any, p: str, h: Tensor, out: Tensor) -> Tensor:
    """The MoE FFN as an :data:`vkxsplit.archs.FfnBlock` (``b``: the graph builder). Not summed
    over tensor-split shards: every shard holds all the experts and computes the whole FFN."""
    return build_moe_ffn(b.g, p, b.W, h, out, b.hp.moe, b.act, b.mul_mat)


__all__ = ["MOE_ARCHS", "MOE_TENSORS", "MoeParams", "build_moe_ffn", "moe_ffn_block", "check_moe_tensors", "expected_moe_shapes",
           "is_moe", "moe_act_cols", "read_moe_params"]
