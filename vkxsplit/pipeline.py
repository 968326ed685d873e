"""Layer split over several GPUs: one hub per GPU, the model's layers a pipeline of stages.

llama.cpp's ``--split-mode layer`` over several GPUs, on Vulkan hubs:

- **Stages.** Each GPU is a whole hub (its own :class:`~vkxsplit.vk.device.Device`, queue,
  memory and kernels). Stage ``i`` is a :class:`~vkxsplit.model.Model` of a contiguous range
  of layers (``layer_split`` proportions, like llama.cpp's ``--tensor-split``): it loads only
  those layers' weights and KV cache; the first stage also holds the token embeddings, the
  last the output norm and projection. Nothing else is shared.
- **Links.** Between stage ``i`` and ``i + 1`` only the hidden state crosses: ``T x n_embd``
  f32 (16 KiB per decode token for an 8B model). It goes through host pages both devices
  import by pointer (``VK_EXT_external_memory_host``, :func:`~vkxsplit.attach.import_host_pages`):
  two GPUs of different deviceUUIDs cannot import each other's opaque-fd memory or
  semaphores (the Vulkan external-handle compatibility tables), host allocations carry no such
  rule. Stage ``i``'s graph ends with a ``cpy`` of its hidden state into the link, stage
  ``i + 1``'s starts with a ``cpy`` out of it.
- **Events.** Stage ``i + 1``'s step waits on the GPU for a timeline of its own device
  (``link`` timeline). A relay thread (:class:`~vkxsplit.attach.HostBridge`) waits for stage
  ``i``'s step and signals that timeline, so the caller submits every stage of a step up front
  and waits once, for the last stage; only the relay thread waits in between (it spins on the
  counter before it blocks: a blocking wait returned late on the H200).
- **Micro-batches** (llama.cpp's pipeline parallelism, ``n_ubatch < n_batch``): a prompt step
  of ``T`` tokens is cut into ``micro_batches`` pieces, each in its own slot (rows of the ids,
  positions, links and logits), all submitted at once: while GPU 1 runs piece ``j``, GPU 0
  already runs piece ``j + 1``. Decode (one token) cannot overlap: its stages run in turn.

The tensor split over two hubs (every matrix by rows, an all-reduce per attention and FFN) is
:mod:`vkxsplit.tensor_split`; it shares :class:`HostLink` and the device selectors. Not built:
GPU-side cross-GPU waits without a host thread (measured impossible on the H200 with Vulkan
alone: docs/MULTI_GPU.md), NVLink peer copies (``cudaMemcpyPeerAsync``; each crossing would
pay the Vulkan/CUDA context switch measured in docs/ATTACH.md).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .attach import HostBridge, HostMapping, _memfd, host_page_align, import_host_pages
from .errors import VkxError, WaitTimeout
from .gguf_model import ModelFile, default_model_path
from .gguf_model import load_model as load_gguf
from .model import LanguageModel, Model, slot_rows
from .vk.device import Device
from .vk.event import Timeline
from .vk.memory import Buffer, _align

log = logging.getLogger("vkxsplit.pipeline")


def layer_ranges(n_layer: int, proportions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, sized by ``proportions`` (llama.cpp's
    ``--tensor-split`` rule: cumulative shares rounded to whole layers; every stage at least
    one layer)."""
    props = [float(p) for p in proportions]
    if len(props) < 1 or any(p < 0 or math.isnan(p) for p in props) or sum(props) <= 0:
        raise VkxError(f"bad layer split {list(proportions)}: give one non-negative share per device, "
                       "not all zero (e.g. 1,1)")
    if len(props) > n_layer:
        raise VkxError(f"{len(props)} stages for {n_layer} layers: every stage needs at least one layer")
    total = sum(props)
    bounds = [0]
    acc = 0.0
    for i, p in enumerate(props[:-1]):
        acc += p
        b = round(n_layer * acc / total)
        # at least one layer for this stage and one for each stage after it
        b = max(b, bounds[-1] + 1)
        b = min(b, n_layer - (len(props) - 1 - i))
        bounds.append(b)
    bounds.append(n_layer)
    return [(bounds[i], bounds[i + 1]) for i in range(len(props))]


class HostLink:
    """Host pages two devices import by pointer: stage ``i`` writes the hidden state into
    ``out`` (a buffer of ``src``), stage ``i + 1`` reads it from ``inp`` (of ``dst``); the same
    bytes. Owns the memfd, the mapping and both imports."""

    def __init__(self, src: Device, dst: Device, nbytes: int, name: str) -> None:
        align = max(host_page_align(src), host_page_align(dst))
        size = _align(max(int(nbytes), 4), align)
        self.name, self.size = name, size
        self._fd = _memfd(size, f"vkxsplit-{name}")
        self._blocks: list[Any] = []
        self.mapping: HostMapping | None = None
        try:
            self.mapping = HostMapping(self._fd.fd, size, align)
            for dev in (src, dst):
                self._blocks.append(import_host_pages(dev, self.mapping.addr, size, f"link:{name}"))
        except BaseException:
            self.close()
            raise
        self.out = Buffer(self._blocks[0], 0, size, f"{name}:out")
        self.inp = Buffer(self._blocks[1], 0, size, f"{name}:in")

    def close(self) -> None:
        """Free both imports, then the pages (after every step using them completed)."""
        for b in self._blocks:
            b.close()
        self._blocks.clear()
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self._fd is not None:
            self._fd.close()
            self._fd = None


def _parse_devices(devices: Any) -> list[str | int]:
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    out = [int(d) if isinstance(d, str) and d.isdigit() else d for d in devices]
    if len(out) < 2:
        raise VkxError(f"a pipeline needs at least two devices, got {list(devices)}",
                       "give --devices 0,1 (or run on one device without --devices)")
    return out


class PipelineModel(LanguageModel):
    """A model whose layers are split over ``devices`` (selectors like ``VKXSPLIT_DEVICE``:
    index or name part; the same device twice gives two hubs on one GPU, which is how the tests
    run it on lavapipe). ``layer_split``: one share per device (default equal). ``ubatch``:
    tokens per prompt step; ``micro_batches``: pieces per prompt step in flight on different
    GPUs at once (default: twice the number of stages, at most so that a piece has 32 tokens).
    The API is :class:`~vkxsplit.model.LanguageModel`'s (``logits``, ``prefill``, ``generate``).
    """

    def __init__(self, path: str | Path | None = None, devices: Any = (0, 1), layer_split: Any = None,
                 n_ctx: int | None = None, ubatch: int = 512, micro_batches: int | None = None,
                 progress: Any = None, timeout: float | None = None) -> None:
        self.path = Path(path) if path else default_model_path()
        sels = _parse_devices(devices)
        self.devices: list[Device] = []
        self.links: list[HostLink] = []
        self.link_timelines: list[Timeline] = []
        self.relays: list[HostBridge] = []
        #: the steps of the last _run per stage (close() must not free what a queued one uses)
        self._last_steps: list[list[Any]] = []
        self.stages: list[Model] = []
        self.file: ModelFile = load_gguf(self.path)
        try:
            self._setup(sels, layer_split, n_ctx, ubatch, micro_batches, progress, timeout)
        except BaseException:
            self.close()
            raise
        log.info("pipeline over %s: layers %s, %d micro-batches of %d tokens",
                 ", ".join(d.name for d in self.devices), self.ranges, self.micro, self.piece)

    def _setup(self, sels: list[Any], layer_split: Any, n_ctx: int | None, ubatch: int,
               micro_batches: int | None, progress: Any, timeout: float | None) -> None:
        self.hp = self.file.hparams
        self._load_tokenizer(self.file)
        if isinstance(layer_split, str):
            layer_split = [s for s in layer_split.replace("/", ",").split(",") if s.strip()]
        self.ranges = layer_ranges(self.hp.n_layer, layer_split or [1] * len(sels))
        if len(self.ranges) != len(sels):
            raise VkxError(f"layer split {layer_split} has {len(self.ranges)} shares for {len(sels)} devices")
        self.n_ctx = int(n_ctx or min(self.hp.n_ctx_train or 2048, 4096))
        self.ubatch = max(1, min(int(ubatch), self.n_ctx))
        n = len(sels)
        want = 2 * n if micro_batches is None else int(micro_batches)
        self.micro = max(1, min(want, self.ubatch // 32 if micro_batches is None else self.ubatch, self.ubatch))
        self.piece = -(-self.ubatch // self.micro)  # tokens per micro-batch
        self.n_past = 0
        self.traffic = {"crossed_bytes": 0, "steps": 0, "relays": 0}
        self.last_traffic = 0
        self.timeout = timeout
        t0 = time.perf_counter()
        for s in sels:
            self.devices.append(Device.open(s))
        link_bytes = self.micro * slot_rows(self.piece, self.micro) * self.hp.n_embd * 4
        for i in range(n - 1):
            self.links.append(HostLink(self.devices[i], self.devices[i + 1], link_bytes, f"link{i}"))
            self.link_timelines.append(Timeline(self.devices[i + 1], name=f"pipeline:link{i}"))
            self.relays.append(self._relay(i))
        for i, (dev, rng) in enumerate(zip(self.devices, self.ranges)):
            self.stages.append(Model(
                self.path, device=dev, n_ctx=self.n_ctx, ubatch=self.piece, layers=rng, slots=self.micro,
                link_in=self.links[i - 1].inp if i > 0 else None,
                link_out=self.links[i].out if i < n - 1 else None,
                progress=progress))
        self.device = self.devices[0]
        self.weight_bytes = sum(st.weight_bytes for st in self.stages)
        self.load_seconds = time.perf_counter() - t0

    # the relays poll the previous stage's timeline this long before a blocking wait: on the H200
    # a blocking vkWaitSemaphores returned ~1.3 ms late per crossing in the tensor split's relay,
    # ~0.2 ms when spinning (tools/diag_tensor_split.py)
    relay_spin_s = 0.5

    def _relay(self, i: int) -> HostBridge:
        """The thread that signals link ``i``'s timeline (on stage i + 1's device) when stage
        ``i``'s step ends."""

        cpu = any(d.is_cpu for d in self.devices)
        return HostBridge(self.devices[i + 1], self.link_timelines[i], name=f"pipeline-relay{i}",
                          run=lambda _job: None, timeout=self.timeout,
                          spin_s=0.0 if cpu else self.relay_spin_s)  # (a spin takes a core from a CPU device)

    # -- steps ----------------------------------------------------------------------------

    @property
    def split(self) -> str:
        return "pipeline, layers " + ",".join(f"{a}-{b - 1}" for a, b in self.ranges)

    def set_split(self, split: Any) -> None:
        """Only ``none`` on each stage (a planner split inside a stage is not supported)."""
        if split not in (None, "", "none"):
            raise VkxError(f"split {split!r} inside a pipeline stage is not supported",
                           "with several devices the layers are split over them; use --split none")

    def _run(self, ids: list[int], all_logits: bool) -> Any:
        """Append ``ids`` (at most ubatch) to the context: its micro-batches through every
        stage, all submitted up front; one wait, for the last stage."""
        T = len(ids)
        self._check_step(T)
        last = len(self.stages) - 1
        steps: list[list[Any]] = [[] for _ in self.stages]
        # what close() must see finished: this step's and any earlier failed step's (one still
        # queued behind a stuck stage stays there until a step after it completes)
        self._last_steps = [*self._last_steps, *steps]
        try:
            for j, s in enumerate(range(0, T, self.piece)):
                piece = ids[s:s + self.piece]
                prev = None
                for i, st in enumerate(self.stages):
                    waits: list[Any] = []
                    if i > 0:
                        tl = self.link_timelines[i - 1]
                        v = tl.next()
                        self.relays[i - 1].enqueue(prev, v)
                        waits = [(tl, v)]
                    # (stages before the last make no logits: one graph for both kinds of step)
                    step = st._submit(piece, self.n_past + s, all_logits and i == last, slot=j, waits=waits)
                    steps[i].append(step)
                    pts = step._final_points()
                    if len(pts) != 1:  # stages run split none: one hub point ends a step
                        raise VkxError(f"stage {i}: a step ended in {len(pts)} points")
                    prev = pts[0]
            for i in reversed(range(len(self.stages))):
                steps[i][-1].wait(self.timeout)  # (a stage's steps end in queue order)
            for r in self.relays:
                r.check()  # a relay that timed out let a stage run on a stale hidden state
        except BaseException:
            self._reset_relays()
            raise
        self._last_steps = steps  # (each stage's queue ran past the earlier ones too)
        for st, st_steps in zip(self.stages, steps):
            for step in st_steps:
                st._count(step)
        self.n_past += T
        self.last_traffic = T * self.hp.n_embd * 4 * (len(self.stages) - 1)
        self.traffic["crossed_bytes"] += self.last_traffic
        self.traffic["steps"] += 1
        self.traffic["relays"] += len(steps[0]) * (len(self.stages) - 1)
        return steps[-1][-1]

    def _reset_relays(self) -> None:
        """After a failed step: new relay threads, so that an error a relay records later (a
        wait of the failed step that times out after the caller gave up) is not raised by the
        next, healthy step. Closing a relay signals every value it handed out: no stage stays
        blocked on a link."""
        for i, r in enumerate(self.relays):
            r.close()
            self.relays[i] = self._relay(i)

    def _out(self) -> Model:
        return self.stages[-1]

    def _read_logits(self, T: int) -> np.ndarray:
        last = self.stages[-1]
        rows = last.logits_buf.numpy(np.float32, (last.slots * last.slot_rows, self.hp.n_vocab))
        return np.concatenate([rows[j * last.slot_rows:j * last.slot_rows + min(self.piece, T - s)]
                               for j, s in enumerate(range(0, T, self.piece))])

    @property
    def stats(self) -> dict[str, int]:
        return self._summed_stats(self.stages)

    def close(self) -> None:
        # (idempotent, and every public method raises ClosedError afterwards: errors.Closable)
        if getattr(self, "_tokenizer", None) is not None:
            self._tokenizer.close()
        for r in self.relays:  # signals whatever is pending: no stage stays blocked on a link
            r.close()
        self.relays.clear()
        # every submitted step must have finished before its memory, the links' host pages and
        # imports, or the devices go; one still queued (a stuck GPU) keeps all of it, leaked
        busy = None
        for step in (step for st_steps in self._last_steps for step in st_steps):
            try:
                step.wait(min(5.0, self.timeout or 5.0))
            except WaitTimeout:
                busy = step  # one is enough to keep everything (and not wait 5 s for each)
                break
            except VkxError:
                pass  # finished, with an error its step already raised
        self._last_steps = []
        if busy is not None:
            log.error("pipeline closed while steps are still queued (a stuck GPU?): its devices, memory "
                      "and host pages are left allocated")
            self.stages.clear()
            self.links.clear()
            self.link_timelines.clear()
            self.devices.clear()
            return
        for st in self.stages:
            st.close()  # waits for its steps
        self.stages.clear()
        for link in self.links:
            link.close()
        self.links.clear()
        for tl in self.link_timelines:
            tl.close()
        self.link_timelines.clear()
        for d in self.devices:
            d.close()
        self.devices.clear()
        if getattr(self, "file", None) is not None:
            self.file.close()
