"""A model on the hub (llama, mistral, qwen2, qwen3, gemma3, phi3): from a GGUF file to logits.

:class:`Model` is three layers, one module each, every attribute set by :meth:`Model.__init__`:

- :class:`vkxsplit.generation.LanguageModel`: the API a user calls (tokenizer, ``logits``,
  ``prefill``, ``generate``), which runs the model only through one step, ``_run``;
- :class:`vkxsplit.placement.PlacedModel`: the hubs and backends the model runs on and what
  each hub holds, placed once at load (``auto`` over several hubs chosen there), and the cost
  model of those devices;
- :class:`Model` (here): the load in order (file, tokenizer, hubs, backends, split, placement),
  the graph, plan and executor of each token count (cached), the steps (on one hub; over
  several hubs with micro-batches and the relay), and ``close``. :func:`load_model` chooses the
  split of the machine when none is given.

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
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .archs import DecodeQ8  # noqa: F401 (DecodeQ8: its old home, re-exported)
from .defaults import split_for_machine
from .errors import ModelError, PlanError, VkxError
from .executor import Executor, Step
from .generation import LanguageModel
from .gguf_model import default_model_path
from .gguf_model import load_model as load_gguf
from .graph import Graph
from .hubs import check_partials, join_hub_graphs, parse_devices, slot_rows
from .placement import PlacedModel
from .plan.cost import simulate
from .plan.lowering import job_needs
from .plan.planner import Planner
from .plan.result import Plan
from .plan.spec import parse_spec
from .sampling import Sampler
from .vk.device import Device

log = logging.getLogger("vkxsplit.model")


__all__ = ["LanguageModel", "Model", "Sampler", "load_model", "slot_rows"]


class Model(PlacedModel):
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
        self._reduce_min = None  # (bf16 threshold, where from): reduce_dtype
        self.file = load_gguf(self.path)
        self.hp = self.file.hparams
        self._load_tokenizer(self.file)
        self._own_device = device is None
        self.device = device  # type: ignore[assignment]
        self.hubs = []
        self.shares = []
        self.links = []
        self.relay = None
        self.timeout = timeout
        self.n_ctx = int(n_ctx or min(self.hp.n_ctx_train or 2048, 4096))
        self.ubatch = max(1, min(ubatch, self.n_ctx))
        self.micro, self.piece, self.slots = 1, self.ubatch, 1
        self.ranges = [(0, self.hp.n_layer)]
        self.n_past = 0
        self._execs: OrderedDict[tuple[int, bool, int], Executor] = OrderedDict()
        self._owned_backends = []
        self.backends = {}
        self.arena = None
        self.workspace = None
        self._cost = None
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
        # weights whose stored pages were given back once the cpu backend repacked them (name ->
        # bytes given back; _settle_weights), and the seconds spent repacking them
        self.given_back: dict[str, int] = {}
        self.repack_seconds = 0.0
        # auto over several hubs: what was chosen at load and the candidates' predicted seconds
        self.hub_choice = None
        try:
            t0 = time.perf_counter()
            self._open_hubs(device, sels)
            self._attach(backends)
            self.planner = Planner(self.backends.values(), workspace=self.workspace, hubs=len(self.hubs))
            if split is None and len(self.hubs) > 1:
                split = "layer"
            if len(self.hubs) > 1 and parse_spec(split).kind == "auto":
                split, micro_batches = self._choose_hub_split(micro_batches)
            self.split = self.planner.check(split)
            self._place(micro_batches, progress)
            self.weight_bytes = sum(sh.weight_bytes for sh in self.shares)
            self.load_seconds = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise
        if len(self.hubs) > 1:
            log.info("%s over %s: %s", self.split, ", ".join(d.name for d in self.hubs), self.split_label)

    @property
    def owns_device(self) -> bool:
        """Whether :meth:`close` closes the hub device: True when the model opened it; set it
        to hand over a device the caller opened for it."""
        return self._own_device

    @owns_device.setter
    def owns_device(self, own: bool) -> None:
        self._own_device = bool(own)

    # -- graphs, plans and executors, per token count -----------------------------------------

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

    def plan(self, T: int, all_logits: bool = False, predict: bool = False) -> Plan:
        """The plan for steps of ``T`` tokens (made once per ``T``; ``predict`` adds the cost
        model's predicted step time, measuring what the profile lacks)."""
        ex = self._executor(T, all_logits)
        if predict and ex.plan.prediction is None:
            self.cost.prepare(ex.plan.graph, job_needs(ex.plan.schedule))
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
        self._settle_weights()
        return ex

    # -- repacked weights -----------------------------------------------------------------------

    def _settle_weights(self) -> None:
        """After a plan is built: the cpu backend repacks the weights its products read (one
        copy each, :meth:`CpuBackend.pack <vkxsplit.backends.cpu.CpuBackend.pack>`), and the
        stored pages of a weight are given back as soon as it is repacked, unless a live plan
        reads them as stored (a hub node, the backend's ``get_rows`` of the embedding, a routed
        product, rows ggml has no repacked layout for): resident memory stays about the file's.
        A plan that reads a given-back weight as stored gets its bytes back from the file first
        (restored before its first step: the hub and the backend never read zeros), and so does
        every weight under ``auto``, whose planner times the graph on the hub."""
        cpu = self._repacker()
        if cpu is None:
            return
        from .backend import MatMulJob
        from .plan.schedule import BackendIdOp, BackendNodeOp, BackendOp

        weights = self.shares[0].weights
        stored: set[str] = set()
        packed: dict[str, list[MatMulJob]] = {}
        for ex in self._execs.values():
            sch = ex.schedule
            for seg in sch.segments:
                for op in seg.ops:
                    stored.update(t.name for t in (*op.reads, *([op.src] if op.src is not None else []))
                                  if t.weight)
            for item, job in zip(sch.jobs, ex.backend_jobs):
                op = item.op
                if isinstance(op, BackendOp) and op.backend == cpu.name and isinstance(job, MatMulJob) \
                        and not op.converted_weight:
                    packed.setdefault(op.weight.name, []).append(job)
                elif isinstance(op, (BackendOp, BackendIdOp)):
                    stored.add(op.weight.name)
                elif isinstance(op, BackendNodeOp):
                    stored.update(t.name for t in op.node.inputs if t.weight)
        # a weight some plan reads as stored (a tied embedding's get_rows, ...) keeps its stored
        # pages: it is not copied too (the weights are held once), and its products read it as
        # stored; copies no live plan multiplies by (a plan dropped for another split) are freed
        both = stored & packed.keys()
        cpu.keep_packed([j for n, jobs in packed.items() if n not in both for j in jobs])
        for n in both:
            for j in packed.pop(n):
                cpu.read_as_stored(j)
        if self.split.kind == "auto":
            stored = set(weights)
        self._restore_weights(stored)
        t0 = time.perf_counter()
        for name, jobs in packed.items():
            every = all([cpu.pack(j) for j in jobs])  # (a list: every job's rows repacked)
            if every and name not in stored and name not in self.given_back and name in weights:
                v = weights[name].buffer
                got = v.shared.discard(v.offset, v.size)
                if got:
                    self.given_back[name] = got
        self.repack_seconds += time.perf_counter() - t0

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
        if spec.kind == "auto":  # (its planner times graphs on the hub before any plan exists)
            self._restore_weights()

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
        if self.slots == 1:
            return super()._read_logits(T)
        out = self._out()
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

    # -- closing ------------------------------------------------------------------------------

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
