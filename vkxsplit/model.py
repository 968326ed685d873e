"""A llama-family model on the hub: from a GGUF file to logits.

Reading order for one step (``Model._run``):

1. the token ids and positions are written into small host-visible buffers;
2. the step's graph (built once per token count ``T`` by :meth:`Model._build_graph`:
   embedding lookup, then per layer RMSNorm -> Q/K/V -> RoPE -> KV-cache store ->
   attention -> output projection -> residual -> RMSNorm -> SwiGLU FFN -> residual, then the
   final norm and the output projection) was recorded into a command sequence once;
3. that sequence is submitted again (replayed); it reads the positions and KV length from
   the buffers of step 1, so nothing is re-recorded per token;
4. the caller waits for the hub timeline and reads the logits (or, for greedy decoding,
   the argmax computed on the GPU).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelError, VkxError
from .executor import record_graph
from .gguf_model import ModelFile, default_model_path
from .gguf_model import load_model as load_gguf
from .graph import Graph, Tensor
from .tokenizer import Tokenizer
from .vk.command import Sequence
from .vk.device import Device
from .vk.kernel import View

log = logging.getLogger("vkxsplit.model")


def _type_name(t: Any) -> str:
    return t.name.lower()


class Model:
    """A loaded model. Use :func:`vkxsplit.load_model`."""

    def __init__(self, path: str | Path | None = None, device: Device | None = None, n_ctx: int | None = None,
                 ubatch: int = 512, split: Any = None, backends: Any = None, progress: Any = None) -> None:
        if split not in (None, "none") or backends:
            raise VkxError("split modes other than 'none' are not available in this build of the model "
                           "runner", "run without --split/--backends (hub only)")
        self.path = Path(path) if path else default_model_path()
        self.file: ModelFile = load_gguf(self.path)
        self.hp = self.file.hparams
        self.tokenizer = Tokenizer.from_model_file(self.file)
        self._own_device = device is None
        self.device = device or Device.open()
        self.n_ctx = int(n_ctx or min(self.hp.n_ctx_train or 2048, 4096))
        self.ubatch = max(1, min(ubatch, self.n_ctx))
        self.n_past = 0
        self._seqs: OrderedDict[tuple[int, bool], tuple[Sequence, Graph]] = OrderedDict()
        self._bufs: list[Any] = []
        self.stats = {"steps": 0, "submits": 0, "recordings": 0}
        try:
            t0 = time.perf_counter()
            self._upload_weights(progress)
            self._alloc_state()
            self.load_seconds = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    # -- memory -------------------------------------------------------------------------

    def _alloc(self, nbytes: int, pool: str, name: str) -> Any:
        b = self.device.memory.alloc(nbytes, pool, name)
        self._bufs.append(b)
        return b

    def _upload_weights(self, progress: Any) -> None:
        self.weights: dict[str, Tensor] = {}
        items = sorted(self.file.tensors.items())
        total = sum(t.nbytes for _, t in items)
        done = 0
        for name, ti in items:
            buf = self._alloc(ti.nbytes, "device", name)
            buf.write(ti.data)
            self.weights[name] = Tensor(name, ti.shape, _type_name(ti.ggml_type), buf, weight=True)
            done += ti.nbytes
            if progress:
                progress(done, total)
        self.weight_bytes = total

    def _alloc_state(self) -> None:
        hp, T = self.hp, self.ubatch
        f32 = 4
        self.kv: list[tuple[Any, Any]] = []
        kv_row = hp.n_head_kv * hp.head_dim * 2  # f16
        for i in range(hp.n_layer):
            self.kv.append((self._alloc(self.n_ctx * kv_row, "device", f"cache_k.{i}"),
                            self._alloc(self.n_ctx * hp.n_head_kv * hp.head_dim_v * 2, "device", f"cache_v.{i}")))
        # per-step inputs, written by the host before each submit
        self.ids_buf = self._alloc(T * 4, "host", "ids")
        self.pos_buf = self._alloc(T * 4, "host", "positions")
        # activations (shared by every graph: steps run one after another on one queue)
        E, F = hp.n_embd, hp.n_ff
        self.act = {
            "x": self._alloc(T * E * f32, "device", "x"),
            "h": self._alloc(T * E * f32, "device", "h"),
            "q": self._alloc(T * hp.n_embd_q * f32, "device", "q"),
            "k": self._alloc(T * hp.n_embd_k_gqa * f32, "device", "k"),
            "v": self._alloc(T * hp.n_embd_v_gqa * f32, "device", "v"),
            "attn": self._alloc(T * hp.n_head * hp.head_dim_v * f32, "device", "attn"),
            "o": self._alloc(T * E * f32, "device", "o"),
            "gate": self._alloc(T * F * f32, "device", "gate"),
            "up": self._alloc(T * F * f32, "device", "up"),
        }
        from .ops.attention import attention_scratch_bytes, attention_splits

        # decode attention splits the KV length over workgroups (flash-decoding)
        self.decode_splits = attention_splits(1, hp.n_head, hp.n_head_kv, self.n_ctx)
        self.attn_scratch = self._alloc(
            attention_scratch_bytes(1, hp.n_head, hp.head_dim_v, self.decode_splits), "device", "attn_scratch")
        self.logits_buf = self._alloc(T * hp.n_vocab * f32, "host", "logits")
        self.argmax_buf = self._alloc(T * 4, "host", "argmax")

    # -- graph ----------------------------------------------------------------------------

    def _build_graph(self, T: int, all_logits: bool) -> Graph:
        """The forward pass for ``T`` tokens as a graph over this model's buffers."""
        hp, W, A = self.hp, self.weights, self.act
        g = Graph(f"{self.file.name}:T{T}")
        f32 = 4

        def act(name: str, cols: int) -> Tensor:
            return Tensor(name, (T, cols), "f32", View(A[name], 0, T * cols * f32))

        ids = Tensor("ids", (T,), "i32", View(self.ids_buf, 0, T * 4))
        pos = Tensor("positions", (T,), "i32", View(self.pos_buf, 0, T * 4))
        split_kv: dict[str, Any] = {}
        if T == 1:
            split_kv = {"n_splits": self.decode_splits,
                        "scratch": Tensor("attn_scratch", (1,), "f32", self.attn_scratch)}
        x = act("x", hp.n_embd)
        g.add("get_rows", "embd", [W["token_embd.weight"], ids], x)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            h = g.add("rms_norm", p + "attn_norm", [x, W[p + "attn_norm.weight"]], act("h", hp.n_embd),
                      eps=hp.rms_norm_eps)
            q = g.add("mul_mat", p + "attn_q", [W[p + "attn_q.weight"], h], act("q", hp.n_embd_q))
            k = g.add("mul_mat", p + "attn_k", [W[p + "attn_k.weight"], h], act("k", hp.n_embd_k_gqa))
            v = g.add("mul_mat", p + "attn_v", [W[p + "attn_v.weight"], h], act("v", hp.n_embd_v_gqa))
            for t, nm in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")):
                bias = W.get(p + nm + ".bias")
                if bias is not None:
                    g.add("add", p + nm + "_bias", [t, bias], t)
            rope = {"n_dims": hp.n_rot, "freq_base": hp.rope_freq_base, "freq_scale": hp.rope_freq_scale,
                    "mode": hp.rope_type, "head_dim": hp.head_dim}
            g.add("rope", p + "rope_q", [q, pos], q, n_heads=hp.n_head, **rope)
            g.add("rope", p + "rope_k", [k, pos], k, n_heads=hp.n_head_kv, **rope)
            ck, cv = self.kv[il]
            cache_k = Tensor(f"cache_k.{il}", (self.n_ctx, hp.n_embd_k_gqa), "f16", ck)
            cache_v = Tensor(f"cache_v.{il}", (self.n_ctx, hp.n_embd_v_gqa), "f16", cv)
            g.add("kv_store", p + "kv_store", [k, v, pos], cache_k, cache_v=cache_v,
                  n_kv_heads=hp.n_head_kv, head_dim=hp.head_dim)
            a = g.add("attention", p + "attn", [q, cache_k, cache_v, pos], act("attn", hp.n_head * hp.head_dim_v),
                      n_heads=hp.n_head, n_kv_heads=hp.n_head_kv, head_dim=hp.head_dim, n_ctx=self.n_ctx,
                      **split_kv)
            o = g.add("mul_mat", p + "attn_output", [W[p + "attn_output.weight"], a], act("o", hp.n_embd))
            g.add("add", p + "attn_residual", [x, o], x)
            h = g.add("rms_norm", p + "ffn_norm", [x, W[p + "ffn_norm.weight"]], act("h", hp.n_embd),
                      eps=hp.rms_norm_eps)
            gate = g.add("mul_mat", p + "ffn_gate", [W[p + "ffn_gate.weight"], h], act("gate", hp.n_ff))
            up = g.add("mul_mat", p + "ffn_up", [W[p + "ffn_up.weight"], h], act("up", hp.n_ff))
            g.add("swiglu", p + "ffn_swiglu", [gate, up], gate)
            o = g.add("mul_mat", p + "ffn_down", [W[p + "ffn_down.weight"], gate], act("o", hp.n_embd))
            g.add("add", p + "ffn_residual", [x, o], x)
        rows = T if all_logits else 1
        # Only the rows whose logits are wanted go through the final norm and projection.
        xl = Tensor("x_out", (rows, hp.n_embd), "f32", View(A["x"], (T - rows) * hp.n_embd * f32,
                                                                 rows * hp.n_embd * f32))
        hl = Tensor("h_out", (rows, hp.n_embd), "f32", View(A["h"], 0, rows * hp.n_embd * f32))
        g.add("rms_norm", "output_norm", [xl, W["output_norm.weight"]], hl, eps=hp.rms_norm_eps)
        out_w = W["output.weight"] if "output.weight" in W else W["token_embd.weight"]
        logits = Tensor("logits", (rows, hp.n_vocab), "f32", View(self.logits_buf, 0, rows * hp.n_vocab * f32))
        g.add("mul_mat", "output", [out_w, hl], logits)
        g.add("argmax", "argmax", [logits], Tensor("argmax", (rows,), "i32", View(self.argmax_buf, 0, rows * 4)))
        return g

    def _sequence(self, T: int, all_logits: bool) -> Sequence:
        key = (T, all_logits)
        hit = self._seqs.get(key)
        if hit is not None:
            self._seqs.move_to_end(key)
            return hit[0]
        g = self._build_graph(T, all_logits)
        seq = Sequence(self.device, g.name)
        record_graph(seq, g)
        seq.end()
        self.stats["recordings"] += 1
        self._seqs[key] = (seq, g)
        while len(self._seqs) > 8:  # bounded: prompts of many lengths must not pile up sequences
            _, (old, _g) = self._seqs.popitem(last=False)
            old.wait()
            old.close()
        return seq

    # -- steps ------------------------------------------------------------------------------

    def _run(self, ids: list[int], all_logits: bool) -> Sequence:
        """Append ``ids`` (at most ubatch) to the context and run the forward pass."""
        T = len(ids)
        if self.n_past + T > self.n_ctx:
            raise VkxError(f"the context is full: {self.n_past} + {T} tokens > n_ctx {self.n_ctx}",
                           "use a shorter prompt or fewer tokens, or pass a larger n_ctx")
        seq = self._sequence(T, all_logits)
        self.ids_buf.numpy(np.int32, (T,))[:] = ids
        self.pos_buf.numpy(np.int32, (T,))[:] = np.arange(self.n_past, self.n_past + T, dtype=np.int32)
        seq.submit()
        seq.wait()
        self.n_past += T
        self.stats["steps"] += 1
        self.stats["submits"] += 1
        return seq

    def reset(self) -> None:
        self.n_past = 0

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.hp.n_vocab]
        if bad:
            raise VkxError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.n_vocab - 1})")

    # -- public API ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits (len(ids), n_vocab) float32 from an empty context."""
        ids = list(ids)
        self._check_ids(ids)
        if len(ids) > self.n_ctx:
            raise VkxError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        self.reset()
        out = np.empty((len(ids), self.hp.n_vocab), np.float32)
        for s in range(0, len(ids), self.ubatch):
            chunk = ids[s:s + self.ubatch]
            self._run(chunk, all_logits=True)
            out[s:s + len(chunk)] = self.logits_buf.numpy(np.float32, (len(chunk), self.hp.n_vocab))
        return out

    def prefill(self, ids: list[int]) -> None:
        """Run ``ids`` through the model from an empty context (last logits kept)."""
        self._check_ids(ids)
        if not ids:
            raise VkxError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise VkxError(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}",
                           "shorten the prompt or raise n_ctx")
        self.reset()
        for s in range(0, len(ids), self.ubatch):
            self._run(ids[s:s + self.ubatch], all_logits=False)

    def last_logits(self) -> np.ndarray:
        return self.logits_buf.numpy(np.float32, (self.hp.n_vocab,)).copy()

    def last_argmax(self) -> int:
        return int(self.argmax_buf.numpy(np.int32, (1,))[0])

    def generate_ids(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stop_ids: set[int] | None = None) -> Iterator[int]:
        """Yield generated token ids (stops at an end-of-turn token or after max_tokens)."""
        sampler = Sampler(temperature, top_k, top_p, seed)
        stop = self.tokenizer.eot_ids if stop_ids is None else stop_ids
        self.timings = {"prompt_tokens": len(prompt_ids), "gen_tokens": 0}
        t0 = time.perf_counter()
        self.prefill(list(prompt_ids))
        self.timings["prompt_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        for i in range(max_tokens):
            tok = self.last_argmax() if sampler.greedy else sampler.sample(self.last_logits())
            if tok in stop:
                break
            self.timings["gen_tokens"] = i + 1
            yield tok
            if i + 1 == max_tokens or self.n_past + 1 >= self.n_ctx:
                break
            self._run([tok], all_logits=False)
        self.timings["gen_s"] = time.perf_counter() - t1

    def generate(self, prompt: str, max_tokens: int = 128, temperature: float = 0.0, seed: int | None = None,
                 chat: bool = False, top_k: int = 0, top_p: float = 1.0) -> Iterator[str]:
        """Yield text pieces of the continuation of ``prompt`` (a chat turn when ``chat``)."""
        if chat:
            ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        else:
            ids = self.tokenize(prompt)
        dec = self.tokenizer.stream()
        for tok in self.generate_ids(ids, max_tokens, temperature, top_k, top_p, seed):
            piece = dec.push(tok)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    def close(self) -> None:
        for seq, _g in self._seqs.values():
            seq.close()
        self._seqs.clear()
        for b in self._bufs:
            b.close()
        self._bufs.clear()
        if getattr(self, "_own_device", False) and getattr(self, "device", None) is not None:
            self.device.close()
            self.device = None  # type: ignore[assignment]
        if getattr(self, "file", None) is not None:
            self.file.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sampler:
    """Greedy, temperature, top-k and top-p sampling on the host (numpy)."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise VkxError(f"bad sampling parameters: temperature={temperature}, top_k={top_k}, top_p={top_p}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sample(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        idx = np.argsort(-z, kind="stable")
        if self.top_k:
            idx = idx[:self.top_k]
        p = np.exp(z[idx] - z[idx[0]])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            idx, p = idx[:keep], p[:keep] / p[:keep].sum()
        return int(idx[self.rng.choice(len(idx), p=p)])


def load_model(path: str | Path | None = None, split: Any = None, backends: Any = None, **kw: Any) -> Model:
    """Load a GGUF model (default: SmolLM2-135M-Instruct Q4_1) onto the hub."""
    try:
        return Model(path, split=split, backends=backends, **kw)
    except FileNotFoundError as exc:
        raise ModelError(f"model file not found: {path}") from exc
