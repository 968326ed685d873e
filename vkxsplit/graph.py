"""A small ggml-like compute graph: tensors and the ops between them.

A :class:`Graph` is built once per model and batch size (number of tokens ``T``) and lists
its nodes in execution order. Tensors know their shape, element type (``f32``, ``f16``,
``i32`` or a ggml weight type such as ``q4_0``) and the hub memory they live in; weights
are shared by every graph of a model (uploaded once). The executor records a graph into
a command sequence once and replays it for every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .vk.kernel import Bindable


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for 2-D
    dtype: str  # f32, f16, i32, u32 or a ggml weight type name (q4_0, q6_k, bf16, ...)
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


@dataclass
class Node:
    op: str
    name: str
    inputs: list[Tensor]
    output: Tensor
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Graph:
    name: str
    nodes: list[Node] = field(default_factory=list)

    def add(self, op: str, name: str, inputs: list[Tensor], output: Tensor, **params: Any) -> Tensor:
        self.nodes.append(Node(op, name, inputs, output, params))
        return output

    def ops(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return out
