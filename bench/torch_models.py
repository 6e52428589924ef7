"""PyTorch eager equivalents of ONNX models, built from the ONNX graph itself (same weights).

`torch_module_from_onnx(model)` walks the graph's nodes in order once, at construction, and turns
each into a closure over torch ops; initializers and Constant outputs become tensors on the
device. `forward` then only runs those closures: it is "PyTorch eager on the same weights", what
the CUDA benchmark compares ephost with (eager, and captured in a torch.cuda.CUDAGraph).

Only the ops the model zoo uses (and a few neighbours) are supported; shapes, axes and perms must be
constants (initializers, Constant nodes or attributes): there is no Shape op.

The real architectures (tests/models: BERT, GPT-2, ViT, Llama, MobileNetV3 exports) are compared
against the torch models they were exported from, rebuilt with the export's seeds (same weights;
the benchmark records the largest difference to the fixture's stored torch output):

    python bench/torch_models.py [--iters 200] [--json out.json] [bert_dynamo ...]

runs ephost's CUDA EP eager and with graph replay against PyTorch eager and torch.cuda.CUDAGraph.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

# ONNX TensorProto element types -> torch dtypes.
_TORCH_DTYPES = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}
_FLOAT_ELEM_TYPES = {1, 10, 11, 16}

_UNARY: dict[str, Callable] = {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf, "Sqrt": torch.sqrt,
    "Exp": torch.exp, "Log": torch.log, "Neg": torch.neg, "Abs": torch.abs, "Reciprocal": torch.reciprocal,
    "Not": torch.logical_not, "HardSwish": F.hardswish, "Cos": torch.cos, "Sin": torch.sin, "IsNaN": torch.isnan,
}
_BINARY: dict[str, Callable] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
    "MatMul": torch.matmul, "And": torch.logical_and, "Or": torch.logical_or, "Equal": torch.eq,
    "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge,
}


class UnsupportedOnnxOp(NotImplementedError):
    """The graph uses an op (or a form of it) this interpreter does not translate."""


def supported_ops() -> list[str]:
    special = ["Gemm", "Reshape", "Transpose", "Softmax", "LayerNormalization", "Gelu", "ReduceMean",
               "ReduceSum", "Constant", "Identity", "Cast", "Concat", "Unsqueeze", "Squeeze", "Flatten",
               "Where", "Gather", "GatherElements", "GatherND", "Split", "Expand", "Slice", "Conv",
               "HardSigmoid", "GlobalAveragePool"]
    return sorted({*_UNARY, *_BINARY, *special})


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if a.name == "value":
            return numpy_helper.to_array(v)
        if a.name == "value_float":
            return np.array(v, np.float32)
        if a.name == "value_floats":
            return np.array(list(v), np.float32)
        if a.name == "value_int":
            return np.array(v, np.int64)
        if a.name == "value_ints":
            return np.array(list(v), np.int64)
    raise UnsupportedOnnxOp(f"Constant node '{node.name}': only value/value_float(s)/value_int(s) are supported")


def _norm_axes(axes, rank: int) -> list[int]:
    return sorted(a + rank if a < 0 else a for a in axes)


class OnnxTorchModule(torch.nn.Module):
    """The result of torch_module_from_onnx: forward(*inputs) in graph-input order (or by name)."""

    def __init__(self, steps: list, template: list, input_slots: dict[str, int], output_slots: list[int],
                 output_names: list[str], constants: list):
        super().__init__()
        self._steps = steps
        self._template = template
        self._input_slots = input_slots
        self._input_order = list(input_slots.values())
        self._output_slots = output_slots
        self.input_names = list(input_slots)
        self.output_names = output_names
        # Kept so the tensors are visible (and stay alive) with the module; forward uses _template.
        self._constants = constants

    def forward(self, *args, **kwargs):
        env = list(self._template)
        if len(args) > len(self._input_order):
            raise TypeError(f"expected at most {len(self._input_order)} inputs {self.input_names}; got {len(args)}")
        for slot, x in zip(self._input_order, args):
            env[slot] = x
        for name, x in kwargs.items():
            slot = self._input_slots.get(name)
            if slot is None:
                raise TypeError(f"unknown input {name!r}; inputs: {self.input_names}")
            env[slot] = x
        for step in self._steps:
            step(env)
        outs = [env[s] for s in self._output_slots]
        return outs[0] if len(outs) == 1 else tuple(outs)


def _make_step(fn: Callable, ins: list[int], outs: list[int]) -> Callable:
    """A closure env -> None running fn on env[ins] and storing into env[outs]."""
    if len(outs) == 1:
        o = outs[0]
        if len(ins) == 1:
            a = ins[0]

            def step1(env):
                env[o] = fn(env[a])
            return step1
        if len(ins) == 2:
            a, b = ins

            def step2(env):
                env[o] = fn(env[a], env[b])
            return step2
        if len(ins) == 3:
            a, b, c = ins

            def step3(env):
                env[o] = fn(env[a], env[b], env[c])
            return step3

        def stepn(env):
            env[o] = fn(*[env[i] for i in ins])
        return stepn

    def stepm(env):
        res = fn(*[env[i] for i in ins])
        for slot, value in zip(outs, res):
            if slot >= 0:
                env[slot] = value
    return stepm


def _wrap_negative(idx, size):
    idx = idx.long()
    return torch.where(idx < 0, idx + size, idx)


class _MoreOps:
    """Mixin of _Translator: the ops the real exports (tests/models, dynamo exporter) add to the zoo's."""

    def op_Where(self, node, attrs):
        self.add(node, torch.where, [node.input[0], node.input[1], node.input[2]])

    def op_Gather(self, node, attrs):
        axis = int(attrs.get("axis", 0))

        def gather(x, idx):
            ax = axis % x.dim()
            idx = _wrap_negative(idx, x.shape[ax])
            out = x.index_select(ax, idx.reshape(-1))
            return out.reshape(tuple(x.shape[:ax]) + tuple(idx.shape) + tuple(x.shape[ax + 1:]))
        self.add(node, gather, [node.input[0], node.input[1]])

    def op_GatherElements(self, node, attrs):
        axis = int(attrs.get("axis", 0))
        self.add(node, lambda x, idx: torch.gather(x, axis, _wrap_negative(idx, x.shape[axis])),
                 [node.input[0], node.input[1]])

    def op_GatherND(self, node, attrs):
        if int(attrs.get("batch_dims", 0)):
            raise UnsupportedOnnxOp(f"GatherND node '{node.name}': batch_dims is not supported")

        def gather_nd(x, idx):
            q = idx.shape[-1]
            return x[tuple(_wrap_negative(idx[..., j], x.shape[j]) for j in range(q))]
        self.add(node, gather_nd, [node.input[0], node.input[1]])

    def op_Split(self, node, attrs):
        axis = int(attrs.get("axis", 0))
        count = len(node.output)
        split = self.const(node, 1, "split") if self.opset >= 13 else attrs.get("split")
        sizes = None if split is None else [int(v) for v in np.asarray(split).reshape(-1)]
        num = attrs.get("num_outputs")

        def split_fn(x):
            dim = x.shape[axis]
            if sizes is not None:
                parts = sizes
            elif num is not None:
                part = -(-dim // count)
                parts = [min(part, max(dim - part * i, 0)) for i in range(count)]
            else:
                parts = [dim // count] * count
            return torch.split(x, parts, dim=axis)
        self.add(node, split_fn, [node.input[0]])

    def op_Expand(self, node, attrs):
        shape = tuple(int(d) for d in self.const(node, 1, "shape"))
        self.add(node, lambda x: torch.broadcast_to(x, tuple(np.broadcast_shapes(tuple(x.shape), shape))),
                 [node.input[0]])

    def op_Slice(self, node, attrs):
        starts = [int(v) for v in self.const(node, 1, "starts")]
        ends = [int(v) for v in self.const(node, 2, "ends")]
        axes = self.const(node, 3, "axes")
        axes = list(range(len(starts))) if axes is None else [int(v) for v in axes]
        steps = self.const(node, 4, "steps")
        steps = [1] * len(starts) if steps is None else [int(v) for v in steps]
        if any(st <= 0 for st in steps):
            raise UnsupportedOnnxOp(f"Slice node '{node.name}': only positive steps are supported")

        def slice_fn(x):
            index = [slice(None)] * x.dim()
            for a, b, e, st in zip(axes, starts, ends, steps):
                index[a % x.dim()] = slice(b, e, st)
            return x[tuple(index)]
        self.add(node, slice_fn, [node.input[0]])

    def op_Conv(self, node, attrs):
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise UnsupportedOnnxOp(f"Conv node '{node.name}': only explicit pads are supported")
        w = self.consts.get(node.input[1])
        rank = (w.ndim - 2) if w is not None else 2
        strides = tuple(attrs.get("strides", [1] * rank))
        dilations = tuple(attrs.get("dilations", [1] * rank))
        pads = list(attrs.get("pads", [0] * (2 * rank)))
        groups = int(attrs.get("group", 1))
        conv = F.conv2d if rank == 2 else F.conv1d
        symmetric = pads[:rank] == pads[rank:]
        torch_pad = [p for i in reversed(range(rank)) for p in (pads[i], pads[i + rank])]

        def conv_fn(x, weight, bias=None):
            if not symmetric:
                x = F.pad(x, torch_pad)
            return conv(x, weight, bias, strides, tuple(pads[:rank]) if symmetric else 0, dilations, groups)
        self.add(node, conv_fn, [n for n in node.input if n])

    def op_HardSigmoid(self, node, attrs):
        alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
        self.add(node, lambda x: torch.clamp(x * alpha + beta, 0.0, 1.0), [node.input[0]])

    def op_GlobalAveragePool(self, node, attrs):
        self.add(node, lambda x: x.mean(tuple(range(2, x.dim())), keepdim=True), [node.input[0]])


class _Translator(_MoreOps):
    def __init__(self, model: onnx.ModelProto, device, dtype):
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.opset = _opset(model)
        self.consts: dict[str, np.ndarray] = {
            t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        self.slots: dict[str, int] = {"": 0}  # slot 0 is the absent optional input: always None
        self.template: list = [None]
        self.device_consts: dict[str, torch.Tensor] = {}
        self.steps: list[Callable] = []

    # -- values ---------------------------------------------------------------------------------
    def slot(self, name: str) -> int:
        s = self.slots.get(name)
        if s is None:
            s = self.slots[name] = len(self.template)
            self.template.append(None)
        return s

    def tensor(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(arr, copy=True))
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        return t.to(self.device)

    def runtime_input(self, name: str) -> int:
        """The slot of an input read at run time; constants get their device tensor in the template."""
        s = self.slot(name)
        if name and name in self.consts and name not in self.device_consts:
            self.device_consts[name] = self.template[s] = self.tensor(self.consts[name])
        return s

    def const(self, node: onnx.NodeProto, index: int, what: str) -> np.ndarray | None:
        """A constant input (shape, axes): None when absent; an error when computed at run time."""
        if index >= len(node.input) or not node.input[index]:
            return None
        name = node.input[index]
        if name not in self.consts:
            raise UnsupportedOnnxOp(f"{node.op_type} node '{node.name}': input {index} ({what}) must be a constant "
                                    f"(initializer or Constant); '{name}' is computed at run time")
        return self.consts[name]

    def add(self, node: onnx.NodeProto, fn: Callable, runtime_inputs: list[str]) -> None:
        ins = [self.runtime_input(n) for n in runtime_inputs]
        outs = [self.slot(n) if n else -1 for n in node.output]
        while outs and outs[-1] == -1:
            outs.pop()
        self.steps.append(_make_step(fn, ins, outs))

    # -- translation ------------------------------------------------------------------------------
    def translate(self) -> OnnxTorchModule:
        g = self.model.graph
        inits = {t.name for t in g.initializer}
        input_slots = {vi.name: self.slot(vi.name) for vi in g.input if vi.name not in inits}
        for node in g.node:
            if node.domain not in ("", "ai.onnx"):
                raise UnsupportedOnnxOp(f"node '{node.name}': domain {node.domain!r} is not supported")
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            handler = getattr(self, f"op_{node.op_type}", None)
            if handler is None:
                if node.op_type in _UNARY:
                    self.add(node, _UNARY[node.op_type], [node.input[0]])
                elif node.op_type in _BINARY:
                    self.add(node, _BINARY[node.op_type], [node.input[0], node.input[1]])
                else:
                    raise UnsupportedOnnxOp(f"node '{node.name}': op {node.op_type} is not supported by "
                                            f"torch_module_from_onnx; supported: {', '.join(supported_ops())}")
            else:
                handler(node, attrs)
        output_names = [vi.name for vi in g.output]
        output_slots = [self.runtime_input(n) for n in output_names]
        return OnnxTorchModule(self.steps, self.template, input_slots, output_slots, output_names,
                               list(self.device_consts.values()))

    # -- ops ---------------------------------------------------------------------------------------
    def op_Constant(self, node, attrs):
        self.consts[node.output[0]] = _constant_value(node)

    def op_Identity(self, node, attrs):
        if node.input[0] in self.consts:
            self.consts[node.output[0]] = self.consts[node.input[0]]
            return
        self.add(node, lambda x: x, [node.input[0]])

    def op_Cast(self, node, attrs):
        to = int(attrs["to"])
        if to not in _TORCH_DTYPES:
            raise UnsupportedOnnxOp(f"Cast node '{node.name}': target type {to} is not supported")
        dtype = self.dtype if (self.dtype is not None and to in _FLOAT_ELEM_TYPES) else _TORCH_DTYPES[to]
        self.add(node, lambda x: x.to(dtype), [node.input[0]])

    def op_Gemm(self, node, attrs):
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        trans_a, trans_b = int(attrs.get("transA", 0)), int(attrs.get("transB", 0))
        a_name, b_name = node.input[0], node.input[1]
        c_name = node.input[2] if len(node.input) > 2 else ""
        b_const = self.consts.get(b_name)
        c_const = self.consts.get(c_name) if c_name else None
        if b_const is not None and b_const.ndim == 2 and (not c_name or c_const is not None):
            # What torch.nn.Linear does: F.linear(x, W[out, in], bias[out]).
            w = b_const if trans_b else b_const.T
            n_out = w.shape[0]
            weight = self.tensor(np.ascontiguousarray(w) * np.asarray(alpha, w.dtype) if alpha != 1.0 else w)
            bias = None
            general_c = None
            if c_const is not None and beta != 0.0:
                c = c_const * np.asarray(beta, c_const.dtype) if beta != 1.0 else c_const
                if c.size == n_out and (c.ndim <= 1 or c.shape == (1, n_out)):
                    bias = self.tensor(c.reshape(n_out))
                else:
                    general_c = self.tensor(c)
            self.device_consts[f"{node.name}/weight"] = weight
            if bias is not None:
                self.device_consts[f"{node.name}/bias"] = bias
            if general_c is not None:
                self.device_consts[f"{node.name}/c"] = general_c

            def gemm_linear(x):
                if trans_a:
                    x = x.t()
                y = F.linear(x, weight, bias)
                return y if general_c is None else y + general_c
            self.add(node, gemm_linear, [a_name])
            return

        def gemm(a, b, c=None):
            if trans_a:
                a = a.t()
            if trans_b:
                b = b.t()
            y = torch.matmul(a, b)
            if alpha != 1.0:
                y = y * alpha
            if c is not None and beta != 0.0:
                y = y + (c * beta if beta != 1.0 else c)
            return y
        self.add(node, gemm, [a_name, b_name] + ([c_name] if c_name else []))

    def op_Reshape(self, node, attrs):
        shape = [int(d) for d in self.const(node, 1, "shape")]
        allowzero = int(attrs.get("allowzero", 0))
        if allowzero or 0 not in shape:
            target = tuple(shape)
            self.add(node, lambda x: x.reshape(target), [node.input[0]])
            return
        zeros = [i for i, d in enumerate(shape) if d == 0]

        def reshape(x):
            s = list(shape)
            for i in zeros:
                s[i] = x.shape[i]
            return x.reshape(s)
        self.add(node, reshape, [node.input[0]])

    def op_Transpose(self, node, attrs):
        perm = attrs.get("perm")
        if perm is None:
            self.add(node, lambda x: x.permute(*reversed(range(x.dim()))), [node.input[0]])
        else:
            p = tuple(int(i) for i in perm)
            self.add(node, lambda x: x.permute(p), [node.input[0]])

    def op_Softmax(self, node, attrs):
        if self.opset >= 13:
            axis = int(attrs.get("axis", -1))
            self.add(node, lambda x: torch.softmax(x, axis), [node.input[0]])
            return
        axis = int(attrs.get("axis", 1))

        def softmax_flat(x):  # opset < 13: softmax over the input coerced to 2-D at `axis`
            ax = axis + x.dim() if axis < 0 else axis
            if ax == x.dim() - 1:
                return torch.softmax(x, -1)
            return torch.softmax(x.reshape(math.prod(x.shape[:ax]), -1), -1).reshape(x.shape)
        self.add(node, softmax_flat, [node.input[0]])

    def op_LayerNormalization(self, node, attrs):
        axis = int(attrs.get("axis", -1))
        eps = float(attrs.get("epsilon", 1e-5))
        x_name, s_name = node.input[0], node.input[1]
        b_name = node.input[2] if len(node.input) > 2 else ""
        extra = any(n for n in node.output[1:])
        scale = self.consts.get(s_name)
        bias = self.consts.get(b_name) if b_name else None
        if (not extra and axis < 0 and scale is not None and scale.ndim == -axis
                and (not b_name or (bias is not None and bias.shape == scale.shape))):
            normalized = tuple(int(d) for d in scale.shape)
            self.add(node, lambda x, w, b=None: F.layer_norm(x, normalized, w, b, eps),
                     [x_name, s_name] + ([b_name] if b_name else []))
            return

        def layer_norm(x, w, b=None):
            ax = axis + x.dim() if axis < 0 else axis
            ns = tuple(x.shape[ax:])
            if tuple(w.shape) == ns and (b is None or tuple(b.shape) == ns):
                y = F.layer_norm(x, ns, w, b, eps)
            else:
                y = F.layer_norm(x, ns, None, None, eps) * w
                if b is not None:
                    y = y + b
            if not extra:
                return y
            dims = tuple(range(ax, x.dim()))
            mean = x.mean(dims, keepdim=True)
            inv_std = torch.rsqrt(x.var(dims, keepdim=True, correction=0) + eps)
            return y, mean, inv_std
        self.add(node, layer_norm, [x_name, s_name] + ([b_name] if b_name else []))

    def op_Gelu(self, node, attrs):
        approximate = attrs.get("approximate", "none")
        if isinstance(approximate, bytes):
            approximate = approximate.decode()
        self.add(node, lambda x: F.gelu(x, approximate=approximate), [node.input[0]])

    def _reduce(self, node, attrs, fn, axes_input_since: int):
        if self.opset >= axes_input_since:
            axes = self.const(node, 1, "axes")
        else:
            axes = attrs.get("axes")
        axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        keepdims = bool(int(attrs.get("keepdims", 1)))
        noop = int(attrs.get("noop_with_empty_axes", 0))
        if not axes:
            if noop:
                self.add(node, lambda x: x, [node.input[0]])
            else:
                self.add(node, lambda x: fn(x, tuple(range(x.dim())), keepdim=keepdims), [node.input[0]])
            return
        dims = tuple(axes)
        self.add(node, lambda x: fn(x, dims, keepdim=keepdims), [node.input[0]])

    def op_ReduceMean(self, node, attrs):
        self._reduce(node, attrs, torch.mean, 18)

    def op_ReduceSum(self, node, attrs):
        self._reduce(node, attrs, torch.sum, 13)

    def op_Concat(self, node, attrs):
        axis = int(attrs["axis"])
        self.add(node, lambda *xs: torch.cat(xs, axis), [n for n in node.input if n])

    def op_Unsqueeze(self, node, attrs):
        raw = self.const(node, 1, "axes") if self.opset >= 13 else attrs.get("axes")
        if raw is None:
            raise UnsupportedOnnxOp(f"Unsqueeze node '{node.name}': axes are required")
        axes = [int(a) for a in np.asarray(raw).reshape(-1)]

        def unsqueeze(x):
            for a in _norm_axes(axes, x.dim() + len(axes)):
                x = x.unsqueeze(a)
            return x
        self.add(node, unsqueeze, [node.input[0]])

    def op_Squeeze(self, node, attrs):
        raw = self.const(node, 1, "axes") if self.opset >= 13 else attrs.get("axes")
        if raw is None or np.asarray(raw).size == 0:
            self.add(node, lambda x: x.squeeze(), [node.input[0]])
            return
        axes = [int(a) for a in np.asarray(raw).reshape(-1)]

        def squeeze(x):
            for a in reversed(_norm_axes(axes, x.dim())):
                x = x.squeeze(a)
            return x
        self.add(node, squeeze, [node.input[0]])

    def op_Flatten(self, node, attrs):
        axis = int(attrs.get("axis", 1))

        def flatten(x):
            ax = axis + x.dim() if axis < 0 else axis
            return x.reshape(math.prod(x.shape[:ax]), -1)
        self.add(node, flatten, [node.input[0]])


def torch_module_from_onnx(model: onnx.ModelProto, device="cuda", dtype: torch.dtype | None = None) -> OnnxTorchModule:
    """A torch.nn.Module computing `model` with its own initializers, as tensors on `device`.

    With `dtype` (e.g. torch.float64), floating-point weights and float Casts use that dtype: a
    higher-precision reference; feed inputs of that dtype then. The module is built for `device`
    (don't move it with .to()). Raises UnsupportedOnnxOp for ops it does not translate.
    """
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"model must be an onnx.ModelProto; got {type(model).__name__}")
    module = _Translator(model, device, dtype).translate()
    module.eval()
    return module


# ---------------------------------------------------------------------------------------------
# Real architectures: the exports in tests/models against the torch models they were exported from


def _timed(fn, iters: int, warmup: int) -> float:
    """bench/timing.py's median (imported here once main() has put the repository root on sys.path)."""
    from bench.timing import median_us

    return median_us(fn, iters, warmup)


def torch_model_for_fixture(name: str, feeds: dict, device: str = "cuda"):
    """The torch module a fixture was exported from, rebuilt as tests/models/export.py built it
    (same seeds, so the same weights), on `device`, with its input tensors in ONNX input order."""
    from tests.models import export

    arch = name.split("_")[0]
    torch.manual_seed(export.SEED)
    rng = np.random.default_rng(export.SEED)
    build = {**export.BUILDERS, **export.GENERATED}[arch]
    with_mask = "attention_mask" in feeds and arch in ("gpt2", "llama")
    model, inputs, _ = build(torch, rng, with_mask=True) if with_mask else build(torch, rng)
    export._randomize_norms(torch, model)
    model = model.to(device).eval()
    args = [torch.from_numpy(np.ascontiguousarray(feeds[k])).to(device) for k in feeds]
    return model, args


def _torch_graph(model, args):
    """(replay, outputs): a torch.cuda.CUDAGraph of model(*args) on static input tensors."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            model(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        out = model(*args)

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    return replay, out


def _torch_graph_of_export(name: str, res: dict, iters: int, warmup: int) -> None:
    """PyTorch CUDA-graph time from the architecture's dynamo export translated to torch ops (same
    weights; pure tensor ops, so capturable where the transformers module is not)."""
    from tests.models import load

    try:
        path, feeds, expected = load(f"{name.split('_')[0]}_dynamo")
        tm = torch_module_from_onnx(onnx.load(str(path)), device="cuda")
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])).cuda() for n in tm.input_names]
        with torch.inference_mode():
            y = tm(*args)
        y = y if isinstance(y, torch.Tensor) else y[0]
        res["torch_onnx_vs_fixture_max_abs"] = float(np.abs(y.float().cpu().numpy() - expected[tm.output_names[0]]).max())
        replay, _ = _torch_graph(tm, args)
        res["torch_graph_us"] = _timed(replay, iters, warmup)
        res["torch_graph_source"] = "dynamo export translated to torch ops"
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the other figures stand
        res["torch_onnx_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        torch.cuda.synchronize()


def bench_real_model(name: str, env, iters: int = 200, warmup: int = 20) -> dict:
    """ephost CUDA EP eager and graph replay vs PyTorch eager and CUDA graphs for one fixture, float32
    with TF32 off on both sides, inputs and outputs in device memory (IOBinding on the ephost side)."""
    import cupy as cp

    from host.runtime.session import InferenceSession
    from tests.models import load

    path, feeds, expected = load(name)
    res: dict = {"model": name}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, args = torch_model_for_fixture(name, feeds)
    out_name = next(iter(expected))
    with torch.inference_mode():
        ref = model(*args)
    ref = (ref if isinstance(ref, torch.Tensor) else ref[0]).float().cpu().numpy()
    res["torch_vs_fixture_max_abs"] = float(np.abs(ref - expected[out_name]).max())  # same weights?

    def torch_eager():
        with torch.inference_mode():
            model(*args)
        torch.cuda.synchronize()
    res["torch_eager_us"] = _timed(torch_eager, iters, warmup)
    try:
        replay, _ = _torch_graph(model, args)
        res["torch_graph_us"] = _timed(replay, iters, warmup)
    except Exception as exc:  # noqa: BLE001 - transformers models copy host tensors in forward
        res["torch_graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        torch.cuda.synchronize()
        _torch_graph_of_export(name, res, iters, warmup)

    modes = (("eager", {}), ("replay", {"enable_cuda_graph": "1"}),
             ("kernels_eager", {"compiled_plan": "0"}), ("kernels_replay", {"compiled_plan": "0", "enable_cuda_graph": "1"}))
    for mode, extra in modes:
        sess = InferenceSession(str(path), providers=[("CUDAExecutionProvider", {"use_tf32": "0", **extra})], env=env)
        assignment = sess.node_assignment()
        res["nodes"] = len(assignment)
        res["nodes_on_cuda"] = sum(v == "CUDAExecutionProvider" for v in assignment.values())
        binding = sess.io_binding()
        keep = []
        for k, v in feeds.items():
            keep.append(cp.asarray(v))
            binding.bind_input(k, keep[-1])
        out = cp.zeros(expected[out_name].shape, expected[out_name].dtype)
        binding.bind_output(out_name, out)
        for other in expected:
            if other != out_name:
                keep.append(cp.zeros(expected[other].shape, expected[other].dtype))
                binding.bind_output(other, keep[-1])
        cp.cuda.Device().synchronize()
        sess.run_with_iobinding(binding)  # replay mode: warm-up runs and capture happen here
        res[f"ephost_{mode}_max_abs_vs_torch"] = float(np.abs(cp.asnumpy(out) - ref).max())
        res[f"ephost_{mode}_us"] = _timed(lambda s=sess, b=binding: s.run_with_iobinding(b), iters, warmup)
        sess.close()
    res["eager_ratio"] = res["ephost_eager_us"] / res["torch_eager_us"]
    if "torch_graph_us" in res:
        res["replay_ratio"] = res["ephost_replay_us"] / res["torch_graph_us"]
    return res


def real_models_table(results: list[dict], device: str) -> str:
    """A markdown table of bench_real_model results (ratios: ephost / PyTorch, lower is better)."""
    lines = [f"Device: {device}. float32, TF32 off, batch 1, IOBinding; median of timed calls in us. "
             "ephost: default (compiled plans) and per-node kernels (compiled_plan=0). *: the transformers module "
             "refuses CUDA-graph capture (host tensors copied in forward); PyTorch graph time of the dynamo export "
             "translated to torch ops, same weights.", "",
             "| model | nodes (on CUDA) | torch eager | ephost eager | kernels eager | ratio | torch graph | "
             "ephost replay | kernels replay | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |")
            continue
        graph = f"{r['torch_graph_us']:.0f}" if "torch_graph_us" in r else "n/a (capture refused)"
        if "torch_graph_source" in r:
            graph += "*"
        ratio = f"{r['replay_ratio']:.2f}" if "replay_ratio" in r else "-"
        lines.append(f"| {r['model']} | {r['nodes']} ({r['nodes_on_cuda']}) | {r['torch_eager_us']:.0f} | "
                     f"{r['ephost_eager_us']:.0f} | {r['ephost_kernels_eager_us']:.0f} | {r['eager_ratio']:.2f} | "
                     f"{graph} | {r['ephost_replay_us']:.0f} | {r['ephost_kernels_replay_us']:.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """python bench/torch_models.py [--iters N] [--json out.json] [names...]: the real-model benchmark."""
    import argparse
    import json
    import sys
    import traceback
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    parser = argparse.ArgumentParser(description="ephost CUDA EP vs PyTorch on the tests/models exports")
    parser.add_argument("names", nargs="*")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("torch_models: no CUDA device for PyTorch; nothing to benchmark")
        return 0
    import build
    import host
    from tests.models import available_models, generated_models

    plugin = build.build_python_plugin("cuda", max(build.PYTHON_PLUGINS["cuda"].versions))
    env = host.Environment()
    env.register_plugin("cuda", str(plugin))
    results = []
    for name in args.names or available_models() + generated_models():
        try:
            results.append(bench_real_model(name, env, args.iters, args.warmup))
        except Exception as exc:  # noqa: BLE001 - one model failing must not hide the others
            traceback.print_exc()
            results.append({"model": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(json.dumps(results[-1]), flush=True)
    table = real_models_table(results, torch.cuda.get_device_name())
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "table": table}, indent=1))
    return 0


__all__ = ["OnnxTorchModule", "UnsupportedOnnxOp", "bench_real_model", "main", "real_models_table",
           "supported_ops", "torch_model_for_fixture", "torch_module_from_onnx"]


if __name__ == "__main__":
    raise SystemExit(main())
