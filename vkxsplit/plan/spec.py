"""The split-spec grammar: what ``--split`` and ``--backends`` say, parsed and checked for syntax.

::

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

Checks that need the attached backends or the graph (names, ratio counts, batch ranges,
regexes matching nothing) are the planner's (:class:`vkxsplit.plan.planner.Planner`).
Imports: ``vkxsplit.errors`` only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError, VkxError

KINDS = ("none", "layer", "tensor", "mode", "auto")
HUB = "hub"
HUB_ALIASES = ("hub", "vulkan")

#: the ``--split`` help text of the command line
SPLIT_HELP = ("split spec: none | layer[:REGEX=NAME,...|:R,R..] | tensor:R,R,..[@REGEX] | "
              "mode:NAME>=N[<=N][@REGEX],... | auto  (ratios: hub first, then --backends order; "
              "docs/PLANNER.md)")


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


def hub_split(mode: str, shares: Any = None) -> str:
    """llama.cpp's ``--split-mode layer|row`` (and ``-ts``) over the hubs of ``--devices`` as a
    split spec: ``layer`` / ``layer:3,1`` (a pipeline of stages, shares hub first) or
    ``tensor:1,1`` (rows over two hubs)."""
    if isinstance(shares, str):
        shares = [x for x in shares.replace("/", ",").split(",") if x.strip()]
    if mode == "row":
        if shares:
            raise VkxError("--layer-split/-ts go with --split-mode layer (split_mode='layer')",
                           "the row split halves every matrix over two hubs")
        return "tensor:1,1"
    if mode != "layer":
        raise VkxError(f"split mode {mode!r} over several hubs is not 'layer' or 'row'")
    return "layer" + (":" + ",".join(f"{r:g}" if isinstance(r, (int, float)) else str(r).strip() for r in shares)
                      if shares else "")


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


__all__ = ["HUB", "HUB_ALIASES", "KINDS", "SPLIT_HELP", "Override", "Rule", "SplitSpec", "hub_split", "parse_backends",
           "parse_spec",
           "parse_specs"]
