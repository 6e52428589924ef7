"""float16 and bfloat16 on the CPU EP: kernels compute in float32 and store half precision.

NumPy has no BLAS or SIMD kernels for float16 (its float16 matmul is a scalar loop) and no bfloat16 at
all (ml_dtypes supplies the dtype and scalar ufuncs). So a node that reads or writes a half-precision
tensor gets its kernel wrapped once, at session creation, by `adapt`:

- its half inputs are widened to float32 before the kernel runs (initializers once, when the run loop
  binds them), so every kernel written for float32 serves both half types with float32 accuracy;
- each tensor output is then stored as the element type the graph declares for it. That is the
  contract a graph's outputs keep on this EP: a kernel that computes in float32 never leaks a float32
  tensor where float16 is declared, and a model whose declared types contradict an op (converters
  that rewrite value types but leave a `Cast(to=FLOAT)`, which onnxruntime refuses to load) returns
  what it declares.

Ops that only move, select or reinterpret elements run on the half arrays as they are (widening them
would only cost time); their outputs are still stored as declared. Nodes of float32 models are never
wrapped, so they pay nothing. Once a plan is built, half_carry.py lets the values that only such CPU
nodes read stay float32 between them (`HalfNode.carry`); graph outputs always have their declared type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from abi.dtypes import HALF_DTYPES, HALF_TYPES, to_numpy
from host.cpu_ep import native
from host.cpu_ep.base import OpKernel

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
# Elements from which the compiled conversion (kernels.c, F16C) beats NumPy's per-element float16 loop,
# counting the call's own cost; ml_dtypes' bfloat16 conversions are fast already.
_NATIVE_MIN = 512


def widen(arr: np.ndarray) -> np.ndarray:
    """A half array as float32 (a new array)."""
    if arr.dtype == _F16 and arr.size >= _NATIVE_MIN and arr.flags.c_contiguous:
        lib = native.LIB
        if lib is not None:
            out = np.empty(arr.shape, _F32)
            if lib.ep_f16_to_f32(native.ptr(arr), native.ptr(out), arr.size):
                return out
    return arr.astype(_F32)


def narrow(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`arr` stored as `dtype` (a new array), rounded to nearest even as NumPy rounds."""
    if dtype == _F16 and arr.dtype == _F32 and arr.size >= _NATIVE_MIN and arr.flags.c_contiguous:
        lib = native.LIB
        if lib is not None:
            out = np.empty(arr.shape, _F16)
            if lib.ep_f32_to_f16(native.ptr(arr), native.ptr(out), arr.size):
                return out
    return arr.astype(dtype)

# (domain, op_type) of kernels that run on half arrays without widening: they copy, select or
# reinterpret elements, which NumPy does for 2-byte dtypes like any other, bit-exactly. Control-flow
# and sequence kernels carry values whose types their bodies or lists declare: they are never widened.
KEEP_HALF = frozenset(("", op) for op in (
    "BitCast", "Cast", "CastLike", "Compress", "Concat", "ConcatFromSequence", "Constant", "ConstantOfShape",
    "DepthToSpace", "Expand", "Flatten", "Gather", "GatherElements", "GatherND", "Identity", "If", "Loop",
    "Optional", "OptionalGetElement", "OptionalHasElement", "Reshape", "ReverseSequence", "Scan", "Scatter",
    "ScatterElements", "ScatterND", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
    "SequenceInsert", "SequenceLength", "SequenceMap", "Shape", "Size", "Slice", "SpaceToDepth", "Split",
    "SplitToSequence", "Squeeze", "Tile", "Transpose", "Unsqueeze",
))


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def declared_types(names: Sequence[str], values: Mapping[str, object]) -> tuple[int, ...]:
    """The declared element type of each value name (0: absent, not a tensor, or not known)."""
    types = []
    for name in names:
        meta = values.get(name) if name else None
        types.append(int(getattr(meta, "elem_type", 0) or 0) if meta is not None and meta.type is None else 0)
    return tuple(types)


def adapt(kernel: OpKernel, in_types: Sequence[int], out_types: Sequence[int]) -> OpKernel:
    """`kernel`, wrapped for half precision when its node reads or writes float16 or bfloat16 (see the
    module's docstring); other kernels are returned untouched."""
    if not HALF_TYPES.intersection(in_types) and not HALF_TYPES.intersection(out_types):
        return kernel
    node = kernel.node
    keep = kernel.takes_device_values or (_domain(node.domain), node.op_type) in KEEP_HALF
    fallback = next((to_numpy(t) for t in in_types if t in HALF_TYPES), None)
    state = kernel.half = HalfNode([to_numpy(t) if t else None for t in out_types], None if keep else fallback,
                                   widens=not keep)
    if keep:
        _wrap_outputs(kernel, state)
    else:
        # Positions of the half inputs, when every present input's type is declared (the usual case):
        # a run then looks at those alone.
        present = [t for name, t in zip(node.inputs, in_types) if name]
        half_pos = None if 0 in present else tuple(i for i, t in enumerate(in_types) if t in HALF_TYPES)
        _wrap_widening(kernel, state, half_pos)
    return kernel


class HalfNode:
    """What `adapt` keeps on a wrapped kernel (`kernel.half`): the dtype each output is stored as
    (None: not declared; False: carried as computed, see half_carry.py), and the store function built
    from them."""

    def __init__(self, targets: list, fallback, widens: bool):
        self.targets, self.fallback, self.widens = targets, fallback, widens
        self.store = _storer(tuple(targets), fallback)
        self.widen_args = tuple  # set by _wrap_widening: the kernel's arguments as its _run widens them

    def half_outputs(self) -> list[int]:
        """Positions of the outputs stored as float16 or bfloat16."""
        return [j for j, t in enumerate(self.targets) if t is not None and t is not False and t in HALF_DTYPES]

    def carry(self, position: int) -> None:
        """Output `position` stays as the kernel computed it (float32): its readers widen it anyway."""
        self.targets[position] = False
        self.store = _storer(tuple(self.targets), self.fallback)


def _stored(outputs, targets, fallback):
    """Each tensor output as its declared dtype (`targets`); an output of undeclared type that the
    kernel computed in float32 goes back to the half type of the node's inputs (`fallback`)."""
    out = []
    for arr, want in zip(outputs, targets):
        if isinstance(arr, np.generic):  # a reduction's NumPy scalar
            arr = np.asarray(arr)
        if want is False:  # carried in float32
            out.append(arr)
            continue
        if isinstance(arr, np.ndarray):
            if want is None and fallback is not None and arr.dtype == _F32:
                want = fallback
            if want is not None and arr.dtype != want and want.kind != "O":
                arr = narrow(arr, want)
        out.append(arr)
    out.extend(outputs[len(targets):])
    return tuple(out)


def _storer(targets, fallback):
    """_stored() for these targets; with one declared tensor output (most nodes), a shortcut that
    costs a type and a dtype comparison when the output already has its type."""
    one = targets[0] if len(targets) == 1 else None
    if one is None or one is False or one.kind == "O":
        return lambda outputs: _stored(outputs, targets, fallback)
    ndarray = np.ndarray

    def store(outputs):
        if len(outputs) == 1:
            arr = outputs[0]
            if type(arr) is ndarray:
                return outputs if arr.dtype == one else (narrow(arr, one),)
        return _stored(outputs, targets, fallback)

    return store


def _wrap_outputs(kernel: OpKernel, state: HalfNode) -> None:
    run = kernel._run

    def run_stored(*inputs):
        return state.store(run(*inputs))

    kernel._run = run_stored


def _wrap_widening(kernel: OpKernel, state: HalfNode, half_pos: tuple[int, ...] | None) -> None:
    """Replaces the instance's `_run` and `bind_constants` (the CPU run loop calls both on the
    instance): half inputs widened to float32, initializers once. `half_pos`: the positions declared
    half (None: some input's type is not declared; every input is looked at)."""
    run, bind = kernel._run, kernel.bind_constants
    widened: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # position -> (bound half array, its float32 copy)

    def bind_widened(constants: dict[int, np.ndarray]) -> None:
        widened.clear()
        wide = {}
        for pos, arr in constants.items():
            if isinstance(arr, np.ndarray) and arr.dtype in HALF_DTYPES:
                widened[pos] = (arr, widen(arr))
                wide[pos] = widened[pos][1]
            else:
                wide[pos] = arr
        bind(wide)

    def widen_args(inputs):
        args = list(inputs)
        positions = range(len(inputs)) if half_pos is None else half_pos
        for pos in positions:
            arr = args[pos] if pos < len(args) else None
            if isinstance(arr, np.ndarray) and arr.dtype in HALF_DTYPES:
                known = widened.get(pos)
                args[pos] = known[1] if known is not None and known[0] is arr else widen(arr)
        return args

    def run_widened(*inputs):
        return state.store(run(*widen_args(inputs)))

    kernel._run = run_widened
    kernel.bind_constants = bind_widened
    # Fused chains (fusion.py) call the kernel's compiled paths with its arguments: widened the same way,
    # the bound weights are the float32 copies the kernel bound, so those paths apply.
    state.widen_args = widen_args


__all__ = ["KEEP_HALF", "HalfNode", "adapt", "declared_types", "narrow", "widen"]
