"""Tensor split over two GPUs: one hub per GPU, each holding a slice of every layer's matrices.

llama.cpp's ``--split-mode row`` (and its meta backend's tensor parallelism), on Vulkan hubs.
Reading order:

- **Shards** (:class:`ShardModel`, a :class:`~vkxsplit.model.Model` with other dimensions).
  Shard ``r`` of ``2`` holds half of the attention heads (rows of ``attn_q``, ``attn_k``,
  ``attn_v``, and its KV cache holds only those heads) and half of the FFN width (rows of
  ``ffn_gate``, ``ffn_up``), and the matching *columns* of ``attn_output`` and ``ffn_down``
  (:func:`shard_slices`). Norms and embeddings are whole on both; only shard 0 makes logits.
  Its graph is the one-GPU graph on its own dimensions (:func:`shard_hparams`), so attention,
  RoPE and the KV cache need nothing new.
- **All-reduce.** A column slice of ``attn_output``/``ffn_down`` gives a partial sum of the
  layer's output. Where the graph has one (:meth:`ShardModel._reduce`), each shard copies its
  partial into its half of host pages both GPUs import, the step's segment ends there, and the
  next segment starts with ``link_sum``: own partial + the other shard's (volatile loads), on the
  GPU. ``a + b`` and ``b + a`` are the same float, so both shards keep bit-identical hidden
  states (with ``partials="f16"`` both add the same two f16-rounded partials). Two slots per shard, by parity of the all-reduce: a shard can be at most one
  all-reduce ahead of the other's reads.
- **Events.** A step is ``2 n_layer + 1`` segments per GPU (:meth:`ShardModel.segments`,
  each recorded once per step shape). Segment ``j`` signals the shard's ``done``
  timeline; a relay thread (:class:`Relay`) waits until both shards' ``done`` reached it and
  submits both shards' segment ``j + 1``: its ``vkQueueSubmit`` is what makes the other GPU's
  partial (made available to the host by the barrier that closes its segment) visible to this
  GPU. Why a host relay: two GPUs have different deviceUUIDs, so neither can import the other's
  timeline; and a GPU polling a flag in host pages does not see the other GPU's write
  (``tools/bench_link.py``: the H200 serves the poll from its cache after the first read).
  Why the relay submits instead of signalling a timeline that segments queued up front wait on:
  queued up front in one submit call, the segments read the other GPU's partial stale on two
  H200s (``tools/diag_tensor_split.py``; docs/MULTI_GPU.md has the measurements).

Two hubs on one device (``devices="0,0"``, lavapipe in CI) run the same code.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelError, VkxError
from .executor import record_graph
from .gguf_model import ModelFile, default_model_path
from .gguf_model import load_model as load_gguf
from .graph import Graph, Tensor
from .model import LanguageModel, Model
from .pipeline import HostLink, _parse_devices
from .vk.command import Sequence
from .vk.device import Device
from .vk.event import Timeline
from .vk.kernel import View
from .vk.memory import _align

log = logging.getLogger("vkxsplit.tensor_split")

WORLD = 2  # shards (GPUs); the all-reduce sums two partials
ROWS = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")  # outputs split: each shard its rows
COLS = ("attn_output", "ffn_down")  # inputs split: each shard a partial sum of the whole output


def shard_hparams(hp: Any, world: int = WORLD) -> Any:
    """The dimensions one shard computes with: its share of the query and KV heads and of the
    FFN width. Raises where the model does not divide (heads, or a column slice that would cut
    a quantization block: checked per weight by :func:`slice_weight`)."""
    bad = [f"{k} {v}" for k, v in (("n_head", hp.n_head), ("n_head_kv", hp.n_head_kv), ("n_ff", hp.n_ff))
           if v % world]
    if bad:
        raise ModelError(f"a tensor split over {world} GPUs needs the heads and the FFN width to divide by "
                         f"{world}: this model has {', '.join(bad)}",
                         "use the layer split (--devices without --split-mode row)")
    return dataclasses.replace(hp, n_head=hp.n_head // world, n_head_kv=hp.n_head_kv // world,
                               n_ff=hp.n_ff // world)


def shard_slices(hp: Any, rank: int, world: int = WORLD) -> dict[str, tuple[str, int, int]]:
    """Per weight kind (``attn_q``, ...): ``("rows" | "cols", start, stop)`` of shard ``rank``,
    in the file's (whole model's) rows or columns."""
    sh = shard_hparams(hp, world)
    q, k, v = sh.n_head * hp.head_dim, sh.n_head_kv * hp.head_dim, sh.n_head_kv * hp.head_dim_v
    o, f = sh.n_head * hp.head_dim_v, sh.n_ff
    return {"attn_q": ("rows", rank * q, (rank + 1) * q), "attn_k": ("rows", rank * k, (rank + 1) * k),
            "attn_v": ("rows", rank * v, (rank + 1) * v), "ffn_gate": ("rows", rank * f, (rank + 1) * f),
            "ffn_up": ("rows", rank * f, (rank + 1) * f),
            "attn_output": ("cols", rank * o, (rank + 1) * o), "ffn_down": ("cols", rank * f, (rank + 1) * f)}


def slice_weight(ti: Any, kind: str, a: int, b: int) -> tuple[tuple[int, ...], np.ndarray]:
    """Rows or columns ``[a, b)`` of tensor ``ti`` as (shape, raw bytes in the file's block
    layout): rows are a zero-copy view of the file; columns a copy of whole blocks of each row."""
    from gguf.constants import GGML_QUANT_SIZES

    if ti.n_dims == 1:  # a bias: its elements, like the rows of the matrix it goes with
        if kind != "rows":  # (an output projection's bias is added once, after the sum)
            raise ModelError(f"{ti.name}: a 1-D tensor cannot be split by columns")
        esz = ti.nbytes // ti.cols
        return (b - a,), ti.data[a * esz:b * esz]
    row_bytes = ti.nbytes // ti.rows
    if kind == "rows":
        return (b - a, ti.cols), ti.data[a * row_bytes:b * row_bytes]
    blk, tsz = GGML_QUANT_SIZES[ti.ggml_type]
    if a % blk or b % blk:
        raise ModelError(f"{ti.name}: columns [{a}, {b}) of a {ti.ggml_type.name} matrix cut its "
                         f"{blk}-value blocks", "use the layer split (--devices without --split-mode row)")
    data = ti.data.reshape(ti.rows, row_bytes)[:, a // blk * tsz:b // blk * tsz]
    return (ti.rows, b - a), np.ascontiguousarray(data).reshape(-1)


def _check_partials(partials: str) -> str:
    if partials not in ("f32", "f16"):
        raise VkxError(f"partials {partials!r}: the all-reduce's partial sums cross as f32 or f16")
    return partials


class Relay:
    """The host between two GPUs' all-reduces: one thread that, for each round ``(v, submit)``
    queued, waits until every shard's ``done`` timeline has reached ``v`` (both shards' segment
    before the all-reduce completed, its partial made available to the host by the segment's
    closing barrier) and then calls ``submit()``: the next segment of every shard, whose
    ``vkQueueSubmit`` makes host-available memory visible to that device. A wait that times out
    (or a submit that fails) is recorded (:meth:`check` raises it) and the step's later rounds
    are dropped: no segment is submitted after the step raised (:meth:`close` joins the thread);
    a failed step replaces the relay (:meth:`TensorSplitModel._run`)."""

    spin_s = 0.5  # spin on the counters this long before blocking waits (0 on CPU devices)
    slice_s = 0.05  # longest single blocking wait, so that close() is heard

    def __init__(self, done: list[Timeline], timeout: float | None, name: str, spin_s: float | None = None) -> None:
        import collections

        self.done, self.timeout = done, timeout
        self.submitting = threading.Lock()  # held while a round submits (see TensorSplitModel._run)
        if spin_s is not None:
            self.spin_s = spin_s
        self._queue: collections.deque[tuple[int, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None
        self.rounds = 0
        self.progress = time.monotonic()  # when a round last went through (or the relay started)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def enqueue(self, rounds: list[tuple[int, Any]]) -> None:
        with self._cond:
            self.progress = time.monotonic()
            self._queue.extend(rounds)
            self._cond.notify()

    def _loop(self) -> None:
        from .vk.event import default_timeout

        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed or not self._queue:
                    self._queue.clear()
                    return
                v, submit = self._queue.popleft()
            if self.error is not None:
                continue  # (a failed step: its later segments are not submitted)
            try:
                if self._wait_all(v, self.timeout if self.timeout is not None else default_timeout()):
                    with self.submitting:
                        submit()
                    self.rounds += 1
                    self.progress = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 (recorded, raised by check())
                self.error = exc

    def _wait_all(self, v: int, timeout: float) -> bool:
        """Every ``done`` at ``v`` (False: closed meanwhile): spinning (:meth:`Timeline.spin`),
        then blocking waits in slices so that :meth:`close` is heard. ``timeout`` is a stall
        limit (:class:`~vkxsplit.vk.event.StallClock`): a GPU whose counter still advances, or
        whose first run compiles its kernels, is waited for; one with no progress for that
        long raises :class:`~vkxsplit.errors.Stalled`."""
        from .errors import Stalled, WaitTimeout
        from .vk.event import StallClock

        for tl in self.done:
            if tl.spin(v, max(0.0, min(self.spin_s, timeout)), lambda: self._closed):
                continue
            clock = StallClock(tl, v, timeout, what=f"{tl.name} to reach {v}")
            left = timeout
            while True:
                try:
                    tl.wait(v, max(0.0, min(self.slice_s, left)))
                    break
                except WaitTimeout:
                    if self._closed:
                        return False
                    try:
                        left = clock.poll()  # raises Stalled after the limit without progress
                    except Stalled as exc:
                        raise Stalled(f"tensor split: {tl.name} did not reach {v}: "
                                      f"{str(exc).splitlines()[0]}; a GPU's segment before an "
                                      "all-reduce is stuck or slow", exc.hint) from None
        return not self._closed

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop; rounds still queued are dropped (their segments never run)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


class ShardModel(Model):
    """Shard ``rank`` of a tensor split: a Model on its own device over its share of the heads
    and FFN width; ``publish[p]``/``peer[p]`` (p = parity of the all-reduce) are (buffer, byte
    offset) in host pages: where it writes its partials, where it reads the other shard's."""

    def __init__(self, path: str | Path, rank: int, publish: list[Any], peer: list[Any], partials: str = "f32",
                 **kw: Any) -> None:
        self.rank, self.world = rank, WORLD
        self.partials = _check_partials(partials)
        self._publish, self._peer = publish, peer
        self._n_reduce = 0
        self._steps: OrderedDict[tuple[int, bool], list[Sequence]] = OrderedDict()
        super().__init__(path, **kw)
        try:
            self.done = Timeline(self.device, name=f"tensor-split:done{rank}")
        except BaseException:
            self.close()
            raise

    @property
    def makes_logits(self) -> bool:  # type: ignore[override]
        return self.rank == 0

    def _shape_hparams(self, hp: Any) -> Any:
        return shard_hparams(hp, WORLD)

    def _holds(self, name: str) -> bool:
        if name == "output.weight":
            return self.rank == 0
        return True

    def _weight_data(self, name: str, ti: Any) -> tuple[tuple[int, ...], np.ndarray]:
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in COLS and ti.n_dims == 1:
            return ti.shape, ti.data  # (not read by the graph: it adds no output-projection bias)
        if parts[0] == "blk" and parts[2] in ROWS + COLS:
            kind, a, b = shard_slices(self.file.hparams, self.rank, self.world)[parts[2]]
            return slice_weight(ti, kind, a, b)
        return ti.shape, ti.data

    def _alloc_state(self) -> None:
        super()._alloc_state()
        self.own16 = None
        if self.partials == "f16":  # this shard's partial as the other one reads it
            self.own16 = self._alloc(self.ubatch * self.hp.n_embd * 2, "device", "partial_f16")

    def _build_graph(self, T: int, all_logits: bool, slot: int = 0) -> Graph:
        self._n_reduce = 0
        return super()._build_graph(T, all_logits, slot)

    def _reduce(self, g: Graph, name: str, o: Tensor) -> Tensor:
        """Publish this shard's partial, end the segment, sum with the other shard's partial."""
        par = self._n_reduce % 2
        self._n_reduce += 1
        dt = self.partials
        nbytes = o.rows * o.cols * (4 if dt == "f32" else 2)
        (pb, po), (qb, qo) = self._publish[par], self._peer[par]
        pub = Tensor(name + ":published", o.shape, dt, View(pb, po, nbytes))
        peer = Tensor(name + ":peer", o.shape, dt, View(qb, qo, nbytes))
        if dt == "f32":
            g.add("cpy", name + "_publish", [o], pub)
            own = o
        else:  # both shards add the same two f16 values: each rounds its own partial once, by
            # the same kernel, for itself and for the other shard
            own = Tensor(name + ":own_f16", o.shape, dt, View(self.own16, 0, nbytes))
            g.add("convert", name + "_round", [o], own)
            g.add("convert", name + "_publish", [o], pub)
        g.add("link_rendezvous", name + "_rendezvous", [pub], pub)  # (a segment boundary, no kernel)
        return g.add("link_sum", name + "_sum", [own, peer], o)

    def segments(self, T: int, all_logits: bool) -> list[Sequence]:
        """The step of ``T`` tokens as segments between its all-reduces, each recorded once.
        Each is submitted by the relay once both shards' previous segment is done
        (TensorSplitModel._run): its vkQueueSubmit makes what the other GPU made available to
        the host visible to this one. Queued up front instead, waiting on timelines the relay
        signalled, the partials were read stale on two H200s when a step's segments went in one
        submit call (tools/diag_tensor_split.py)."""
        key = (T, all_logits)
        hit = self._steps.get(key)
        if hit is not None:
            self._steps.move_to_end(key)
            return hit
        if T > self.ubatch:
            raise VkxError(f"a step of {T} tokens is more than ubatch {self.ubatch}")
        g = self._build_graph(T, all_logits)
        pieces: list[Graph] = [Graph(f"{g.name}:seg0", T=T)]
        for n in g.nodes:
            if n.op == "link_rendezvous":
                pieces.append(Graph(f"{g.name}:seg{len(pieces)}", T=T))
            else:
                pieces[-1].nodes.append(n)
        seqs: list[Sequence] = []
        try:
            for piece in pieces:
                seq = Sequence(self.device, piece.name)
                seqs.append(seq)
                record_graph(seq, piece)
                seq.end()
        except BaseException:
            for seq in seqs:
                seq.close()
            raise
        self.stats["recordings"] += 1
        while len(self._steps) >= 8:  # prompts of many lengths must not pile up sequences
            _, old = self._steps.popitem(last=False)  # (the least recently used)
            for seq in old:
                seq.close()
        self._steps[key] = seqs
        return seqs

    def close(self) -> None:
        for seqs in self._steps.values():
            for seq in seqs:
                seq.close()  # (waits, bounded, for its last submission)
        self._steps.clear()
        tl = getattr(self, "done", None)
        if tl is not None:
            tl.close()
        super().close()


class TensorSplitModel(LanguageModel):
    """A model whose matrices are split by rows (and the output projections by columns) over
    two ``devices``, one hub each, with an all-reduce after each layer's attention and FFN. The
    API is :class:`~vkxsplit.model.LanguageModel`'s (``logits``, ``prefill``, ``generate``).
    ``partials``: the type the partial sums cross in: ``f32`` (default), or ``f16`` (half the
    bytes; each partial rounded to f16 once, ~5e-4 relative, before the f32 sum)."""

    def __init__(self, path: str | Path | None = None, devices: Any = (0, 1), n_ctx: int | None = None,
                 ubatch: int = 512, progress: Any = None, timeout: float | None = None,
                 partials: str = "f32") -> None:
        self.path = Path(path) if path else default_model_path()
        self.partials = _check_partials(partials)
        try:
            sels = _parse_devices(devices)
        except VkxError:
            sels = []
        if len(sels) != WORLD:
            raise VkxError(f"a tensor split runs over {WORLD} devices, got {devices!r}",
                           "give --devices 0,1 (or use the layer split for more devices)")
        self.devices: list[Device] = []
        self.shards: list[ShardModel] = []
        self.relays: list[Relay] = []
        self.pages: HostLink | None = None
        self.file: ModelFile = load_gguf(self.path)
        try:
            self._setup(sels, n_ctx, ubatch, progress, timeout)
        except BaseException:
            self.close()
            raise
        log.info("tensor split over %s", ", ".join(d.name for d in self.devices))

    def _setup(self, sels: list[Any], n_ctx: int | None, ubatch: int, progress: Any, timeout: float | None) -> None:
        self.hp = self.file.hparams
        shard_hparams(self.hp)  # refuse early, with the reason
        self._load_tokenizer(self.file)
        self.n_ctx = int(n_ctx or min(self.hp.n_ctx_train or 2048, 4096))
        self.ubatch = max(1, min(int(ubatch), self.n_ctx))
        self.n_past = 0
        self.timeout = timeout
        self.traffic = {"crossed_bytes": 0, "steps": 0, "all_reduces": 0}
        self.last_traffic = 0
        t0 = time.perf_counter()
        for s in sels:
            self.devices.append(Device.open(s))
        slot = _align(self.ubatch * self.hp.n_embd * 4, 256)
        self.pages = HostLink(self.devices[0], self.devices[1], 2 * WORLD * slot, "tensor-split")
        seen = [self.pages.out, self.pages.inp]  # the same pages, as each device sees them

        def views(dev: int, owner: int) -> list[Any]:
            return [(seen[dev], (owner * 2 + p) * slot) for p in range(2)]

        for r, dev in enumerate(self.devices):
            self.shards.append(ShardModel(self.path, r, views(r, r), views(r, 1 - r), partials=self.partials,
                                          device=dev, n_ctx=self.n_ctx, ubatch=self.ubatch, progress=progress))
        self.relays.append(self._relay())
        self.device = self.devices[0]
        self.weight_bytes = sum(s.weight_bytes for s in self.shards)
        self.load_seconds = time.perf_counter() - t0
        self._base = 0
        self._pending: list[Sequence] = []  # what a failed step submitted (see _drain)

    def _relay(self) -> Relay:

        cpu = any(d.is_cpu for d in self.devices)
        return Relay([s.done for s in self.shards], self.timeout, "tensor-split-relay",
                     spin_s=0.0 if cpu else None)  # (a spin would take a core from a CPU device)

    @property
    def split(self) -> str:
        return f"tensor split (rows) over {WORLD} GPUs"

    def set_split(self, split: Any) -> None:
        """Only ``none`` (no planner split inside a shard)."""
        if split not in (None, "", "none"):
            raise VkxError(f"split {split!r} inside a tensor-split shard is not supported",
                           "with --split-mode row the matrices are split over the GPUs; use --split none")

    def _run(self, ids: list[int], all_logits: bool) -> Any:
        """One step on both GPUs: segment 0 of both submitted here, every later one by the relay
        when both shards finished the one before; one wait per GPU, here."""
        T = len(ids)
        self._check_step(T)
        self._drain()
        first = any((T, all_logits) not in s._steps for s in self.shards)
        segs = [s.segments(T, all_logits) for s in self.shards]
        n = len(segs[0])
        if any(len(q) != n for q in segs):
            raise VkxError(f"the shards' steps have {[len(q) for q in segs]} segments")
        base = self._base
        self._base += n
        if first:  # kernels compile at their first dispatch: the longer stall limit (vk.event)
            for s in self.shards:
                s.done.expect_slow(base + n, f"the first run of a step of {T} tokens")
        relay = self.relays[0]
        t0 = time.perf_counter()

        def segment(j: int) -> Any:
            def submit() -> None:
                for s, q in zip(self.shards, segs):
                    q[j].submit(signals=[(s.done, base + j + 1)])
            return submit

        try:
            for s in self.shards:
                s._write_inputs(ids, self.n_past)
            relay.enqueue([(base + j, segment(j)) for j in range(1, n)])
            segment(0)()
            self.last_submit_s = time.perf_counter() - t0  # host time spent queueing (segment 0)
            for s in self.shards:
                self._wait_done(s, base + n, relay)
            with relay.submitting:  # (the relay is out of its last vkQueueSubmit of the step)
                relay.check()
        except BaseException as exc:
            self._pending = [q for qs in segs for q in qs]  # (what the failed step submitted)
            err = relay.error
            self._reset_relays()
            if err is not None and err is not exc:
                raise err from exc  # the relay's reason names the shard that did not finish
            raise
        for s in self.shards:
            s.stats["steps"] += 1
            s.stats["submits"] += n
        self.n_past += T
        isz = 4 if self.partials == "f32" else 2
        self.last_traffic = (n - 1) * T * self.hp.n_embd * isz * WORLD  # each shard's partial, both ways
        self.traffic["crossed_bytes"] += self.last_traffic
        self.traffic["steps"] += 1
        self.traffic["all_reduces"] += n - 1
        return None

    def _wait_done(self, s: ShardModel, value: int, relay: Relay) -> None:
        """Wait for shard ``s``'s last segment: raises the relay's error as soon as it has one,
        and times out only after ``timeout`` without progress (a step is many crossings)."""
        from .errors import WaitTimeout
        from .vk.event import COLD_FACTOR, default_timeout

        timeout = self.timeout if self.timeout is not None else default_timeout()
        while True:
            if relay.error is not None:
                raise relay.error
            try:
                s.done.wait(value, 0.05)
                return
            except WaitTimeout:
                # the relay's own stall limit (longer while a shard's first run compiles its
                # kernels), and a little more: its error, naming the shard that is stuck, wins
                cold = any(sh.done._value() < sh.done._slow_until for sh in self.shards)
                limit = timeout * (COLD_FACTOR if cold else 1.0) + 4 * relay.slice_s
                if time.monotonic() - relay.progress > limit:
                    raise WaitTimeout(f"tensor split: {s.done.name} did not reach {value} within {timeout:g} s "
                                      f"of the last crossing (it is at {s.done.value}): a GPU's step is stuck",
                                      "raise VKXSPLIT_TIMEOUT_S if the work is just slow") from None

    def _drain(self) -> None:
        """Before a step: what a failed step submitted must have finished (it reads the ids,
        positions and activations the new step writes)."""
        for q in self._pending:
            try:
                q.wait(min(5.0, self.timeout or 5.0))
            except VkxError as exc:
                raise VkxError(f"tensor split: a segment of a failed step is still running on {q.device.name} "
                               f"({exc})", "wait for the stuck GPU, or close the model") from None
        self._pending = []

    def _reset_relays(self) -> None:
        """After a failed step: a new relay, so that an error the old one records later (a wait
        of the failed step timing out after the caller gave up) is not the next step's."""
        try:
            for rl in self.relays:
                rl.close()
        finally:
            self.relays = [self._relay()]

    def _out(self) -> Model:
        return self.shards[0]

    @property
    def stats(self) -> dict[str, int]:
        return self._summed_stats(self.shards)

    def close(self) -> None:
        # (idempotent, and every public method raises ClosedError afterwards: errors.Closable)
        if getattr(self, "_tokenizer", None) is not None:
            self._tokenizer.close()
        for rl in self.relays:  # drops what is queued: no later segment is submitted
            rl.close()
        self.relays.clear()
        # every submitted segment must have finished before its memory, its timeline, the host
        # pages or the device go; one still queued (a stuck GPU) keeps all of it, leaked
        busy = []
        for s in self.shards:
            for seqs in s._steps.values():
                for q in seqs:
                    try:
                        q.wait(min(5.0, self.timeout or 5.0))
                    except VkxError:
                        busy.append(q)
        if busy:
            log.error("tensor split closed while %d segments are still queued on %s (a stuck GPU?): its "
                      "devices, memory and host pages are left allocated", len(busy),
                      ", ".join(sorted({q.device.name for q in busy})))
            self.shards.clear()
            self.devices.clear()
            self.pages = None
            return
        for s in self.shards:
            s.close()
        self.shards.clear()
        if self.pages is not None:
            self.pages.close()
            self.pages = None
        for d in self.devices:
            d.close()
        self.devices.clear()
        if getattr(self, "file", None) is not None:
            self.file.close()
