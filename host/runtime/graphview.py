"""The read-only EpGraphView the host shows to GetCapability and CreateKernel.

Built once per session; every C object it points to is kept alive by the view.
"""

from __future__ import annotations

import numpy as np

import abi
from abi.dtypes import to_onnx
from host.plugins.hostapi import ffi
from host.runtime.model import Graph

_ATTR_FLOAT, _ATTR_INT, _ATTR_STRING, _ATTR_TENSOR, _ATTR_FLOATS, _ATTR_INTS, _ATTR_STRINGS = 1, 2, 3, 4, 6, 7, 8


class GraphView:
    """Owns the C structs of one EpGraphView; `ptr` is what plugins receive."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._keep: list = []
        self.value_index: dict[str, int] = {}
        names = self._value_names(graph)
        self.value_names = names
        for i, n in enumerate(names):
            self.value_index[n] = i
        self.ptr = ffi.new("EpGraphView*")
        self.ptr.struct_size = ffi.sizeof("EpGraphView")
        self.ptr.version = abi.ABI_VERSION
        self.ptr.name = self._str(graph.model.graph.name or "main")
        self._fill_values(graph, names)
        self._fill_nodes(graph)
        ins = [self.value_index[v.name] for v in graph.inputs]
        outs = [self.value_index[v.name] for v in graph.outputs]
        self.ptr.num_inputs, self.ptr.inputs = len(ins), self._ints32(ins)
        self.ptr.num_outputs, self.ptr.outputs = len(outs), self._ints32(outs)

    @staticmethod
    def _value_names(graph: Graph) -> list[str]:
        seen: dict[str, None] = {}
        for v in graph.inputs:
            seen[v.name] = None
        for name in graph.initializers:
            seen[name] = None
        for n in graph.nodes:
            for name in (*n.inputs, *n.outputs):
                if name:
                    seen[name] = None
        return list(seen)

    def _str(self, s: str):
        c = ffi.new("char[]", s.encode())
        self._keep.append(c)
        return c

    def _ints32(self, xs):
        c = ffi.new("int32_t[]", list(xs) or [0])
        self._keep.append(c)
        return c

    def _ints64(self, xs):
        c = ffi.new("int64_t[]", list(xs) or [0])
        self._keep.append(c)
        return c

    def tensor(self, arr: np.ndarray):
        arr = np.asarray(arr, order="C")
        t = ffi.new("EpTensor*")
        self._keep += [t, arr]
        t.data = ffi.cast("void*", arr.ctypes.data)
        t.shape = self._ints64(arr.shape)
        t.ndim, t.elem_type = arr.ndim, to_onnx(arr.dtype)
        t.device_type, t.device_id, t.nbytes = abi.DEVICE_CPU, 0, arr.nbytes
        return t

    def _fill_values(self, graph: Graph, names: list[str]) -> None:
        vals = ffi.new("EpValueInfo[]", max(len(names), 1))
        self._keep.append(vals)
        graph_ins = {v.name for v in graph.inputs}
        graph_outs = {v.name for v in graph.outputs}
        for i, name in enumerate(names):
            meta = graph.values.get(name)
            v = vals[i]
            v.name = self._str(name)
            v.elem_type = meta.elem_type if meta else 0
            if meta is None or meta.shape is None:
                v.ndim = -1
            else:
                v.ndim = len(meta.shape)
                v.shape = self._ints64([d if isinstance(d, int) and d > 0 else -1 for d in meta.shape])
            if name in graph.initializers:
                v.kind = abi.VALUE_INITIALIZER
                if graph.initializers[name].dtype != object:  # no C view of Python str objects
                    v.constant = self.tensor(graph.initializers[name])
            elif name in graph_ins:
                v.kind = abi.VALUE_GRAPH_INPUT
            elif name in graph_outs:
                v.kind = abi.VALUE_GRAPH_OUTPUT
        self.ptr.num_values, self.ptr.values = len(names), vals

    def mark_host_computed(self, value_ids) -> None:
        """Flag the values the host's shape program computes (EpValueInfo.flags, since 7): kernels
        of v7+ EPs receive them in host memory (host/runtime/steps/plugin.py)."""
        for vid in value_ids:
            self.ptr.values[vid].flags |= abi.VALUE_HOST_COMPUTED

    def _fill_nodes(self, graph: Graph) -> None:
        nodes = ffi.new("EpNodeView[]", max(len(graph.nodes), 1))
        self._keep.append(nodes)
        for i, n in enumerate(graph.nodes):
            c = nodes[i]
            c.name, c.op_type, c.domain = self._str(n.name), self._str(n.op_type), self._str(n.domain)
            c.opset = n.opset
            ins = [self.value_index[x] if x else -1 for x in n.inputs]
            outs = [self.value_index[x] if x else -1 for x in n.outputs]
            c.num_inputs, c.inputs = len(ins), self._ints32(ins)
            c.num_outputs, c.outputs = len(outs), self._ints32(outs)
            attrs = [(k, v) for k, v in n.attrs.items() if self._attr_kind(v) is not None]
            arr = ffi.new("EpAttribute[]", max(len(attrs), 1))
            self._keep.append(arr)
            for j, (k, v) in enumerate(attrs):
                self._fill_attr(arr[j], k, v)
            c.num_attributes, c.attributes = len(attrs), arr
        self.ptr.num_nodes, self.ptr.nodes = len(graph.nodes), nodes

    @staticmethod
    def _attr_kind(v):
        if isinstance(v, bool) or isinstance(v, int):
            return _ATTR_INT
        if isinstance(v, float):
            return _ATTR_FLOAT
        if isinstance(v, str):
            return _ATTR_STRING
        if isinstance(v, np.ndarray):
            return _ATTR_TENSOR
        if isinstance(v, (list, tuple)):
            if all(isinstance(x, int) for x in v):
                return _ATTR_INTS
            if all(isinstance(x, (int, float)) for x in v):
                return _ATTR_FLOATS
            if all(isinstance(x, str) for x in v):
                return _ATTR_STRINGS
        return None

    def _fill_attr(self, a, name: str, v) -> None:
        a.name = self._str(name)
        kind = a.type = self._attr_kind(v)
        if kind == _ATTR_INT:
            a.i = int(v)
        elif kind == _ATTR_FLOAT:
            a.f = float(v)
        elif kind == _ATTR_STRING:
            a.s = self._str(v)
        elif kind == _ATTR_TENSOR:
            a.tensor = self.tensor(v)
        elif kind == _ATTR_INTS:
            a.count, a.ints = len(v), self._ints64(v)
        elif kind == _ATTR_FLOATS:
            fl = ffi.new("double[]", [float(x) for x in v] or [0.0])
            self._keep.append(fl)
            a.count, a.floats = len(v), fl
        elif kind == _ATTR_STRINGS:
            ptrs = ffi.new("char*[]", [self._str(x) for x in v] or [ffi.NULL])
            self._keep.append(ptrs)
            a.count, a.strings = len(v), ptrs
