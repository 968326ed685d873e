"""A small ggml-like compute graph: tensors and the ops between them.

A :class:`Graph` is built once per model and batch size (number of tokens ``T``) and lists
its nodes in execution order. Tensors know their shape, element type (``f32``, ``f16``,
``i32`` or a ggml weight type such as ``q4_0``) and the hub memory they live in; weights
are shared by every graph of a model (uploaded once, never copied per graph or per plan).
When backends are attached, that memory is a :class:`~vkxsplit.attach.SharedView` (hub
kernels bind it, backends read it in place).

The planner (:mod:`vkxsplit.plan`) decides where each node runs; the executor
(:mod:`vkxsplit.executor`) records the hub's share once into command sequences (each node
through its op's recorder, :mod:`vkxsplit.ops.nodes`) and replays them every step. This module
imports neither: they import it. Both reason about which bytes a node reads and writes
(:meth:`Node.reads`, :meth:`Node.writes`, :func:`span`): activation buffers are reused
across layers, so the order of a write and a later read of the same range is what creates
a dependency, not the tensor's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .vk.kernel import Bindable, as_range
from .vk.kernel import spans_overlap as overlap  # the one overlap rule (ops' checks use it too)

_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(eq=False)
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for 2-D
    dtype: str  # f32, f16, bf16, i32, u32 or a ggml weight type name (q4_0, q6_k, ...)
    buffer: Bindable | None = None
    weight: bool = False

    @property
    def rows(self) -> int:
        r = 1
        for d in self.shape[:-1]:
            r *= d
        return r

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def shared(self) -> bool:
        """Whether attached backends can reach this tensor's memory (a SharedView)."""
        from .attach import SharedView

        return isinstance(self.buffer, SharedView)

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.shape}, {self.dtype})"


Span = tuple[Any, int, int]  # (memory key, first byte, end byte)


def span(t: Tensor) -> Span:
    """The bytes ``t`` occupies, for dependency analysis: ``(block serial, start, end)``.
    A tensor without memory (dry planning) is its own memory, keyed by name."""
    if t.buffer is None:
        return (("tensor", t.name), 0, 1)
    _h, off, size, serial = as_range(t.buffer)
    return (serial, off, off + size)


def any_overlap(xs: list[Span], ys: list[Span]) -> bool:
    return any(overlap(x, y) for x in xs for y in ys)


#: params that name tensors a node only reads
READ_ONLY_PARAMS = frozenset({"xq"})


@dataclass(eq=False)
class Node:
    op: str
    name: str
    inputs: list[Tensor]
    output: Tensor
    params: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    hub: int = 0  # the Vulkan hub whose buffers the node reads and writes (a model over several hubs)

    def _param_tensors(self) -> list[Tensor]:
        return [v for v in self.params.values() if isinstance(v, Tensor)]

    def reads(self) -> list[Tensor]:
        """Tensors the node reads (inputs, and tensors passed as params, e.g. scratch)."""
        return [*self.inputs, *self._param_tensors()]

    def writes(self) -> list[Tensor]:
        """Tensors the node writes: its output, and tensors passed as params (the V cache of
        ``kv_store``, the scratch of ``attention``), conservatively; not the read-only ones
        (``xq``: the quantized x a ``mul_mat`` reads, which the q, k and v projections share:
        counted as written it would order them one after another)."""
        return [self.output, *(v for k, v in self.params.items() if isinstance(v, Tensor) and k not in READ_ONLY_PARAMS)]

    @property
    def weight(self) -> Tensor | None:
        """The weight input of the node (``mul_mat``: the matrix), if any."""
        for t in self.inputs:
            if t.weight:
                return t
        return None

    @property
    def layer(self) -> int | None:
        """The decoder layer (``blk.N.``) the node belongs to, or None (embedding, output)."""
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None

    def names(self) -> list[str]:
        """The names a split regex is matched against: the node's and its weights'."""
        return [self.name, *(t.name for t in self.inputs if t.weight)]

    def signature(self) -> str:
        """What the cost of running this node on the hub depends on (the profile key): op,
        input/output types and shapes, and its scalar parameters."""
        ts = ";".join(f"{t.dtype}:{'x'.join(map(str, t.shape))}" for t in (*self.inputs, self.output))
        ps = ",".join(f"{k}={v}" for k, v in sorted(self.params.items())
                      if isinstance(v, (int, float, str)) and not isinstance(v, bool))
        return f"{self.op}|{ts}|{ps}"

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.op}, {self.name!r})"


@dataclass(eq=False)
class Graph:
    name: str
    nodes: list[Node] = field(default_factory=list)
    T: int = 0  # tokens per step (the batch size the graph was built for)

    def add(self, op: str, name: str, inputs: list[Tensor], output: Tensor, **params: Any) -> Tensor:
        self.nodes.append(Node(op, name, inputs, output, params, index=len(self.nodes)))
        return output

    def ops(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return out

    def mul_mats(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "mul_mat"]

    def find(self, pattern: str | re.Pattern[str]) -> list[Node]:
        """Nodes whose name, or the name of one of their weights, matches ``pattern``
        (``re.search``, like llama.cpp's ``--override-tensor``)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return [n for n in self.nodes if any(rx.search(s) for s in n.names())]

    @property
    def n_layer(self) -> int:
        layers = [n.layer for n in self.nodes if n.layer is not None]
        return max(layers) + 1 if layers else 0

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
