"""The executor: records a graph's nodes into a hub command sequence.

``record_graph(seq, graph)`` walks the nodes in order and calls the hub recorder of each op
(the ``HUB_OPS`` table: op name -> function(seq, node)). Recording happens once per graph;
the step is then replayed by submitting the sequence again, with per-step values (token
ids, positions, KV length) read by the kernels from small buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import KernelError
from .graph import Graph, Node
from .vk.command import Sequence


def _mul_mat(seq: Sequence, n: Node) -> None:
    from .ops.mul_mat import record_mul_mat

    w, x = n.inputs
    y = n.output
    record_mul_mat(seq, w.buffer, w.dtype, x.buffer, y.buffer, M=x.rows, N=w.shape[0], K=w.shape[-1])


def _get_rows(seq: Sequence, n: Node) -> None:
    from .ops.get_rows import record_get_rows

    w, ids = n.inputs
    record_get_rows(seq, w.buffer, w.dtype, ids.buffer, n.output.buffer, ids.shape[0], w.shape[-1])


def _rms_norm(seq: Sequence, n: Node) -> None:
    from .ops.norm import record_rms_norm

    x, w = n.inputs
    record_rms_norm(seq, x.buffer, n.output.buffer, x.rows, x.cols, n.params["eps"], w.buffer)


def _add(seq: Sequence, n: Node) -> None:
    from .ops.elementwise import record_add

    a, b = n.inputs
    record_add(seq, a.buffer, b.buffer, n.output.buffer, a.rows, a.cols, b_rows=b.rows if len(b.shape) > 1 else 1)


def _swiglu(seq: Sequence, n: Node) -> None:
    from .ops.elementwise import record_swiglu

    g, u = n.inputs
    record_swiglu(seq, g.buffer, u.buffer, n.output.buffer, g.rows, g.cols)


def _rope(seq: Sequence, n: Node) -> None:
    from .ops.rope import record_rope

    x, pos = n.inputs
    p = n.params
    record_rope(seq, x.buffer, pos.buffer, n.output.buffer, x.rows, p["n_heads"], p["head_dim"],
                n_dims=p["n_dims"], mode="neox" if p["mode"] == "neox" else "normal",
                freq_base=p["freq_base"], freq_scale=p["freq_scale"])


def _kv_store(seq: Sequence, n: Node) -> None:
    from .ops.attention import record_kv_store

    k, v, pos = n.inputs
    p = n.params
    record_kv_store(seq, k.buffer, v.buffer, pos.buffer, n.output.buffer, p["cache_v"].buffer, k.rows,
                    p["n_kv_heads"], p["head_dim"], n.output.shape[0])


def _attention(seq: Sequence, n: Node) -> None:
    from .ops.attention import record_attention

    q, ck, cv, pos = n.inputs
    p = n.params
    scratch = p.get("scratch")
    record_attention(seq, q.buffer, ck.buffer, cv.buffer, pos.buffer, n.output.buffer, q.rows, p["n_heads"],
                     p["n_kv_heads"], p["head_dim"], p["n_ctx"], n_splits=p.get("n_splits", 1),
                     scratch=scratch.buffer if scratch is not None else None)


def _argmax(seq: Sequence, n: Node) -> None:
    from .ops.argmax import record_argmax

    (x,) = n.inputs
    record_argmax(seq, x.buffer, n.output.buffer, x.rows, x.cols)


HUB_OPS: dict[str, Callable[[Sequence, Node], None]] = {
    "mul_mat": _mul_mat,
    "get_rows": _get_rows,
    "rms_norm": _rms_norm,
    "add": _add,
    "swiglu": _swiglu,
    "rope": _rope,
    "kv_store": _kv_store,
    "attention": _attention,
    "argmax": _argmax,
}


def record_graph(seq: Sequence, graph: Graph, ops: dict[str, Any] | None = None) -> None:
    table = ops or HUB_OPS
    for node in graph.nodes:
        fn = table.get(node.op)
        if fn is None:
            raise KernelError(f"graph {graph.name}: no hub kernel for op {node.op} (node {node.name})")
        fn(seq, node)
