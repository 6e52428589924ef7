"""Captured graphs per input-shape signature under one gpu_graph_id (issue 23, item 3).

A CUDA graph replays fixed kernels on fixed buffers of fixed sizes, so a binding whose inputs change
shape needs another graph. ONNX Runtime leaves that to the caller (one gpu_graph_id per shape);
ephost does it itself: under each gpu_graph_id a thread holds up to `session.ephost.graphs_per_id`
graphs, one per signature of the bound inputs' shapes and dtypes, least recently used evicted (and
released through the EP's ReleaseCapturedGraph). The EP sees an internal graph id per graph: the
caller's id for the first graph of an id (so a caller with one shape per id sees no change), then ids
from a range callers may not use (>= INTERNAL_BASE), unique in the process.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from host.errors import InvalidArgument

CONFIG_KEY = "session.ephost.graphs_per_id"
DEFAULT_GRAPHS_PER_ID = 8
INTERNAL_BASE = 1 << 30  # the ABI's graph ids are int32: callers get [0, 2^30), per-shape graphs the rest
_internal_ids = itertools.count(INTERNAL_BASE)  # next() is atomic under the GIL: no two graphs share one


def capacity(entries: dict[str, str]) -> int:
    """Graphs kept per gpu_graph_id and thread; 0 is strict mode (one graph per id, a new shape is an error)."""
    text = entries.get(CONFIG_KEY, str(DEFAULT_GRAPHS_PER_ID))
    if not (text.isascii() and text.isdigit()):
        raise InvalidArgument(f"session config '{CONFIG_KEY}' = {text!r}: expected a decimal integer >= 0 "
                              f"(captured graphs kept per gpu_graph_id, one per input-shape signature; 0 keeps "
                              f"one graph per id and refuses a new shape; default {DEFAULT_GRAPHS_PER_ID})")
    return int(text)


def shape_signature(binding) -> tuple:
    """The bound inputs' names, shapes and dtypes: what decides which graph a binding replays."""
    return tuple(sorted((name, tuple(v.shape), v.dtype.str) for name, v in binding.inputs.items()))


@dataclass(eq=False)
class Graph:
    """One graph of an id: the id the EP knows it by and, once captured, the binding it was captured with."""

    internal_id: int
    shape: tuple
    binding: dict | None = None  # None until the EP reports it captured, and again once evicted
    copies: list = field(default_factory=list)  # device copies its replays read (GraphCapture._capture)


class GraphsOfId:
    """The graphs one thread holds under one gpu_graph_id, by shape signature, least recently used first."""

    def __init__(self, gid: int, limit: int):
        self.gid = gid
        self.limit = max(limit, 1)  # strict mode (0) holds one graph; GraphCapture refuses the second shape
        self.by_shape: OrderedDict[tuple, Graph] = OrderedDict()

    def get(self, shape: tuple) -> Graph | None:
        graph = self.by_shape.get(shape)
        if graph is not None:
            self.by_shape.move_to_end(shape)
        return graph

    def touch(self, graph: Graph) -> None:
        self.by_shape.move_to_end(graph.shape)

    @property
    def full(self) -> bool:
        return len(self.by_shape) >= self.limit

    def add(self, shape: tuple) -> Graph:
        """A new graph for `shape` (the caller made room): the caller's id if free, else a fresh internal one."""
        used = {g.internal_id for g in self.by_shape.values()}
        graph = Graph(self.gid if self.gid not in used else next(_internal_ids), shape)
        self.by_shape[shape] = graph
        return graph

    def evict(self, shape: tuple) -> Graph:
        """Drop the least recently used graph and give its internal id to a new graph for `shape`
        (the caller released the old one in the EP first)."""
        _, old = self.by_shape.popitem(last=False)
        old.binding = None
        graph = Graph(old.internal_id, shape)
        self.by_shape[shape] = graph
        return graph

    def remove(self, shape: tuple) -> None:
        self.by_shape.pop(shape).binding = None

    def oldest(self) -> Graph:
        return next(iter(self.by_shape.values()))

    def newest_captured(self) -> Graph | None:
        return next((g for g in reversed(self.by_shape.values()) if g.binding is not None), None)

    def internal_ids(self) -> list[int]:
        return [g.internal_id for g in self.by_shape.values()]
