"""Python copies of what the host shows a plugin: devices, memory, graph views, call-frame tensors.

Read once at session creation (GetCapability, Compile), never per run. A view's constants are not
copied: they are read-only NumPy views of the host's memory, which the host keeps unchanged as long
as the view (abi/ep_abi.h, "Lifetimes"). Copying them cost a BERT-base session 0.3 s (issue 29).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from abi.dtypes import to_numpy


@dataclass(frozen=True)
class DeviceSpec:
    device_type: int
    device_id: int
    vendor_id: int = 0
    name: str = ""
    memory_name: str = "Cpu"


@dataclass(frozen=True)
class MemorySpec:
    name: str
    device_type: int
    device_id: int
    mem_type: int = 0


@dataclass
class ValueSpec:
    name: str
    elem_type: int
    shape: tuple | None  # None: rank unknown; -1 marks an unknown dimension (None in FusedGraph inputs/outputs)
    kind: int
    constant: np.ndarray | None = None
    flags: int = 0  # EpValueInfo.flags (since 7): abi.VALUE_HOST_COMPUTED

    @property
    def host_computed(self) -> bool:
        """The host computes this value from the input shapes and hands it to this EP's kernels
        in host memory (abi.VALUE_HOST_COMPUTED)."""
        return bool(self.flags & 1)

    @property
    def dtype(self) -> int:
        """The element type as an ONNX TensorProto enum int (the same as elem_type)."""
        return self.elem_type


@dataclass
class NodeSpec:
    index: int
    name: str
    op_type: str
    domain: str
    opset: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: dict = field(default_factory=dict)


@dataclass
class GraphSpec:
    """A Python copy of an EpGraphView. `inputs`/`outputs` describe the graph's inputs and outputs
    with None for unknown dimensions; `input_ids`/`output_ids` are their indices into `values`."""

    nodes: list[NodeSpec]
    values: list[ValueSpec]
    inputs: list[ValueSpec] = field(default_factory=list)
    outputs: list[ValueSpec] = field(default_factory=list)
    input_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    name: str = ""


@dataclass
class FusedGraph:
    """One claimed group as Compile sees it: `name` is the fused node's name (errors name it),
    `graph` holds just the group's nodes, the constants they read, and the group's inputs/outputs
    in the order of the call frame's inputs/outputs."""

    name: str
    graph: GraphSpec


@dataclass(frozen=True)
class FrameTensor:
    """One input or output of a call frame: a device pointer (0: an output not preallocated),
    an ONNX element type and a shape (for an output not preallocated, the inferred one, with
    None for unknown dimensions, or None when even the rank is unknown)."""

    ptr: int
    dtype: int
    shape: tuple | None


def _s(ffi, p) -> str:
    return "" if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")


def tensor_to_numpy(ffi, t) -> np.ndarray:
    """Copy a CPU EpTensor into a NumPy array."""
    return _tensor_view(ffi, t).copy()


def constant_view(ffi, t) -> np.ndarray:
    """A read-only NumPy view of a graph view's constant (no copy: see the module docstring)."""
    arr = _tensor_view(ffi, t)
    arr.flags.writeable = False
    return arr


def _tensor_view(ffi, t) -> np.ndarray:
    dtype = to_numpy(t.elem_type)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.nbytes == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(ffi.buffer(t.data, t.nbytes), dtype=dtype).reshape(shape)


def _attr_value(ffi, a):
    kind = a.type
    if kind == 1:
        return float(a.f)
    if kind == 2:
        return int(a.i)
    if kind == 3:
        return _s(ffi, a.s)
    if kind == 4:
        return tensor_to_numpy(ffi, a.tensor[0]) if a.tensor != ffi.NULL else None
    if kind == 6:
        return [float(a.floats[i]) for i in range(a.count)]
    if kind == 7:
        return [int(a.ints[i]) for i in range(a.count)]
    if kind == 8:
        return [_s(ffi, a.strings[i]) for i in range(a.count)]
    return None


def _io_spec(v: ValueSpec) -> ValueSpec:
    shape = None if v.shape is None else tuple(None if d < 0 else d for d in v.shape)
    return ValueSpec(v.name, v.elem_type, shape, v.kind, v.constant)


def read_graph(ffi, g, flags: bool = True) -> GraphSpec:
    """Python copy of an EpGraphView (done at session creation, never per run). `flags`: read
    EpValueInfo.flags (an EP that negotiated v7 or later; before, the field is reserved)."""
    values = []
    for i in range(g.num_values):
        v = g.values[i]
        shape = None if v.ndim < 0 else tuple(int(v.shape[d]) for d in range(v.ndim))
        const = constant_view(ffi, v.constant[0]) if v.constant != ffi.NULL else None
        values.append(ValueSpec(_s(ffi, v.name), v.elem_type, shape, v.kind, const, int(v.flags) if flags else 0))
    nodes = []
    for i in range(g.num_nodes):
        n = g.nodes[i]
        attrs = {_s(ffi, n.attributes[k].name): _attr_value(ffi, n.attributes[k]) for k in range(n.num_attributes)}
        nodes.append(NodeSpec(
            i, _s(ffi, n.name), _s(ffi, n.op_type), _s(ffi, n.domain), n.opset,
            tuple(n.inputs[k] for k in range(n.num_inputs)),
            tuple(n.outputs[k] for k in range(n.num_outputs)), attrs))
    ins = tuple(int(g.inputs[k]) for k in range(g.num_inputs))
    outs = tuple(int(g.outputs[k]) for k in range(g.num_outputs))
    return GraphSpec(nodes, values, [_io_spec(values[i]) for i in ins], [_io_spec(values[i]) for i in outs],
                     ins, outs, _s(ffi, g.name))


def read_key_values(ffi, entries, count: int) -> dict[str, str]:
    return {_s(ffi, entries[i].key): _s(ffi, entries[i].value) for i in range(count)}

