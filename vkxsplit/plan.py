"""The split planner: which participant (the Vulkan hub or an attached backend) runs each op.

Given a graph (:mod:`vkxsplit.graph`), the backends present and a split spec, :class:`Planner`
produces a :class:`Plan`: for every node the participant that runs it, or for a ``mul_mat`` the
row ranges each participant computes; the conversions it inserts (x f32 -> bf16 every step and
the weights once, on the hub, for a backend that computes in bf16; y stays f32); and, lowered
and cut by :func:`vkxsplit.executor.build_schedule`, the timeline points between participants.
The executor (:class:`vkxsplit.executor.Executor`) runs it. Spec grammar (``docs/PLANNER.md``)::

    none                                  everything on the hub
    layer[:ITEM,...]                      ITEM: REGEX=NAME   ops whose node or weight name
                                                             matches go to NAME (first match
                                                             wins, like llama.cpp -ot)
                                                R | NAME=R   decoder layers in contiguous
                                                             blocks by ratio (hub first)
    tensor:R,R,...[@REGEX]                mul_mat output rows divided by ratio (hub first, then
    tensor:NAME=R,...[@REGEX]             the backends in --backends order); @REGEX: only those
    mode:RULE,...                         RULE: NAME[>=N][<=N][>N][<N][=N][@REGEX]: NAME runs
                                          every mul_mat of a step whose batch size T is in the
                                          range (default: its caps' min_batch..max_batch)
    auto                                  the cheapest of the above per T, from a cost model
                                          measured on the graph's own shapes

Costs (:class:`CostModel`) come from measurements on this machine: hub ops from GPU
timestamps of the graph itself, backends from host timers on the graph's ``mul_mat`` shapes;
they are kept in a JSON :class:`Profile` under ``vkxsplit.vk.device.cache_dir()``, keyed by
the hub's device UUID, driver version and kernels (the shipped SPIR-V and the kill switches
set: :func:`kernels_ident`); when any changes, a new profile is measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .backend import NODE_OPS
from .errors import PlanError, VkxError
from .executor import BackendNodeOp, BackendOp, HubOp, Item, Schedule, build_schedule
from .graph import Graph, Node, Span, Tensor, any_overlap, span

if TYPE_CHECKING:
    from .attach import SharedArena
    from .vk.device import Device

log = logging.getLogger("vkxsplit.plan")

KINDS = ("none", "layer", "tensor", "mode", "auto")
HUB = "hub"
HUB_ALIASES = ("hub", "vulkan")
#: Ops the planner may hand a backend; every other op of the graph stays on the hub.
OFFLOADABLE_OPS = frozenset({"mul_mat"})
#: Ops whose inputs and outputs are f32 state (residual stream, norms, attention, positions):
#: they have no bf16 form, so a backend that computes only in bf16 can never take them.
F32_ONLY_OPS = frozenset({"get_rows", "rms_norm", "add_rms_norm", "add", "swiglu", "rope", "kv_store", "attention", "argmax",
                          "softmax", "norm", "mul", "scale", "silu", "gelu", "cpy"})
FLOAT_TYPES = ("f32", "f16", "bf16")
_ELEM = {"f32": 4, "f16": 2, "bf16": 2}
GRANULE = 16  # tensor-split row boundaries are multiples of this (except the last)

# =============================================================================================
# the spec grammar


@dataclass(frozen=True)
class Override:
    pattern: str
    backend: str


@dataclass(frozen=True)
class Rule:
    backend: str
    lo: int | None = None
    hi: int | None = None
    filter: str | None = None

    @property
    def explicit(self) -> bool:
        return self.lo is not None or self.hi is not None

    def describe(self) -> str:
        lo = self.lo if self.lo is not None else 1
        hi = "inf" if self.hi is None else self.hi
        return f"{self.backend}: T in [{lo}, {hi}]"


@dataclass(frozen=True)
class SplitSpec:
    """A parsed split spec (:func:`parse_spec`); ``str(spec)`` is the text it came from."""

    kind: str
    text: str
    ratios: tuple[tuple[str | None, float], ...] = ()   # (participant name or None = positional, ratio)
    overrides: tuple[Override, ...] = ()
    rules: tuple[Rule, ...] = ()
    filter: str | None = None

    def __str__(self) -> str:
        return self.text

    def names(self) -> list[str]:
        """Participant names the spec refers to."""
        out = [n for n, _ in self.ratios if n is not None]
        out += [o.backend for o in self.overrides]
        out += [r.backend for r in self.rules]
        return out


def _split_items(body: str) -> list[str]:
    """Split at commas outside (), [] and {} and not escaped (``\\,`` is a literal comma)."""
    items: list[str] = []
    depth = 0
    cur = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            if body[i + 1] == ",":
                cur.append(",")
            else:
                cur.append(body[i:i + 2])
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        if c == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    items.append("".join(cur))
    return [s.strip() for s in items]


_NUM = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_NAME = re.compile(r"^[A-Za-z][\w.-]*$")


def _ratio(text: str, spec: str) -> float:
    if not _NUM.match(text):
        raise PlanError(f"split '{spec}': ratio {text!r} is not a number", "ratios are numbers >= 0, e.g. tensor:3,1")
    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise PlanError(f"split '{spec}': ratio {text} must be a finite number >= 0")
    return v


def _regex(pattern: str, spec: str) -> str:
    if not pattern:
        raise PlanError(f"split '{spec}': empty regex")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise PlanError(f"split '{spec}': bad regex {pattern!r}: {exc}") from None
    return pattern


def _parse_ratios(items: list[str], spec: str) -> tuple[tuple[str | None, float], ...]:
    out: list[tuple[str | None, float]] = []
    for it in items:
        if "=" in it:
            name, _, val = it.partition("=")
            name = name.strip()
            if not _NAME.match(name):
                raise PlanError(f"split '{spec}': {name!r} is not a participant name")
            out.append((name, _ratio(val.strip(), spec)))
        else:
            out.append((None, _ratio(it, spec)))
    kinds = {n is None for n, _ in out}
    if len(kinds) > 1:
        raise PlanError(f"split '{spec}': mixes positional and named ratios", "use one form: 3,1 or hub=3,cpu=1")
    names = [n for n, _ in out if n is not None]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanError(f"split '{spec}': ratio for {dup[0]} given twice")
    return tuple(out)


_COND = re.compile(r"\s*(>=|<=|>|<|=)\s*([^<>=@\s]*)")


def _parse_rule(item: str, spec: str) -> Rule:
    text, at, filt = item.partition("@")
    m = re.match(r"^\s*([^<>=@\s]+)\s*(.*)$", text)
    if not m or not m.group(1):
        raise PlanError(f"split '{spec}': rule {item!r} names no backend", "e.g. mode:cuda>=32")
    name, rest = m.group(1), m.group(2)
    if not _NAME.match(name):
        raise PlanError(f"split '{spec}': {name!r} is not a backend name")
    lo = hi = None
    pos = 0
    while pos < len(rest):
        c = _COND.match(rest, pos)
        if not c or c.end() == pos:
            raise PlanError(f"split '{spec}': cannot read the batch condition {rest[pos:]!r} of rule {item!r}",
                            "conditions are >=N, >N, <=N, <N or =N with N an integer")
        op, val = c.group(1), c.group(2)
        if not re.fullmatch(r"\d+", val or ""):
            raise PlanError(f"split '{spec}': batch threshold {val!r} in {item!r} is not a positive integer")
        n = int(val)
        new_lo = new_hi = None
        if op == ">=":
            new_lo = n
        elif op == ">":
            new_lo = n + 1
        elif op == "<=":
            new_hi = n
        elif op == "<":
            new_hi = n - 1
        else:
            new_lo = new_hi = n
        if new_lo is not None:
            if lo is not None:
                raise PlanError(f"split '{spec}': rule {item!r} has two lower bounds")
            lo = new_lo
        if new_hi is not None:
            if hi is not None:
                raise PlanError(f"split '{spec}': rule {item!r} has two upper bounds")
            hi = new_hi
        pos = c.end()
    if lo is not None and lo < 1:
        raise PlanError(f"split '{spec}': batch threshold {lo} in {item!r} is nonsensical: a step has at least "
                        "1 token", "use >=1 (or leave the lower bound out)")
    if hi is not None and hi < 1:
        raise PlanError(f"split '{spec}': rule {item!r} selects no batch size (upper bound {hi} < 1)")
    if lo is not None and hi is not None and lo > hi:
        raise PlanError(f"split '{spec}': rule {item!r} is nonsensical: lower bound {lo} is above upper bound {hi}",
                        "e.g. mode:cpu>=8<=64")
    return Rule(name, lo, hi, _regex(filt, spec) if at else None)


def parse_spec(text: str | SplitSpec | None) -> SplitSpec:
    """Parse a split spec (see the module docstring); raises :class:`PlanError` naming the
    problem. Checks needing the backends or the graph happen in :class:`Planner`."""
    if isinstance(text, SplitSpec):
        return text
    if text is None or not str(text).strip() or str(text).strip().lower() == "none":
        return SplitSpec("none", "none")
    raw = str(text).strip()
    head, sep, body = raw.partition(":")
    kind = head.strip().lower()
    if kind not in KINDS:
        raise PlanError(f"unknown split mode {head.strip()!r} in '{raw}'",
                        "one of: none, layer, tensor, mode, auto (docs/PLANNER.md)")
    body = body.strip()
    if kind == "none":
        raise PlanError(f"split 'none' takes no arguments (got '{raw}')")
    if kind == "auto":
        if body:
            raise PlanError(f"split 'auto' takes no arguments (got '{raw}')")
        return SplitSpec("auto", raw)
    if kind == "tensor":
        rtext, at, filt = body.partition("@")
        if not rtext.strip():
            raise PlanError(f"split '{raw}' gives no ratios", "e.g. tensor:3,1 (hub 3 parts, the first backend 1)")
        ratios = _parse_ratios([s.strip() for s in rtext.split(",")], raw)
        return SplitSpec("tensor", raw, ratios=ratios, filter=_regex(filt, raw) if at else None)
    if kind == "layer":
        ratios: list[str] = []
        overrides: list[Override] = []
        if body:
            for it in _split_items(body):
                if not it:
                    raise PlanError(f"split '{raw}': empty item")
                if _NUM.match(it):
                    ratios.append(it)
                    continue
                if "=" not in it:
                    raise PlanError(f"split '{raw}': item {it!r} is neither a ratio nor REGEX=BACKEND",
                                    r"e.g. layer:blk\..*\.ffn_.*=npu-emu or layer:3,1")
                left, _, right = it.rpartition("=")
                left, right = left.strip(), right.strip()
                if _NUM.match(right) and _NAME.match(left):
                    ratios.append(f"{left}={right}")
                    continue
                if not _NAME.match(right):
                    raise PlanError(f"split '{raw}': {right!r} after '=' in {it!r} is not a backend name")
                overrides.append(Override(_regex(left, raw), right))
        return SplitSpec("layer", raw, ratios=_parse_ratios(ratios, raw) if ratios else (),
                         overrides=tuple(overrides))
    # mode
    if not body:
        raise PlanError(f"split '{raw}' gives no rules", "e.g. mode:cuda>=32 (cuda runs steps of 32+ tokens)")
    rules = tuple(_parse_rule(it, raw) for it in _split_items(body))
    return SplitSpec("mode", raw, rules=rules)


def parse_specs(text: str) -> list[SplitSpec]:
    """Several specs separated by ``;`` (``vkxsplit bench --split 'none;tensor:1,1'``)."""
    return [parse_spec(s) for s in text.split(";")] if text else [parse_spec(None)]


def parse_backends(text: str | Iterable[Any] | None) -> list[Any]:
    """``"cpu,npu-emu:min_batch=1:gflops=50"`` -> ``[("cpu", {}), ("npu-emu", {...})]``.
    Backend objects in a list are passed through."""
    if text is None:
        return []
    if not isinstance(text, str):
        out: list[Any] = []
        for x in text:
            out += parse_backends(x) if isinstance(x, str) else [x]
        return out
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, *opts = item.split(":")
        kw: dict[str, Any] = {}
        for o in opts:
            k, eq, v = o.partition("=")
            if not eq or not k:
                raise VkxError(f"backend option {o!r} of {name} is not KEY=VALUE", "e.g. npu-emu:min_batch=1")
            kw[k.strip()] = _opt_value(v.strip())
        out.append((name.strip(), kw))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise VkxError(f"backend {dup[0]} is listed twice")
    return out


def _opt_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


# =============================================================================================
# workspace: memory the planner inserts


class Workspace:
    """Memory the planner inserts: per-step shadows of activations in a backend's compute type
    and weights converted once. This base class makes buffer-less tensors (dry planning, the
    cost model's candidate evaluation); :class:`ArenaWorkspace` allocates and converts."""

    dry = True

    def __init__(self) -> None:
        self._shadows: dict[tuple[Span, str], Tensor] = {}
        self._weights: dict[tuple[str, int, int, str], Tensor] = {}
        self._resident: dict[str, set[tuple[Any, ...]]] = {}

    def shadow(self, x: Tensor, dtype: str) -> Tensor:
        key = (span(x), dtype)
        t = self._shadows.get(key)
        if t is None:
            t = self._shadows[key] = Tensor(f"{x.name}@{dtype}", x.shape, dtype, self._alloc_shadow(x, dtype))
        return t

    def converted_weight(self, w: Tensor, r0: int, r1: int, dtype: str) -> Tensor:
        key = (w.name, r0, r1, dtype)
        t = self._weights.get(key)
        if t is None:
            buf = self._convert(w, r0, r1, dtype)
            t = self._weights[key] = Tensor(f"{w.name}[{r0}:{r1}]@{dtype}", (r1 - r0, w.shape[-1]), dtype, buf,
                                            weight=True)
        return t

    def resident(self, backend: str) -> set[tuple[Any, ...]]:
        """Kernel keys (loaded weights) the live plans put on a capped backend."""
        return self._resident.setdefault(backend, set())

    def _alloc_shadow(self, x: Tensor, dtype: str) -> Any:
        return None

    def _convert(self, w: Tensor, r0: int, r1: int, dtype: str) -> Any:
        return None

    @property
    def converted_bytes(self) -> int:
        return sum(t.rows * t.cols * _ELEM[t.dtype] for t in self._weights.values())

    def release(self) -> None:
        """Forget everything (a new split config)."""
        self._shadows.clear()
        self._weights.clear()
        self._resident.clear()

    def close(self) -> None:
        self.release()


class ArenaWorkspace(Workspace):
    """Shadows and converted weights in a :class:`~vkxsplit.attach.SharedArena`. Weights are
    converted once, on the hub, with its kernels (``get_rows`` dequantizes quantized rows into
    f32, ``convert`` rounds them), when a plan first needs them; plans share them."""

    dry = False

    def __init__(self, device: Device, arena: SharedArena) -> None:
        super().__init__()
        self.device = device
        self.arena = arena
        self._bufs: list[Any] = []
        self.conversions = 0          # weight conversions run (each once) since the last release()
        self.shadow_bytes = 0

    def _alloc_shadow(self, x: Tensor, dtype: str) -> Any:
        n = x.rows * x.cols * _ELEM[dtype]
        sb = self.arena.alloc(n, f"{x.name}@{dtype}")
        self._bufs.append(sb)
        self.shadow_bytes += n
        return sb.view(0, n)

    def _convert(self, w: Tensor, r0: int, r1: int, dtype: str) -> Any:
        from .ops.convert import record_convert
        from .ops.get_rows import record_get_rows
        from .vk.command import Sequence

        K = w.shape[-1]
        rows = r1 - r0
        n = rows * K * _ELEM[dtype]
        sb = self.arena.alloc(n, f"{w.name}[{r0}:{r1}]@{dtype}")
        self._bufs.append(sb)
        dev = self.device
        tmp = ids = None
        seqs = []
        try:
            if w.dtype in FLOAT_TYPES:
                seq = Sequence(dev, f"convert {w.name}")
                seqs.append(seq)
                record_convert(seq, w.buffer, sb.view(0, n), rows * K, w.dtype, dtype, src_offset=r0 * K)
                seq.run()
            else:
                chunk = max(1, min(rows, (16 << 20) // (K * 4), 65535))
                tmp = dev.memory.alloc(chunk * K * 4, "device", "convert-tmp")
                ids = dev.memory.alloc(rows * 4, "host", "convert-ids")
                ids.numpy(np.int32, (rows,))[:] = np.arange(r0, r1, dtype=np.int32)
                for c0 in range(0, rows, chunk):
                    c = min(chunk, rows - c0)
                    seq = Sequence(dev, f"convert {w.name}")
                    seqs.append(seq)
                    record_get_rows(seq, w.buffer, w.dtype, ids, tmp, c, K, ids_offset=c0,
                                    n_rows=w.shape[0])
                    record_convert(seq, tmp, sb.view(0, n), c * K, "f32", dtype, dst_offset=c0 * K)
                    seq.run()
        finally:
            for s in seqs:
                s.close()
            for b in (tmp, ids):
                if b is not None:
                    b.close()
        self.conversions += 1
        return sb.view(0, n)

    def release(self) -> None:
        super().release()
        for b in self._bufs:
            b.close()
        self._bufs.clear()
        self.shadow_bytes = 0
        self.conversions = 0


# =============================================================================================
# costs


PROFILE_VERSION = 2

#: Used where nothing was measured (dry planning without a profile).
DEFAULTS = {"hub_gflops": 100.0, "hub_gbs": 50.0, "backend_gflops": 10.0, "latency_s": 2e-4,
            "submit_s": 3e-5, "convert_ns_per_elem": 0.1, "enqueue_s": 2e-5}


#: settings that change which kernels the hub runs (so what a profile measured)
KERNEL_SWITCHES = ("VKXSPLIT_DISABLE_COOPMAT", "VKXSPLIT_DISABLE_COOPMAT2", "VKXSPLIT_DISABLE_DQ16", "VKXSPLIT_DISABLE_VECQ", "VKXSPLIT_DISABLE_VECQ_SG",
                   "VKXSPLIT_DISABLE_SPLITK", "VKXSPLIT_DISABLE_COOP_SHAPES", "VKXSPLIT_DISABLE_FUSION")


def kernels_ident() -> str:
    """A hash of the kernels the hub would run: every shipped SPIR-V module's hash and the
    kill switches set (KERNEL_SWITCHES). New kernels (a vkxsplit upgrade, a rebuild) or another
    switch mean other costs: a profile measured before does not apply."""
    from .shaders import shipped
    from .vk.instance import env_flag

    h = hashlib.sha256()
    for name, meta in sorted(shipped().items()):
        h.update(f"{name}:{meta.get('spv_sha256', '')}\n".encode())
    for k in KERNEL_SWITCHES:
        h.update(f"{k}={int(env_flag(k))}\n".encode())  # (unset, "", "0", "off": the same)
    return h.hexdigest()[:16]


def _hub_ident(device: Any) -> dict[str, Any]:
    p = device.physical
    return {"device": device.name, "device_uuid": bytes(p.device_uuid).hex(), "driver_version": int(p.driver_version),
            "kernels": kernels_ident()}


class Profile:
    """Measured costs of one hub device, as JSON under the cache dir. The file name and its
    content carry the device UUID, driver version and kernels (:func:`kernels_ident`): when
    any changes, what was measured no longer applies and is measured again."""

    def __init__(self, path: Path | None = None, ident: dict[str, Any] | None = None) -> None:
        self.path = path
        self.ident = ident or {}
        self.entries: dict[str, dict[str, Any]] = {}
        self.stale_reason: str | None = None
        self.dirty = False

    @classmethod
    def for_device(cls, device: Any, directory: str | Path | None = None) -> Profile:
        from .vk.device import cache_dir

        ident = _hub_ident(device)
        key = hashlib.sha256(f"{ident['device_uuid']}:{ident['driver_version']}:{ident['kernels']}".encode()
                             ).hexdigest()[:16]
        p = cls(Path(directory or cache_dir()) / f"profile-{key}.json", ident)
        p._load()
        return p

    def _load(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.stale_reason = f"unreadable ({exc})"
            return
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            self.stale_reason = "another profile format"
            return
        for k in ("device_uuid", "driver_version", "kernels"):
            if data.get(k) != self.ident.get(k):
                self.stale_reason = f"{k} changed ({data.get(k)} -> {self.ident.get(k)})"
                return
        self.entries = {k: dict(v) for k, v in data.get("entries", {}).items() if isinstance(v, dict)}

    def get(self, scope: str, key: str) -> Any:
        return self.entries.get(scope, {}).get(key)

    def put(self, scope: str, key: str, value: Any) -> None:
        self.entries.setdefault(scope, {})[key] = value
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        data = {"version": PROFILE_VERSION, **self.ident, "entries": self.entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as exc:
            log.warning("cannot save the device profile %s: %s", self.path, exc)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


class CostModel:
    """Seconds per op for each participant, from a :class:`Profile`; missing entries are
    measured on demand (``device``/``arena``/``backends`` given) or estimated from
    :data:`DEFAULTS` and the backends' ``calibrate()`` rates (then ``estimated`` says so).

    Keys: hub nodes by :meth:`vkxsplit.graph.Node.signature`, measured by ``hub_runner(graph)``
    (the model runs the graph once with GPU timestamps); backend ``mul_mat`` by (weight type
    handed to it, N, K, M), timed on the host; per-backend round-trip latency; the hub's submit
    overhead and conversion rate."""

    def __init__(self, profile: Profile | None = None, *, device: Device | None = None,
                 arena: SharedArena | None = None, backends: Iterable[Any] = (), reps: int = 3,
                 hub_runner: Callable[[Graph], dict[int, float]] | None = None) -> None:
        self.profile = profile or Profile()
        self.device = device
        self.arena = arena
        self.backends = {b.name: b for b in backends}
        self.reps = max(1, reps)
        self.hub_runner = hub_runner
        self.estimated: set[str] = set()
        self.measured = 0
        self._rates: dict[str, float] = {}

    # -- keys ---------------------------------------------------------------------------------

    def scope(self, name: str) -> str:
        if name == HUB:
            return "hub"
        b = self.backends.get(name)
        extra = []
        for attr in ("gflops",):
            if b is not None and isinstance(getattr(b, attr, None), (int, float)):
                extra.append(f"{attr}={getattr(b, attr):g}")
        return f"backend:{name}" + (f"({','.join(extra)})" if extra else "")

    def resource(self, name: str) -> str:
        """The hardware a participant computes on, for the simulation: participants on one
        resource do not overlap. cuda/hip run on the hub's own GPU (the backend requires the
        same device UUID); the cpu backend shares the cores of a CPU hub (lavapipe). A backend
        may say so itself with a ``shares_hub`` attribute."""
        if name == HUB:
            return HUB
        b = self.backends.get(name)
        explicit = getattr(b, "shares_hub", None)
        if isinstance(explicit, bool):
            return HUB if explicit else name
        if name in ("cuda", "hip"):
            return HUB
        if name == "cpu" and self.device is not None:
            from .vk.api import vk

            if getattr(self.device.physical, "device_type", None) == vk.VK_PHYSICAL_DEVICE_TYPE_CPU:
                return HUB
        return name

    @staticmethod
    def job_key(w_type: str, N: int, K: int, M: int) -> str:
        return f"mul_mat|{w_type}|{N}x{K}|M={M}"

    # -- queries ------------------------------------------------------------------------------

    def submit(self) -> float:
        v = self.profile.get("hub", "submit")
        if v is None:
            self.estimated.add("hub submit")
            return DEFAULTS["submit_s"]
        return float(v)

    def convert(self, n: int) -> float:
        v = self.profile.get("hub", "convert")
        if v is None:
            self.estimated.add("hub convert")
            return n * DEFAULTS["convert_ns_per_elem"] * 1e-9
        a, b = v
        return float(a) + float(b) * n

    def hub_node(self, node: Node) -> float:
        v = self.profile.get("hub", "node|" + node.signature())
        if v is not None:
            return float(v)
        self.estimated.add(f"hub {node.op}")
        nbytes = sum(t.rows * t.cols * _ELEM.get(t.dtype, 1) for t in (*node.inputs, node.output)
                     if not t.weight or t.dtype in _ELEM)
        if node.op == "mul_mat":
            w, x = node.inputs
            from .ops.quant import row_bytes

            nbytes += w.shape[0] * row_bytes(w.dtype, w.shape[-1]) if w.dtype not in _ELEM else 0
            return 2.0 * x.rows * w.shape[0] * w.shape[-1] / (DEFAULTS["hub_gflops"] * 1e9) + \
                nbytes / (DEFAULTS["hub_gbs"] * 1e9)
        return nbytes / (DEFAULTS["hub_gbs"] * 1e9)

    def hub_item(self, it: HubOp) -> float:
        if it.kind == "convert":
            assert it.src is not None
            return self.convert(it.src.rows * it.src.cols)
        assert it.node is not None
        t = self.hub_node(it.node)
        if it.kind == "rows":
            return t * (it.r1 - it.r0) / it.node.inputs[0].shape[0]
        return t

    def _rate(self, name: str) -> float:
        r = self._rates.get(name)
        if r is None:
            b = self.backends.get(name)
            r = DEFAULTS["backend_gflops"]
            try:
                got = b.calibrate() if b is not None else {}
                r = float(got.get("mul_mat_gflops", r)) or r
            except Exception as exc:  # a broken calibrate() hook: keep the default
                log.debug("%s.calibrate(): %s", name, exc)
            self._rates[name] = r
        return r

    def job(self, backend: str, w_type: str, N: int, K: int, M: int) -> float:
        """Seconds of one full ``mul_mat`` (all N rows) on ``backend``, sync latency excluded."""
        v = self.profile.get(self.scope(backend), self.job_key(w_type, N, K, M))
        if v is not None:
            return float(v)
        self.estimated.add(f"{backend} mul_mat")
        return 2.0 * M * N * K / (self._rate(backend) * 1e9)

    def latency(self, backend: str) -> float:
        v = self.profile.get(self.scope(backend), "latency")
        if v is None:
            self.estimated.add(f"{backend} latency")
            return DEFAULTS["latency_s"]
        return float(v)

    def enqueue(self, backend: str) -> float:
        """Host seconds to enqueue one job on ``backend`` (a step enqueues everything up front:
        a job cannot start before the host got to it)."""
        v = self.profile.get(self.scope(backend), "enqueue")
        if v is None:
            self.estimated.add(f"{backend} enqueue")
            return DEFAULTS["enqueue_s"]
        return float(v)

    def backend_item(self, op: BackendOp | BackendNodeOp) -> float:
        if isinstance(op, BackendNodeOp):
            return self.node_on(op.backend, op.node)
        return self.job(op.backend, op.weight.dtype, op.N, op.K, op.M) * (op.r1 - op.r0) / op.N

    def node_on(self, backend: str, node: Node) -> float:
        """Seconds of a small op (norm, SwiGLU, add) on a backend: not measured; the hub's
        time for it (the same memory-bound work) on a backend sharing the hub's GPU, else
        from its bytes at the default bandwidth."""
        self.estimated.add(f"{backend} {node.op}")
        if self.resource(backend) == HUB:
            return self.hub_node(node)
        nbytes = sum(t.rows * t.cols * 4 for t in (*node.inputs, *node.writes()))
        return nbytes / (DEFAULTS["hub_gbs"] * 1e9)

    # -- measuring ----------------------------------------------------------------------------

    @property
    def can_measure(self) -> bool:
        return self.device is not None

    def prepare(self, graph: Graph | None = None, jobs: Iterable[tuple[str, str, int, int, int]] = ()) -> None:
        """Measure what is missing for ``graph`` (hub nodes) and ``jobs`` ((backend, w_type,
        N, K, M) of full-row jobs), then save the profile."""
        if not self.can_measure:
            return
        self._measure_hub_basics()
        if graph is not None and self.hub_runner is not None:
            if any(self.profile.get("hub", "node|" + n.signature()) is None for n in graph.nodes):
                times = self.hub_runner(graph)
                for n in graph.nodes:
                    if n.index in times:
                        self.profile.put("hub", "node|" + n.signature(), times[n.index])
                self.measured += 1
        for name in {j[0] for j in jobs}:
            if self.profile.get(self.scope(name), "latency") is None:
                self._measure_latency(name)
        for name, w_type, N, K, M in sorted(set(jobs)):
            if self.profile.get(self.scope(name), self.job_key(w_type, N, K, M)) is None:
                self._measure_job(name, w_type, N, K, M)
        self.profile.save()

    def _measure_hub_basics(self) -> None:
        from .ops.convert import record_convert
        from .vk.command import Sequence, Timestamps

        dev = self.device
        assert dev is not None
        if self.profile.get("hub", "submit") is None:
            seq = Sequence(dev, "probe-submit")
            try:
                seq.end()
                ts = []
                for r in range(self.reps + 2):
                    t = time.perf_counter()
                    seq.submit()
                    seq.wait()
                    if r:
                        ts.append(time.perf_counter() - t)
            finally:
                seq.close()
            self.profile.put("hub", "submit", _median(ts))
        if self.profile.get("hub", "convert") is None and dev.timestamp_bits:
            sizes = (4096, 1 << 20)
            src = dev.memory.alloc(sizes[-1] * 4, "device", "probe-src")
            dst = dev.memory.alloc(sizes[-1] * 2, "device", "probe-dst")
            got = []
            try:
                for n in sizes:
                    tsp = Timestamps(dev, 2)
                    seq = Sequence(dev, "probe-convert")
                    try:
                        record_convert(seq, src, dst, n, "f32", "bf16")
                        seq.barrier()
                        seq.write_timestamp(tsp, 0)
                        for _ in range(self.reps):
                            record_convert(seq, src, dst, n, "f32", "bf16")
                            seq.barrier()
                        seq.write_timestamp(tsp, 1)
                        seq.run()
                        t = tsp.read()
                        got.append(max(1e-9, (t[1] - t[0]) * 1e-9 / self.reps))
                    finally:
                        seq.close()
                        tsp.close()
            finally:
                src.close()
                dst.close()
            b = max(0.0, (got[1] - got[0]) / (sizes[1] - sizes[0]))
            a = max(0.0, got[0] - b * sizes[0])
            self.profile.put("hub", "convert", [a, b])

    def _backend_types(self, name: str) -> tuple[str, str] | None:
        """(weight type, x type) of a small probe job the backend takes."""
        b = self.backends[name]
        wt = next((d for d in (b.caps.x_dtype, "f32", "bf16", "f16") if d in b.caps.weight_types), None)
        return (wt, b.caps.x_dtype) if wt else None

    def _capped_full(self, name: str) -> bool:
        b = self.backends[name]
        cap = b.caps.max_kernels
        n = getattr(b, "resident_kernels", None)
        return cap is not None and isinstance(n, int) and n >= cap

    def _scratch(self, nbytes: int, name: str) -> Any:
        assert self.arena is not None
        sb = self.arena.alloc(nbytes, name)
        sb.buffer.write(np.zeros(nbytes, np.uint8))
        return sb

    def _measure_latency(self, name: str) -> None:
        """Round trip hub -> backend -> hub of a tiny job (``latency``), and the host time of
        one ``mul_mat`` call (``enqueue``).

        Where the hub has timestamps the round trip is measured on the GPU clock, as a step
        runs it: the chain (hub sequence, backend job, hub sequence) is queued behind a
        host-signalled gate, then released; latency = the gap between the two sequences less
        the same gap with no backend in between. That excludes the host's time to enqueue
        (a step enqueues everything up front; ``enqueue`` models that). A backend whose
        enqueue waits for the GPU would wait for the gate forever: a watchdog opens it after
        a few seconds and the host round trip is used instead. Without timestamps: the host
        round trip less two submits."""
        from .backend import MatMulJob
        from .vk.command import Sequence

        types = self._backend_types(name)
        if self.arena is None or types is None or self._capped_full(name):
            return
        b = self.backends[name]
        wt, xt = types
        N, K = 16, 32
        bufs = [self._scratch(N * K * _ELEM[wt], "probe-w"), self._scratch(K * _ELEM[xt], "probe-x"),
                self._scratch(N * 4, "probe-y")]
        dev = self.device
        assert dev is not None
        s1, s2 = Sequence(dev, "probe-a"), Sequence(dev, "probe-b")
        try:
            job = MatMulJob(bufs[0].view(), wt, bufs[1].view(), bufs[2].view(), 1, N, K, x_type=xt)
            enq: list[float] = []
            lat = self._gpu_round_trip(b, job, s1, s2, enq) if dev.timestamp_bits else None
            if lat is None:
                lat = self._host_round_trip(b, job, s1, s2, enq)
            self.profile.put(self.scope(name), "latency", max(1e-6, lat))
            self.profile.put(self.scope(name), "enqueue", _median(enq))
            self.measured += 1
        finally:
            s1.close()
            s2.close()
            b.unload(bufs[0].view())
            for sb in bufs:
                sb.close()

    def _host_round_trip(self, b: Any, job: Any, s1: Any, s2: Any, enq: list[float]) -> float:
        from .attach import host_wait

        if s1.recording:
            s1.end()
            s2.end()
        ts = []
        for r in range(self.reps + 2):
            t = time.perf_counter()
            v1 = s1.submit()
            p = b.next_point()
            t1 = time.perf_counter()
            b.mul_mat(job, (s1.timeline, v1), p)
            enq.append(time.perf_counter() - t1)
            s2.submit(waits=[p])
            host_wait((s2.timeline, s2.last_value))
            b.check()
            if r:
                ts.append(time.perf_counter() - t)
        return _median(ts) - 2 * self.submit()

    def _gpu_round_trip(self, b: Any, job: Any, s1: Any, s2: Any, enq: list[float]) -> float | None:
        from .attach import host_wait
        from .vk.command import Timestamps
        from .vk.event import Gate

        dev = self.device
        ts = Timestamps(dev, 2)  # type: ignore[arg-type]
        gate = Gate(dev, name="probe-gate")  # type: ignore[arg-type]
        try:
            s1.write_timestamp(ts, 0)
            s2.write_timestamp(ts, 1)
            s1.end()
            s2.end()

            def gap(via_backend: bool, gated: bool) -> float | None:
                hold = gate.hold(5.0 if gated else None)
                v1 = s1.submit(waits=[hold.point])
                if via_backend:
                    p = b.next_point()
                    t = time.perf_counter()
                    b.mul_mat(job, (s1.timeline, v1), p)
                    enq.append(time.perf_counter() - t)
                    s2.submit(waits=[p])
                else:
                    s2.submit(waits=[(s1.timeline, v1)])
                late = gated and not hold.release()
                host_wait((s2.timeline, s2.last_value))
                b.check()
                t01 = ts.read()
                return None if late else (t01[1] - t01[0]) * 1e-9

            for _ in range(2):  # warm-up, ungated: first-use work (imports, kernel loads)
                gap(True, False)
                gap(False, False)
            enq.clear()
            via, hub = [], []
            for _ in range(self.reps + 2):
                a, c = gap(True, True), gap(False, True)
                if a is None:  # the enqueue waited for the GPU: no GPU-side measure
                    log.info("%s: mul_mat enqueue waits for the GPU; latency from a host round trip", b.name)
                    return None
                if c is not None:
                    via.append(a)
                    hub.append(c)
            return _median(via) - _median(hub)
        finally:
            ts.close()
            gate.close()

    def _measure_job(self, name: str, w_type: str, N: int, K: int, M: int) -> None:
        from .backend import MatMulJob, row_bytes

        b = self.backends.get(name)
        if b is None or self.arena is None or self._capped_full(name):
            return
        xt = b.caps.x_dtype
        try:
            bufs = [self._scratch(N * row_bytes(w_type, K), "probe-w"), self._scratch(M * K * _ELEM[xt], "probe-x"),
                    self._scratch(M * N * 4, "probe-y")]
        except VkxError as exc:
            log.warning("cannot measure %s mul_mat %s %dx%d: %s", name, w_type, N, K, exc)
            return
        try:
            job = MatMulJob(bufs[0].view(), w_type, bufs[1].view(), bufs[2].view(), M, N, K, x_type=xt)
            tiny = MatMulJob(bufs[0].view(0, row_bytes(w_type, K)), w_type, bufs[1].view(), bufs[2].view(),
                             1, N, K, x_type=xt, r0=0, r1=1)

            def timed(j: Any, n: int) -> float:
                """Seconds per job with ``n`` jobs queued back to back and one wait at the end:
                in a step every job is enqueued up front, so a per-call host wait (which is
                large for a GPU driven from Python) is not part of a job's cost."""
                t = time.perf_counter()
                for _ in range(n):
                    p = b.next_point()
                    b.mul_mat(j, None, p)
                b.wait(p)
                return (time.perf_counter() - t) / n

            own = b.time_job(job, self.reps) if type(b).implements("time_job") else None
            if own is not None:  # the backend's own clock: no host round trips in it
                self.profile.put(self.scope(name), self.job_key(w_type, N, K, M), max(1e-7, own))
                self.measured += 1
                return
            timed(job, 1)  # warm-up (a backend may prepare the weight once: dequantize, load)
            timed(tiny, 1)
            full = _median([timed(job, 4) for _ in range(self.reps)])
            over = _median([timed(tiny, 4) for _ in range(self.reps)])
            self.profile.put(self.scope(name), self.job_key(w_type, N, K, M), max(1e-7, full - over))
            self.measured += 1
        except VkxError as exc:
            log.warning("cannot measure %s mul_mat %s %dx%d M=%d: %s", name, w_type, N, K, M, exc)
        finally:
            b.unload(bufs[0].view())
            for sb in bufs:
                sb.close()


@dataclass
class Prediction:
    total_s: float
    busy: dict[str, float]
    estimated: list[str]

    def describe(self) -> str:
        busy = ", ".join(f"{k} busy {v * 1e3:.3f} ms" for k, v in self.busy.items())
        est = f"; estimated, not measured: {', '.join(self.estimated)}" if self.estimated else ""
        return f"{self.total_s * 1e3:.3f} ms ({busy}){est}"


def simulate(schedule: Schedule, cost: CostModel) -> Prediction:
    """Predicted step time: hub segments run one after another, each backend runs its jobs in
    order; a job starts half a round trip after its hub point, a segment half a round trip
    after the jobs it waits for; each segment costs one submit. Participants on one hardware
    resource (:meth:`CostModel.resource`) take it in submission order, without overlap. The
    host enqueues the step in order, a backend job taking it :meth:`CostModel.enqueue`: a job
    starts no earlier than the host got to it (what bounds a step of small jobs on a backend
    driven from Python)."""
    before = set(cost.estimated)
    cost.estimated.clear()
    free: dict[str, float] = {}      # per participant stream (the hub's segments, each backend's jobs)
    res_free: dict[str, float] = {}  # per hardware resource
    seg_end: dict[int, float] = {}
    job_end: dict[int, float] = {}
    busy: dict[str, float] = {HUB: 0.0}
    host = 0.0                       # the caller's thread, enqueueing the step
    for kind, i in schedule.order:
        if kind == "seg":
            s = schedule.segments[i]
            start = max(free.get(HUB, 0.0), res_free.get(HUB, 0.0))
            for j in s.waits:
                start = max(start, job_end[j] + cost.latency(schedule.jobs[j].op.backend) / 2)
            dur = cost.submit() + sum(cost.hub_item(op) for op in s.ops)
            free[HUB] = res_free[HUB] = seg_end[i] = start + dur
            busy[HUB] += dur
        else:
            jb = schedule.jobs[i]
            b = jb.op.backend
            res = cost.resource(b)
            host += cost.enqueue(b)
            start = max(seg_end[jb.wait] + cost.latency(b) / 2, free.get(b, 0.0), res_free.get(res, 0.0), host)
            dur = cost.backend_item(jb.op)
            free[b] = res_free[res] = job_end[i] = start + dur
            busy[b] = busy.get(b, 0.0) + dur
    total = max([free.get(HUB, 0.0), *job_end.values()])
    est = sorted(cost.estimated)
    cost.estimated |= before
    return Prediction(total, busy, est)


# =============================================================================================
# plans


@dataclass(frozen=True)
class Part:
    """Output rows ``[r0, r1)`` of a ``mul_mat`` on ``participant`` (``hub`` or a backend)."""

    participant: str
    r0: int
    r1: int


@dataclass(eq=False)
class Plan:
    """Where each node of ``graph`` runs, the inserted conversions, and the schedule."""

    graph: Graph
    spec: SplitSpec
    family: str                           # none / layer / tensor / mode (what auto chose, too)
    assign: dict[int, list[Part]]         # node index -> parts; nodes not listed run on the hub
    items: list[Item]
    schedule: Schedule
    participants: list[str]
    notes: list[str] = field(default_factory=list)
    prediction: Prediction | None = None
    candidates: list[tuple[str, float]] = field(default_factory=list)

    @property
    def T(self) -> int:
        return self.graph.T

    @property
    def label(self) -> str:
        return str(self.spec) + (f" -> {self.family}" if self.spec.kind == "auto" else "")

    @property
    def backend_jobs(self) -> int:
        return len(self.schedule.jobs)

    def parts(self, node: Node | str) -> list[Part]:
        n = self.graph.node(node) if isinstance(node, str) else node
        got = self.assign.get(n.index)
        if got:
            return got
        N = n.inputs[0].shape[0] if n.op == "mul_mat" else 0
        return [Part(HUB, 0, N)]

    def runs_on(self, node: Node | str) -> list[str]:
        return sorted({p.participant for p in self.parts(node)})

    def conversions(self) -> dict[str, list[str]]:
        step = [f"{it.src.name} {it.src.dtype}->{it.dst.dtype} ({it.src.rows}x{it.src.cols})"
                for it in self.items if isinstance(it, HubOp) and it.kind == "convert"
                and it.src is not None and it.dst is not None]
        once = sorted({f"{op.weight.name} ({op.backend})" for op in self.items
                       if isinstance(op, BackendOp) and op.converted_weight})
        return {"per_step": step, "once": once}

    def by_participant(self) -> dict[str, dict[str, list[str]]]:
        out: dict[str, dict[str, list[str]]] = {p: {"ops": [], "mul_mat": []} for p in self.participants}
        for n in self.graph.nodes:
            for part in self.parts(n):
                d = out.setdefault(part.participant, {"ops": [], "mul_mat": []})
                if n.op == "mul_mat":
                    N = n.inputs[0].shape[0]
                    rows = "" if (part.r0, part.r1) == (0, N) else f" rows {part.r0}:{part.r1}/{N}"
                    d["mul_mat"].append(f"{n.name}{rows}")
                else:
                    d["ops"].append(n.name)
        return out

    def describe(self, points: bool = False) -> str:
        lines = [f"plan {self.graph.name}  T={self.T}  split={self.spec}  ({self.family})"]
        for p, d in self.by_participant().items():
            mm = _compress(d["mul_mat"])
            other = _compress(d["ops"])
            lines.append(f"  {p}: {len(d['mul_mat'])} mul_mat{'s' if len(d['mul_mat']) != 1 else ''}"
                         + (f", {len(d['ops'])} other ops" if d["ops"] else ""))
            if mm:
                lines.append("      mul_mat: " + ", ".join(mm))
            if other and p == HUB and len(other) <= 12:
                lines.append("      ops: " + ", ".join(other))
        conv = self.conversions()
        if conv["per_step"]:
            lines.append("  per-step conversions on the hub: " + ", ".join(_compress(conv["per_step"])))
        if conv["once"]:
            lines.append("  weights converted once at load: " + ", ".join(_compress(conv["once"])))
        lines.append(f"  timeline: {self.schedule.submits} hub submit{'s' if self.schedule.submits != 1 else ''}, "
                     f"{self.backend_jobs} backend job{'s' if self.backend_jobs != 1 else ''} per step")
        if points:
            lines += ["      " + s for s in self.schedule.points()]
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.candidates:
            lines.append("  auto candidates: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.candidates))
        if self.prediction is not None:
            lines.append(f"  predicted: {self.prediction.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        sch = self.schedule
        return {
            "graph": self.graph.name, "T": self.T, "split": str(self.spec), "family": self.family,
            "participants": self.by_participant(),
            "conversions": self.conversions(),
            "segments": [{"index": s.index, "ops": [op.name for op in s.ops], "waits": s.waits} for s in sch.segments],
            "jobs": [{"index": j.index, "backend": j.op.backend, "op": j.op.name, "rows": [j.op.r0, j.op.r1],
                      **({"N": j.op.N, "K": j.op.K, "M": j.op.M, "w_type": j.op.weight.dtype, "x_type": j.op.x.dtype}
                         if isinstance(j.op, BackendOp) else {"node_op": j.op.node.op}),
                      "waits_segment": j.wait} for j in sch.jobs],
            "order": [f"{k}{i}" for k, i in sch.order],
            "notes": self.notes,
            "predicted_s": self.prediction.total_s if self.prediction else None,
            "busy_s": self.prediction.busy if self.prediction else None,
            "estimated": self.prediction.estimated if self.prediction else None,
            "candidates": [{"split": k, "predicted_s": v} for k, v in self.candidates],
        }


def _compress(names: list[str]) -> list[str]:
    """``blk.0.attn_q, blk.1.attn_q`` -> ``blk.{0-1}.attn_q`` (order of first appearance)."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for s in names:
        m = re.match(r"^blk\.(\d+)\.(.*)$", s)
        key, idx = (f"blk.{{}}.{m.group(2)}", int(m.group(1))) if m else (s, -1)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if idx >= 0:
            groups[key].append(idx)
    out = []
    for key in order:
        idx = sorted(set(groups[key]))
        if not idx:
            out.append(key)
            continue
        runs = []
        a = b = idx[0]
        for i in idx[1:]:
            if i == b + 1:
                b = i
            else:
                runs.append((a, b))
                a = b = i
        runs.append((a, b))
        rs = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        out.append(key.replace("{}", rs if len(runs) == 1 and runs[0][0] == runs[0][1] else "{" + rs + "}"))
    return out


# =============================================================================================
# the planner


class Planner:
    """Plans graphs for one set of attached backends (see the module docstring).

    ``backends``: objects with ``name`` and ``caps`` (attached :class:`~vkxsplit.backend.Backend`\\ s,
    or stand-ins for dry planning). ``workspace``: where inserted memory comes from (default:
    dry, buffer-less). ``cost``: a :class:`CostModel` (needed by ``auto`` and for predictions).
    ``require_shared``: offload only ``mul_mat``\\ s whose memory backends can reach."""

    def __init__(self, backends: Iterable[Any] = (), *, cost: CostModel | None = None,
                 workspace: Workspace | None = None, require_shared: bool = True, granule: int = GRANULE) -> None:
        self.backends: dict[str, Any] = {}
        for b in backends:
            if b.name in HUB_ALIASES:
                raise PlanError(f"a backend cannot be named {b.name!r} (the hub's name)")
            self.backends[b.name] = b
        self.names = [HUB, *self.backends]
        self.cost = cost
        self.workspace = workspace or Workspace()
        self.require_shared = require_shared
        self.granule = granule

    # -- spec checks that need only the backends -----------------------------------------

    def _name(self, name: str, spec: SplitSpec) -> str:
        if name in HUB_ALIASES:
            return HUB
        if name not in self.backends:
            attached = ", ".join(self.names)
            raise PlanError(f"unknown backend '{name}' in split '{spec}' (attached: {attached})",
                            f"attach it with --backends {name}, or name one of: {attached}")
        return name

    def _ratios(self, spec: SplitSpec) -> dict[str, float]:
        if not spec.ratios:
            return {}
        if spec.ratios[0][0] is None:
            if len(spec.ratios) != len(self.names):
                raise PlanError(
                    f"split '{spec}' gives {len(spec.ratios)} ratio{'s' if len(spec.ratios) != 1 else ''} for "
                    f"{len(self.names)} participants ({', '.join(self.names)})",
                    f"one ratio per participant, hub first ({spec.kind}:{','.join(['1'] * len(self.names))}), "
                    f"or name them ({spec.kind}:{HUB}=1,{self.names[-1]}=1)")
            r = {p: v for p, (_, v) in zip(self.names, spec.ratios)}
        else:
            r = {p: 0.0 for p in self.names}
            for n, v in spec.ratios:
                r[self._name(n or "", spec)] = v
        if sum(r.values()) <= 0:
            raise PlanError(f"split '{spec}': every ratio is 0, nothing would compute")
        return r

    def _rules(self, spec: SplitSpec) -> list[Rule]:
        out: list[Rule] = []
        seen: set[str] = set()
        for r in spec.rules:
            name = self._name(r.backend, spec)
            if name == HUB:
                raise PlanError(f"split '{spec}': a mode rule names the hub",
                                "the hub takes every batch size no backend rule takes; give rules for backends")
            if name in seen:
                raise PlanError(f"split '{spec}': two rules for {name}", "give one range per backend, e.g. cpu>=8<=64")
            seen.add(name)
            caps = self.backends[name].caps
            lo, hi = r.lo, r.hi
            if not r.explicit:
                lo, hi = caps.min_batch, caps.max_batch
            else:
                lo = 1 if lo is None else lo
                if hi is None:
                    hi = caps.max_batch
            if caps.max_batch is not None and (hi is None or hi > caps.max_batch or lo > caps.max_batch):
                if lo > caps.max_batch:
                    raise PlanError(f"split '{spec}': {name} takes at most {caps.max_batch} tokens per mul_mat "
                                    f"(max_batch), so batch sizes >= {lo} are nonsensical for it")
                raise PlanError(f"split '{spec}': the range of {name} goes beyond its max_batch {caps.max_batch}",
                                f"add <={caps.max_batch}")
            out.append(Rule(name, lo, hi, r.filter))
        for i, a in enumerate(out):
            for b in out[i + 1:]:
                a_hi = math.inf if a.hi is None else a.hi
                b_hi = math.inf if b.hi is None else b.hi
                lo, hi = max(a.lo or 1, b.lo or 1), min(a_hi, b_hi)
                if lo <= hi:
                    raise PlanError(f"split '{spec}': the batch ranges of {a.backend} ({a.describe()}) and "
                                    f"{b.backend} ({b.describe()}) overlap at T={lo}",
                                    "give each batch size to one backend, e.g. mode:cpu<8,npu-emu>=8")
        return out

    def check(self, spec: str | SplitSpec | None) -> SplitSpec:
        """Parse ``spec`` and check what needs only the backends (names, ratio counts, batch
        ranges); returns the parsed spec. Graph-level checks happen in :meth:`plan`."""
        s = parse_spec(spec)
        for n in s.names():
            self._name(n, s)
        if s.kind in ("tensor", "layer"):
            self._ratios(s)
        if s.kind == "mode":
            self._rules(s)
        return s

    # -- what a backend can take ------------------------------------------------------------

    def route(self, b: Any, w: Tensor) -> tuple[str | None, bool, str]:
        """``(weight type handed to b, converted?, why not)`` for a weight ``w``."""
        caps = b.caps
        if w.dtype in caps.weight_types:
            return w.dtype, False, ""
        pref = [caps.x_dtype] if caps.x_dtype != "f32" else []
        pref += [d for d in ("f16", "bf16", "f32") if d not in pref]
        targets = [d for d in pref if d in caps.weight_types]
        if not targets:
            return None, False, (f"{b.name} reads {', '.join(sorted(caps.weight_types))} weights, not {w.dtype}, "
                                 "and none of f32/f16/bf16 the hub could convert to")
        from .ops.quant import TYPES

        if w.dtype not in TYPES:
            return None, False, f"the hub cannot dequantize {w.dtype} weights for {b.name}"
        return targets[0], True, ""

    def why_not(self, b: Any, node: Node, *, soft: bool = True) -> tuple[str, str] | None:
        """Why ``node`` cannot run on ``b``: ``("hard", reason)`` (never), ``("soft", reason)``
        (not at this batch size / memory), or None when it can."""
        if node.op in NODE_OPS:
            if node.op not in b.caps.ops or not type(b).implements("run_op"):
                return "hard", f"{node.op} runs on the hub only ({b.name} does not take it)"
            if "xq" in node.params:  # its q8_1 output feeds the hub's integer-dot-product mat-vecs
                return "hard", f"{node.name} also writes the q8_1 x of the hub's mat-vecs (hub only)"
            if "f32" not in b.caps.compute_dtypes:
                return "hard", f"{node.op} computes in f32, {b.name} does not"
            if self.require_shared:
                unshared = sorted({t.name for t in (*node.inputs, *node.writes()) if not t.shared})
                if unshared:
                    return "soft", f"{', '.join(unshared)} not in memory shared with backends"
            return None
        if node.op not in OFFLOADABLE_OPS:
            return "hard", f"{node.op} runs on the hub only"
        w, x = node.inputs
        wt, conv, why = self.route(b, w)
        if wt is None:
            return "hard", why
        caps = b.caps
        M = x.rows
        if caps.max_batch is not None and M > caps.max_batch:
            return "soft", f"M={M} is over {b.name}'s max_batch {caps.max_batch}"
        if soft and M < caps.min_batch:
            return "soft", f"M={M} is under {b.name}'s min_batch {caps.min_batch}"
        if self.require_shared:
            own_copy = getattr(b, "private_weights", False) and w.host is not None  # loads its own rows
            stage = getattr(b, "stages_activations", False)  # x and y go through shadows the hub copies
            need = ([] if stage else [node.output]) + ([] if conv or own_copy else [w]) + (
                [x] if caps.x_dtype == "f32" and not stage else [])
            unshared = [t.name for t in need if not t.shared]
            if unshared:
                return "soft", f"{', '.join(unshared)} not in memory shared with backends"
        return None

    def _kernel_key(self, b: Any, node: Node, part: Part) -> tuple[Any, ...]:
        w = node.inputs[0]
        _wt, conv, _ = self.route(b, w)
        return (w.name, part.r0, part.r1) if conv else (w.name,)

    # -- planning ---------------------------------------------------------------------------

    def plan(self, graph: Graph, spec: str | SplitSpec | None, *, predict: bool = False,
             commit: bool = True) -> Plan:
        """Plan ``graph`` under ``spec``; raises :class:`PlanError` naming what is wrong."""
        s = self.check(spec)
        T = graph.T or max((n.inputs[1].rows for n in graph.mul_mats()), default=1)
        notes: list[str] = []
        candidates: list[tuple[str, float]] = []
        family = s.kind
        if s.kind == "none":
            assign: dict[int, list[Part]] = {}
        elif s.kind == "layer":
            assign = self._layer(graph, s, notes)
        elif s.kind == "tensor":
            assign = self._tensor(graph, s, notes)
        elif s.kind == "mode":
            assign = self._mode(graph, s, T, notes)
        else:
            assign, family, candidates = self._auto(graph, T, notes)
        self._check_caps(graph, assign, s)
        items = self._lower(graph, assign, self.workspace)
        sch = build_schedule(items)
        participants = [p for p in self.names if p == HUB or any(j.op.backend == p for j in sch.jobs)]
        plan = Plan(graph, s, family, assign, items, sch, participants, _dedupe(notes), candidates=candidates)
        if commit:
            for p, keys in self._kernel_keys(graph, assign).items():
                self.workspace.resident(p).update(keys)
        if (predict or s.kind == "auto") and self.cost is not None:
            self.cost.prepare(graph, self._job_needs(sch))
            plan.prediction = simulate(sch, self.cost)
        return plan

    def _place(self, assign: dict[int, list[Part]], node: Node, p: str, notes: list[str], *, why: str,
               soft: bool = True) -> None:
        N = node.output.rows if node.op in NODE_OPS else node.inputs[0].shape[0]
        if p == HUB:
            assign.pop(node.index, None)
            return
        bad = self.why_not(self.backends[p], node, soft=soft)
        if bad is not None:
            kind, reason = bad
            if kind == "hard":
                raise PlanError(f"{why} puts {node.name} on {p}, which cannot run it: {reason}")
            notes.append(f"{node.name} stays on the hub: {reason}")
            assign.pop(node.index, None)
            return
        assign[node.index] = [Part(p, 0, N)]

    def _layer(self, graph: Graph, spec: SplitSpec, notes: list[str]) -> dict[int, list[Part]]:
        assign: dict[int, list[Part]] = {}
        taken: set[int] = set()
        for ov in spec.overrides:
            p = self._name(ov.backend, spec)
            matched = graph.find(ov.pattern)
            if not matched:
                sample = ", ".join(n.name for n in graph.mul_mats()[:3])
                raise PlanError(f"split '{spec}': override '{ov.pattern}={ov.backend}' matches no node or tensor "
                                f"of {graph.name}", f"names look like {sample} (regexes use re.search)")
            mms = [n for n in matched if n.op in OFFLOADABLE_OPS]
            if not mms and p != HUB:
                b = self.backends[p]
                ops = sorted({n.op for n in matched})
                names = ", ".join(n.name for n in matched[:4]) + (" ..." if len(matched) > 4 else "")
                if "f32" not in b.caps.compute_dtypes and any(o in F32_ONLY_OPS for o in ops):
                    raise PlanError(f"split '{spec}': {p} computes only in {'/'.join(sorted(b.caps.compute_dtypes))} "
                                    f"and '{ov.pattern}' selects only f32-only ops ({', '.join(ops)}: {names})",
                                    "a bf16 backend takes mul_mat; match the matrices, e.g. 'blk\\..*\\.ffn_(gate|up|down)'")
                raise PlanError(f"split '{spec}': {p} does not run {', '.join(ops)} ('{ov.pattern}' selects {names}); "
                                "backends take mul_mat", "match mul_mat nodes (attn_q/k/v/output, ffn_*, output)")
            skipped = 0
            for n in matched:
                if n.index in taken:
                    continue
                taken.add(n.index)
                if n.op not in OFFLOADABLE_OPS:
                    skipped += 1
                    continue
                self._place(assign, n, p, notes, why=f"override '{ov.pattern}={ov.backend}'")
            if skipped and p != HUB:
                notes.append(f"'{ov.pattern}' also matches {skipped} op(s) other than mul_mat: they stay on the hub")
        ratios = self._ratios(spec)
        if not ratios and not spec.overrides:
            ratios = {p: 1.0 for p in self.names}
        if ratios:
            n_layer = graph.n_layer
            total = sum(ratios.values())
            bounds: list[tuple[str, float, float]] = []
            acc = 0.0
            for p in self.names:
                r = ratios.get(p, 0.0)
                bounds.append((p, acc / total * n_layer, (acc + r) / total * n_layer))
                acc += r
            for n in graph.mul_mats():
                if n.index in taken or n.layer is None:
                    continue
                mid = n.layer + 0.5
                owner = next((p for p, a, b in bounds if a <= mid < b and b > a), HUB)
                self._place(assign, n, owner, notes, why=f"layer split '{spec}'")
        return assign

    def _filtered(self, graph: Graph, spec: SplitSpec, pattern: str | None) -> list[Node]:
        if pattern is None:
            return graph.mul_mats()
        matched = graph.find(pattern)
        if not matched:
            raise PlanError(f"split '{spec}': regex '{pattern}' matches no node or tensor of {graph.name}")
        mms = [n for n in matched if n.op in OFFLOADABLE_OPS]
        if not mms:
            ops = sorted({n.op for n in matched})
            raise PlanError(f"split '{spec}': regex '{pattern}' matches only {', '.join(ops)}; "
                            f"{spec.kind} split divides mul_mat", "match mul_mat nodes (e.g. 'ffn_(gate|up|down)')")
        return mms

    def bounds(self, N: int, shares: Sequence[float]) -> list[tuple[int, int]]:
        """Row ranges for ``shares`` of N rows: contiguous, in order, boundaries on multiples
        of the granule (the last one at N); a share of 0 gets an empty range."""
        total = sum(shares)
        if total <= 0:
            raise PlanError("every ratio is 0")
        g = max(1, min(self.granule, N))
        last = max(i for i, s in enumerate(shares) if s > 0)
        cuts = [0]
        acc = 0.0
        for i, s in enumerate(shares):
            acc += s
            end = N if i >= last else min(N, int(round(acc / total * N / g)) * g)
            cuts.append(max(end, cuts[-1]))
        return [(cuts[i], cuts[i + 1]) for i in range(len(shares))]

    def _tensor(self, graph: Graph, spec: SplitSpec, notes: list[str]) -> dict[int, list[Part]]:
        ratios = self._ratios(spec)
        assign: dict[int, list[Part]] = {}
        shares = [ratios.get(p, 0.0) for p in self.names]
        for n in self._filtered(graph, spec, spec.filter):
            N = n.inputs[0].shape[0]
            parts: list[Part] = []
            for p, (r0, r1) in zip(self.names, self.bounds(N, shares)):
                if r1 <= r0:
                    continue
                if p != HUB:
                    bad = self.why_not(self.backends[p], n)
                    if bad is not None:
                        kind, reason = bad
                        if kind == "hard":
                            raise PlanError(f"split '{spec}': {p} has ratio {ratios[p]:g} but cannot run "
                                            f"{n.name}: {reason}", f"give {p} ratio 0, or restrict with @REGEX")
                        notes.append(f"{n.name} rows {r0}:{r1} of {p} go to the hub: {reason}")
                        p = HUB
                parts.append(Part(p, r0, r1))
            assign[n.index] = _merge_hub(parts, N)
        return {k: v for k, v in assign.items() if v != [Part(HUB, 0, v[-1].r1)]}

    def _mode(self, graph: Graph, spec: SplitSpec, T: int, notes: list[str]) -> dict[int, list[Part]]:
        rules = self._rules(spec)
        assign: dict[int, list[Part]] = {}
        hit = [r for r in rules if (r.lo or 1) <= T <= (math.inf if r.hi is None else r.hi)]
        for r in rules:
            self._filtered(graph, spec, r.filter)  # a filter matching nothing is an error at any T
        if not hit:
            notes.append(f"T={T}: no rule takes this batch size; everything runs on the hub")
            return assign
        rule = hit[0]
        explicit = any(o.backend == rule.backend and o.explicit for o in spec.rules)
        for n in self._filtered(graph, spec, rule.filter):
            self._place(assign, n, rule.backend, notes, why=f"mode rule {rule.describe()}", soft=not explicit)
        if rule.filter is None:
            self._add_glue(graph, assign, rule.backend)
        return assign

    def _add_glue(self, graph: Graph, assign: dict[int, list[Part]], name: str) -> dict[int, list[Part]]:
        """Put the glue between the matmuls (norms, SwiGLU, residual adds) on backend ``name``
        too, where it runs them (``caps.ops`` and ``run_op``). Why: every hand-off between hub
        and backend costs a round trip (~0.3 ms hub <-> cuda on the H200); with the glue on the
        backend a decoder layer crosses once (attention stays on the hub) instead of four
        times."""
        b = self.backends.get(name)
        if b is not None and b.caps.ops & NODE_OPS and type(b).implements("run_op"):
            for n in graph.nodes:
                if n.op in NODE_OPS and self.why_not(b, n) is None:
                    assign[n.index] = [Part(b.name, 0, n.output.rows)]
        return assign

    def _kernel_keys(self, graph: Graph, assign: dict[int, list[Part]]) -> dict[str, set[tuple[Any, ...]]]:
        out: dict[str, set[tuple[Any, ...]]] = {}
        for idx, parts in assign.items():
            n = graph.nodes[idx]
            if n.op in NODE_OPS:  # no weight matrix: nothing resident
                continue
            for part in parts:
                if part.participant == HUB:
                    continue
                b = self.backends[part.participant]
                if b.caps.max_kernels is not None:
                    out.setdefault(b.name, set()).add(self._kernel_key(b, n, part))
        return out

    def _check_caps(self, graph: Graph, assign: dict[int, list[Part]], spec: SplitSpec) -> None:
        for name, keys in self._kernel_keys(graph, assign).items():
            cap = self.backends[name].caps.max_kernels
            have = self.workspace.resident(name)
            total = keys | have
            if len(total) > cap:
                shown = ", ".join(_compress(sorted({k[0].removesuffix(".weight") for k in keys})))
                raise PlanError(
                    f"split '{spec}' puts {len(keys)} weight matrices on {name}"
                    + (f" (plus {len(have - keys)} other plans loaded)" if have - keys else "")
                    + f", which holds at most {cap} resident kernels: {shown}",
                    "restrict it with a regex (layer:'blk\\.0\\.ffn_.*=NAME', tensor:...@REGEX, "
                    "mode:NAME>=N@REGEX) or use auto, which picks the ones that save most")

    def _lower(self, graph: Graph, assign: dict[int, list[Part]], ws: Workspace) -> list[Item]:
        items: list[Item] = []
        fresh: dict[tuple[Span, str], tuple[Span, Tensor]] = {}

        def invalidate(written: list[Tensor]) -> None:
            ws_ = [span(t) for t in written]
            for k in [k for k, (src, _t) in fresh.items() if any_overlap([src], ws_)]:
                del fresh[k]

        for n in graph.nodes:
            parts = assign.get(n.index)
            if not parts:
                items.append(HubOp("node", n.name, n.reads(), n.writes(), node=n))
                invalidate(n.writes())
                continue
            if n.op in NODE_OPS:
                items.append(BackendNodeOp(parts[0].participant, n.name, n))
                invalidate(n.writes())
                continue
            w, x = n.inputs
            y = n.output
            N = w.shape[0]
            group = n.index if len(parts) > 1 else None
            # A backend that stages activations (a vulkan peer on another GPU: it reaches only
            # host pages) gets x and y through shadows in the arena while the hub keeps its
            # activations in device memory: the hub copies x out before the job and y back after
            # it (all parts of a split node then write the shadow).
            stage = not y.shared and any(getattr(self.backends[p.participant], "stages_activations", False)
                                         for p in parts if p.participant != HUB)
            yt = ws.shadow(y, "f32") if stage else y
            for part in parts:
                if part.participant == HUB:
                    continue
                b = self.backends[part.participant]
                xd = b.caps.x_dtype
                xt = x
                if xd != "f32" or (not x.shared and getattr(b, "stages_activations", False)):
                    key = (span(x), xd)
                    if key in fresh:
                        xt = fresh[key][1]
                    else:
                        xt = ws.shadow(x, xd)
                        items.append(HubOp("convert", f"{x.name}->{xd}", [x], [xt], src=x, dst=xt))
                        fresh[key] = (span(x), xt)
                wt, conv, why = self.route(b, w)
                if wt is None:
                    raise PlanError(f"{n.name} on {b.name}: {why}")
                if conv:
                    wtensor, w_row0 = ws.converted_weight(w, part.r0, part.r1, wt), part.r0
                else:
                    wtensor, w_row0 = w, 0
                items.append(BackendOp(b.name, n.name if group is None else f"{n.name}[{part.r0}:{part.r1}]",
                                       n, wtensor, w_row0, xt, yt, part.r0, part.r1, group, conv))
            for part in parts:
                if part.participant != HUB:
                    continue
                if (part.r0, part.r1) == (0, N):
                    items.append(HubOp("node", n.name, n.reads(), n.writes(), node=n))
                else:
                    items.append(HubOp("rows", f"{n.name}[{part.r0}:{part.r1}]", [w, x], [yt], node=n,
                                       r0=part.r0, r1=part.r1, group=group, dst=yt if stage else None))
            if stage:
                items.append(HubOp("convert", f"{y.name}<-{yt.name}", [yt], [y], src=yt, dst=y))
            invalidate([y])
        return items

    def _job_needs(self, sch: Schedule) -> set[tuple[str, str, int, int, int]]:
        return {(j.op.backend, j.op.weight.dtype, j.op.N, j.op.K, j.op.M) for j in sch.jobs
                if isinstance(j.op, BackendOp)}

    # -- auto ---------------------------------------------------------------------------------

    def _auto(self, graph: Graph, T: int, notes: list[str]) -> tuple[dict[int, list[Part]], str,
                                                                     list[tuple[str, float]]]:
        cost = self.cost
        if cost is None:
            raise PlanError("split 'auto' needs a cost model (a measured device profile)",
                            "plan through a loaded model (vkxsplit.load_model) or pass Planner(cost=CostModel(...))")
        mms = graph.mul_mats()
        able: dict[int, list[str]] = {}
        needs: set[tuple[str, str, int, int, int]] = set()
        for n in mms:
            ps = []
            for name, b in self.backends.items():
                if self.why_not(b, n) is None:
                    ps.append(name)
                    wt, _conv, _ = self.route(b, n.inputs[0])
                    w = n.inputs[0]
                    needs.add((name, wt or w.dtype, w.shape[0], w.shape[-1], n.inputs[1].rows))
            able[n.index] = ps
        cost.prepare(graph, needs)

        def whole(n: Node, p: str) -> float:
            if p == HUB:
                return cost.hub_node(n)
            b = self.backends[p]
            w, x = n.inputs
            wt, _conv, _ = self.route(b, w)
            t = cost.latency(p) + cost.job(p, wt or w.dtype, w.shape[0], w.shape[-1], x.rows)
            if b.caps.x_dtype != "f32":
                t += cost.convert(x.rows * x.cols)
            return t

        costs = {n.index: {p: whole(n, p) for p in [HUB, *able[n.index]]} for n in mms}
        cands: list[tuple[str, dict[int, list[Part]]]] = [("none", {})]
        # mode-like: one backend takes every mul_mat it can
        for name in self.backends:
            choice = {n.index: name for n in mms if name in able[n.index]}
            if choice:
                only = {i: {HUB: c[HUB], name: c[name]} for i, c in costs.items() if name in c}
                cands.append((f"mode:{name}", self._add_glue(graph, self._cap_fit(graph, choice, only), name)))
        # layer-like: each mul_mat on its cheapest participant
        best = {i: min(c, key=c.get) for i, c in costs.items()}  # type: ignore[arg-type]
        greedy = self._cap_fit(graph, {i: p for i, p in best.items() if p != HUB}, costs)
        cands.append(("layer", greedy))
        # tensor: rows divided where that beats the cheapest single participant
        mixed = {k: list(v) for k, v in greedy.items()}
        any_split = False
        for n in mms:
            ps = [HUB] + [p for p in able[n.index]
                          if self.backends[p].caps.max_kernels is None and not self.route(self.backends[p], n.inputs[0])[1]]
            if len(ps) < 2:
                continue
            lat = {p: (0.0 if p == HUB else cost.latency(p)) for p in ps}
            full = {p: (costs[n.index][HUB] if p == HUB else costs[n.index][p] - lat[p]) for p in ps}
            shares, finish = _water_fill(lat, full)
            whole_best = min(costs[n.index].values())
            if finish < 0.95 * whole_best and sum(1 for v in shares.values() if v > 0) > 1:
                N = n.inputs[0].shape[0]
                parts = [Part(p, r0, r1) for p, (r0, r1) in zip(ps, self.bounds(N, [shares[p] for p in ps]))
                         if r1 > r0]
                if len(parts) > 1:
                    mixed[n.index] = _merge_hub(parts, N)
                    any_split = True
        if any_split:
            cands.append(("tensor", mixed))
        results: list[tuple[str, float, dict[int, list[Part]]]] = []
        dry = Workspace()
        seen: list[dict[int, list[Part]]] = []
        for label, assign in cands:
            if assign in seen:  # the same assignment under another name: evaluated once
                continue
            seen.append(assign)
            sch = build_schedule(self._lower(graph, assign, dry))
            results.append((label, simulate(sch, cost).total_s, assign))
        label, _t, assign = min(results, key=lambda r: r[1])
        fam = label.split(":")[0]
        notes.append(f"auto picked {label} for T={T}")
        return assign, fam, [(lb, t) for lb, t, _ in results]

    def _cap_fit(self, graph: Graph, choice: dict[int, str], costs: dict[int, dict[str, float]]) -> dict[int, list[Part]]:
        """Whole-op assignment ``choice`` with capped backends limited to the ops where they save
        most (kernels already resident first); the rest go to their next cheapest participant."""
        choice = dict(choice)
        for name, b in self.backends.items():
            cap = b.caps.max_kernels
            if cap is None:
                continue
            mine = [i for i, p in choice.items() if p == name]
            resident = self.workspace.resident(name)

            def saving(i: int, name: str = name) -> float:
                alt = min(v for p, v in costs[i].items() if p != name)
                return alt - costs[i][name]

            keys = {i: self._kernel_key(b, graph.nodes[i], Part(name, 0, graph.nodes[i].inputs[0].shape[0]))
                    for i in mine}
            ranked = sorted(mine, key=lambda i: (keys[i] not in resident, -saving(i)))
            kept: list[int] = []
            loaded = set(resident)
            for i in ranked:
                if saving(i) <= 0:
                    continue
                if keys[i] in loaded or len(loaded) < cap:
                    loaded.add(keys[i])
                    kept.append(i)
            for i in mine:
                if i not in kept:
                    alts = {p: v for p, v in costs[i].items() if p != name}
                    choice[i] = min(alts, key=alts.get)  # type: ignore[arg-type]
        return {i: [Part(p, 0, graph.nodes[i].inputs[0].shape[0])] for i, p in choice.items() if p != HUB}


def _water_fill(lat: dict[str, float], full: dict[str, float]) -> tuple[dict[str, float], float]:
    """Shares s_p >= 0, sum 1, minimising max_p(lat_p + s_p * full_p): all active participants
    finish together at F = (1 + sum lat/full) / sum 1/full."""
    active = sorted(lat, key=lambda p: lat[p])
    while True:
        inv = sum(1.0 / max(full[p], 1e-12) for p in active)
        F = (1.0 + sum(lat[p] / max(full[p], 1e-12) for p in active)) / inv
        drop = [p for p in active if lat[p] >= F]
        if not drop or len(active) == 1:
            break
        active = [p for p in active if p not in drop]
    shares = {p: (max(0.0, (F - lat[p]) / max(full[p], 1e-12)) if p in active else 0.0) for p in lat}
    tot = sum(shares.values()) or 1.0
    return {p: v / tot for p, v in shares.items()}, F


def _merge_hub(parts: list[Part], N: int) -> list[Part]:
    out: list[Part] = []
    for p in parts:
        if out and out[-1].participant == p.participant == HUB and out[-1].r1 == p.r0:
            out[-1] = Part(HUB, out[-1].r0, p.r1)
        else:
            out.append(p)
    return out


def _dedupe(xs: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in xs if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]


# =============================================================================================
# hub timing of a graph (the cost model's hub runner)


def hub_node_times(device: Device, graph: Graph, before_step: Callable[[], None] | None = None,
                   steps: int = 2) -> dict[int, float]:
    """Seconds of each node of ``graph`` run on the hub alone: GPU timestamps around every node
    give the shares, and two timestamps around the whole graph (recorded without the others,
    which cost time themselves) the total (the last of ``steps`` runs; the first warms up)."""
    from .executor import Executor, record_graph
    from .vk.command import Sequence, Timestamps

    plan = Planner().plan(graph, "none")
    ex = Executor(device, plan, trace=True, name=f"calibrate {graph.name}")
    try:
        st = None
        for _ in range(max(1, steps)):
            if before_step is not None:
                before_step()
            st = ex.run()
        assert st is not None
        times = st.op_times()
    finally:
        ex.close()
    out = {it.node.index: times[id(it)] for it in plan.items if isinstance(it, HubOp) and it.node is not None}
    ts = Timestamps(device, 2)
    seq = Sequence(device, f"calibrate {graph.name} (total)")
    try:
        seq.write_timestamp(ts, 0)
        record_graph(seq, graph)
        seq.write_timestamp(ts, 1)
        seq.end()
        for _ in range(max(1, steps)):
            if before_step is not None:
                before_step()
            seq.run()
        t = ts.read()
        total = max(0.0, (t[1] - t[0]) * 1e-9)
    finally:
        seq.close()
        ts.close()
    parts = sum(out.values())
    if parts > 0 and total > 0:
        out = {k: v * total / parts for k, v in out.items()}
    return out


# =============================================================================================
# the command line


def cmd_plan(args: Any) -> int:
    from .model import load_model
    from .vk.device import Device

    try:
        Ts = sorted({int(t) for t in str(args.tokens).split(",") if t.strip()})
    except ValueError:
        raise VkxError(f"-t wants token counts like 1 or 1,512, got {args.tokens!r}") from None
    if not Ts or min(Ts) < 1:
        raise VkxError("-t wants positive token counts")
    dev = Device.open(args.device) if args.device is not None else None
    ub = max(Ts)
    n_ctx = args.ctx_size or max(ub + 1, 256)
    try:
        model = load_model(args.model, split=args.split, backends=args.backends, device=dev, n_ctx=n_ctx,
                           ubatch=ub)
    except BaseException:
        if dev is not None:
            dev.close()
        raise
    if dev is not None:
        model._own_device = True
    try:
        plans = [model.plan(T, predict=True) for T in Ts]
        if args.trace:
            model.set_trace(True)
            rng = np.random.default_rng(0)
            model.reset()
            model._run(rng.integers(0, model.hp.n_vocab, Ts[-1]).tolist(), all_logits=False)
            Path(args.trace).write_text(json.dumps(model.last_trace))
            print(f"trace of one step (T={Ts[-1]}) written to {args.trace} (open in https://ui.perfetto.dev)",
                  file=sys.stderr)
        if args.json:
            print(json.dumps({"model": model.file.name, "device": model.device.name,
                              "backends": list(model.backends), "profile": str(model.cost.profile.path),
                              "plans": [p.to_dict() for p in plans]}, indent=1))
        else:
            for p in plans:
                print(p.describe(points=args.verbose_points))
                print()
            print(f"device profile: {model.cost.profile.path}")
    finally:
        model.close()
    return 0


SPLIT_HELP = ("split spec: none | layer[:REGEX=NAME,...|:R,R..] | tensor:R,R,..[@REGEX] | "
              "mode:NAME>=N[<=N][@REGEX],... | auto  (ratios: hub first, then --backends order; "
              "docs/PLANNER.md)")


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="show which backend runs which ops (and rows) and the predicted time")
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--split", default="none", help=SPLIT_HELP)
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to attach, with options: cpu,npu-emu:min_batch=1")
    p.add_argument("-t", "--tokens", default="1", help="batch size(s) T to plan for, e.g. 1,512 (default 1)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default: max(T + 1, 256))")
    p.add_argument("--device", default=None, help="hub device index or name part (VKXSPLIT_DEVICE)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--points", dest="verbose_points", action="store_true",
                   help="list every timeline point (hub segments and backend jobs)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also run one step of the largest T and write its Chrome trace-event JSON")
    p.set_defaults(func=cmd_plan)


__all__ = ["ArenaWorkspace", "CostModel", "HUB", "Override", "Part", "Plan", "Planner", "Prediction", "Profile",
           "Rule", "SplitSpec", "Workspace", "hub_node_times", "parse_backends", "parse_spec", "parse_specs",
           "register", "simulate"]
