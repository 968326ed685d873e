"""Chat templates from GGUF files, compiled and rendered in a bounded jinja2 sandbox.

A model file's ``tokenizer.chat_template`` is untrusted code. jinja2's
``ImmutableSandboxedEnvironment`` blocks escapes (no attribute access to internals, no
mutation of lists and dicts) but not time or size, so the environment here also counts steps,
watches a deadline and bounds every value a template builds (see :func:`_chat_environment`).
Every failure is a :class:`~vkxsplit.errors.ModelError` naming the template problem, with
``--no-chat`` as the way on.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import threading
import time
import types
from collections.abc import Collection, Iterable, Iterator, Mapping
from functools import lru_cache
from typing import Any

from .errors import ModelError

__all__ = ["CHATML_TEMPLATE", "TEMPLATE_MAX_CHARS", "TEMPLATE_MAX_STEPS", "TEMPLATE_TIME_LIMIT_S",
           "compile_template", "render_template"]

#: Used when the file has no tokenizer.chat_template (llama.cpp's default is ChatML too).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Limits on the chat template, which comes from the model file and is therefore untrusted code:
# the jinja2 sandbox blocks escapes but not time or size, so the environment below (see
# _chat_environment) also counts steps, watches a deadline and bounds every value it builds.
#: seconds one render (or compile) may take
TEMPLATE_TIME_LIMIT_S = 2.0
#: loop iterations, calls, attribute lookups, filters and operators of one render
TEMPLATE_MAX_STEPS = 2_000_000
#: characters of the rendered text, and of any one value (string, list, ...) the template builds
TEMPLATE_MAX_CHARS = 4 << 20
#: characters all ``{{ ... }}`` of one render may print, macros and blocks included, in
#: TEMPLATE_MAX_CHARS (the final text is at most TEMPLATE_MAX_CHARS)
TEMPLATE_OUTPUT_FACTOR = 4
#: characters of the template source
TEMPLATE_MAX_SOURCE = 1 << 20
#: items of a range() (jinja2's MAX_RANGE)
TEMPLATE_MAX_RANGE = 100_000
#: bits of an integer a template computes
TEMPLATE_MAX_INT_BITS = 1 << 16

_TEMPLATE_HINT = (
    "the model's chat template is broken or hostile: run with --no-chat and write the prompt in the "
    "model's chat format yourself (or, from Python, generate(..., chat=False))"
)


def compile_template(source: str, where: str) -> Any:
    """``source`` compiled in the bounded environment (``where``: the file, for messages)."""
    from jinja2.exceptions import TemplateError

    if len(source) > TEMPLATE_MAX_SOURCE:
        raise ModelError(
            f"{where}: tokenizer.chat_template is {len(source)} characters long, more than the "
            f"{TEMPLATE_MAX_SOURCE} vkxsplit compiles",
            hint=_TEMPLATE_HINT,
        )
    env = _chat_environment()
    try:
        with _Budget():
            return env.from_string(source)
    except TemplateError as e:
        raise ModelError(
            f"{where}: tokenizer.chat_template does not compile ({e})",
            hint="pass messages already rendered to text, or fix the model's chat template",
        ) from e
    except _TemplateLimit as e:
        raise ModelError(f"{where}: the chat template {e}", hint=_TEMPLATE_HINT) from None
    except (RecursionError, MemoryError, SyntaxError, ValueError, OverflowError) as e:
        raise ModelError(
            f"{where}: tokenizer.chat_template does not compile ({type(e).__name__}: {str(e)[:200]})",
            hint=_TEMPLATE_HINT,
        ) from None


def render_template(tmpl: Any, ctx: dict[str, Any], where: str) -> str:
    """A compiled template rendered with ``ctx`` within the limits above."""
    from jinja2.exceptions import TemplateError

    try:
        with _Budget():
            return str(tmpl.render(**ctx))
    except _TemplateLimit as e:
        raise ModelError(f"{where}: the chat template {e}", hint=_TEMPLATE_HINT) from None
    except RecursionError:
        raise ModelError(
            f"{where}: the chat template recurses too deeply (a macro or value nested past "
            "Python's recursion limit)",
            hint=_TEMPLATE_HINT,
        ) from None
    except MemoryError:
        raise ModelError(f"{where}: the chat template ran out of memory", hint=_TEMPLATE_HINT) from None
    except TemplateError as e:
        raise ModelError(
            f"{where}: the chat template rejected the messages: {e}",
            hint="check the roles and order of the messages (many templates need user/assistant to "
            "alternate); " + _TEMPLATE_HINT,
        ) from e
    except Exception as e:  # any Python error inside the template: 1/0, int('x'), [] + 1, ...
        raise ModelError(
            f"{where}: the chat template failed ({type(e).__name__}: {str(e)[:200]})",
            hint=_TEMPLATE_HINT,
        ) from None


# ---- jinja2 ---------------------------------------------------------------------------------


class _TemplateLimit(Exception):
    """A chat template went past one of the TEMPLATE_* limits (the message says which)."""


_ACTIVE = threading.local()


class _Budget:
    """The steps and the deadline of one render (or compile), for the current thread."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + TEMPLATE_TIME_LIMIT_S
        self.steps = 0
        self.printed = 0  # characters of {{ ... }} output, macros' and blocks' included

    def __enter__(self) -> _Budget:
        self._prev = getattr(_ACTIVE, "budget", None)
        _ACTIVE.budget = self
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.budget = self._prev


def _tick(n: int = 1, clock: bool = False) -> None:
    """Count ``n`` steps of the active render; raise _TemplateLimit past the step budget or the
    deadline. With no render active (jinja2 folding constants while compiling) refuse, so that the
    work is left to the render, where it is counted."""
    b = getattr(_ACTIVE, "budget", None)
    if b is None:
        raise _TemplateLimit("ran outside a render")
    b.steps += n
    if b.steps > TEMPLATE_MAX_STEPS:
        raise _TemplateLimit(f"ran more than {TEMPLATE_MAX_STEPS} steps (loop iterations, calls, filters)")
    if (clock or not b.steps & 255) and time.monotonic() > b.deadline:
        raise _TemplateLimit(f"ran longer than {TEMPLATE_TIME_LIMIT_S:g} s")


def _too_big(what: str, n: int, limit: int = TEMPLATE_MAX_CHARS) -> _TemplateLimit:
    return _TemplateLimit(f"builds {what} of {n} characters or more (at most {limit})")


def _weight(value: Any, limit: int = TEMPLATE_MAX_CHARS) -> int:
    """About how many characters ``value`` prints as (strings: their length; containers: their
    items plus one each), counted up to just past ``limit``."""
    from jinja2.utils import Namespace

    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v)
        elif isinstance(v, Namespace):
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        elif isinstance(v, Mapping):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, range):
            total += len(v)
        elif isinstance(v, Collection):
            total += len(v)
            stack.extend(v)
        else:
            total += 1
        if total > limit:
            break
    return total


def _check_size(value: Any, what: str = "a value") -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        n = _weight(value)
        if n > TEMPLATE_MAX_CHARS:
            raise _too_big(what, n)
    return value


def _check_width(n: Any, what: str) -> None:
    if isinstance(n, int) and n > TEMPLATE_MAX_CHARS:
        raise _too_big(what, n)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_NUMBER = re.compile(r"\d+")


def _check_percent(fmt: str) -> None:
    """``fmt % args`` makes at most ~len(fmt) + args, unless a width or precision is huge."""
    for m in _PERCENT_SPEC.finditer(fmt):
        for g in m.groups():
            if g == "*":
                raise _TemplateLimit("uses a '*' width in %-formatting, which is not allowed")
            if g is not None:
                _check_width(int(g), "a %-formatted field")


def _check_format(fmt: str) -> None:
    """The same for ``str.format``: no field width or precision past the size limit."""
    import string

    for _lit, _field, spec, _conv in string.Formatter().parse(fmt):
        if spec:
            if "{" in spec:
                raise _TemplateLimit("uses a nested field in a str.format spec, which is not allowed")
            for m in _NUMBER.finditer(spec):
                _check_width(int(m.group()), "a str.format field")


def _materialize(iterable: Any) -> list[Any]:
    if isinstance(iterable, (list, tuple)):
        return list(iterable)
    out = []
    for x in iterable:
        _tick()
        out.append(x)
        if len(out) > TEMPLATE_MAX_CHARS:
            raise _too_big("a list", len(out))
    return out


def _check_join(sep: str, items: list[Any]) -> None:
    n = _weight(items) + len(sep) * max(len(items) - 1, 0)
    if n > TEMPLATE_MAX_CHARS:
        raise _too_big("a joined string", n)


def _check_replace(s: str, old: Any, new: Any, count: Any = -1) -> None:
    if not isinstance(old, str) or not isinstance(new, str):
        return
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    n = len(s) + hits * max(len(new) - len(old), 0)
    if n > TEMPLATE_MAX_CHARS:
        raise _too_big("a replaced string", n)


def _guard_str_method(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Pre-checks of the str methods whose result can be far larger than their inputs."""
    s, name = obj.__self__, obj.__name__
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0], f"a str.{name} result")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_width(len(s) + s.count("\t") * size, "an expandtabs result")
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, *args[:3])
    elif name == "join" and args:
        items = _materialize(args[0])
        _check_join(s, [str(x) if not isinstance(x, str) else x for x in items])
        return (items, *args[1:])
    return args


def _guard_iter(iterable: Any) -> Iterator[Any]:
    """What a ``{% for %}`` loops over: one step per item."""
    for x in iterable:
        _tick()
        yield x


def _guarded_concat(values: Any) -> str:
    """``a ~ b ~ ...`` with the result's size checked before it is built."""
    parts = [v if isinstance(v, str) else str(v) for v in values]
    n = sum(map(len, parts))
    if n > TEMPLATE_MAX_CHARS:
        raise _too_big("a ~ concatenation", n)
    _tick()
    return "".join(parts)


def _counted_output(value: Any) -> str:
    """Each ``{{ ... }}``: its text counts toward TEMPLATE_OUTPUT_FACTOR x TEMPLATE_MAX_CHARS for
    the whole render (a macro's or block's output is buffered before it is joined, so the join
    alone would check too late)."""
    text = value if isinstance(value, str) else str(value)
    b = getattr(_ACTIVE, "budget", None)
    if b is None:
        raise _TemplateLimit("ran outside a render")
    b.printed += len(text)
    if b.printed > TEMPLATE_OUTPUT_FACTOR * TEMPLATE_MAX_CHARS:
        raise _too_big("output (macros and blocks included)", b.printed, TEMPLATE_OUTPUT_FACTOR * TEMPLATE_MAX_CHARS)
    _tick()
    return text


def _bounded_concat(pieces: Iterable[str]) -> str:
    """environment.concat: the template's output (and a macro's, a block's) up to the size limit."""
    out, n = [], 0
    for p in pieces:
        n += len(p)
        if n > TEMPLATE_MAX_CHARS:
            raise _too_big("output", n)
        out.append(p)
    return "".join(out)


def _safe_range(*args: Any) -> range:
    _tick()
    r = range(*args)
    try:
        n = len(r)
    except OverflowError:
        n = TEMPLATE_MAX_RANGE + 1
    if n > TEMPLATE_MAX_RANGE:
        raise _TemplateLimit(f"asks for a range of more than {TEMPLATE_MAX_RANGE} items ({r})")
    return r


#: value argument checks of the filters that can build far more than they are given; each gets
#: the filter's arguments (without a context) and returns them, perhaps materialized
def _f_center(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    _check_width(a[1] if len(a) > 1 else k.get("width", 80), "a centered string")
    return a


def _f_indent(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    width = a[1] if len(a) > 1 else k.get("width", 4)
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    s = str(a[0])
    _check_width(len(s) + (s.count("\n") + 1) * w, "an indented string")
    return a


def _f_format(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    _check_percent(str(a[0]))
    return a


def _f_join(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    items = _materialize(a[0])
    sep = a[1] if len(a) > 1 else k.get("d", "")
    _check_join(str(sep), items)
    return (items, *a[1:])


def _f_replace(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    if len(a) >= 3:
        _check_replace(str(a[0]), a[1], a[2], a[3] if len(a) > 3 else k.get("count", -1))
    return a


def _f_count_arg(name: str, pos: int) -> Any:
    def check(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
        n = a[pos] if len(a) > pos else k.get(name, 0)
        if isinstance(n, int) and n > TEMPLATE_MAX_RANGE:
            raise _TemplateLimit(f"asks a filter for {n} {name} (at most {TEMPLATE_MAX_RANGE})")
        return a

    return check


def _f_sum(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    start = a[2] if len(a) > 2 else k.get("start", 0)
    if not isinstance(start, (int, float)):
        raise _TemplateLimit("sums non-numbers with the sum filter, which is not allowed")
    return a


def _f_small_input(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    if _weight(a[0], 1 << 18) > 1 << 18:
        raise _TemplateLimit(f"gives a slow filter more than {1 << 18} characters")
    return a


def _f_tojson(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, ...]:
    indent = a[1] if len(a) > 1 else k.get("indent")
    if (isinstance(indent, int) and indent > 16) or (isinstance(indent, str) and len(indent) > 16):
        raise _TemplateLimit("asks tojson for an indent of more than 16")
    return a


_FILTER_CHECKS: dict[str, Any] = {
    "center": _f_center,
    "indent": _f_indent,
    "format": _f_format,
    "join": _f_join,
    "replace": _f_replace,
    "batch": _f_count_arg("linecount", 1),
    "slice": _f_count_arg("slices", 1),
    "sum": _f_sum,
    "tojson": _f_tojson,
    **dict.fromkeys(("wordwrap", "urlize", "pprint", "striptags", "xmlattr", "urlencode"), _f_small_input),
}


def _guard_filter(name: str, func: Any) -> Any:
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(func) is None else 1  # a context / environment comes first
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick(clock=True)
        if check is not None and len(args) > skip:
            args = (*args[:skip], *check(args[skip:], kwargs))
        out = func(*args, **kwargs)
        if isinstance(out, types.GeneratorType):
            return _guard_iter(out)
        return _check_size(out, f"a {name} filter result")

    return guarded


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _chat_environment() -> Any:
    """The jinja2 environment chat templates run in: ImmutableSandboxedEnvironment (no escapes, no
    mutation of lists and dicts) plus limits on time and size, enforced at every point where a
    template can do work: each ``{% for %}`` item, call, attribute or item lookup, filter and
    arithmetic operator counts a step (and checks the deadline), ``range`` is bounded, and the
    operations that can build a large value (``*``, ``+``, ``**``, ``%``, ``~``, str.format,
    str.center/ljust/rjust/zfill/expandtabs/replace/join, the filters in _FILTER_CHECKS, the
    output of the template and of its macros and blocks) check the size first."""
    from jinja2 import nodes
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    def _at(node: Any, like: Any) -> Any:
        return node.set_lineno(like.lineno)

    class _Rewrite(NodeTransformer):
        """Each for loop's iterable through _guard_iter, each ``~`` through _guarded_concat, each
        printed expression through _counted_output."""

        def visit_Output(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.nodes = [
                n if isinstance(n, nodes.TemplateData) else _at(nodes.Filter(n, "_vkx_out", [], [], None, None), n)
                for n in node.nodes
            ]
            return node

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = _at(nodes.Filter(node.iter, "_vkx_iter", [], [], None, None), node)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            items = _at(nodes.List(list(node.nodes)), node)
            return _at(nodes.Filter(items, "_vkx_concat", [], [], None, None), node)

    class GuardedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = _Rewrite().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            _tick()
            seqs = (str, bytes, list, tuple)
            ints = (int,)
            if op == "*":
                if isinstance(left, seqs) and isinstance(right, ints) or isinstance(right, seqs) and isinstance(
                    left, ints
                ):
                    seq, n = (left, right) if isinstance(left, seqs) else (right, left)
                    if n > 0 and _weight(seq) * n > TEMPLATE_MAX_CHARS:
                        raise _too_big("a repeated sequence", _weight(seq) * n)
                elif isinstance(left, ints) and isinstance(right, ints):
                    if abs(left).bit_length() + abs(right).bit_length() > TEMPLATE_MAX_INT_BITS:
                        raise _TemplateLimit(f"computes an integer of more than {TEMPLATE_MAX_INT_BITS} bits")
            elif op == "+":
                if isinstance(left, seqs) and isinstance(right, seqs):
                    n = _weight(left) + _weight(right)
                    if n > TEMPLATE_MAX_CHARS:
                        raise _too_big("a concatenation", n)
            elif op == "**":
                if isinstance(left, ints) and isinstance(right, ints) and right > 0 and abs(left) > 1:
                    if right * abs(left).bit_length() > TEMPLATE_MAX_INT_BITS:
                        raise _TemplateLimit(f"computes an integer of more than {TEMPLATE_MAX_INT_BITS} bits")
            elif op == "%" and isinstance(left, str):
                _check_percent(left)
            return self.binop_table[op](left, right)

        def getattr(self, obj: Any, attribute: str) -> Any:
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _tick()
            return super().getitem(obj, argument)

        def wrap_str_format(self, value: Any) -> Any:
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format(value.__self__)
            return wrapped

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _tick(clock=True)
            if isinstance(__obj, types.BuiltinMethodType) and isinstance(getattr(__obj, "__self__", None), str):
                args = _guard_str_method(__obj, args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            return _check_size(out, "a call result")

    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.concat = _bounded_concat  # type: ignore[method-assign]
    env.globals["range"] = _safe_range
    env.globals.pop("lipsum", None)  # lipsum(n) makes n paragraphs; no chat template needs it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["_vkx_iter"] = _guard_iter
    env.filters["_vkx_concat"] = _guarded_concat
    env.filters["_vkx_out"] = _counted_output
    return env
