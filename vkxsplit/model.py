"""A model on the hub (llama, mistral, qwen2, qwen3, gemma3, phi3): from a GGUF file to logits.

Reading order for one step (``Model._run``):

1. the token ids and positions are written into small host-visible buffers;
2. the step's graph (built once per token count ``T`` by :meth:`Model._build_graph`, the
   architecture's forward from :mod:`vkxsplit.archs`: embedding lookup, then per layer RMSNorm
   -> Q/K/V -> RoPE -> KV-cache store -> attention -> output projection -> residual -> RMSNorm
   -> FFN -> residual, then the final norm and the output projection) was recorded into a
   command sequence once;
3. the split planner (:mod:`vkxsplit.plan`) decided once per ``T`` which participant runs
   each op (everything on the hub for split ``none``), and the executor
   (:mod:`vkxsplit.executor`) recorded the hub's share into command sequences once; every step
   replays them and hands the backends their ``mul_mat`` jobs, all submitted up front; the
   sequences read the positions and KV length from the buffers of step 1, so nothing is
   re-recorded per token;
4. the caller waits for the step's last points and reads the logits (or, for greedy
   decoding, the argmax computed on the GPU).

With backends attached (``backends="cpu,npu-emu"``), the weights and the activations live in
one :class:`~vkxsplit.attach.SharedArena`: hub kernels bind them and the backends read and
write them in place. Prompt processing and decode get different plans (``T`` differs) over
the same weights and KV cache; ``mode:cuda>=32`` is "CUDA does prefill, Vulkan does decode".
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .archs import DecodeQ8, build_graph, weight_tensors  # noqa: F401 (DecodeQ8: its old home, re-exported)
from .calibrate import MeasuringCostModel, hub_node_times
from .defaults import N_PREDICT, SAMPLING, chat_default, split_for_machine
from .errors import Closable, ModelError, VkxError
from .executor import Executor, Step
from .gguf_model import ModelFile, default_model_path
from .gguf_model import load_model as load_gguf
from .graph import Graph, Tensor
from .plan.cost import CostModel, simulate
from .plan.planner import Plan, Planner
from .plan.profile import Profile
from .plan.spec import SplitSpec, parse_backends
from .plan.workspace import ArenaWorkspace
from .tokenizer import Tokenizer
from .vk.device import Device
from .vk.kernel import View

log = logging.getLogger("vkxsplit.model")


def _type_name(t: Any) -> str:
    return t.name.lower()


def slot_rows(ubatch: int, slots: int) -> int:
    """Rows per slot: ``ubatch`` rounded up to 64 rows when there are several slots, so every
    slot's offset into an i32 or f32 buffer is a multiple of 256 bytes (the largest
    ``minStorageBufferOffsetAlignment`` the Vulkan spec allows)."""
    return ubatch if slots <= 1 else -(-ubatch // 64) * 64


#: bytes of a weight copied to the hub at a time (the file pages behind each chunk are released)
_UPLOAD_CHUNK = 16 << 20

class LanguageModel(Closable):
    """Tokens and text in, logits and tokens out: the API a user calls, the same for a model on
    one GPU (:class:`Model`) and one split over several GPUs
    (:class:`vkxsplit.pipeline.PipelineModel`). Subclasses set ``hp``, ``n_ctx``, ``ubatch``,
    ``n_past``, ``_tokenizer``/``_tokenizer_error`` and implement ``_run`` (one step of at most
    ``ubatch`` tokens appended to the context) and ``_out`` (the :class:`Model` whose
    ``logits_buf``/``argmax_buf`` the step's outputs land in)."""

    hp: Any
    n_ctx: int
    ubatch: int
    n_past: int
    _tokenizer: Tokenizer | None
    _tokenizer_error: ModelError | None
    # after close() every public method (and a step a generator resumes) raises ClosedError
    _closed_guards = ("_run",)
    _closed_what = "model"

    def _run(self, ids: list[int], all_logits: bool) -> Any:
        raise NotImplementedError

    def _check_step(self, T: int) -> None:
        """A step of ``T`` tokens fits ``ubatch`` and the context (raises with what to do)."""
        if T > self.ubatch:
            raise VkxError(f"a step of {T} tokens is more than ubatch {self.ubatch}")
        if self.n_past + T > self.n_ctx:
            raise VkxError(f"the context is full: {self.n_past} + {T} tokens > n_ctx {self.n_ctx}",
                           "use a shorter prompt or fewer tokens, or a larger context: n_ctx= (load_model), -c (command line)")

    def _load_tokenizer(self, file: ModelFile) -> None:
        """The file's tokenizer, or the reason it has none (logits() still works on token ids;
        text needs a vocabulary)."""
        self._tokenizer, self._tokenizer_error = None, None
        try:
            self._tokenizer = Tokenizer.from_model_file(file)
        except ModelError as exc:
            self._tokenizer_error = exc

    @staticmethod
    def _summed_stats(parts: Iterable[Model]) -> dict[str, int]:
        """Step counters of a model made of several hubs' Models (stages, shards), summed."""
        out: dict[str, int] = {}
        for part in parts:
            for k, v in part.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    def _out(self) -> Model:
        raise NotImplementedError

    def _read_logits(self, T: int) -> np.ndarray:
        """The logits of every row of the last step of ``T`` tokens (all_logits)."""
        return self._out().logits_buf.numpy(np.float32, (T, self.hp.n_vocab))

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.hp.n_vocab]
        if bad:
            raise VkxError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.n_vocab - 1})")

    def reset(self) -> None:
        self.n_past = 0

    def run_step(self, ids: list[int], all_logits: bool = False) -> Any:
        """Append ``ids`` (at most ``ubatch`` tokens) to the context and run one step of the
        forward pass; its logits are then what :meth:`last_logits` / :meth:`last_argmax` read
        (every row's with ``all_logits``). Returns the step (its counters, its trace)."""
        return self._run(list(ids), all_logits)

    # -- public API ---------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer (raises the file's ModelError when it has no vocabulary)."""
        if self._tokenizer is None:
            assert self._tokenizer_error is not None
            raise self._tokenizer_error
        return self._tokenizer

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
            out[s:s + len(chunk)] = self._read_logits(len(chunk))
        return out

    def prefill(self, ids: list[int]) -> None:
        """Run ``ids`` through the model from an empty context (last logits kept)."""
        self._check_ids(ids)
        if not ids:
            raise VkxError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise VkxError(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}",
                           "shorten the prompt or raise the context: n_ctx= (load_model), -c (command line)")
        self.reset()
        for s in range(0, len(ids), self.ubatch):
            self._run(ids[s:s + self.ubatch], all_logits=False)

    def last_logits(self) -> np.ndarray:
        return self._out().logits_buf.numpy(np.float32, (self.hp.n_vocab,)).copy()

    def last_argmax(self) -> int:
        out = self._out()
        views = out.__dict__.get("_io_views")
        tok = int(views[2][0] if views is not None else out.argmax_buf.numpy(np.int32, (1,))[0])
        if tok < 0:  # the GPU argmax saw a NaN or +inf (ops/argmax.py)
            raise _nonfinite_logits(self)
        return tok

    def _prepare_steps(self, n_prompt: int) -> None:
        """Plan and record the steps a generation from an ``n_prompt``-token prompt runs (with
        ``--split auto``, the planner's first-run measurements), so that no reported rate counts them."""
        executor = getattr(self, "_executor", None)
        if executor is None or n_prompt < 1:
            return
        Ts = {min(self.ubatch, n_prompt), 1} | ({n_prompt % self.ubatch} - {0})
        for T in sorted(Ts):
            executor(T, False)

    def generate_ids(self, prompt_ids: list[int], max_tokens: int = N_PREDICT,
                     temperature: float = SAMPLING.temperature, top_k: int = SAMPLING.top_k,
                     top_p: float = SAMPLING.top_p, seed: int | None = None,
                     stop_ids: set[int] | None = None, min_p: float = SAMPLING.min_p,
                     repeat_penalty: float = SAMPLING.repeat_penalty,
                     repeat_last_n: int = SAMPLING.repeat_last_n) -> Iterator[int]:
        """Yield generated token ids: until an end-of-turn token, ``max_tokens`` tokens, or a full
        context (``max_tokens=-1``: no limit but the context). ``timings`` then holds the
        counts, the seconds (planning and first-run measurements apart, in ``setup_s``) and
        ``stop``: ``"eos"``, ``"length"`` or ``"context"``. Defaults: :mod:`vkxsplit.defaults`."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < -1:
            raise VkxError(f"max_tokens must be a whole number >= -1, got {max_tokens!r}",
                           "-1 generates until the end of generation or a full context")
        sampler = Sampler(temperature, top_k, top_p, seed, min_p=min_p, repeat_penalty=repeat_penalty,
                          repeat_last_n=repeat_last_n)
        stop = self.tokenizer.eot_ids if stop_ids is None else stop_ids
        history = list(prompt_ids)
        self.timings = {"prompt_tokens": len(prompt_ids), "gen_tokens": 0, "stop": "length"}
        ts = time.perf_counter()
        if 0 < len(prompt_ids) < self.n_ctx:
            self._prepare_steps(len(prompt_ids))
        self.timings["setup_s"] = time.perf_counter() - ts
        t0 = time.perf_counter()
        self.prefill(list(prompt_ids))
        self.timings["prompt_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        i = 0
        while max_tokens < 0 or i < max_tokens:
            if not sampler.needs_logits:
                tok = self.last_argmax()
            else:
                logits = self.last_logits()
                if not np.isfinite(logits).all() and (np.isnan(logits).any() or np.isposinf(logits).any()):
                    raise _nonfinite_logits(self)
                tok = sampler.sample(logits, history)
            if tok in stop:
                self.timings["stop"] = "eos"
                break
            i += 1
            self.timings["gen_tokens"] = i
            history.append(tok)
            yield tok
            if i == max_tokens:
                break
            if self.n_past + 1 >= self.n_ctx:
                self.timings["stop"] = "context"
                break
            self._run([tok], all_logits=False)
        self.timings["gen_s"] = time.perf_counter() - t1

    def chat_ids(self, prompt: str | list[dict[str, str]], chat: bool | None = None,
                 system: str | None = None) -> list[int]:
        """The prompt's token ids: ``prompt`` (text, or chat messages ``[{"role", "content"}]``)
        through the file's chat template when ``chat`` (default: exactly when the file has a
        template; messages always are), with ``system`` as a first system message."""
        if chat is None:
            chat = not isinstance(prompt, str) or chat_default(self.tokenizer)
        if not chat:
            if not isinstance(prompt, str):
                raise VkxError("chat messages need the chat template: chat=False takes text only")
            return self.tokenize(((system + "\n\n") if system else "") + prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system:
            messages = [{"role": "system", "content": system}] + messages
        return self.tokenizer.encode_chat(messages)

    def generate(self, prompt: str | list[dict[str, str]], max_tokens: int = N_PREDICT,
                 temperature: float = SAMPLING.temperature, seed: int | None = None, chat: bool | None = None,
                 top_k: int = SAMPLING.top_k, top_p: float = SAMPLING.top_p, min_p: float = SAMPLING.min_p,
                 repeat_penalty: float = SAMPLING.repeat_penalty, repeat_last_n: int = SAMPLING.repeat_last_n,
                 system: str | None = None) -> Iterator[str]:
        """Yield text pieces of the continuation of ``prompt`` (text, or chat messages); a chat
        turn when ``chat`` (default: exactly when the file has a chat template). Other defaults:
        :mod:`vkxsplit.defaults`, the same as the command line's."""
        ids = self.chat_ids(prompt, chat, system)
        yield from self.tokenizer.decode_stream(self.generate_ids(
            ids, max_tokens, temperature, top_k, top_p, seed, min_p=min_p, repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n))

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> LanguageModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Model(LanguageModel):
    """A loaded model. Use :func:`vkxsplit.load_model`.

    ``split``: a split spec (:mod:`vkxsplit.plan`: ``none``, ``layer:...``, ``tensor:3,1``,
    ``mode:cpu>=8``, ``auto``); ``backends``: backends to attach, as ``"cpu,npu-emu:min_batch=1"``
    or a list of names / ``(name, options)`` / :class:`~vkxsplit.backend.Backend` objects (those
    stay the caller's). ``trace``: record GPU timestamps every step (``last_trace``).

    A stage of a model split over several GPUs (:class:`vkxsplit.pipeline.PipelineModel`) is a
    Model of ``layers=(first, end)``: it holds only those layers' weights and KV cache; a stage
    that does not start at layer 0 reads its input hidden state from ``link_in``, one that
    does not end at the last layer writes its output hidden state to ``link_out`` (views of
    host pages the two GPUs share, ``slots`` x :func:`slot_rows` rows of ``n_embd`` f32: a step
    of slot ``s`` reads and writes rows ``[s*slot_rows, s*slot_rows + T)`` of them and of the
    ids, positions and logits, so micro-batches in flight on different stages never share
    rows)."""

    def __init__(self, path: str | Path | None = None, device: Device | None = None, n_ctx: int | None = None,
                 ubatch: int = 512, split: Any = None, backends: Any = None, progress: Any = None,
                 trace: bool = False, profile_dir: str | Path | None = None,
                 layers: tuple[int, int] | None = None, link_in: Any = None, link_out: Any = None,
                 slots: int = 1) -> None:
        self.path = Path(path) if path else default_model_path()
        self.file: ModelFile = load_gguf(self.path)
        try:
            self.hp = self._shape_hparams(self.file.hparams)
        except BaseException:
            self.file.close()
            raise
        n_layer = self.hp.n_layer
        self.layers = range(*(layers or (0, n_layer)))
        if not (0 <= self.layers.start < self.layers.stop <= n_layer):
            self.file.close()
            raise VkxError(f"layers {tuple(layers or ())} are not a non-empty range of the model's {n_layer} layers")
        self.first, self.last = self.layers.start == 0, self.layers.stop == n_layer
        if (link_in is None) != self.first or (link_out is None) != self.last:
            self.file.close()
            raise VkxError(f"stage of layers [{self.layers.start}, {self.layers.stop}): a stage that does not start "
                           "at layer 0 needs link_in, one that does not end at the last layer needs link_out "
                           "(and only those)")
        self.link_in, self.link_out = link_in, link_out
        self.slots = max(1, int(slots))
        self._load_tokenizer(self.file)
        self._own_device = device is None
        self.device = device or Device.open()
        self.n_ctx = int(n_ctx or min(self.hp.n_ctx_train or 2048, 4096))
        self.ubatch = max(1, min(ubatch, self.n_ctx))
        self.slot_rows = slot_rows(self.ubatch, self.slots)
        self.n_past = 0
        self._execs: OrderedDict[tuple[int, bool, int], Executor] = OrderedDict()
        self._bufs: list[Any] = []
        self._owned_backends: list[Any] = []
        self.backends: dict[str, Any] = {}
        self.arena: Any = None
        self.workspace: ArenaWorkspace | None = None
        self._cost: CostModel | None = None
        self._profile_dir = profile_dir
        self.tracing = trace
        self.last_step: Step | None = None
        self.last_trace: dict[str, Any] | None = None
        self.stats = {"steps": 0, "submits": 0, "recordings": 0, "backend_jobs": 0, "host_waits_in_step": 0,
                      "staged_bytes": 0}
        try:
            t0 = time.perf_counter()
            self._attach(backends)
            self.planner = Planner(self.backends.values(), workspace=self.workspace)
            self.split: SplitSpec = self.planner.check(split)
            self._upload_weights(progress)
            self._alloc_state()
            self.load_seconds = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    # -- backends and memory ------------------------------------------------------------------

    def _attach(self, backends: Any) -> None:
        from .attach import SharedArena
        from .backend import Backend, create_backend

        for item in parse_backends(backends):
            if isinstance(item, Backend):
                b = item
            else:
                name, opts = item if isinstance(item, tuple) else (item, {})
                b = create_backend(name, self.device, **opts)
                self._owned_backends.append(b)
            if b.name in self.backends:
                raise VkxError(f"backend {b.name} is attached twice")
            self.backends[b.name] = b
        if self.backends:
            self.arena = SharedArena(self.device, list(self.backends.values()), name=f"model:{self.path.name}")
            self.workspace = ArenaWorkspace(self.device, self.arena)

    def _alloc(self, nbytes: int, pool: str, name: str, shared: bool = False) -> Any:
        """A buffer from the hub pool ``pool``, or from the shared arena when ``shared`` and
        backends are attached (a SharedBuffer: hub kernels bind it, backends reach it)."""
        if shared and self.arena is not None:
            sb = self.arena.alloc(nbytes, name)
            if pool == "host" and not sb.buffer.host_visible:  # the caller reads it: keep it readable
                sb.close()
            else:
                return sb
        b = self.device.memory.alloc(nbytes, pool, name)
        self._bufs.append(b)
        return b

    @staticmethod
    def _view(buf: Any, offset: int = 0, size: int | None = None) -> Any:
        from .attach import SharedBuffer

        if isinstance(buf, SharedBuffer):
            return buf.view(offset, size)
        return View(buf, offset, size)

    def _upload_weights(self, progress: Any) -> None:
        self.weights: dict[str, Tensor] = {}
        # (phi3's fused attn_qkv / gate-up ffn_up come as their row ranges: archs.weight_tensors)
        items = sorted(weight_tensors(self.file).items())
        total = sum(t.nbytes for _, t in items)
        done = 0
        from .attach import SharedBuffer

        # Weights go to the shared arena when some backend reads them in place. When every
        # attached backend loads its own copy (a split-mode vulkan peer on another GPU: its
        # arena is host pages), they stay in the hub's device memory, and the backends load
        # their rows from the file's mapping (Tensor.host): the hub never reads its weights
        # over the bus.
        shared = any(not getattr(b, "private_weights", False) for b in self.backends.values())
        items = [(name, ti) for name, ti in items if self._holds(name)]
        total = sum(t.nbytes for _, t in items)
        held = 0
        for name, ti in items:
            shape, data = self._weight_data(name, ti)
            buf = self._alloc(data.nbytes, "device", name, shared=shared)
            dst = buf.buffer if isinstance(buf, SharedBuffer) else buf
            src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            # The hub's copy (or the arena's) is the one kept: copy in chunks and let go of the
            # file pages each chunk touched, or every weight is resident twice (and a large one
            # briefly three times through a staging buffer as large as it). A backend loading
            # its own rows from Tensor.host later faults in only those.
            for o in range(0, src.nbytes, _UPLOAD_CHUNK):
                dst.write(src[o:o + _UPLOAD_CHUNK], o)  # staged when device-only
                self.file.release_pages(src[o:o + _UPLOAD_CHUNK])
            self.file.release_pages(ti.data)  # (a slice copied from it: the file's pages too)
            # (host: where a backend loading its own copy reads the rows from; only with backends,
            # so that a slice copied at load, a tensor-split shard's columns, is not kept)
            self.weights[name] = Tensor(name, shape, _type_name(ti.ggml_type), self._view(buf), weight=True,
                                        host=data if self.backends else None)
            done += ti.nbytes
            held += data.nbytes
            if progress:
                progress(done, total)
        self.weight_bytes = held

    def _shape_hparams(self, hp: Any) -> Any:
        """The dimensions this model computes with: the file's (a tensor-split shard's are
        its share of the heads and of the FFN width)."""
        return hp

    def _weight_data(self, name: str, ti: Any) -> tuple[tuple[int, ...], np.ndarray]:
        """The shape and raw bytes this model holds of weight ``ti`` (all of it; a shard of a
        tensor split over hubs holds a slice: :mod:`vkxsplit.tensor_split`)."""
        return ti.shape, ti.data

    def _reduce(self, g: Graph, name: str, o: Tensor) -> Tensor:
        """Where a layer's output projection (``attn_output``, ``ffn_down``) ends: the identity
        here; a shard of a tensor split sums its partial with the other shards' there."""
        return o

    makes_logits = True  # (a tensor-split shard other than the first leaves the logits to it)

    def _holds(self, name: str) -> bool:
        """Whether this model (a pipeline stage: some of the layers) needs weight ``name``."""
        if name.startswith("blk."):
            return int(name.split(".")[1]) in self.layers
        tied = "output.weight" not in self.file.tensors
        if name == "token_embd.weight":
            return self.first or (self.last and tied)
        if name in ("output_norm.weight", "output.weight"):
            return self.last
        return True

    def _alloc_state(self) -> None:
        hp, T = self.hp, self.ubatch
        f32 = 4
        self.kv: dict[int, tuple[Any, Any]] = {}
        kv_row = hp.n_head_kv * hp.head_dim * 2  # f16
        # the step's state (KV cache, ids, positions, argmax) in shared memory when a backend can
        # run the whole step (backend.STEP_OPS) beside a CPU hub, whose memory is the same RAM
        st = bool(self.device.is_cpu) and any("kv_store" in b.caps.ops for b in self.backends.values())
        for i in self.layers:
            kv = (self._alloc(self.n_ctx * kv_row, "device", f"cache_k.{i}", shared=st),
                  self._alloc(self.n_ctx * hp.n_head_kv * hp.head_dim_v * 2, "device", f"cache_v.{i}", shared=st))
            self.kv[i] = (self._view(kv[0]), self._view(kv[1])) if st else kv  # (graph tensors take views)
        # per-step inputs, written by the host before each submit (one ubatch per slot)
        S = self.slots * self.slot_rows
        self.ids_buf = self._alloc(S * 4, "host", "ids", shared=st)
        self.pos_buf = self._alloc(S * 4, "host", "positions", shared=st)
        # activations (shared by every graph: steps run one after another on one queue); the
        # ones mul_mat reads and writes are in shared memory when backends are attached
        E, F = hp.n_embd, hp.n_ff
        sizes = {"x": E, "h": E, "q": hp.n_embd_q, "k": hp.n_embd_k_gqa, "v": hp.n_embd_v_gqa,
                 "attn": hp.n_head * hp.head_dim_v, "o": E, "gate": F, "up": F}
        if hp.moe is not None:  # the MoE FFN's router, grouping and expert activations (vkxsplit/moe.py)
            from .moe import moe_act_cols

            sizes.update(moe_act_cols(hp.moe, E, T))
        # (not when every backend stages activations, i.e. a vulkan peer on another GPU: then
        # they stay in device memory and the plan copies x/y through arena shadows at each job)
        act_shared = any(not getattr(b, "stages_activations", False) for b in self.backends.values())
        self.act = {k: self._alloc(T * c * f32, "device", k, shared=act_shared) for k, c in sizes.items()}
        from .ops.attention import attention_scratch_bytes, attention_splits, decode_target_workgroups

        # decode attention splits the KV length over workgroups (flash-decoding), as many as
        # fill the device
        self.decode_splits = attention_splits(1, hp.n_head, hp.n_head_kv, self.n_ctx,
                                              target_workgroups=decode_target_workgroups(self.device))
        self.attn_scratch = self._alloc(
            attention_scratch_bytes(1, hp.n_head, hp.head_dim_v, self.decode_splits), "device", "attn_scratch",
            shared=st)
        if st:
            self.attn_scratch = self._view(self.attn_scratch)
        # decode: x quantized to q8_1 for the integer-dot-product mat-vecs (hub only; one
        # scratch reused by every quantize node: each one's readers come before the next)
        from .ops.mul_mat import vecq_scratch_bytes

        self.xq_buf = self._alloc(vecq_scratch_bytes(1, max(sizes.values())), "device", "xq")
        self.logits_buf = self.argmax_buf = None
        if self.last and self.makes_logits:  # (all logits of every slot's rows: logits() of a prompt split in micro-batches)
            self.logits_buf = self._alloc(S * hp.n_vocab * f32, "host", "logits", shared=act_shared)
            self.argmax_buf = self._alloc(S * 4, "host", "argmax", shared=st)

    # -- graph ----------------------------------------------------------------------------

    def _build_graph(self, T: int, all_logits: bool, slot: int = 0) -> Graph:
        """The forward pass for ``T`` tokens as a graph over this model's buffers (a pipeline
        stage's: its layers, reading or writing the hidden state through its links): the
        architecture's graph from :mod:`vkxsplit.archs`."""
        return build_graph(self, T, all_logits, slot)

    # -- plans and steps ----------------------------------------------------------------------

    @property
    def owns_device(self) -> bool:
        """Whether :meth:`close` closes the hub device: True when the model opened it; set it
        to hand over a device the caller opened for it."""
        return self._own_device

    @owns_device.setter
    def owns_device(self, own: bool) -> None:
        self._own_device = bool(own)

    @property
    def cost(self) -> CostModel:
        """The cost model (measured on demand, cached in the device profile)."""
        if self._cost is None:
            self._cost = MeasuringCostModel(Profile.for_device(self.device, self._profile_dir), device=self.device,
                                            arena=self.arena, backends=self.backends.values(),
                                            hub_runner=self._time_hub)
            self.planner.cost = self._cost
        return self._cost

    def _time_hub(self, graph: Graph) -> dict[int, float]:
        """Hub seconds per node of ``graph``, run alone with timestamps. Positions are the last
        ``T`` of the context: KV rows written there are rewritten before any step reads them."""
        T = graph.T

        def before() -> None:
            self.ids_buf.numpy(np.int32, (T,))[:] = 0
            self.pos_buf.numpy(np.int32, (T,))[:] = np.arange(self.n_ctx - T, self.n_ctx, dtype=np.int32)

        # the calibration overwrites the outputs: keep what last_logits()/last_argmax() read
        if self.logits_buf is None:  # a pipeline stage before the last: no outputs to keep
            return hub_node_times(self.device, graph, before)
        keep_logits = self.logits_buf.numpy(np.float32, (self.hp.n_vocab,)).copy()
        keep_argmax = self.argmax_buf.numpy(np.int32, (1,)).copy()
        try:
            return hub_node_times(self.device, graph, before)
        finally:
            self.logits_buf.numpy(np.float32, (self.hp.n_vocab,))[:] = keep_logits
            self.argmax_buf.numpy(np.int32, (1,))[:] = keep_argmax

    def plan(self, T: int, all_logits: bool = False, predict: bool = False) -> Plan:
        """The plan for steps of ``T`` tokens (made once per ``T``; ``predict`` adds the cost
        model's predicted step time, measuring what the profile lacks)."""
        ex = self._executor(T, all_logits)
        if predict and ex.plan.prediction is None:
            self.cost.prepare(ex.plan.graph, self.planner._job_needs(ex.plan.schedule))
            ex.plan.prediction = simulate(ex.plan.schedule, self.cost)
        return ex.plan

    def _make_plan(self, T: int, all_logits: bool, slot: int = 0) -> Plan:
        g = self._build_graph(T, all_logits, slot)
        if self.split.kind == "auto":
            _ = self.cost  # attaches the cost model to the planner
        return self.planner.plan(g, self.split)

    def _executor(self, T: int, all_logits: bool, slot: int = 0) -> Executor:
        if T > self.ubatch:
            raise VkxError(f"a step of {T} tokens is more than ubatch {self.ubatch}")
        key = (T, all_logits, slot)
        hit = self._execs.get(key)
        if hit is not None:
            self._execs.move_to_end(key)
            return hit
        plan = self._make_plan(T, all_logits, slot)
        ex = Executor(self.device, plan, self.backends, trace=self.tracing)
        self.stats["recordings"] += ex.recordings
        self._execs[key] = ex
        # bounded: prompts of many lengths must not pile up sequences (a pipeline stage keeps
        # one per slot of its micro-batches in flight, plus decode)
        while len(self._execs) > max(8, 2 * self.slots + 1):
            _, old = self._execs.popitem(last=False)
            old.close()
        return ex

    def set_split(self, split: Any) -> None:
        """Switch to another split spec over the same weights, backends and KV cache (plans and
        converted weights of the previous spec are dropped)."""
        spec = self.planner.check(split)
        self._drop_executors()
        if self.workspace is not None:
            self.workspace.release()
        self.split = spec

    def set_trace(self, on: bool = True) -> None:
        """Record GPU timestamps around every hub op (and watch backend points) every step;
        ``last_trace`` then holds the last step as Chrome trace-event JSON."""
        if on != self.tracing:
            self._drop_executors()
            self.tracing = on

    def _drop_executors(self) -> None:
        for ex in self._execs.values():
            ex.close()
        self._execs.clear()

    # -- steps ------------------------------------------------------------------------------

    def _run(self, ids: list[int], all_logits: bool) -> Step:
        """Append ``ids`` (at most ubatch) to the context and run the forward pass."""
        T = len(ids)
        if self.n_past + T > self.n_ctx:
            raise VkxError(f"the context is full: {self.n_past} + {T} tokens > n_ctx {self.n_ctx}",
                           "use a shorter prompt or fewer tokens, or a larger context: n_ctx= (load_model), -c (command line)")
        step = self._submit(ids, self.n_past, all_logits)
        step.wait()
        self.n_past += T
        self._count(step)
        return step

    def _submit(self, ids: list[int], start: int, all_logits: bool, slot: int = 0, waits: Any = ()) -> Step:
        """Write the step's token ids and positions ``start..`` into ``slot``'s rows and submit
        it (after ``waits``: points of this device) without waiting."""
        ex = self._executor(len(ids), all_logits, slot)
        self._write_inputs(ids, start, slot)
        return ex.step(waits)

    def _write_inputs(self, ids: list[int], start: int, slot: int = 0) -> None:
        """The step's token ids and positions ``start..`` into ``slot``'s rows."""
        T = len(ids)
        views = self.__dict__.get("_io_views")
        if views is None:  # zero-copy views of the per-step input buffers, made once
            views = self._io_views = (self.ids_buf.numpy(np.int32), self.pos_buf.numpy(np.int32),
                                      None if self.argmax_buf is None else self.argmax_buf.numpy(np.int32))
        r0 = slot * self.slot_rows
        views[0][r0:r0 + T] = ids
        views[1][r0:r0 + T] = np.arange(start, start + T, dtype=np.int32)

    def _count(self, step: Step) -> None:
        st = self.stats
        st["steps"] += 1
        st["submits"] += step.submits
        st["backend_jobs"] += step.jobs
        st["host_waits_in_step"] += step.host_waits
        st["staged_bytes"] += step.staged_bytes
        self.last_step = step
        if self.tracing:
            self.last_trace = step.trace()

    def _out(self) -> Model:
        return self

    def close(self) -> None:
        self._io_views = None  # views of buffers freed below
        self._drop_executors()
        for be in self.backends.values():  # copies a backend made of weights the hub keeps private
            if getattr(be, "private_weights", False) and be not in self._owned_backends and not be.closed:
                for t in getattr(self, "weights", {}).values():
                    if not t.shared:
                        be.unload(t.buffer)
        if self.workspace is not None:
            self.workspace.close()
            self.workspace = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        for b in self._bufs:
            b.close()
        self._bufs.clear()
        for be in self._owned_backends:
            be.close()  # its timelines stay with the hub device (queued work may name them)
        self._owned_backends.clear()
        if getattr(self, "_own_device", False) and getattr(self, "device", None) is not None:
            self.device.close()
            self.device = None  # type: ignore[assignment]
        if getattr(self, "file", None) is not None:
            self.file.close()
        if getattr(self, "_tokenizer", None) is not None:
            self._tokenizer.close()  # (taken from the model: unusable with it, ClosedError)

def _nonfinite_logits(model: LanguageModel) -> ModelError:
    where = getattr(model, "path", None)
    return ModelError(f"the logits of {where.name if where else 'the model'} are not finite (NaN or "
                      "infinity): the model file most likely holds non-finite weights",
                      "check the file (e.g. gguf's dequantize of each tensor for NaN or inf) or fetch it again")


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p sampling and the repeat penalty on the host (numpy).

    Defaults: :mod:`vkxsplit.defaults` (shared with the command line). The repeat penalty is
    llama.cpp's: each distinct token among the last ``repeat_last_n`` of ``history`` has its
    logit divided by ``repeat_penalty`` where positive, multiplied where negative (also when
    greedy). min-p keeps the tokens whose probability is at least ``min_p`` times the largest."""

    def __init__(self, temperature: float = SAMPLING.temperature, top_k: int = SAMPLING.top_k,
                 top_p: float = SAMPLING.top_p, seed: int | None = None, min_p: float = SAMPLING.min_p,
                 repeat_penalty: float = SAMPLING.repeat_penalty, repeat_last_n: int = SAMPLING.repeat_last_n):
        def number(v: Any, integer: bool = False) -> bool:
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                return False
            return float(v) == int(v) if integer and math.isfinite(v) else math.isfinite(v)

        if not (number(temperature) and temperature >= 0 and number(top_p) and 0 < top_p <= 1
                and number(top_k, integer=True) and top_k >= 0 and number(min_p) and 0 <= min_p <= 1
                and number(repeat_penalty) and repeat_penalty > 0
                and number(repeat_last_n, integer=True) and repeat_last_n >= -1):
            raise VkxError(f"bad sampling parameters: temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r}, "
                           f"min_p={min_p!r}, repeat_penalty={repeat_penalty!r}, repeat_last_n={repeat_last_n!r}",
                           "temperature: a finite number >= 0 (0 = greedy); top_k: a whole number >= 0 "
                           "(0 = off); top_p: a number in (0, 1]; min_p: a number in [0, 1] (0 = off); "
                           "repeat_penalty: a number > 0 (1 = off); repeat_last_n: a whole number >= -1 "
                           "(-1 = the whole history)")
        temperature, top_k, top_p = float(temperature), int(top_k), float(top_p)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.min_p, self.repeat_penalty, self.repeat_last_n = float(min_p), float(repeat_penalty), int(repeat_last_n)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits(self) -> bool:
        """False when the GPU argmax gives the token (greedy without a repeat penalty)."""
        return not self.greedy or self.repeat_penalty != 1.0

    def penalize(self, logits: np.ndarray, history: list[int] | None) -> np.ndarray:
        """``logits`` with the repeat penalty applied over the recent ``history`` (a copy)."""
        if self.repeat_penalty == 1.0 or not history or self.repeat_last_n == 0:
            return logits
        recent = history if self.repeat_last_n < 0 else history[-self.repeat_last_n:]
        ids = np.unique(np.asarray(recent, np.int64))
        ids = ids[(ids >= 0) & (ids < len(logits))]
        out = logits.astype(np.float64)
        v = out[ids]
        out[ids] = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)
        return out

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        logits = self.penalize(logits, history)
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
        if self.min_p > 0.0:
            keep = max(1, int(np.count_nonzero(p >= self.min_p * p[0])))
            idx, p = idx[:keep], p[:keep] / p[:keep].sum()
        return int(idx[self.rng.choice(len(idx), p=p)])


def load_model(path: str | Path | None = None, split: Any = None, backends: Any = None,
               device: Device | None = None, **kw: Any) -> Model:
    """Load a GGUF model (default: SmolLM2-135M-Instruct Q4_1) onto the hub.

    Without ``split``, the split is :func:`vkxsplit.defaults.split_for_machine`'s, the same as the
    command line's: ``auto`` over the given ``backends``; with neither, on a CPU hub (no GPU) the
    cpu backend with ``mode:cpu`` when the hub is opened here (no ``device`` given), else ``none``."""
    own = device is None and split is None and not backends
    try:
        if own:
            device = Device.open()
            choice = split_for_machine(None, None, device.is_cpu, path, device.name)
            if choice.note:
                log.info("%s", choice.note)
            split, backends = choice.split, choice.backends
        elif split is None and backends:
            split = split_for_machine(None, backends, False).split
        m = Model(path, split=split, backends=backends, device=device, **kw)
    except FileNotFoundError as exc:
        if own and device is not None:
            device.close()
        raise ModelError(f"model file not found: {path}") from exc
    except BaseException:
        if own and device is not None:
            device.close()
        raise
    if own:
        m.owns_device = True
    return m
