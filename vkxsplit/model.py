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
write them in place. Over several GPUs (``devices="0,1"``) every GPU is a hub and a
participant of the same planner and executor (``hub0``, ``hub1``): what each holds is placed at
load (:mod:`vkxsplit.hubs`), the graph is every hub's part joined, and the executor carries the
waits between hubs through one relay (:mod:`vkxsplit.relay`). Prompt processing and decode
get different plans (``T`` differs) over the same weights and KV cache; ``mode:cuda>=32`` is
"CUDA does prefill, Vulkan does decode".
"""

from __future__ import annotations

import logging
import time
import types
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .archs import DecodeQ8  # noqa: F401 (DecodeQ8: its old home, re-exported)
from .calibrate import MeasuringCostModel, hub_node_times
from .defaults import N_PREDICT, SAMPLING, chat_default, split_for_machine
from .errors import Closable, ModelError, PlanError, VkxError
from .executor import Executor, Step
from .features import is_disabled
from .gguf_model import ModelFile, default_model_path
from .gguf_model import load_model as load_gguf
from .graph import Graph
from .hubs import (
    WORLD,
    DryHubShare,
    DryLink,
    HostLink,
    HubShare,
    check_partials,
    join_hub_graphs,
    layer_ranges,
    parse_devices,
    shard_hparams,
    slot_rows,
)
from .plan.cost import CostModel, simulate
from .plan.planner import HUB_AUTO_WORKLOAD, HubCandidate, Planner
from .plan.profile import Profile
from .plan.result import Plan
from .plan.spec import SplitSpec, parse_backends, parse_spec
from .plan.workspace import ArenaWorkspace
from .relay import Relay
from .sampling import Sampler
from .tokenizer import Tokenizer
from .vk.device import Device
from .vk.memory import _align

log = logging.getLogger("vkxsplit.model")


__all__ = ["LanguageModel", "Model", "Sampler", "load_model", "slot_rows"]


class LanguageModel(Closable):
    """Tokens and text in, logits and tokens out: the API a user calls, the same for a model on
    one hub or several (:class:`Model`). Subclasses set ``hp``, ``n_ctx``, ``ubatch``,
    ``n_past``, ``_tokenizer``/``_tokenizer_error`` and implement ``_run`` (one step of at most
    ``ubatch`` tokens appended to the context) and ``_out`` (the hub share,
    :class:`vkxsplit.hubs.HubShare`, whose ``logits_buf``/``argmax_buf`` the step's outputs
    land in)."""

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

    def _out(self) -> Any:
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
        if executor is None or n_prompt < 1 or getattr(self, "slots", 1) > 1:
            return  # (micro-batches: the pieces' executors are made at the first step)
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

    ``devices``: one Vulkan hub per device (``"0,1"``, or the same device twice for two hubs on
    one GPU), each a participant of the planner (``hub0``, ``hub1``, ...): ``split`` is then
    ``layer[:R,R...]`` (default: equal shares), the layers as a pipeline of stages, one range
    per hub, with ``micro_batches`` pieces of a prompt step in flight on different hubs at once
    (default: twice the hubs, pieces of at least 32 tokens), or ``tensor:1,1`` over two hubs,
    every matrix split by rows with an all-reduce after each attention and FFN, its partial sums
    crossing in ``partials``: ``auto`` (the default: f32 below a size measured once per device,
    bf16 from it on, :meth:`reduce_dtype`), or always ``f32``, ``f16`` or ``bf16`` (half the
    bytes, each partial rounded once).
    What each hub holds is decided here, at load (:mod:`vkxsplit.hubs`); ``timeout``: the stall
    limit of the relay between the hubs (default ``VKXSPLIT_TIMEOUT_S``). Backends attach to a
    model on one hub only."""

    def __init__(self, path: str | Path | None = None, device: Device | None = None, n_ctx: int | None = None,
                 ubatch: int = 512, split: Any = None, backends: Any = None, progress: Any = None,
                 trace: bool = False, profile_dir: str | Path | None = None, devices: Any = None,
                 micro_batches: int | None = None, partials: str = "auto", timeout: float | None = None) -> None:
        self.path = Path(path) if path else default_model_path()
        sels = parse_devices(devices) if devices is not None else None
        if sels is not None and device is not None:
            raise VkxError("device= and devices= both choose the hub", "give devices= (one hub each) or device=")
        self.partials = check_partials(partials)
        self._reduce_min: tuple[int | None, str] | None = None  # (bf16 threshold, where from): reduce_dtype
        self.file: ModelFile = load_gguf(self.path)
        self.hp = self.file.hparams
        self._load_tokenizer(self.file)
        self._own_device = device is None
        self.device: Device = device  # type: ignore[assignment]
        self.hubs: list[Device] = []
        self.shares: list[HubShare] = []
        self.links: list[HostLink] = []
        self.relay: Relay | None = None
        self.timeout = timeout
        self.n_ctx = int(n_ctx or min(self.hp.n_ctx_train or 2048, 4096))
        self.ubatch = max(1, min(ubatch, self.n_ctx))
        self.micro, self.piece, self.slots = 1, self.ubatch, 1
        self.ranges: list[tuple[int, int]] = [(0, self.hp.n_layer)]
        self.n_past = 0
        self._execs: OrderedDict[tuple[int, bool, int], Executor] = OrderedDict()
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
        # several hubs: bytes that crossed between them (into host pages both import), relay
        # rounds and all-reduces, since load and in the last step
        self.traffic = {"crossed_bytes": 0, "steps": 0, "relays": 0, "all_reduces": 0}
        self.last_traffic = 0
        self._failed: list[Step] = []  # the steps of a failed step over several hubs (see _drain)
        # auto over several hubs: what was chosen at load and the candidates' predicted seconds
        self.hub_choice: dict[str, Any] | None = None
        try:
            t0 = time.perf_counter()
            if sels is None:
                self.device = device or Device.open()
                self.hubs = [self.device]
            else:
                for sel in sels:
                    self.hubs.append(Device.open(sel))
                    self.device = self.hubs[0]  # (at once: close() after a failed open closes it)
                self._own_device = True
            self._attach(backends)
            self.planner = Planner(self.backends.values(), workspace=self.workspace, hubs=len(self.hubs))
            if split is None and len(self.hubs) > 1:
                split = "layer"
            if len(self.hubs) > 1 and parse_spec(split).kind == "auto":
                split, micro_batches = self._choose_hub_split(micro_batches)
            self.split: SplitSpec = self.planner.check(split)
            self._place(micro_batches, progress)
            self.weight_bytes = sum(sh.weight_bytes for sh in self.shares)
            self.load_seconds = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise
        if len(self.hubs) > 1:
            log.info("%s over %s: %s", self.split, ", ".join(d.name for d in self.hubs), self.split_label)

    # -- hubs -------------------------------------------------------------------------------

    def _place(self, micro_batches: int | None, progress: Any) -> None:
        """What each hub holds (:mod:`vkxsplit.hubs`), from the split spec: the whole model on
        one hub; layer ranges by share (a pipeline; micro-batches in slots); or row shards."""
        hubs, n, E = self.hubs, len(self.hubs), self.hp.n_embd
        if micro_batches is not None:  # (1: one piece, what every split but the layer split runs)
            if int(micro_batches) < 1:
                raise VkxError(f"micro_batches {micro_batches}: a prompt step goes as at least 1 piece",
                               "give micro_batches at least 1 (--micro-batches), or leave it out")
            if int(micro_batches) > 1 and (n == 1 or self.split.kind != "layer"):
                raise VkxError(f"micro_batches={micro_batches} puts pieces of a prompt step in flight on "
                               "different hubs: it goes with a layer split over several hubs, not "
                               + (f"split {self.split}" if n > 1 else "a model on one hub"),
                               "drop micro_batches, or split the layers: devices='0,1' (split 'layer')")
        if n == 1:
            self.shares = [HubShare(self, 0, self.device)]
        elif self.split.kind == "layer":
            self.ranges = layer_ranges(self.hp.n_layer, self.planner.hub_shares(self.split))
            self.micro, self.piece = self._pieces(micro_batches)
            self.slots = self.micro
            link_bytes = self.micro * slot_rows(self.piece, self.micro) * E * 4
            for i in range(n - 1):
                self.links.append(HostLink([hubs[i], hubs[i + 1]], link_bytes, f"link{i}"))
            for i, rng in enumerate(self.ranges):
                self.shares.append(HubShare(self, i, hubs[i], layers=rng,
                                            link_in=self.links[i - 1].views[1] if i > 0 else None,
                                            link_out=self.links[i].views[0] if i < n - 1 else None))
        else:  # tensor: row shards, an all-reduce through host pages both hubs import
            shard_hparams(self.hp)  # refuse early, with the reason
            slot = _align(self.ubatch * E * 4, 256)
            pages = HostLink(hubs, 2 * WORLD * slot, "row-split")
            self.links.append(pages)

            def views(dev: int, owner: int) -> list[Any]:  # (buffer as hub dev sees it, offset) per parity
                return [(pages.views[dev], (owner * 2 + p) * slot) for p in range(2)]

            for r in range(n):
                self.shares.append(HubShare(self, r, hubs[r], rank=r, publish=views(r, r), peer=views(r, 1 - r)))
        for sh in self.shares:
            sh.upload_weights(progress)
            sh.alloc_state()
        if n > 1:  # (a spin on the counters would take a core from a CPU device)
            self.relay = Relay("hub-relay", self.timeout, spin_s=0.0 if any(d.is_cpu for d in hubs) else None)

    def _pieces(self, micro_batches: int | None) -> tuple[int, int]:
        """(micro-batches, tokens per micro-batch) of a prompt step of a layer split over the
        hubs: ``micro_batches`` pieces, by default twice the hubs, pieces of at least 32 tokens."""
        n = len(self.hubs)
        want = 2 * n if micro_batches is None else int(micro_batches)
        micro = max(1, min(want, self.ubatch // 32 if micro_batches is None else self.ubatch, self.ubatch))
        piece = -(-self.ubatch // micro)  # tokens per micro-batch
        return -(-self.ubatch // piece), piece  # the pieces a full step has (8 in 5 -> 4 of 2)

    def _choose_hub_split(self, micro_batches: int | None) -> tuple[str, int | None]:
        """``auto`` over several hubs, decided here because the weights are placed at load: one
        hub (the others closed), the layer split or the row split, whichever the cost model
        predicts cheapest for :data:`~vkxsplit.plan.planner.HUB_AUTO_WORKLOAD`
        (:meth:`Planner.choose_hub_split` over each candidate's graphs, built over dry shares:
        no weight read or placed). Hub node times come from the device profile where an
        earlier run measured those shapes, else the cost model's roofline estimate (named in
        ``hub_choice``); the relay crossing is the cost model's. Returns the spec to place and
        ``micro_batches`` (dropped unless the layer split wins)."""
        cands: list[HubCandidate] = []
        notes: list[str] = []
        for label, spec in (("one hub", "none"), ("layer", "layer"), ("row", "tensor:1,1")):
            try:
                cands.append(HubCandidate(label, spec, self._dry_steps(spec, micro_batches)))
            except VkxError as exc:  # (a model the row split cannot halve; more than two hubs)
                notes.append(f"{label}: not a candidate ({exc})")
        cost = self.cost
        if isinstance(cost, MeasuringCostModel):  # what the profile lacks of the candidates' nodes
            cost.prepare()  # (the hub's submit overhead)
            for c in cands:
                for g, _times in c.steps:
                    cost.measure_dry(g, self.hubs, self.n_ctx)
        picked, table, est = self.planner.choose_hub_split(cands, cost)
        prompt, decode = HUB_AUTO_WORKLOAD
        self.hub_choice = {"picked": picked.label, "spec": picked.spec, "candidates": table, "estimated": est,
                           "workload": f"a {prompt}-token prompt in steps of {min(prompt, self.ubatch)} and "
                                       f"{decode} decode steps", "notes": notes}
        log.info("auto over %d hubs: %s (%s)", len(self.hubs), picked.label,
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in table))
        if picked.spec == "none":  # one hub: the others are closed, the model is a one-hub model
            for d in self.hubs[1:]:
                d.close()
            self.hubs = self.hubs[:1]
            self.planner = Planner(self.backends.values(), workspace=self.workspace, hubs=1, cost=cost)
        return picked.spec, micro_batches if picked.spec == "layer" else None

    def _dry_steps(self, spec: str, micro_batches: int | None) -> list[tuple[Graph, float]]:
        """The graphs of :data:`HUB_AUTO_WORKLOAD`'s steps (a prompt step of ``ubatch`` tokens,
        as its micro-batches for a layer split, and a decode step) of the model placed over the
        hubs by ``spec``, over dry shares (:class:`vkxsplit.hubs.DryHubShare`), with how often
        each runs."""
        hubs, n, E = self.hubs, len(self.hubs), self.hp.n_embd
        kind = parse_spec(spec).kind
        stub = types.SimpleNamespace(file=self.file, n_ctx=self.n_ctx, piece=self.ubatch, slots=1, backends={},
                                     arena=None, partials=self.partials, reduce_dtype=self.reduce_dtype)
        if kind == "none":
            shares = [DryHubShare(stub, 0, hubs[0])]
        elif kind == "layer":
            ranges = layer_ranges(self.hp.n_layer, self.planner.hub_shares(spec))
            stub.slots, stub.piece = self._pieces(micro_batches)
            nb = stub.slots * slot_rows(stub.piece, stub.slots) * E * 4
            links = [DryLink([hubs[i], hubs[i + 1]], nb, f"link{i}") for i in range(n - 1)]
            shares = [DryHubShare(stub, i, hubs[i], layers=rng, link_in=links[i - 1].views[1] if i > 0 else None,
                                  link_out=links[i].views[0] if i < n - 1 else None) for i, rng in enumerate(ranges)]
        else:
            self.planner.hub_shares(spec)
            shard_hparams(self.hp)
            slot = _align(self.ubatch * E * 4, 256)
            pages = DryLink(hubs, 2 * WORLD * slot, "row-split")
            shares = [DryHubShare(stub, r, hubs[r], rank=r, publish=[(pages.views[r], (r * 2 + p) * slot) for p in range(2)],
                                  peer=[(pages.views[r], ((1 - r) * 2 + p) * slot) for p in range(2)])
                      for r in range(n)]
        for sh in shares:
            sh.upload_weights()
            sh.alloc_state()

        def step(T: int) -> Graph:
            nodes: list[Any] = []
            for j, s in enumerate(range(0, T, stub.piece)):
                parts = [sh.build_graph(min(stub.piece, T - s), False, j) for sh in shares]
                nodes += join_hub_graphs("", T, parts, interleave=kind == "tensor").nodes
            g = Graph(f"{self.file.name}:{spec}:T{T}", T=T)
            for node in nodes:
                node.index = len(g.nodes)
                g.nodes.append(node)
            return g

        prompt, decode = HUB_AUTO_WORKLOAD
        T = min(prompt, self.ubatch)
        return [(step(T), prompt / T), (step(1), float(decode))]

    @property
    def split_label(self) -> str:
        """The split in words: the spec, and over several hubs what each holds (and what auto
        compared, when it chose)."""
        hc = self.hub_choice
        if hc is None:
            return self._placed_label()
        costs = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in hc["candidates"])
        return f"auto over {len(hc['candidates'])} candidates ({costs}): {hc['picked']}, {self._placed_label()}"

    def _placed_label(self) -> str:
        if len(self.hubs) == 1:
            return str(self.split)
        if self.split.kind == "layer":
            return f"{self.split}: layers " + ",".join(f"{a}-{b - 1}" for a, b in self.ranges) + \
                f" on hub{'s' if len(self.hubs) > 1 else ''} 0-{len(self.hubs) - 1}"
        return f"{self.split}: tensor split (rows) over {len(self.hubs)} hubs, {self.partials_label}"

    @property
    def partials_label(self) -> str:
        """How the row split's partial sums cross, in words."""
        if self.partials != "auto":
            return f"{self.partials} partials"
        if self._reduce_min is None:
            return "f32 partials, bf16 from a size measured at the first step"
        th, why = self._reduce_min
        return "f32 partials" + (f", bf16 from {th} bytes ({why})" if th is not None else f" ({why})")

    def reduce_dtype(self, nbytes: int) -> str:
        """The type the row split's all-reduce sends a partial sum of ``nbytes`` (as f32) in:
        ``partials``, or for ``auto`` bf16 from the threshold the calibration measured on hub 0
        (:func:`vkxsplit.calibrate.measure_reduce`, kept in the device profile; the cost
        model's documented default until then), f32 below it; always f32 when
        ``VKXSPLIT_DISABLE=bf16_reduce``. Read once per model (every step's graph agrees)."""
        if self.partials != "auto":
            return self.partials
        if self._reduce_min is None:
            if is_disabled(self.device, "bf16_reduce"):
                self._reduce_min = (None, "bf16 switched off: VKXSPLIT_DISABLE=bf16_reduce")
            else:
                cost = self.cost
                th = cost.reduce_threshold()
                est = "bf16 all-reduce threshold" in cost.estimated
                self._reduce_min = (th, "the default, not measured" if est else
                                    "measured" if th is not None else "bf16 was slower at every size measured")
        th = self._reduce_min[0]
        return "bf16" if th is not None and nbytes >= th else "f32"

    def _share(self) -> HubShare:
        return self.shares[0]

    # the buffers of a model on one hub (hub 0's share over several hubs; the logits: _out())
    weights = property(lambda self: self._share().weights)
    kv = property(lambda self: self._share().kv)
    act = property(lambda self: self._share().act)
    ids_buf = property(lambda self: self._share().ids_buf)
    pos_buf = property(lambda self: self._share().pos_buf)
    xq_buf = property(lambda self: self._share().xq_buf)
    attn_scratch = property(lambda self: self._share().attn_scratch)
    decode_splits = property(lambda self: self._share().decode_splits)
    slot_rows = property(lambda self: self._share().slot_rows)
    logits_buf = property(lambda self: self._out().logits_buf)
    argmax_buf = property(lambda self: self._out().argmax_buf)

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

    # -- graph ----------------------------------------------------------------------------

    def _build_graph(self, T: int, all_logits: bool, slot: int = 0) -> Graph:
        """The forward pass for ``T`` tokens as one graph over the hubs' buffers: the
        architecture's graph (:mod:`vkxsplit.archs`) of each hub's share, its nodes marked with
        their hub. A layer split's parts follow one another; a row split's are interleaved at
        the all-reduces (each shard's nodes up to its next ``link_sum``, hub by hub), so that
        both partials are published before either sum reads them."""
        parts = [sh.build_graph(T, all_logits, slot) for sh in self.shares]
        if len(parts) == 1:
            return parts[0]
        return join_hub_graphs(f"{self.file.name}:T{T}" + (f":s{slot}" if slot else ""), T, parts,
                               interleave=self.split.kind != "layer")

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
            first: dict[bytes, int] = {}  # hubs on one device take it in turn (simulate)
            for i, d in enumerate(self.hubs):
                j = first.setdefault(bytes(d.physical.device_uuid), i)
                if j != i:
                    self._cost.hub_groups[f"hub{i}"] = f"hub{j}"
            if len(self.hubs) > 1:  # the relay crossing, measured between hubs 0 and 1
                self._cost.relay_devices = list(self.hubs)
                self._cost.relay_key = f"relay|{bytes(self.hubs[1].physical.device_uuid).hex()}"
            self.planner.cost = self._cost
        return self._cost

    def _time_hub(self, graph: Graph) -> dict[int, float]:
        """Hub seconds per node of ``graph``, run alone with timestamps (over several hubs, each
        hub's nodes on its own device). Positions are the last ``T`` of the context: KV rows
        written there are rewritten before any step reads them."""
        T = graph.T
        # the calibration overwrites the outputs: keep what last_logits()/last_argmax() read
        keep_logits = self.logits_buf.numpy(np.float32, (self.hp.n_vocab,)).copy()
        keep_argmax = self.argmax_buf.numpy(np.int32, (1,)).copy()
        try:
            out: dict[int, float] = {}
            for h, sh in enumerate(self.shares):
                nodes = [n for n in graph.nodes if n.hub == h]
                part = graph if len(self.shares) == 1 else Graph(f"{graph.name}:hub{h}", nodes, T)

                def before(sh: HubShare = sh) -> None:
                    sh.ids_buf.numpy(np.int32, (T,))[:] = 0
                    sh.pos_buf.numpy(np.int32, (T,))[:] = np.arange(self.n_ctx - T, self.n_ctx, dtype=np.int32)

                if nodes:
                    out.update(hub_node_times(self.hubs[h], part, before))
            return out
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
        plan = self.planner.plan(g, self.split)
        hc = self.hub_choice
        if hc is not None:  # auto over several hubs, decided at load
            plan.candidates = list(hc["candidates"])
            plan.notes.append(f"auto over the hubs picked {hc['picked']} at load, where the weights are placed "
                              f"(predicted for {hc['workload']}"
                              + (f"; estimated, not measured: {', '.join(hc['estimated'])}" if hc["estimated"] else "")
                              + ")")
            plan.notes += hc["notes"]
        return plan

    def _executor(self, T: int, all_logits: bool, slot: int = 0) -> Executor:
        if T > self.piece:
            if self.micro > 1:  # (a layer split over hubs: a prompt step runs as its pieces' plans)
                raise VkxError(f"a plan of {T} tokens is more than a micro-batch: ubatch {self.ubatch} runs as "
                               f"{self.micro} pieces of at most {self.piece} tokens",
                               f"plan steps of at most {self.piece} tokens, or load with micro_batches=1")
            raise VkxError(f"a step of {T} tokens is more than ubatch {self.piece}")
        key = (T, all_logits, slot)
        hit = self._execs.get(key)
        if hit is not None:
            self._execs.move_to_end(key)
            return hit
        plan = self._make_plan(T, all_logits, slot)
        ex = Executor(self.device, plan, self.backends, trace=self.tracing, hubs=self.hubs, relay=self.relay)
        self.stats["recordings"] += ex.recordings
        self._execs[key] = ex
        # bounded: prompts of many lengths must not pile up sequences (a layer split over hubs
        # keeps one per slot of its micro-batches in flight, plus decode)
        while len(self._execs) > max(8, 2 * self.slots + 1):
            _, old = self._execs.popitem(last=False)
            old.close()
        return ex

    def set_split(self, split: Any) -> None:
        """Switch to another split spec over the same weights, backends and KV cache (plans and
        converted weights of the previous spec are dropped). Over several hubs the split was
        placed at load: only that spec."""
        if self.hub_choice is not None and parse_spec(split).kind == "auto":
            return  # (auto over several hubs: what it chose at load)
        spec = self.planner.check(split)
        if len(self.hubs) > 1:
            if str(spec) != str(self.split):
                raise PlanError(f"split {str(spec)!r} after load is not supported on a model over {len(self.hubs)} "
                                f"hubs: their weights were placed for {str(self.split)!r}",
                                "load the model again with that split (--split-mode / --split)")
            return
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
        if len(self.hubs) > 1:
            return self._run_hubs(ids, all_logits)
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
        """The step's token ids and positions ``start..`` into ``slot``'s rows (every hub's)."""
        for sh in self.shares:
            sh.write_inputs(ids, start, slot)

    def _run_hubs(self, ids: list[int], all_logits: bool) -> Step:
        """One step over several hubs: its micro-batches (a layer split's pieces, each in its
        own slot) all submitted up front through their executors, the relay carrying every
        cross-hub wait; one wait, here, for the last piece's hubs."""
        T = len(ids)
        self._check_step(T)
        self._drain()
        steps: list[Step] = []
        try:
            t0 = time.perf_counter()
            for j, s in enumerate(range(0, T, self.piece)):
                steps.append(self._submit(ids[s:s + self.piece], self.n_past + s, all_logits, slot=j))
            self.last_submit_s = time.perf_counter() - t0  # host time spent queueing the step
            for step in reversed(steps):  # (each hub runs its pieces in queue order)
                step.wait(self.timeout)
            assert self.relay is not None
            with self.relay.submitting:  # (out of its last submit or signal of the step)
                self.relay.check()
        except BaseException:
            self._failed = steps  # (what the failed step submitted: _drain)
            if self.relay is not None:
                self.relay.reset()
            raise
        crossed = 0
        for step in steps:
            self._count(step)
            plan = step.executor.plan
            crossed += plan.crossed_bytes
            self.traffic["relays"] += len(plan.schedule.cross_waits())
            self.traffic["all_reduces"] += sum(1 for n in plan.graph.nodes if n.op == "link_sum" and n.hub == 0)
        self.n_past += T
        self.last_traffic = crossed
        self.traffic["crossed_bytes"] += crossed
        self.traffic["steps"] += 1
        return steps[-1]

    def _drain(self) -> None:
        """Before a step: what a failed step submitted must have finished (it reads the ids,
        positions and activations the new step writes)."""
        for step in self._failed:
            for seq in step.executor._seqs:
                try:
                    seq.wait(min(5.0, self.timeout or 5.0))
                except VkxError as exc:
                    raise VkxError(f"a segment of a failed step is still running on {seq.device.name} ({exc})",
                                   "wait for the stuck GPU, or close the model") from None
        self._failed = []

    def _read_logits(self, T: int) -> np.ndarray:
        out = self._out()
        if self.slots == 1:
            return out.logits_buf.numpy(np.float32, (T, self.hp.n_vocab))
        rows = out.logits_buf.numpy(np.float32, (self.slots * out.slot_rows, self.hp.n_vocab))
        return np.concatenate([rows[j * out.slot_rows:j * out.slot_rows + min(self.piece, T - s)]
                               for j, s in enumerate(range(0, T, self.piece))])

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

    def _out(self) -> HubShare:
        """The share that makes the logits (the last layer's hub; shard 0 of a row split)."""
        return next(sh for sh in self.shares if sh.makes_logits)

    def close(self) -> None:
        if self.relay is not None:  # pending signals go out (no queue stays blocked), submits are dropped
            self.relay.close()
        if len(self.hubs) > 1:
            # every submitted segment must have finished before its memory, the links' host
            # pages and imports, or the hubs go; one still queued (a stuck GPU) keeps all of it
            busy = self._busy()
            if busy is not None:
                log.error("model over %d hubs closed while a step is still queued on %s (a stuck GPU?): its "
                          "hubs, memory and host pages are left allocated", len(self.hubs), busy)
                self._close_file()
                return
        self._free()

    def _busy(self) -> str | None:
        """The device of a submitted segment that does not finish within a few seconds (the
        model's timeout, at most 5 s), or None."""
        for step in [*self._failed, *(ex._last for ex in self._execs.values() if ex._last is not None)]:
            for seq in step.executor._seqs:
                try:
                    seq.wait(min(5.0, self.timeout or 5.0))
                except VkxError:
                    return seq.device.name
        return None

    def _free(self) -> None:
        """Free everything: executors, backends' copies, memory, links, relay timelines, hubs."""
        self._drop_executors()
        if self.workspace is not None:
            self.workspace.close()
            self.workspace = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        for sh in self.shares:
            sh.close()
        self.shares.clear()
        for link in self.links:
            link.close()
        self.links.clear()
        if self.relay is not None:
            self.relay.close_timelines()
        for be in self._owned_backends:
            be.close()  # its timelines stay with the hub device (queued work may name them)
        self._owned_backends.clear()
        if len(self.hubs) > 1:
            for d in self.hubs:
                d.close()
            self.hubs.clear()
            self.device = None  # type: ignore[assignment]
        elif getattr(self, "_own_device", False) and getattr(self, "device", None) is not None:
            self.device.close()
            self.device = None  # type: ignore[assignment]
        self._close_file()

    def _close_file(self) -> None:
        if getattr(self, "file", None) is not None:
            self.file.close()
        if getattr(self, "_tokenizer", None) is not None:
            self._tokenizer.close()  # (taken from the model: unusable with it, ClosedError)


def _nonfinite_logits(model: LanguageModel) -> ModelError:
    where = getattr(model, "path", None)
    return ModelError(f"the logits of {where.name if where else 'the model'} are not finite (NaN or "
                      "infinity): the model file most likely holds non-finite weights",
                      "check the file (e.g. gguf's dequantize of each tensor for NaN or inf) or fetch it again")


def load_model(path: str | Path | None = None, split: Any = None, backends: Any = None,
               device: Device | None = None, **kw: Any) -> Model:
    """Load a GGUF model (default: SmolLM2-135M-Instruct Q4_1) onto the hub.

    Without ``split``, the split is :func:`vkxsplit.defaults.split_for_machine`'s, the same as the
    command line's: ``auto`` over the given ``backends``; with neither, on a CPU hub (no GPU) the
    cpu backend with ``mode:cpu`` when the hub is opened here (no ``device`` given), else ``none``.
    ``devices``: one hub per device (:class:`Model`), the split ``layer`` by default."""
    if kw.get("devices") is not None:  # one hub per device, the split placed over them at load
        if device is not None:
            raise VkxError("device= and devices= both choose the hub", "give devices= (one hub each) or device=")
        try:
            return Model(path, split=split, backends=backends, **kw)
        except FileNotFoundError as exc:
            raise ModelError(f"model file not found: {path}") from exc
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
