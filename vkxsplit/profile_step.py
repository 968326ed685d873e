"""A per-level GPU profile of one step (``vkxsplit bench --profile``).

Not the planner's cost profile (:mod:`vkxsplit.plan.profile`): this measures where the GPU time
of one executor step goes, level by level.

A *level* is the commands of a hub segment between two barriers: the dispatches (and copies)
that may run together. :class:`LevelProfiler` records each segment of an :class:`Executor`'s
schedule a second time, into sequences of its own (:class:`_LevelSequence`) that write a GPU
timestamp when a level ends (before the barrier that closes it, and before the sequence's end),
and remember which schedule items (graph nodes) each level holds. The executor's own recordings
are untouched: the normal replay carries no timestamp query and no branch; a profiled step is
the same step submitted with the profiler's sequences (:meth:`Executor.step_with`), so its
outputs are bit-identical to an unprofiled step's.

A level's time runs from the previous level's end timestamp to its own: it includes the
barrier before it (the gap the issue is about) and its own kernels. Timestamps are
``timestampPeriod`` nanoseconds a tick, masked to the queue's ``timestampValidBits``.

:func:`profile_model` runs profiled decode and prefill steps of a loaded model;
:func:`op_table` aggregates levels by the ops they hold; :meth:`StepProfile.trace` is a Chrome /
Perfetto trace (one slice per level).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import VkxError
from .executor import Executor, Step, _record
from .plan.schedule import HubOp
from .vk.command import Sequence, Timestamps

if TYPE_CHECKING:
    from .vk.device import Device

_LAYER = re.compile(r"(?:^|\.)blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer a schedule item belongs to, from its node name (``blk.N.``), else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def role_of(name: str) -> str:
    """A node name without its layer: ``blk.3.attn_q`` -> ``attn_q``, ``blk.3.quantize.3`` ->
    ``quantize``."""
    m = _LAYER.search(name)
    if m is None:
        return name
    rest = name[m.end():]
    return re.sub(rf"\.{m.group(1)}$", "", rest)


class _Full(Exception):
    """The timestamp pool of a recording is too small (the profiler records again, larger)."""


class _LevelSequence(Sequence):
    """A :class:`Sequence` that writes a timestamp at the end of every non-empty level and
    records the items (indices set by the caller in ``item``) whose commands each level holds."""

    def __init__(self, device: Device, name: str, capacity: int) -> None:
        self.stamps = Timestamps(device, capacity)
        self.capacity = capacity
        self.n_stamps = 0
        self.levels: list[list[int]] = []       # items of each closed level, in record order
        self.level_cmds: list[int] = []          # commands (dispatches, copies, fills) per level
        self.item = -1
        self._cur: list[int] = []
        self._cmds = 0
        self._started = False
        try:
            super().__init__(device, name)      # begin(): the barrier against earlier submits
            self.reset_timestamps(self.stamps)  # once: no reset command between levels
            self._stamp()                       # the first level starts here
            self._started = True
        except BaseException:
            self.close()
            raise

    def _stamp(self) -> None:
        if self.n_stamps >= self.capacity:
            raise _Full
        self.write_timestamp(self.stamps, self.n_stamps, reset=False)
        self.n_stamps += 1

    def _close_level(self) -> None:
        if self._started and self._cmds:
            self._stamp()
            self.levels.append(self._cur)
            self.level_cmds.append(self._cmds)
            self._cur, self._cmds = [], 0

    def _note(self) -> None:
        self._cmds += 1
        if not self._cur or self._cur[-1] != self.item:
            self._cur.append(self.item)

    # every barrier the base class records goes through one of these three
    def barrier(self) -> None:
        self._close_level()
        super().barrier()

    def publish_barrier(self) -> None:
        self._close_level()
        super().publish_barrier()

    def _compute_barrier(self) -> None:
        self._close_level()
        super()._compute_barrier()

    def dispatch(self, *a: Any, **kw: Any) -> None:
        super().dispatch(*a, **kw)
        self._note()

    def copy(self, *a: Any, **kw: Any) -> None:
        super().copy(*a, **kw)
        self._note()

    def fill(self, *a: Any, **kw: Any) -> None:
        super().fill(*a, **kw)
        self._note()

    def end(self) -> Sequence:
        self._close_level()
        return super().end()

    def close(self) -> None:
        if getattr(self, "cb", None) is not None:
            super().close()
        if getattr(self, "stamps", None) is not None:
            self.stamps.close()
            self.stamps = None  # type: ignore[assignment]


@dataclass
class Level:
    """One level of a step: where it ran, what it holds, how long it took."""

    index: int                 # in the step, over all segments
    segment: int
    items: list[str]           # schedule item names (graph node names), in record order
    ops: list[str]             # their op names (the graph node's op, or the item kind)
    layers: list[int]
    commands: int              # dispatches, copies and fills
    start_us: float = 0.0      # GPU time from the step's first timestamp
    us: float = 0.0            # from the previous level's end (its barrier included)

    @property
    def label(self) -> str:
        """The level's ops, sorted and joined by ``+`` (a level of independent q/k/v
        projections is ``mul_mat``; one of rope and kv_store is ``kv_store+rope``)."""
        return "+".join(sorted(set(self.ops)))

    @property
    def role(self) -> str:
        """The label with the level's nodes named without their layer (``mul_mat
        [attn_q+attn_k+attn_v]``): the same level of every layer has the same role."""
        names = list(dict.fromkeys(role_of(n) for n in self.items))
        return f"{self.label} [{'+'.join(names)}]"


@dataclass
class StepProfile:
    """The levels of one profiled step of ``T`` tokens and its wall time (submit to done)."""

    name: str
    T: int
    n_layer: int
    levels: list[Level]
    barriers: int              # barriers between levels (each segment's first barrier, which
    #                            orders it after earlier submits, not counted)
    segments: int
    wall_us: float
    device: str = ""
    timestamp_period_ns: float = 1.0
    timestamp_bits: int = 64
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def busy_us(self) -> float:
        """GPU time of the step: the sum of its levels (segments run one after another)."""
        return float(sum(lv.us for lv in self.levels))

    def trace(self, pid: int = 1) -> dict[str, Any]:
        """Chrome trace-event JSON (https://ui.perfetto.dev): one slice per level on one track,
        named by its ops, with its nodes, segment, layers and command count as args."""
        ev: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{self.name} (T={self.T})"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": f"hub levels ({self.device})"}},
        ]
        for lv in self.levels:
            ev.append({"ph": "X", "name": lv.label, "cat": "level", "pid": pid, "tid": 0,
                       "ts": lv.start_us, "dur": lv.us,
                       "args": {"level": lv.index, "segment": lv.segment, "role": lv.role, "nodes": lv.items,
                                "layers": sorted(set(lv.layers)), "commands": lv.commands}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"T": self.T, "levels": len(self.levels), "barriers": self.barriers,
                              "gpu_busy_us": self.busy_us, "wall_us": self.wall_us}}


class LevelProfiler:
    """Profiled recordings of an executor's hub segments (see the module docstring). ``step()``
    submits one step with them; ``read(step)`` (after the step finished) its levels."""

    def __init__(self, executor: Executor, n_layer: int = 0) -> None:
        dev = executor.device
        if dev.timestamp_bits == 0:
            raise VkxError(f"the queue of '{dev.name}' writes no timestamps (timestampValidBits is 0): "
                           "a per-level profile needs them", "profile on another device")
        if executor.tracing:
            raise VkxError("a traced executor (trace=True) times its own recordings: its step trace would "
                           "read timestamps a profiled step never writes",
                           "profile an executor made without trace (Model.set_trace(False), no --trace)")
        self.executor = executor
        self.n_layer = n_layer
        self.seqs: list[_LevelSequence] = []
        self._items: list[list[HubOp]] = []
        try:
            for seg in executor.schedule.segments:
                self.seqs.append(self._record(seg.index, list(seg.ops)))
                self._items.append(list(seg.ops))
        except BaseException:
            self.close()
            raise

    def _record(self, index: int, ops: list[HubOp]) -> _LevelSequence:
        cap = 4 * len(ops) + 8
        while True:
            seq = _LevelSequence(self.executor.device, f"{self.executor.name}#{index}:levels", cap)
            try:
                for i, op in enumerate(ops):
                    seq.item = i
                    _record(seq, op)
                seq.end()
                return seq
            except _Full:
                seq.close()
                cap *= 2
            except BaseException:
                seq.close()
                raise

    @property
    def levels_per_step(self) -> int:
        return sum(len(s.levels) for s in self.seqs)

    def step(self, waits: Iterable[Any] = ()) -> Step:
        return self.executor.step_with(list(self.seqs), waits)

    def read(self, step: Step, wall_us: float, T: int) -> StepProfile:
        """The levels of ``step`` (waited for here), timed by its GPU timestamps."""
        step.wait()
        dev = self.executor.device
        levels: list[Level] = []
        t0: float | None = None
        barriers = 0
        for si, (seq, items) in enumerate(zip(self.seqs, self._items)):
            ts = seq.stamps.read(seq.n_stamps)  # (only the written ones: see Timestamps.read)
            if t0 is None and len(ts):
                t0 = float(ts[0])
            barriers += max(0, len(seq.levels) - 1)
            for k, (idx, cmds) in enumerate(zip(seq.levels, seq.level_cmds)):
                ops = [items[i] for i in idx]
                levels.append(Level(
                    index=len(levels), segment=si, items=[o.name for o in ops],
                    ops=[o.node.op if o.node is not None and o.kind != "convert" else o.kind for o in ops],
                    layers=[n for n in (layer_of(o.name) for o in ops) if n is not None], commands=cmds,
                    start_us=(float(ts[k]) - (t0 or 0.0)) / 1000.0,
                    us=max(0.0, float(ts[k + 1]) - float(ts[k])) / 1000.0))
        return StepProfile(self.executor.name, T, self.n_layer, levels, barriers, len(self.seqs), wall_us,
                           device=dev.name, timestamp_period_ns=float(dev.physical.limits["timestampPeriod"]),
                           timestamp_bits=int(dev.timestamp_bits))

    def close(self) -> None:
        for s in self.seqs:
            s.wait()
            s.close()
        self.seqs.clear()


# ---------------------------------------------------------------------------------------------
# a model's steps


def profiled_step(model: Any, ids: list[int], profilers: dict[int, LevelProfiler]) -> StepProfile:
    """Append ``ids`` to ``model``'s context and run them as one profiled step (the same
    executor, inputs and outputs as ``model.run_step(ids)``). ``profilers``: by executor id,
    kept by the caller so repeated steps reuse the recordings."""
    T = len(ids)
    model._check_ids(ids)
    model._check_step(T)
    ex = model._executor(T, False)
    prof = profilers.get(id(ex))
    if prof is None or prof.executor is not ex:
        prof = profilers[id(ex)] = LevelProfiler(ex, model.hp.n_layer)
    model._write_inputs(ids, model.n_past)
    t0 = time.perf_counter()
    step = prof.step()
    step.wait()
    wall = (time.perf_counter() - t0) * 1e6
    model.n_past += T
    return prof.read(step, wall, T)


def profile_model(model: Any, n_decode: int, n_prompt: int, seed: int = 0) -> tuple[list[StepProfile], StepProfile | None]:
    """``n_decode`` profiled decode steps after a prompt, and one profiled prefill step of
    ``min(n_prompt, ubatch)`` random ids from an empty context (None when ``n_prompt`` is 0).
    Each kind of step runs once unprofiled first, so kernel compilation at a first dispatch
    is not in the profile."""
    if not hasattr(model, "_executor"):
        raise VkxError("--profile profiles one hub's steps: it does not go with --devices")
    rng = np.random.default_rng(seed)
    nv = model.hp.n_vocab
    profilers: dict[int, LevelProfiler] = {}
    try:
        prefill = None
        if n_prompt:
            T = min(n_prompt, model.ubatch, model.n_ctx - 1)
            ids = rng.integers(0, nv, T).tolist()
            model.prefill(ids)
            model.reset()
            profiled_step(model, ids, profilers)  # records; its first run compiles nothing new
            model.reset()
            prefill = profiled_step(model, ids, profilers)
        decode: list[StepProfile] = []
        if n_decode:
            n = max(1, min(n_decode, model.n_ctx - 3))
            model.prefill([int(rng.integers(0, nv))])
            tok = model.last_argmax()
            model.run_step([tok])
            tok = model.last_argmax()
            for _ in range(n):
                decode.append(profiled_step(model, [tok], profilers))
                tok = model.last_argmax()
            decode = decode[1:] if len(decode) > 1 else decode  # the first includes recording-side warm-up
        return decode, prefill
    finally:
        for p in profilers.values():
            p.close()


# ---------------------------------------------------------------------------------------------
# tables and the trace file


def op_table(steps: list[StepProfile], by: str = "label") -> list[dict[str, Any]]:
    """Levels aggregated over ``steps`` (profiles of the same executor) by their ``label`` (the
    ops they hold) or their ``role`` (those ops and nodes, layer left out): levels per step, per
    layer, total us per step, median us per level, share of the step."""
    if by not in ("label", "role"):
        raise ValueError(f"op_table: by={by!r} (label or role)")
    if not steps:
        return []
    n_layer = max(1, steps[0].n_layer)
    busy = statistics.fmean(s.busy_us for s in steps)
    groups: dict[str, list[Level]] = {}
    for s in steps:
        for lv in s.levels:
            groups.setdefault(getattr(lv, by), []).append(lv)
    rows = []
    for label, lvs in groups.items():
        per_step = len(lvs) / len(steps)
        in_layers = sum(1 for lv in lvs if lv.layers) / len(steps)  # the output head's are not
        total = sum(lv.us for lv in lvs) / len(steps)
        rows.append({"op": label, "levels_per_step": per_step,
                     "levels_per_layer": in_layers / n_layer if in_layers else None,
                     "us_per_step": total, "us_per_level_median": statistics.median(lv.us for lv in lvs),
                     "share": total / busy if busy > 0 else 0.0})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def summary(steps: list[StepProfile]) -> dict[str, Any]:
    """Totals of ``steps``: GPU busy and wall time per step and per token, levels, barriers."""
    T = steps[0].T
    busy = statistics.fmean(s.busy_us for s in steps)
    wall = statistics.fmean(s.wall_us for s in steps)
    in_layers = sum(1 for lv in steps[0].levels if lv.layers)
    return {"T": T, "steps": len(steps), "levels": len(steps[0].levels), "barriers": steps[0].barriers,
            "segments": steps[0].segments, "gpu_busy_us": busy, "wall_us": wall,
            "gpu_busy_us_per_token": busy / T, "wall_us_per_token": wall / T,
            "levels_per_layer": in_layers / max(1, steps[0].n_layer)}


def format_table(title: str, steps: list[StepProfile], roles: bool = False) -> str:
    """The markdown table ``bench --profile`` prints for one kind of step (by op; ``roles``:
    a second table by level role)."""
    s = summary(steps)
    out = [f"### {title}: T={s['T']}, {s['steps']} profiled step(s), {s['levels']} levels "
           f"({s['levels_per_layer']:.1f} per layer), {s['barriers']} barriers, {s['segments']} segment(s)"]
    for by, head in (("label", "op"), ("role", "level (op [nodes])"))[:2 if roles else 1]:
        out += ["", f"| {head} | levels/step | levels/layer | us/step | us/level (median) | share |",
                "|---|---:|---:|---:|---:|---:|"]
        for r in op_table(steps, by):
            lpl = "-" if r["levels_per_layer"] is None else f"{r['levels_per_layer']:.2f}"
            out.append(f"| {r['op']} | {r['levels_per_step']:.0f} | {lpl} | {r['us_per_step']:.1f} | "
                       f"{r['us_per_level_median']:.1f} | {100 * r['share']:.1f}% |")
    out += ["", f"GPU busy {s['gpu_busy_us']:.1f} us per step ({s['gpu_busy_us_per_token']:.1f} us per token); "
            f"wall {s['wall_us']:.1f} us per step ({s['wall_us_per_token']:.1f} us per token, submit to done, "
            f"profiled); GPU busy / wall = {s['gpu_busy_us'] / s['wall_us']:.0%}" if s["wall_us"] > 0 else ""]
    return "\n".join(out)


def trace_json(decode: list[StepProfile], prefill: StepProfile | None) -> dict[str, Any]:
    """One Chrome/Perfetto trace: the last profiled decode step (process 1) and the prefill
    step (process 2)."""
    ev: list[dict[str, Any]] = []
    other: dict[str, Any] = {}
    if decode:
        t = decode[-1].trace(pid=1)
        ev += t["traceEvents"]
        other["decode"] = t["otherData"]
    if prefill is not None:
        t = prefill.trace(pid=2)
        ev += t["traceEvents"]
        other["prefill"] = t["otherData"]
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": other}


__all__ = ["Level", "LevelProfiler", "StepProfile", "format_table", "layer_of", "op_table", "profile_model",
           "profiled_step", "role_of", "summary", "trace_json"]
