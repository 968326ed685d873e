"""The hub's fusion passes (vkxsplit.fusion) on the plain graphs the model code builds.

- The graphs after the passes are node for node those the model builder emitted when it fused
  by hand (tests/data/fused_graphs.json: op, name, inputs, output, params of every node, dumped
  from that builder before the passes replaced it: llama, qwen3, gemma3, phi3 and a qwen3moe
  MoE at T = 1 and 8, fused and with ``VKXSPLIT_DISABLE=fusion``; both shards of a tensor split
  and the three stages of a layer split, fused).
- Per pass: its kill switch leaves exactly that pass's nodes unfused, and the fused graph's
  logits are the unfused graph's within a stated bound (hub only, tiny models).

One deliberate change since that record: the MoE decode graph (``qwen3moe:T1``) has its routed
expert products read the q8_1 x their producers write (the q8_1 pass over ``mul_mat_id``:
params ``xq``/``vecq`` on the three products, ``xq``/``q8`` on the FFN norm and the MoE SwiGLU),
where the hand-fusing builder left each product to quantize its own x inside its recorder;
:func:`test_moe_decode_entry_differs_only_by_the_q8_x` checks that this is the entry's only
difference from the graph the pass makes without it.

``VKXSPLIT_WRITE_FUSION_FIXTURE=1`` rewrites the fixture from the current builder instead of
comparing (only for a deliberate change of the graphs; review the diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vkxsplit import fusion

FIXTURE = Path(__file__).parent / "data" / "fused_graphs.json"
WRITE = os.environ.get("VKXSPLIT_WRITE_FUSION_FIXTURE") == "1"

#: param values that are kernel choices of the device (the mat-vec variant, the KV splits of
#: decode attention), not graph structure: the dump records that they are there, not their value
_CHOICE_PARAMS = frozenset({"vecq", "n_splits"})


def _tensor(t: Any) -> str:
    return f"{t.name}:{t.dtype}:{'x'.join(map(str, t.shape))}"


def _value(k: str, v: Any) -> Any:
    from vkxsplit.graph import Tensor

    if isinstance(v, Tensor):
        return "T:" + _tensor(v)
    if k in _CHOICE_PARAMS:
        return "*"
    if isinstance(v, dict):
        return {kk: _value(kk, vv) for kk, vv in sorted(v.items())}
    if isinstance(v, (list, tuple)):
        return [_value(k, x) for x in v]
    return v


def dump(g: Any) -> list[list[Any]]:
    """A graph's nodes as JSON-able lists: op, name, inputs, output, params (sorted; tensors by
    name, type and shape; kernel-choice values as ``*``)."""
    return [[n.op, n.name, [_tensor(t) for t in n.inputs], _tensor(n.output),
             {k: _value(k, v) for k, v in sorted(n.params.items())}] for n in g.nodes]


def _files(tmp: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The tiny models of the fixture: name -> (path, load_model options)."""
    from test_archs import write_arch
    from test_moe_model import write_moe_gguf

    from vkxsplit.synth import write_synthetic

    return {
        # llama (head_dim 64: attention writes the q8_1 x of attn_output) with Llama 3's rope_freqs
        "llama": (write_synthetic(tmp / "llama.gguf", "tiny", "q8_0", seed=7, n_layer=3, rope_freqs=True), {}),
        "qwen3": (write_arch(tmp / "qwen3.gguf", "qwen3", wtype=Q.Q8_0, seed=1), {}),
        "gemma3": (write_arch(tmp / "gemma3.gguf", "gemma3", n_layer=3, sliding_window=4, wtype=Q.Q8_0, seed=2), {}),
        # head_dim 16: attention cannot write q8_1 (a quantize node), LongRoPE factors
        "phi3": (write_arch(tmp / "phi3.gguf", "phi3", head_dim=16, wtype=Q.Q8_0, seed=5), {}),
        "qwen3moe": (write_moe_gguf(tmp / "moe.gguf", "qwen3moe", Q.Q8_0), {}),
    }


#: (T, all_logits) of each dumped graph
STEPS = ((1, False), (8, False), (8, True))


def _dump_models(device: Any, tmp: Path) -> dict[str, Any]:
    from vkxsplit.model import load_model

    out: dict[str, Any] = {}
    tmp.mkdir(exist_ok=True)
    for name, (path, kw) in _files(tmp).items():
        with load_model(path, device=device, n_ctx=32, ubatch=8, **kw) as m:
            for T, al in STEPS:
                out[f"{name}:T{T}{':all' if al else ''}"] = dump(m._build_graph(T, al))
    return out


def _dump_tensor_split(tmp: Path) -> dict[str, Any]:
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp / "ts.gguf", "tiny", "q8_0", seed=7, n_layer=2)
    out: dict[str, Any] = {}
    with load_model(path, devices="0,0", split="tensor:1,1", n_ctx=32, ubatch=8) as m:
        for r, shard in enumerate(m.shares):
            for T in (1, 8):
                out[f"tensor_split{r}:T{T}"] = dump(shard.build_graph(T, False))
    return out


def _dump_pipeline(tmp: Path) -> dict[str, Any]:
    """The stages of a layer split over three hubs (the first without the output, the middle one
    with neither embedding nor output, links in and out)."""
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp / "pipe.gguf", "tiny", "q8_0", seed=7, n_layer=3)
    out: dict[str, Any] = {}
    with load_model(path, devices="0,0,0", split="layer:1,1,1", n_ctx=32, ubatch=8) as m:
        for s, stage in enumerate(m.shares):
            for T in (1, 8):
                out[f"pipeline{s}:T{T}"] = dump(stage.build_graph(T, False))
    return out


def _with_disabled(device: Any, monkeypatch: Any, names: set[str]) -> None:
    """Exactly ``names`` switched off (whatever VKXSPLIT_DISABLE the run has: the fixture's
    graphs are those of every other switch on), for ``device`` and the devices models open."""
    monkeypatch.setattr(device, "disabled", frozenset(names))
    monkeypatch.setenv("VKXSPLIT_DISABLE", ",".join(sorted(names)))


def test_passes_give_the_hand_fused_graphs(device, tmp_path, monkeypatch):
    """Every fixture graph, fused (all passes) and with ``VKXSPLIT_DISABLE=fusion``, node for
    node as the hand-fusing builder made it."""
    got: dict[str, Any] = {}
    for off in (set(), {"fusion"}):
        _with_disabled(device, monkeypatch, off)
        got.update({(k + ":unfused" if off else k): v for k, v in _dump_models(device, tmp_path / f"m{len(off)}").items()})
    _with_disabled(device, monkeypatch, set())
    got.update(_dump_tensor_split(tmp_path))
    got.update(_dump_pipeline(tmp_path))
    if WRITE:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(got, indent=None, separators=(",", ":")).replace('],["', '],\n["') + "\n")
        pytest.skip(f"wrote {FIXTURE}")
    want = json.loads(FIXTURE.read_text())
    assert sorted(got) == sorted(want)
    for key in want:
        g = json.loads(json.dumps(got[key]))  # (tuples as lists, as the fixture holds them)
        for i, (a, b) in enumerate(zip(g, want[key], strict=False)):
            assert a == b, (key, i, a, b)
        assert len(g) == len(want[key]), (key, len(g), len(want[key]))
    # the fixture is not trivially satisfied: fused and unfused graphs differ where the passes act
    fused, plain = want["llama:T1"], want["llama:T1:unfused"]
    assert {n[0] for n in fused} - {n[0] for n in plain} == {"add_rms_norm"}
    assert "blk.0.rope_k" in {n[1] for n in plain} - {n[1] for n in fused} and len(fused) < len(plain)


def test_moe_decode_entry_differs_only_by_the_q8_x(device, tmp_path, monkeypatch):
    """The fixture's MoE decode graph against the same graph with the routed products left out
    of the q8_1 pass (ops.moe.vecq_id_decode giving nothing: the graph the hand-fusing builder
    made): node for node the same but for the q8_1 x the pass adds, ``xq``/``vecq`` on each
    ``mul_mat_id``, ``xq``/``q8`` on the FFN norm and the MoE SwiGLU that write it; no node
    added or removed (the products' own quantize dispatches were never graph nodes)."""
    from test_moe_model import write_moe_gguf

    from vkxsplit.model import load_model
    from vkxsplit.ops import moe

    _with_disabled(device, monkeypatch, set())
    if "q8_0" not in moe.vecq_id_decode(device):
        pytest.skip(f"{device.name}: the routed decode of Q8_0 does not take the q8_1 path")
    monkeypatch.setattr(moe, "vecq_id_decode", lambda dev: {})
    with load_model(write_moe_gguf(tmp_path / "moe.gguf", "qwen3moe", Q.Q8_0), device=device, n_ctx=32,
                    ubatch=8) as m:
        plain = json.loads(json.dumps(dump(m._build_graph(1, False))))
    want = json.loads(FIXTURE.read_text())["qwen3moe:T1"]
    assert [n[:4] for n in plain] == [n[:4] for n in want]
    added = {"mul_mat_id": {"xq", "vecq"}, "add_rms_norm": {"xq", "q8"}, "swiglu": {"xq", "q8"}}
    changed = 0
    for a, b in zip(plain, want, strict=True):
        if a[4] != b[4]:
            changed += 1
            extra = set(b[4]) - set(a[4])
            assert extra == added[a[0]] and {k: v for k, v in b[4].items() if k not in extra} == a[4], (a, b)
            assert a[1].rsplit(".", 1)[-1] in ("ffn_norm", "ffn_gate_exps", "ffn_up_exps", "ffn_moe_swiglu",
                                               "ffn_down_exps"), a[1]
    assert changed == 5 * 2  # (both layers of the tiny file)


# -- each pass and its kill switch ---------------------------------------------------------

#: pass switch -> the token counts of the graphs it acts on
PASS_CASES = {"fuse_norm": (1, 8), "fuse_rope": (1, 8), "fuse_q8": (1,)}


def _made_by(switch: str, g: Any) -> int:
    """How many nodes of ``g`` the pass of ``switch`` made."""
    if switch == "fuse_norm":
        return sum(n.op == "add_rms_norm" for n in g.nodes)
    if switch == "fuse_rope":
        return sum(n.op == "kv_store" and n.params.get("rope_k") is not None for n in g.nodes)
    return sum(n.op != "mul_mat" and "xq" in n.params and n.op != "quantize_q8_1" for n in g.nodes)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from vkxsplit.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("fuse") / "llama.gguf", "tiny", "q8_0", seed=7, n_layer=3,
                           rope_freqs=True)


@pytest.mark.parametrize("switch", list(PASS_CASES))
def test_kill_switch_leaves_its_pass_unfused(device, llama_path, monkeypatch, switch):
    """With one pass switched off, that pass's fused nodes are gone (its plain nodes instead)
    and the other passes' are all there; running the pass afterwards on that graph gives the
    fixture's fused graph, node for node (the passes are independent where they act)."""
    from vkxsplit.model import load_model

    want = json.loads(FIXTURE.read_text())
    n_layer = 3
    for T in PASS_CASES[switch]:
        _with_disabled(device, monkeypatch, set())
        with load_model(llama_path, device=device, n_ctx=32, ubatch=8) as m:
            full = m._build_graph(T, False)
            _with_disabled(device, monkeypatch, {switch})
            g = m._build_graph(T, False)
            others = [s for s in PASS_CASES if s != switch and T in PASS_CASES[s]]
            assert _made_by(switch, full) > 0 and _made_by(switch, g) == 0, (switch, T)
            assert all(_made_by(s, g) == _made_by(s, full) > 0 for s in others), (switch, T)
            ops = g.ops()
            if switch == "fuse_norm":  # every residual add (the last one's norm reads a view of x)
                assert ops["add"] == 2 * n_layer and ops["rms_norm"] == 2 * n_layer + 1
                if T == 1:  # (the q8_1 pass made its norms write q8_1: no longer a plain pair)
                    continue
                fusion.fuse_add_rms_norm(g)
            elif switch == "fuse_rope":
                assert ops["rope"] == 2 * n_layer
                fusion.fuse_rope_kv_store(g)
            else:  # the same q8_1 x, each from a quantize node; strip them and run the pass again
                xqs = {id(n.params["xq"]) for n in g.nodes if n.op == "mul_mat" and "xq" in n.params}
                assert ops["quantize_q8_1"] == len(xqs) == _made_by("fuse_q8", full) + full.ops().get("quantize_q8_1", 0)
                g.nodes = [n for n in g.nodes if n.op != "quantize_q8_1"]
                for n in g.nodes:
                    if n.op == "mul_mat":
                        n.params.clear()
                from vkxsplit.ops.choose import kernels_for

                fusion.decode_q8_x(g, kernels_for(device).vecq_decode(), lambda nbytes: m.xq_buf)
            assert json.loads(json.dumps(dump(g))) == want[f"llama:T{T}"], (switch, T)


def test_switch_names():
    """``fusion`` covers every pass; each pass is a name of its own; a wrong one is refused
    naming them."""
    from vkxsplit import features
    from vkxsplit.errors import VkxError

    class Dev:
        disabled = features.parse_disabled(" Fusion ")

    assert all(features.is_disabled(Dev, p) for p in features.PASSES)
    Dev.disabled = features.parse_disabled("fuse_rope,intdot")
    assert [p for p in features.PASSES if features.is_disabled(Dev, p)] == ["fuse_rope"]
    assert not features.is_disabled(Dev, "fusion") and features.is_disabled(Dev, "intdot")
    with pytest.raises(VkxError, match="fuse_nrom") as exc:
        features.parse_disabled("fuse_nrom")
    assert all(p in exc.value.hint for p in features.PASSES)


# -- logits: each fused graph against its unfused graph -------------------------------------

#: the fused kernels do the same f32 arithmetic as the nodes they replace (K roped in registers
#: instead of through memory, the same q8_1 blocks written by x's producer instead of a quantize
#: node): on lavapipe the logits are bit-identical; the bound leaves room for another device's
#: reduction order in a fused kernel (a fraction of the logit scale); the wrong fused nodes below
#: move them by more than 10 times it
LOGIT_BOUND = 1e-4


def _logits(device, path, ids) -> tuple[np.ndarray, np.ndarray]:
    """Prefill logits (steps of 8) and decode logits (every step T = 1) of ``ids``."""
    from vkxsplit.model import load_model

    with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
        pp = m.logits(ids)
        m.reset()
        m.ubatch = 1
        return pp, m.logits(ids)


def _far(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


_RIGHT_ROPE, _RIGHT_NORM = fusion._rope_store, fusion._residual_norm


def _wrong_rope(a, b):
    """The RoPE of K folded into the KV store as no rotation (scale 0): a wrong fused node."""
    f = _RIGHT_ROPE(a, b)
    if f is not None:
        f.params["rope_k"] = {**f.params["rope_k"], "freq_scale": 0.0}
    return f


def _wrong_norm(a, b):
    """add_rms_norm with an epsilon of 1 instead of the norm's: a wrong fused node."""
    f = _RIGHT_NORM(a, b)
    if f is not None:
        f.params["eps"] = 1.0
    return f


@pytest.mark.parametrize("switch", list(PASS_CASES))
def test_fused_logits_match_unfused(device, llama_path, monkeypatch, switch):
    """Prefill and decode logits with all passes against those with ``switch``'s pass off:
    within LOGIT_BOUND of the logit scale, the same top-1; a deliberately wrong fused node of
    that pass fails the same check."""
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 512, 10)]
    _with_disabled(device, monkeypatch, set())
    fused = _logits(device, llama_path, ids)
    _with_disabled(device, monkeypatch, {switch})
    plain = _logits(device, llama_path, ids)
    for f, p in zip(fused, plain, strict=True):
        assert _far(f, p) <= LOGIT_BOUND, (switch, _far(f, p))
        assert (f.argmax(1) == p.argmax(1)).all()
    _with_disabled(device, monkeypatch, set())
    if switch == "fuse_rope":
        monkeypatch.setattr(fusion, "_rope_store", _wrong_rope)
    elif switch == "fuse_norm":
        monkeypatch.setattr(fusion, "_residual_norm", _wrong_norm)
    else:  # a mat-vec reads the q8_1 of the previous x of its width (attn_output: h's, not attn's)
        monkeypatch.setattr(fusion.DecodeQ8, "_stale", lambda self, x: self._cur is None or self._cur[0].cols != x.cols)
    wrong = _logits(device, llama_path, ids)
    k = 0 if switch != "fuse_q8" else 1  # (the q8_1 pass acts on decode only)
    assert _far(wrong[k], plain[k]) > 10 * LOGIT_BOUND, (switch, _far(wrong[k], plain[k]))
