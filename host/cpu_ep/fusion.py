"""Node chains that the CPU EP's run loop runs as one step (runner.py).

On small models most of a node's cost is fixed (the loop's bookkeeping, a fresh output, a few NumPy
calls on tiny arrays), so the run loop joins, when it builds a plan's steps, chains whose inner values
nothing else reads:

- **epilogues**: a node that always returns a fresh array (Conv, Gemm, MatMul, ai.ephost.FusedMatMul)
  followed by Relu / HardSwish / HardSigmoid / Sigmoid / Gelu (exact or tanh) / SiLU (Sigmoid(x) -> Mul(x,
  that)) /
  Add or Mul(that output, another value of the same shape): the activations, the residual add and the
  gating product (SwiGLU's `silu(gate) * up`) run in place on the producer's output;
- **squeeze-and-excitation** (MobileNetV3, EfficientNet): GlobalAveragePool or ReduceMean over the
  spatial axes -> 1x1 Conv -> Relu -> 1x1 Conv -> HardSigmoid or Sigmoid -> Mul with the pooled input,
  both convolutions' weights initializers: a few GEMVs on the pooled channels;
- **joint q, k, v projections** with the Attention node reading them (fusion_qkv.py);
- **a product and the SkipLayerNormalization** that alone reads it (fusion_norm.py);
- **consecutive GEMM layers** (an MLP's chains, each reading the last alone) as one compiled call
  (fusion_stack.py).
- **quantized nodes in a row** (QuantizeLinear -> QLinearConv -> ... -> DequantizeLinear) as one compiled
  call (quant_chain.py).

The graph is not changed: node assignment, the optimizer and other EPs see the nodes as they are.
A chain computes what its nodes compute one by one, with the same NumPy operations in the same
order (the pooling is the GEMV that the ReduceMean and GlobalAveragePool kernels use); input it does
not expect (another dtype, rank or shape) runs the nodes' own kernels in turn. An error names the node whose
kernel failed. Nodes wrapped by a profiler are never joined, so each keeps its event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.base import constant_column
from host.cpu_ep.ops_elementwise import sigmoid_inplace
from host.errors import EphostError

# Producers whose kernels always return a newly allocated output (never a view of an input).
_FRESH = {("", "Conv"), ("", "Gemm"), ("", "MatMul"), ("ai.ephost", "FusedMatMul")}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass
class FusedNode:
    """Stands for a chain in the run loop's steps: `kernel` runs it, `inputs` are the value ids read
    from outside the chain (the loop names a missing one), `names` the chain's node names."""

    kernel: object
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]
    names: tuple[str, ...]


def _domain(kernel) -> str:
    return "" if kernel.node.domain in ("", "ai.onnx") else kernel.node.domain


def _op(node) -> tuple[str, str]:
    return _domain(node.kernel), node.op_type


def _call(kernel, *args):
    """kernel._run(*args) with its failure named as the run loop would name it."""
    try:
        return kernel._run(*args)
    except EphostError:
        raise
    except Exception as exc:
        raise kernel.failure(exc) from exc


def run_one_by_one(nodes, values) -> dict:
    """Every value a chain of `nodes` makes, by their kernels in turn, by value id (the chain's inner values
    never reach `values`)."""
    local: dict[int, np.ndarray] = {}
    for node in nodes:
        args = [local[v] if v in local else (values[v] if v >= 0 else None) for v in node.inputs]
        outs = _call(node.kernel, *args)
        for vid, out in zip(node.outputs, outs):
            local[vid] = out if isinstance(out, np.ndarray) else np.asarray(out)
    return local


# -- in-place epilogues --------------------------------------------------------------------------


def _relu(kernel, y, _other=None):
    return np.maximum(y, 0, out=y)


def _hard_sigmoid(kernel, y, _other=None):
    if y.dtype not in _FLOATS:
        return _call(kernel, y)[0]
    y *= kernel.alpha
    y += kernel.beta
    np.maximum(y, 0, out=y)
    return np.minimum(y, 1, out=y)


def _hard_swish(kernel, y, _other=None):
    if y.dtype not in _FLOATS:
        return _call(kernel, y)[0]
    gate = y * y.dtype.type(1 / 6)  # as the HardSwish kernel computes it
    gate += 0.5
    np.maximum(gate, 0, out=gate)
    np.minimum(gate, 1, out=gate)
    y *= gate
    return y


def _sigmoid(kernel, y, _other=None):
    if y.dtype not in _FLOATS:
        return _call(kernel, y)[0]
    return sigmoid_inplace(y)


def _add(kernel, y, other):
    if other.dtype == y.dtype and other.shape == y.shape:
        y += other
        return y
    return _call(kernel, y, other)[0]


def _mul(kernel, y, other):
    if other.dtype == y.dtype and other.shape == y.shape:
        y *= other
        return y
    return _call(kernel, y, other)[0]


def _gelu(kernel, y, _other=None):
    """Gelu, exact or tanh-approximate as the node says (its kernel's compiled or NumPy path)."""
    return _call(kernel, y)[0]


def _silu(kernels, y, _other=None):
    """Sigmoid(y) then Mul(y, that): `kernels` is the pair of nodes' kernels."""
    if y.dtype not in _FLOATS:
        return _call(kernels[1], y, _call(kernels[0], y)[0])[0]
    y *= sigmoid_inplace(y.copy())
    return y


_EPILOGUES = {("", "Relu"): _relu, ("", "HardSigmoid"): _hard_sigmoid, ("", "HardSwish"): _hard_swish,
              ("", "Sigmoid"): _sigmoid, ("", "Add"): _add, ("", "Mul"): _mul, ("", "Gelu"): _gelu}
# The same steps in the compiled kernels' epilogues (host/cpu_ep/native).
_NATIVE = {_relu: native.RELU, _hard_sigmoid: native.HARD_SIGMOID, _hard_swish: native.HARD_SWISH,
           _sigmoid: native.SIGMOID, _add: native.ADD, _mul: native.MUL, _silu: native.SILU}
_BINARY = (_add, _mul)  # epilogues with a second operand, read from outside the chain


def _native_steps(producer, epilogues, others):
    """(program, residual value id or -1, alpha, beta) running `producer`'s own epilogue steps and then
    the chain's epilogues in the compiled kernels, or None: a producer without `fused_native`, more than one
    Add or Mul by another value, more than one HardSigmoid, or more steps than a program holds."""
    if not hasattr(producer, "fused_native"):
        return None
    steps, res, alpha, beta = [], -1, 0.0, 0.0
    for (kernel, fn), other in zip(epilogues, others):
        code = _NATIVE[fn] if fn is not _gelu else (native.GELU_TANH if kernel.tanh else native.GELU)
        if fn in _BINARY:  # the compiled epilogue takes one such operand
            if res >= 0:
                return None
            res = other
        elif code == native.HARD_SIGMOID:
            if code in steps:
                return None
            alpha, beta = kernel.alpha, kernel.beta
        steps.append(code)
    if len(producer.native_steps) + len(steps) > native.MAX_STEPS:
        return None
    return native.program(producer.native_steps + tuple(steps)), res, alpha, beta


class _EpilogueChain:
    """producer(*args), then each epilogue in place on its output."""

    def __init__(self, producer, arg_ids: tuple[int, ...], epilogues: list[tuple], others: list[int]):
        self.producer = producer
        self.arg_ids = arg_ids      # the producer's input value ids (the run loop gathers them)
        self.epilogues = epilogues  # (kernel, function)
        self.others = others        # per epilogue: the value id of Add's or Mul's other operand, or -1
        self.name, self.op_type = producer.name, producer.op_type
        self.native = _native_steps(producer, epilogues, others)
        # A half-precision chain computes in float32 where its values are carried so (half_carry.py): its
        # last node stores the chain's output as that node declares it (half.py).
        last = epilogues[-1][0] if epilogues else producer
        self.half = getattr(last[-1] if isinstance(last, tuple) else last, "half", None)
        producer_half = getattr(producer, "half", None)
        self.widen_args = producer_half.widen_args if producer_half is not None and producer_half.widens else None
        # Per input shape: (lib, closure of (x, res) or False, the bound operands it was made for).
        self._runs: dict[tuple, tuple] = {}

    def failure(self, exc):
        return self.producer.failure(exc)

    def _native_run(self, lib, args):
        """The producer's closure for bound operands (native_runner), kept per input shape; None where it
        does not serve (fed operands, no closure for this producer or shape)."""
        x = args[0]
        entry = self._runs.get(x.shape)
        if entry is None or entry[0] is not lib:
            if len(self._runs) >= 16:
                self._runs.clear()
            maker = getattr(self.producer, "native_runner", None)
            prog, _, alpha, beta = self.native
            entry = self._runs[x.shape] = (lib, maker and maker(lib, args, prog, alpha, beta), args[1:])
        run, bound = entry[1], entry[2]
        if run and len(args) == len(bound) + 1 and args[1] is bound[0] and (len(bound) < 2 or args[2] is bound[1]):
            return run
        return None

    def _run(self, values, args):
        lib = native.LIB
        if self.widen_args is not None:  # a half-precision producer: its arguments as its kernel sees them
            args = self.widen_args(args)
        if self.native is not None and lib is not None:
            x = args[0]
            if x.dtype == native.F32 and x.flags.c_contiguous:
                run = self._native_run(lib, args)
                if run is not None:
                    res = self.native[1]
                    y = run(x, values[res] if res >= 0 else None)
                    if y is not None:
                        return self._stored(y)
            prog, res, alpha, beta = self.native
            try:
                y = self.producer.fused_native(args, prog, values[res] if res >= 0 else None, alpha, beta)
            except EphostError:
                raise
            except Exception as exc:
                raise self.producer.failure(exc) from exc
            if y is not None:
                return self._stored(y)
        y = _call(self.producer, *args)[0]
        for (kernel, fn), other in zip(self.epilogues, self.others):
            y = fn(kernel, y, values[other] if other >= 0 else None)
        return self._stored(y)

    def _stored(self, y):
        return (y,) if self.half is None else self.half.store((y,))


def _consumers(nodes) -> dict[int, int]:
    count: dict[int, int] = {}
    for node in nodes:
        for v in node.inputs:
            if v >= 0:
                count[v] = count.get(v, 0) + 1
    return count


def _private(value: int, consumers: dict, keep) -> bool:
    """Only the next node of the chain reads `value`, and it is not a graph output."""
    return value >= 0 and consumers.get(value, 0) == 1 and value not in keep


def _wrapped(node) -> bool:
    return "run" in node.kernel.__dict__  # a profiler's timing wrapper


def match_epilogues(nodes, i: int, consumers, keep, constants=()):
    """(FusedNode, nodes used) for an epilogue chain starting at nodes[i], or None. An Add or Mul by an
    initializer ends the chain: that is a bias or a scale, not a same-shape operand, so the compiled
    epilogue would refuse it at every run before the nodes ran one by one."""
    first = nodes[i]
    if _op(first) not in _FRESH or len(first.outputs) != 1 or _wrapped(first):
        return None
    chain, others, j, y = [], [], i + 1, first.outputs[0]
    while j < len(nodes):
        silu = _match_silu(nodes, j, y, consumers, keep)
        if silu is not None:
            chain.append(((nodes[j].kernel, nodes[j + 1].kernel), _silu))
            others.append(-1)
            y, j = silu, j + 2
            continue
        node = nodes[j]
        fn = _EPILOGUES.get(_op(node))
        if fn is None or _wrapped(node) or not _private(y, consumers, keep) or len(node.outputs) != 1:
            break
        ins = node.inputs
        if fn in _BINARY:
            if len(ins) != 2 or ins.count(y) != 1 or min(ins) < 0:
                break
            other = ins[1] if ins[0] == y else ins[0]
            if other in constants:
                break
            others.append(other)
        elif ins != (y,):
            break
        else:
            others.append(-1)
        chain.append((node.kernel, fn))
        y = node.outputs[0]
        j += 1
    if not chain:
        return None
    used = nodes[i:j]
    kernel = _EpilogueChain(first.kernel, first.inputs, chain, others)
    inputs = first.inputs + tuple(o for o in others if o >= 0)
    return _fused(kernel, used, inputs, (y,)), j - i


def _match_silu(nodes, j: int, y: int, consumers, keep) -> int | None:
    """The output of Sigmoid(y) -> Mul(y, that) at nodes[j:j+2] (SiLU, as exporters write it), when those
    two nodes are y's only readers and the sigmoid's value is the Mul's alone; else None."""
    if j + 1 >= len(nodes) or y < 0 or y in keep or consumers.get(y, 0) != 2:
        return None
    sig, mul = nodes[j], nodes[j + 1]
    if _op(sig) != ("", "Sigmoid") or _op(mul) != ("", "Mul") or _wrapped(sig) or _wrapped(mul):
        return None
    if sig.inputs != (y,) or len(sig.outputs) != 1 or len(mul.outputs) != 1:
        return None
    s = sig.outputs[0]
    if not _private(s, consumers, keep) or sorted(mul.inputs) != sorted((y, s)):
        return None
    return mul.outputs[0]


def _fused(kernel, used, inputs, outputs) -> FusedNode:
    frees = tuple(v for n in used for v in n.frees)
    return FusedNode(kernel, inputs, outputs, frees, tuple(n.name for n in used))


# -- squeeze-and-excitation ----------------------------------------------------------------------


def _pointwise_weights(node, constants):
    """(W as (M, C), bias as (M, 1) or None) of a 1x1, one-group, unpadded Conv whose weights are
    initializers, else None."""
    k = node.kernel
    w = constants.get(node.inputs[1]) if len(node.inputs) > 1 else None
    b = constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] >= 0 else None
    if w is None or w.ndim < 3 or any(d != 1 for d in w.shape[2:]) or w.dtype not in _FLOATS:
        return None
    if len(node.inputs) > 2 and node.inputs[2] >= 0 and (b is None or b.shape != (w.shape[0],)):
        return None
    if k.group != 1 or any(k.pads or ()) or k.auto_pad not in ("NOTSET", "VALID"):
        return None
    wm = np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1]))
    bm = None if b is None else np.ascontiguousarray(b.reshape(-1, 1), dtype=w.dtype)
    return wm, bm


class _SqueezeExcite:
    """x * gate(W2 @ relu(W1 @ mean(x over spatial axes) + b1) + b2), per image, channels as columns."""

    def __init__(self, nodes, w1, b1, w2, b2):
        self.nodes = nodes  # pool, conv1, relu, conv2, gate, mul
        self.arg_ids = ()   # reads its inputs from the values itself
        self._pool_by_rank: dict[int, bool] = {}
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2
        self.gate = nodes[4].kernel
        self.gate_fn = _EPILOGUES[_op(nodes[4])]
        gate = _NATIVE[self.gate_fn]
        alpha, beta = (self.gate.alpha, self.gate.beta) if gate == native.HARD_SIGMOID else (0.0, 0.0)
        self.native = (gate, alpha, beta) if w1.dtype == native.F32 else None
        self.x_id = nodes[0].inputs[0]
        self._runs: dict[tuple, tuple | bool] = {}
        self.name, self.op_type = nodes[0].name, nodes[0].op_type

    def failure(self, exc):
        return self.nodes[0].kernel.failure(exc)

    def _run(self, values, args):
        x = values[self.x_id]
        lib = native.LIB
        if lib is not None and self.native is not None and x.dtype == native.F32 and x.flags.c_contiguous:
            run = native.cached(self._runs, x.shape, lib, lambda: self._native_runner(lib, x, values))
            if run:
                return (run(x),)
        if (x.dtype == self.w1.dtype and x.ndim >= 3 and x.flags.c_contiguous and x.size
                and x.shape[1] == self.w1.shape[1] and self._pool_ok(x, values)):
            return (self._fast(x),)
        return self._one_by_one(values)

    def _native_runner(self, lib, x, values):
        """For float32 input of x's shape: a function of x doing the whole block in one compiled call, or
        False (the NumPy paths then decide)."""
        if x.ndim < 3 or not x.size or x.shape[1] != self.w1.shape[1] or not self._pool_ok(x, values):
            return False
        n, c, hw, r = x.shape[0], x.shape[1], math.prod(x.shape[2:]), self.w1.shape[0]
        ptr, null, empty, se = native.ptr, native.NULL, np.empty, lib.ep_squeeze_excite
        w1, w2 = ptr(self.w1), ptr(self.w2)
        b1 = null if self.b1 is None else ptr(self.b1)
        b2 = null if self.b2 is None else ptr(self.b2)
        gate, alpha, beta = self.native
        shape = x.shape

        def run(x):
            y = empty(shape, dtype=native.F32)
            if se(ptr(x), ptr(y), n, c, hw, w1, b1, w2, b2, r, gate, alpha, beta):
                return self._fast(x)  # no scratch memory: the NumPy path
            return y

        return run

    def _pool_ok(self, x, values) -> bool:
        """Whether the pool averages exactly the spatial axes, keeping them (decided once per rank: the
        axes are an attribute or an initializer)."""
        ok = self._pool_by_rank.get(x.ndim)
        if ok is None:
            pool = self.nodes[0]
            if pool.op_type == "GlobalAveragePool":
                ok = True
            else:
                k = pool.kernel
                axes = values[pool.inputs[1]] if len(pool.inputs) > 1 and pool.inputs[1] >= 0 else None
                ok = bool(k.keepdims) and sorted(k._axes(x, axes) or ()) == list(range(2, x.ndim))
            self._pool_by_rank[x.ndim] = ok
        return ok

    def _fast(self, x):
        n, c = x.shape[:2]
        hw = math.prod(x.shape[2:])
        flat = x.reshape(n * c, hw)
        pooled = np.dot(flat, constant_column(hw, 1 / hw, x.dtype))  # (n*c, 1): the pool's GEMV
        cols = pooled if n == 1 else pooled.reshape(n, c).T  # channels x images
        h = np.dot(self.w1, cols)
        if self.b1 is not None:
            h += self.b1
        np.maximum(h, 0, out=h)
        g = np.dot(self.w2, h)
        if self.b2 is not None:
            g += self.b2
        g = self.gate_fn(self.gate, g)
        gate = g if n == 1 else np.ascontiguousarray(g.T).reshape(n * c, 1)
        return (flat * gate).reshape(x.shape)

    def _one_by_one(self, values):
        """The six kernels in turn."""
        return (run_one_by_one(self.nodes, values)[self.nodes[-1].outputs[0]],)


_SE_OPS = ((("", "GlobalAveragePool"), ("", "ReduceMean")), (("", "Conv"),), (("", "Relu"),), (("", "Conv"),),
           (("", "HardSigmoid"), ("", "Sigmoid")), (("", "Mul"),))


def match_squeeze_excite(nodes, i: int, consumers, keep, constants):
    """(FusedNode, 6) for a squeeze-and-excitation block starting at nodes[i], or None."""
    block = nodes[i:i + 6]
    if len(block) < 6 or any(_op(n) not in ops for n, ops in zip(block, _SE_OPS)) or any(map(_wrapped, block)):
        return None
    pool, conv1, relu, conv2, gate, mul = block
    x = pool.inputs[0]
    # Each inner value feeds only the next node; Mul multiplies the pool's input by the gate.
    if any(len(n.outputs) != 1 or not _private(n.outputs[0], consumers, keep) for n in block[:-1]):
        return None
    if conv1.inputs[0] != pool.outputs[0] or relu.inputs != (conv1.outputs[0],) or conv2.inputs[0] != relu.outputs[0]:
        return None
    if gate.inputs != (conv2.outputs[0],) or sorted(mul.inputs) != sorted((x, gate.outputs[0])) or x < 0:
        return None
    if pool.op_type == "ReduceMean" and len(pool.inputs) > 1 and pool.inputs[1] >= 0 and pool.inputs[1] not in constants:
        return None
    first, second = _pointwise_weights(conv1, constants), _pointwise_weights(conv2, constants)
    if first is None or second is None or second[0].shape != (first[0].shape[1], first[0].shape[0]):
        return None
    kernel = _SqueezeExcite(block, first[0], first[1], second[0], second[1])
    return _fused(kernel, block, (x,), mul.outputs), 6


def fuse(nodes, keep, constants) -> list:
    """The run loop's step nodes: plan nodes, with the chains above (and fusion_qkv's joint q, k, v
    projections with their Attention) replaced by FusedNodes."""
    from host.cpu_ep.fusion_norm import match_gemm_skip_norm
    from host.cpu_ep.fusion_qkv import match_qkv_attention
    from host.cpu_ep.fusion_stack import stack_layers
    from host.cpu_ep.ml_chain import match_scaler_linear
    from host.cpu_ep.quant_chain import match_quant_chain

    consumers = _consumers(nodes)
    out, i = [], 0
    while i < len(nodes):
        joint = match_qkv_attention(nodes, i, consumers, keep, constants)
        if joint is not None:  # the nodes it passed over, then the join
            out += joint[0]
            i += joint[1]
            continue
        found = (match_squeeze_excite(nodes, i, consumers, keep, constants)
                 or match_gemm_skip_norm(nodes, i, consumers, keep, constants)
                 or match_epilogues(nodes, i, consumers, keep, constants)
                 or match_quant_chain(nodes, i, consumers, keep, constants)
                 or match_scaler_linear(nodes, i, consumers, keep, constants))
        if found is None:
            out.append(nodes[i])
            i += 1
        else:
            out.append(found[0])
            i += found[1]
    return stack_layers(out, consumers, keep)

