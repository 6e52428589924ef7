"""Consecutive GEMM layers (an MLP at a small batch) run as one compiled call.

An MLP's layers become epilogue chains in the run loop (fusion.py: a Gemm or MatMul over a bound weight,
then its Relu or the like), each reading the one before it alone. At batch 1 a 256 x 256 layer's product
takes a few microseconds, and the Python around it (the loop's step, the chain's checks, the pointers)
about as much again. `ep_gemm_stack` runs the layers in one call: each layer is the compiled GEMM call
that its own chain makes (the same product, bias and epilogue program), so the results are the same bits.
The intermediates go to scratch that the C side allocates per call, so concurrent runs share nothing.

A stack is made of whole chains without a residual operand and without half-precision storage, each over
bound float32 weights that the small GEMM takes at the run's row count. Any other input runs the chains one
by one, each as it would alone.
"""

from __future__ import annotations

import operator

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.fusion import FusedNode, _EpilogueChain

F32 = native.F32
_LAYERS = {("", "Gemm"), ("", "MatMul")}


def _layer(node) -> _EpilogueChain | None:
    """The chain of a step that can be a stack's layer, else None."""
    chain = node.kernel if isinstance(node, FusedNode) else None
    if not isinstance(chain, _EpilogueChain) or chain.native is None:
        return None
    prog, res, alpha, beta = chain.native
    producer = chain.producer
    domain = "" if producer.node.domain in ("", "ai.onnx") else producer.node.domain
    if (domain, producer.op_type) not in _LAYERS or res >= 0 or alpha or beta:
        return None
    if chain.half is not None or chain.widen_args is not None or node.inputs != chain.arg_ids:
        return None
    return chain


def _follows(prev: FusedNode, node: FusedNode, consumers: dict, keep) -> bool:
    """Whether `node` reads `prev`'s output as its first operand, and nothing else reads it."""
    y = prev.outputs[0]
    return (len(prev.outputs) == 1 and node.kernel.arg_ids[0] == y and y not in keep and consumers.get(y, 0) == 1
            and y not in node.kernel.arg_ids[1:])


def stack_layers(steps: list, consumers: dict, keep) -> list:
    """`steps` with every run of two or more consecutive layer chains (see the module doc) replaced by one
    FusedNode running them as a stack."""
    out, i = [], 0
    while i < len(steps):
        j = i + 1
        if _layer(steps[i]) is not None:
            while j < len(steps) and _layer(steps[j]) is not None and _follows(steps[j - 1], steps[j], consumers, keep):
                j += 1
        if j - i >= 2:
            out.append(_stacked(steps[i:j]))
        else:
            out.extend(steps[i:j])
        i = j
    return out


def _stacked(nodes: list) -> FusedNode:
    kernel = LayerStack([n.kernel for n in nodes])
    inputs = nodes[0].inputs + tuple(v for n in nodes[1:] for v in n.inputs[1:])
    frees = tuple(v for n in nodes for v in n.frees)
    names = tuple(name for n in nodes for name in n.names)
    return FusedNode(kernel, inputs, nodes[-1].outputs, frees, names)


class LayerStack:
    """The chains `layers`, the output of each the first operand of the next, in one compiled call."""

    def __init__(self, layers: list[_EpilogueChain]):
        self.layers = layers
        self.arg_ids = layers[0].arg_ids  # the run loop gathers these for the first layer
        self.operand_ids = [layer.arg_ids[1:] for layer in layers[1:]]
        self.later_ids = tuple(v for ids in self.operand_ids for v in ids)
        self.name, self.op_type = layers[0].name, layers[0].op_type
        self._runs: dict[tuple, tuple] = {}  # per input shape: (lib, call or False, the operands it was made for)

    def failure(self, exc):
        return self.layers[0].failure(exc)

    def _run(self, values, args):
        lib, x = native.LIB, args[0]
        if lib is not None and x.dtype == F32 and x.flags.c_contiguous:
            # The layers' weights as this run has them, flat: the stack's call was made for these objects.
            operands = (*args[1:], *(values[v] for v in self.later_ids))
            entry = self._runs.get(x.shape)
            if entry is None or entry[0] is not lib or not _same(entry[2], operands):
                if len(self._runs) >= 16:
                    self._runs.clear()
                entry = self._runs[x.shape] = (lib, _stack_call(lib, self.layers, x, self._per_layer(operands)),
                                               operands)
            if entry[1]:
                y = entry[1](x)
                if y is not None:
                    return (y,)
        return self._one_by_one(values, args)

    def _per_layer(self, operands: tuple) -> list[tuple]:
        """The flat operands cut into each layer's."""
        out, at = [], 0
        for layer in self.layers:
            n = len(layer.arg_ids) - 1
            out.append(operands[at:at + n])
            at += n
        return out

    def _one_by_one(self, values, args):
        y = self.layers[0]._run(values, args)[0]
        for layer, ids in zip(self.layers[1:], self.operand_ids):
            y = layer._run(values, (y, *(values[v] for v in ids)))[0]
        return (y,)


def _same(made: tuple, operands: tuple) -> bool:
    return len(made) == len(operands) and all(map(operator.is_, made, operands))


def _weights(layer: _EpilogueChain, operands: tuple):
    """(B as K x N float32, bias or None) of one layer as its own compiled call takes them, else None."""
    producer = layer.producer
    if producer.op_type == "Gemm":
        b, c = (*operands, None)[:2]
        if b is not producer._bound_b or (c is not None and c is not producer._bound_c):
            return None
        b = producer._plain_b(b, c)
        if b is None or (c is not None and (c.dtype != F32 or c.shape != (b.shape[1],))):
            return None
        return b, c
    if len(operands) != 1 or operands[0] is not producer._bound_b:
        return None
    return operands[0], None


def _stack_call(lib, layers: list[_EpilogueChain], x: np.ndarray, operands: list[tuple]):
    """A function of x running the stack by ep_gemm_stack for x's shape, or False where a layer is not one
    the small GEMM takes (then the chains run one by one)."""
    first = layers[0].producer
    if x.ndim < 2 or (first.op_type == "Gemm" and x.ndim != 2):
        return False
    rows, k = x.size // x.shape[-1], x.shape[-1]
    ks, ns, ws, biases, keep = [], [], [], [], []
    for layer, ops in zip(layers, operands):
        found = _weights(layer, ops)
        if found is None:
            return False
        b, c = found
        if (b.ndim != 2 or b.dtype != F32 or not b.flags.c_contiguous or b.shape[0] != k
                or not native.gemm_fits(rows, k, b.shape[1])):
            return False
        c = None if c is None else np.ascontiguousarray(c)
        ks.append(k)
        ns.append(b.shape[1])
        ws.append(b.ctypes.data)
        biases.append(0 if c is None else c.ctypes.data)
        keep.append((b, c))
        k = b.shape[1]
    out_shape = (*x.shape[:-1], k)
    new = native.ffi.new  # arrays of plain C types cross into the API module's functions too
    arrays = (new("int[]", ks), new("int[]", ns), new("int64_t[]", ws), new("int64_t[]", biases),
              new("unsigned[]", [layer.native[0] for layer in layers]))
    ptr, stack, count, empty = native.ptr, lib.ep_gemm_stack, len(layers), np.empty

    def run(x):
        y = empty(out_shape, dtype=F32)
        if stack(count, ptr(x), ptr(y), rows, *arrays):
            return None  # no scratch: the chains one by one
        return y

    run.keep = keep  # the weights the addresses point into live as long as the call
    return run
