"""The model runner on the hub vs the independent float64 reference (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference_greedy, reference_logits

from vkxsplit.errors import ModelError, VkxError

# Bound on |logits - reference| for SmolLM2 (Q4_1 weights, f32 activations, f16 KV cache).
# The KV cache rounds K/V to f16 (relative 2^-11); through 30 layers that perturbs logits of
# magnitude ~20 by well under 0.1, so 0.25 leaves room without hiding a wrong kernel (a
# wrong rope pairing or a skipped element moves logits by whole units).
MAX_ABS_ERR = 0.25


@pytest.fixture(scope="module")
def smol(device):
    from conftest import smol_path

    from vkxsplit.model import load_model

    m = load_model(smol_path(), device=device, n_ctx=256, ubatch=32)
    yield m
    m.close()


def test_logits_match_reference(smol):
    text = "The capital of France is Paris. The capital of Italy is"
    ids = smol.tokenize(text)
    got = smol.logits(ids)
    want = reference_logits(smol.file, ids)
    assert got.shape == (len(ids), smol.hp.n_vocab) and got.dtype == np.float32
    assert np.isfinite(got).all()
    assert (got.argmax(1) == want.argmax(1)).all(), "top-1 disagrees with the reference"
    err = np.abs(got - want).max()
    assert err < MAX_ABS_ERR, f"max |logits - reference| = {err}"


def test_chunked_prefill_equals_one_chunk(smol):
    ids = smol.tokenize("One two three four five six seven eight nine ten eleven twelve thirteen fourteen")
    assert len(ids) > 10
    whole = smol.logits(ids)
    ub = smol.ubatch
    try:
        smol.ubatch = 5  # several chunks, and the last one short
        parts = smol.logits(ids)
    finally:
        smol.ubatch = ub
    # Chunks of 5 take the mat-vec path and one chunk of 14 the tiled one: the sums run in
    # another order (f32), which moves logits by ~1e-3 after 30 layers, far below the
    # reference bound; a chunking bug (wrong positions, KV rows) moves them by whole units.
    assert np.abs(whole - parts).max() < 0.02
    assert (whole.argmax(1) == parts.argmax(1)).all()


def test_greedy_generation_matches_reference_and_is_deterministic(smol):
    ids = smol.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    want = reference_greedy(smol.file, ids, 12, stop_ids=tuple(smol.tokenizer.eot_ids))
    got1 = list(smol.generate_ids(ids, 12))
    got2 = list(smol.generate_ids(ids, 12))
    assert got1 == got2, "greedy generation must be deterministic"
    # the reference includes the end-of-turn token it stopped at; generate_ids does not yield it
    if want and want[-1] in smol.tokenizer.eot_ids:
        want = want[:-1]
    assert got1 == want
    assert "Paris" in smol.detokenize(got1)


def test_sampling_is_seeded(smol):
    ids = smol.tokenize("Once upon a time")
    a = list(smol.generate_ids(ids, 8, temperature=0.9, top_k=40, top_p=0.95, seed=7))
    b = list(smol.generate_ids(ids, 8, temperature=0.9, top_k=40, top_p=0.95, seed=7))
    assert a == b and len(a) > 0


def test_bad_inputs(smol, tmp_path):
    from vkxsplit.model import load_model

    with pytest.raises(VkxError, match="context"):
        smol.prefill([1] * 300)
    with pytest.raises(VkxError, match="outside the vocabulary"):
        smol.logits([smol.hp.n_vocab + 5])
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(smol.path.read_bytes()[:100_000])
    with pytest.raises(ModelError):
        load_model(bad)
    with pytest.raises(ModelError):
        load_model(tmp_path / "missing.gguf")


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q6_k"])
def test_synthetic_model_matches_reference(device, tmp_path, qtype):
    """A random-weight llama-shaped model (runs wherever the default model is not installed)."""
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp_path / f"tiny-{qtype}.gguf", "smol135m", qtype, seed=3, n_vocab=2000, n_layer=2)
    ids = list(np.random.default_rng(5).integers(0, 2000, 40))
    with load_model(path, device=device, n_ctx=64, ubatch=16) as m:
        got = m.logits(ids)
    from vkxsplit.gguf_model import load_model as load_gguf

    with load_gguf(path) as mf:
        want = reference_logits(mf, ids)
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    assert err <= 2e-3 * scale + 1e-3, f"max err {err} vs logit scale {scale}"
    # top-1 must agree wherever the reference's margin is clearly above the error bound
    srt = np.sort(want, axis=1)
    clear = (srt[:, -1] - srt[:, -2]) > 4 * (2e-3 * scale + 1e-3)
    assert (got.argmax(1) == want.argmax(1))[clear].all()


@pytest.mark.parametrize("arch,bias,tied", [("llama", False, True), ("qwen2", True, False), ("mistral", False, False)])
def test_architectures_match_reference(device, tmp_path, arch, bias, tied):
    """Qwen2 (q/k/v biases, NeoX RoPE), untied output, mistral naming: vs the float64 reference."""
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import load_model

    path = write_tiny(tmp_path / f"{arch}.gguf", arch=arch, bias=bias, tied=tied, n_vocab=64, scale=0.3)
    ids = list(np.random.default_rng(1).integers(0, 64, 20))
    with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
        assert m.file.architecture == arch
        got = m.logits(ids)
    with load_gguf(path) as mf:
        want = reference_logits(mf, ids)
    scale = np.abs(want).max()
    # f32 weights: the only roundings are f32 arithmetic and the f16 KV cache (2^-11 relative)
    assert np.abs(got - want).max() <= 2e-3 * scale + 1e-4, (np.abs(got - want).max(), scale)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_freqs_match_reference(device, tmp_path, monkeypatch, arch):
    """Llama 3.x's RoPE frequency factors (``rope_freqs.weight``, each pair's angle divided by
    its factor): a tiny f32 model with factors in [1, 8], normal (llama) and NeoX (qwen2)
    ordering, fused (RoPE of K in the KV store) and unfused graphs, prefill (T = 8, 4) and
    decode (T = 1) steps, all against the float64 reference that applies the factors. The same
    file without the tensor (the unscaled RoPE) is far from that reference: the test would fail
    on a forward that ignores the factors."""
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import load_model

    ff = np.random.default_rng(3).uniform(1.0, 8.0, 8).astype(np.float32)  # head_dim 16: 8 pairs
    kw = dict(arch=arch, bias=arch == "qwen2", tied=False, n_vocab=64, scale=0.3)
    path = write_tiny(tmp_path / f"{arch}-ff.gguf", rope_freqs=ff, **kw)
    plain = write_tiny(tmp_path / f"{arch}-plain.gguf", **kw)
    ids = list(np.random.default_rng(1).integers(0, 64, 20))
    with load_gguf(path) as mf:
        assert mf.rope_freqs is not None
        want = reference_logits(mf, ids)
    with load_gguf(plain) as mf:
        unscaled = reference_logits(mf, ids)
    scale = np.abs(want).max()
    bound = 2e-3 * scale + 1e-4
    assert np.abs(unscaled - want).max() > 20 * bound  # the factors matter at this bound
    for fused in (True, False):
        monkeypatch.setattr(device, "disabled", device.disabled - {"fusion"} if fused else device.disabled | {"fusion"})
        with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
            g = m._build_graph(1, False)
            ropes = [n for n in g.nodes if n.op == "rope" or (n.op == "kv_store" and n.params.get("rope_k"))]
            assert len(ropes) == 2 * m.hp.n_layer and all(n.inputs[-1].name == "rope_freqs.weight" for n in ropes)
            pp = m.logits(ids)
            m.reset()
            m.ubatch = 1  # every step a decode step (T = 1)
            dec = m.logits(ids)
        for what, got in (("prefill", pp), ("decode", dec)):
            err = np.abs(got - want).max()
            assert err <= bound, (fused, what, err, scale)


def test_model_without_vocabulary_runs_ids_but_names_the_missing_tokenizer(device, tmp_path):
    from test_gguf_model import write_tiny

    from vkxsplit.model import load_model

    with load_model(write_tiny(tmp_path / "novocab.gguf"), device=device, n_ctx=16, ubatch=4) as m:
        assert m.logits([1, 2, 3]).shape == (3, 100)
        with pytest.raises(ModelError, match="no tokenizer"):
            m.tokenize("hello")


#: SmolLM2 with matrix products on the cpu backend: ggml rounds x to 8 bits per block of 32
#: (q8_0 / q8_1, up to 1/254 of the block's largest value) before each of them, as llama.cpp's
#: CPU path does; over 30 layers that moves logits spanning ~35 by about 1 (0.93-1.08 measured
#: with half or all of the products there), four times the hub's f32-x bound (MAX_ABS_ERR)
CPU_Q8_MAX_ABS_ERR = 1.5


@pytest.mark.parametrize("split", ["tensor:1,1", "layer:1,1", "mode:cpu>=4"])
def test_smollm2_split_with_cpu_matches_reference(device, split):
    """SmolLM2 under the split modes this machine has (hub + cpu backend): the reference's top-1
    at every position, and logits within the bound of ggml's 8-bit rounding of x."""
    from conftest import smol_path

    from vkxsplit.model import load_model

    path = smol_path()
    with load_model(path, device=device, n_ctx=64, ubatch=16, split=split, backends="cpu") as m:
        ids = m.tokenize("The capital of France is Paris. The capital of Italy is")
        got = m.logits(ids)
        want = reference_logits(m.file, ids)
        assert (got.argmax(1) == want.argmax(1)).all()
        assert np.abs(got - want).max() < CPU_Q8_MAX_ABS_ERR
        st = dict(m.stats)
    assert st["host_waits_in_step"] == 0 and st["backend_jobs"] > 0, st


def test_smollm2_whole_step_on_cpu_matches_reference(device):
    """The CPU-hub default (``mode:cpu`` with ``--backends cpu:step=1``): the cpu backend runs the
    whole step (embedding, RoPE, KV store, attention over the f16 cache, products, glue,
    argmax), the hub nothing but the step's first (empty) submit; the executor hands each step
    over as one run. Prefill (two ubatches: the second attends to the first's cache) and decode
    match the reference's top-1 and are within CPU_Q8_MAX_ABS_ERR (ggml's 8-bit x, plus its f16
    q and V sums in attention: within the same bound)."""
    if not device.is_cpu:
        pytest.skip("the state is shared with the cpu backend beside a CPU hub only")
    from conftest import smol_path

    from vkxsplit.model import load_model

    with load_model(smol_path(), device=device, n_ctx=64, ubatch=8, split="mode:cpu", backends="cpu:step=1") as m:
        ids = m.tokenize("The capital of France is Paris. The capital of Italy is")
        want = reference_logits(m.file, ids)
        got = m.logits(ids)
        for T in (8, 1):
            plan = m.plan(T)
            assert plan.by_participant()["hub"] == {"ops": [], "mul_mat": []}, T
            assert plan.schedule.submits == 1
        ex = next(iter(m._execs.values()))
        assert list(ex._chains.values()) == [list(range(len(ex.schedule.jobs)))]  # one run per step
        runs = [c for c in m.backends["cpu"].graphs.values() if hasattr(c, "pieces")]
        assert runs and all(len(c.pieces) == 2 for c in runs)  # one ggml graph, then the argmax
        m.reset()
        m.ubatch = 1
        dec = m.logits(ids)
        st = dict(m.stats)
    for out in (got, dec):
        assert (out.argmax(1) == want.argmax(1)).all()
        assert np.abs(out - want).max() < CPU_Q8_MAX_ABS_ERR
    assert st["host_waits_in_step"] == 0 and st["staged_bytes"] == 0, st


@pytest.mark.parametrize("arch,bias,ff", [("llama", False, False), ("qwen2", True, False), ("llama", False, True)])
def test_architectures_whole_step_on_cpu(device, tmp_path, arch, bias, ff):
    """The whole step on the cpu backend (``cpu:step=1``) for tiny f32 files: llama (RoPE in
    pairs), qwen2 (q/k/v biases, NeoX RoPE), llama 3.x frequency factors; prefill in ubatches of
    8 and decode against the float64 reference. f32 weights: ggml keeps x in f32, so the
    roundings are the f16 KV cache and flash attention's f16 q and f16 V sums (the hub's bound
    of 2e-3 of the logit scale, doubled)."""
    if not device.is_cpu:
        pytest.skip("the state is shared with the cpu backend beside a CPU hub only")
    from test_gguf_model import write_tiny

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import load_model

    freqs = np.random.default_rng(3).uniform(1, 8, 8).astype(np.float32) if ff else None
    path = write_tiny(tmp_path / f"{arch}.gguf", arch=arch, bias=bias, tied=arch == "llama", n_vocab=64, scale=0.3,
                      rope_freqs=freqs)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 64, 20)]
    with load_gguf(path) as mf:
        want = reference_logits(mf, ids)
    bound = 4e-3 * np.abs(want).max() + 1e-4
    with load_model(path, device=device, n_ctx=32, ubatch=8, split="mode:cpu", backends="cpu:step=1") as m:
        assert m.plan(8).schedule.submits == 1 and not m.plan(8).by_participant()["hub"]["ops"]
        pp = m.logits(ids)
        m.reset()
        m.ubatch = 1
        dec = m.logits(ids)
    for what, got in (("prefill", pp), ("decode", dec)):
        assert np.abs(got - want).max() <= bound, (what, np.abs(got - want).max(), bound)


def test_fusion_kill_switch_gives_the_same_logits(device, tmp_path, monkeypatch):
    """VKXSPLIT_DISABLE=fusion builds the unfused graph (more nodes) with the same results."""
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp_path / "fuse.gguf", "smol135m", "q8_0", seed=4, n_vocab=500, n_layer=3)
    ids = list(np.random.default_rng(2).integers(0, 500, 12))
    out, nodes = {}, {}
    for off in ("", "1"):
        monkeypatch.setattr(device, "disabled", device.disabled | {"fusion"} if off else device.disabled - {"fusion"})
        with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
            out[off] = m.logits(ids)
            g = m._build_graph(1, False)
            nodes[off] = g.ops()
    assert nodes[""].get("add_rms_norm") == 2 * 3 - 1 and "add_rms_norm" not in nodes["1"]
    assert nodes["1"]["rope"] == 2 * nodes[""]["rope"]
    scale = np.abs(out["1"]).max()
    assert np.abs(out[""] - out["1"]).max() <= 1e-3 * scale  # the same math, other f32 roundings



def _q8_1_round(x):
    """x rounded as the q8_1 blocks of ggml's MMVQ: per 32 elements d = max|x| / 127 (in f32),
    x / d rounded half away from zero (written here from the format, not taken from vkxsplit)."""
    xb = np.asarray(x, np.float64).reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(axis=-1, keepdims=True).astype(np.float32) * np.float32(1 / 127)).astype(np.float64)
    q = np.sign(xb) * np.floor(np.abs(xb) / np.where(d > 0, d, 1) + 0.5)
    return (np.where(d > 0, q, 0) * d).reshape(x.shape)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_decode_integer_dot_products(device, tmp_path, monkeypatch, qtype):
    """Decode (T = 1) reads Q4_0 / Q4_1 / Q8_0 weights (and Q4_K / Q6_K where the device's vecq
    table has them: a 256-wide model) with x quantized to q8_1 once per x (shared by
    q/k/v and by gate/up; by the norm or SwiGLU that makes x, else a quantize node). Checked:
    the graph's quantize points; the wiring, exactly: after a step, ffn_down's output (x from
    the SwiGLU's q8_1) and the logits (the output norm's q8_1) equal float64 products of the dequantized weights
    with q8_1-rounded copies of the f32 x they read; the decoded logits near the float64
    reference; ``intdot`` switched off (VKXSPLIT_DISABLE=intdot): no quantize nodes and the tight
    f32 bound again."""
    from reference import KVCache, reference_forward

    from vkxsplit.gguf_model import load_model as load_gguf
    from vkxsplit.model import load_model
    from vkxsplit.ops.mul_mat import vecq_variant
    from vkxsplit.synth import write_synthetic

    if vecq_variant(device, qtype, 1) is None:
        pytest.skip(f"{device.name} decodes {qtype} with the f32-x mat-vec (no shaderIntegerDotProduct, "
                    "or a type outside its vecq table)")
    L = 2
    shape = "tiny" if qtype in ("q4_k", "q6_k") else "smol135m"  # (K-quants: rows of 256-multiples)
    path = write_synthetic(tmp_path / f"dq-{qtype}.gguf", shape, qtype, seed=6, n_vocab=700, n_layer=L)
    ids = [int(i) for i in np.random.default_rng(8).integers(0, 700, 10)]
    mf = load_gguf(path)
    got, quantized = {}, {}
    on = device.disabled - {"intdot"}
    for off in ("", "1"):
        monkeypatch.setattr(device, "disabled", on | {"intdot"} if off else on)
        with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
            g = m._build_graph(1, False)
            quantized[off] = {n.name for n in g.mul_mats() if "xq" in n.params}
            m.prefill(ids[:6])
            rows = []
            for t in ids[6:]:
                m._run([t], all_logits=False)
                rows.append(m.last_logits())
            got[off] = np.stack(rows)
            if off:
                continue
            assert {n.name for n in g.mul_mats() if n.layer is not None} <= quantized[off]
            q_nodes = [n for n in g.nodes if n.op == "quantize_q8_1"]
            norms = [n for n in g.nodes if "xq" in n.params and n.op != "mul_mat"]
            # one per x: the attention input, the ffn input and the ffn_down input (written by
            # their norm / SwiGLU as q8_1 too), the attention output (by the attention: its
            # KV-split combine, or a quantize dispatch after it), the output norm's; no quantize node
            assert {n.op for n in norms} == {"rms_norm", "add_rms_norm", "swiglu", "attention"} and not q_nodes
            assert len(norms) == 4 * L + ("output" in quantized[off])
            assert len({n.name for n in q_nodes}) == len(q_nodes)
            for mm_node in (n for n in g.mul_mats() if "xq" in n.params):  # the q8_1 of its own x, made before
                src = next(n for n in g.nodes if n.index < mm_node.index and n.op != "mul_mat"
                           and mm_node.params["xq"] in (n.output, n.params.get("xq")))
                assert mm_node.inputs[1] is (src.inputs[0] if src.op == "quantize_q8_1" else src.output)
            hp = m.hp
            gate = m.act["gate"].read()[:4 * hp.n_ff].view(np.float32)[None]
            o = m.act["o"].read()[:4 * hp.n_embd].view(np.float32)
            w_down = mf.tensor(f"blk.{L - 1}.ffn_down.weight").dequantize().astype(np.float64)
            want_o = (_q8_1_round(gate) @ w_down.T)[0]
            assert np.abs(o - want_o).max() <= 1e-5 * np.abs(want_o).max()
            if "output" in quantized[off]:
                h_out = m.act["h"].read()[:4 * hp.n_embd].view(np.float32)[None]
                w_out = mf.tensor("output.weight" if "output.weight" in mf.tensors else "token_embd.weight")
                want_l = (_q8_1_round(h_out) @ w_out.dequantize().astype(np.float64).T)[0]
                assert np.abs(rows[-1] - want_l).max() <= 1e-5 * np.abs(want_l).max()
    assert not quantized["1"]
    cache = KVCache.empty(L)
    reference_forward(mf, ids[:6], cache, last_only=True)
    want = np.concatenate([reference_forward(mf, [t], cache, last_only=True) for t in ids[6:]])
    mf.close()
    scale = np.abs(want).max()
    # f32 x: the f32 bound of the other synthetic tests
    assert np.abs(got["1"] - want).max() <= 2e-3 * scale + 1e-3
    # q8_1 x: each element off by up to half a step, 1/254 of its block's max; through two
    # layers that moves logits by ~1% of their scale (3% allowed; a skipped or misread block
    # moves them by the whole scale). Its reference cannot round like the runtime: the f16 KV
    # cache perturbs x, and rounding to 8 bits turns that into whole steps.
    err = np.abs(got[""] - want).max()
    assert err <= 3e-2 * scale, (err, scale)
    srt = np.sort(want, axis=1)
    clear = (srt[:, -1] - srt[:, -2]) > 2 * err  # top-1 agrees wherever the margin allows
    assert (got[""].argmax(1) == want.argmax(1))[clear].all()
    assert np.abs(got[""] - got["1"]).max() > 1e-4 * scale  # the rounding is visible


def test_decode_q8_placement_rules():
    """DecodeQ8 on hand-made graphs (tensors without memory: each is its own span): one q8_1
    per x shared by its readers; written by the norm / SwiGLU that made x when that is safe,
    else by a quantize node; re-quantized after x is rewritten; never fused into a producer
    that readers of the previous x's q8_1 come after (they share one scratch); other types
    read f32 x."""
    from vkxsplit.graph import Graph, Tensor
    from vkxsplit.model import DecodeQ8

    def t(name, cols=64, dtype="f32", weight=False):
        return Tensor(name, (1, cols) if not weight else (cols, 64), dtype, weight=weight)

    g = Graph("t", T=1)
    q8 = DecodeQ8(g, {"q4_0": "vq4"}, lambda nbytes: None)
    x, h, a, o, w = t("x"), t("h"), t("a"), t("o"), t("norm.w", weight=True)
    wq, wk, w6 = t("wq", dtype="q4_0", weight=True), t("wk", dtype="q4_0", weight=True), t("w6", dtype="q6_k", weight=True)
    g.add("rms_norm", "blk.0.attn_norm", [x, w], h, eps=1e-5)
    norm = g.nodes[-1]
    q8.mul_mat("blk.0.attn_q", wq, h, t("q"))
    q8.mul_mat("blk.0.attn_k", wk, h, t("k"))
    q8.mul_mat("blk.0.attn_v", w6, h, t("v"))  # a type the map names no variant for: f32 x
    mms = g.mul_mats()
    assert norm.params.get("xq") is not None and "quantize_q8_1" not in g.ops()
    assert mms[0].params["xq"] is mms[1].params["xq"] is norm.params["xq"] and "xq" not in mms[2].params
    # a producer that cannot write q8_1 (attention with heads of 40: its q8_1 blocks would
    # straddle heads): a quantize node after it
    g.add("attention", "blk.0.attn", [t("q")], a, head_dim=40)
    q8.mul_mat("blk.0.attn_output", wq, a, o)
    qn = [n for n in g.nodes if n.op == "quantize_q8_1"]
    assert len(qn) == 1 and qn[0].inputs[0] is a and g.mul_mats()[-1].params["xq"] is qn[0].output
    # x rewritten in place after its quantization: quantized again
    g.add("add", "blk.0.a_bias", [a, t("bias", weight=True)], a)
    q8.mul_mat("blk.0.attn_output2", wq, a, t("o2"))
    assert sum(n.op == "quantize_q8_1" for n in g.nodes) == 2
    # the busy rule: a norm makes h2, then a reader of a's q8_1, then h2's first reader
    h2 = t("h2")
    g.add("rms_norm", "blk.1.attn_norm", [x, w], h2, eps=1e-5)
    n2 = g.nodes[-1]
    q8.mul_mat("blk.0.late", wk, a, t("late"))   # still reads a's q8_1, after the norm
    q8.mul_mat("blk.1.attn_q", wq, h2, t("q2"))
    assert "xq" not in n2.params  # fusing would overwrite a's q8_1 before blk.0.late read it
    assert g.nodes[-2].op == "quantize_q8_1" and g.nodes[-2].inputs[0] is h2
    # tall products (gate / up: N x K weights with 8192 <= N <= 4 K) take their own GPU shape;
    # weight tensors are (rows N, cols K)
    from vkxsplit.ops import mul_mat as mm

    gpu = f"mul_mat_vecq_q4_0_q8_1_m1_{mm.vecq_default_config('q4_0', cpu=False).tag}"
    g3 = Graph("t3", T=1)
    q83 = DecodeQ8(g3, {"q4_0": gpu}, lambda nbytes: None)
    hx = Tensor("hx", (1, 4096), "f32")
    q83.mul_mat("up", Tensor("wu", (14336, 4096), "q4_0", weight=True), hx, Tensor("u", (1, 14336), "f32"))
    q83.mul_mat("down", Tensor("wd", (4096, 14336), "q4_0", weight=True), Tensor("u2", (1, 14336), "f32"),
                Tensor("d", (1, 4096), "f32"))
    up, down = g3.mul_mats()
    assert up.params["vecq"] == mm.vecq_for_shape(gpu, "q4_0", 14336, 4096) != gpu and down.params["vecq"] == gpu
    # attention with heads of a multiple of 32 writes the q8_1 of its output itself
    g4 = Graph("t4", T=1)
    q84 = DecodeQ8(g4, {"q4_0": "vq4"}, lambda nbytes: None)
    g4.add("attention", "blk.0.attn", [t("q")], a, head_dim=64)
    q84.mul_mat("blk.0.attn_output", wq, a, o)
    assert "quantize_q8_1" not in g4.ops() and g4.nodes[0].params["xq"] is g4.mul_mats()[0].params["xq"]
    # fuse off (VKXSPLIT_DISABLE=fusion): quantize nodes only
    g2 = Graph("t2", T=1)
    q82 = DecodeQ8(g2, {"q4_0": "vq4"}, lambda nbytes: None, fuse=False)
    g2.add("rms_norm", "n", [x, w], h, eps=1e-5)
    q82.mul_mat("m", wq, h, t("y"))
    assert "xq" not in g2.nodes[0].params and g2.ops().get("quantize_q8_1") == 1
