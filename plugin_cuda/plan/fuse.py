"""Fusion: a Program's ops become the steps of a plan.

Pure Python (no CuPy). Elementwise ops of one output shape are grouped into one kernel; a group
is "sealed" once any op outside it reads one of its values, so a group never waits for a value
that itself needs the group (no cycles), and it runs at the position of its last member. A GEMM
with few rows, or a convolution, whose result only feeds one group of its shape is computed inside
that group's kernel (the group is its epilogue; the group's "head"); every other GEMM goes to cuBLAS.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import numpy as np

from plugin_cuda.plan import cudnn_step
from plugin_cuda.plan.program import F32, Op, Program

SMALL_GEMM_MAX_ROWS = 8  # rows M up to which a GEMM is a generated GEMV-like kernel
# Multiply-adds up to which a GEMM with more rows is a generated tiled kernel (with its epilogue
# fused) rather than cuBLAS: below it, cuBLAS's host cost per call outweighs its faster kernel.
TILED_GEMM_MAX_MACS = 1 << 26


@dataclass
class Group:
    """Elementwise ops computed in one kernel over `shape`, after an optional head: a small GEMM or
    a convolution (HEAD_KINDS) whose result the members read."""

    shape: tuple
    members: list = field(default_factory=list)  # Ops, in program order
    head: Op | None = None
    sealed: bool = False
    leaves: list = field(default_factory=list)  # value ids read from memory
    exports: list = field(default_factory=list)  # value ids written to memory


@dataclass
class Step:
    """One launch (or one cuBLAS call) of the plan: `kind` in ew, gemm, softmax, norm, transpose."""

    kind: str
    op: Op | None
    group: Group | None
    reads: list
    writes: list
    name: str  # the ONNX node(s) it runs, for errors and reports


# Ops computed one thread per output element, so they can open an elementwise kernel: a whole
# convolution, or the sum of a split convolution's channel slices.
HEAD_KINDS = ("conv", "slice_sum")


def small_gemm(prog: Program, op: Op, tiled: bool = True) -> bool:
    """Whether a GEMM runs as a generated kernel: row-major A times a 2-D B, few rows or few
    multiply-adds (see SMALL_GEMM_MAX_ROWS, TILED_GEMM_MAX_MACS)."""
    if op.kind != "gemm" or op.attrs["trans_a"] or op.attrs["trans_b"]:
        return False
    a, b = prog.values[op.inputs[0]].shape, prog.values[op.inputs[1]].shape
    if len(b) != 2 or len(a) < 1:
        return False
    rows = math.prod(a[:-1]) if len(a) > 1 else 1
    if rows < 1 or b[0] < 1 or b[1] < 1:
        return False
    return rows <= SMALL_GEMM_MAX_ROWS or tiled and rows * b[0] * b[1] <= TILED_GEMM_MAX_MACS


def _consumers(prog: Program) -> dict:
    users: dict = {}
    for op in prog.ops:
        for v in op.inputs:
            users.setdefault(v, []).append(op)
    return users


def group_ops(prog: Program) -> tuple[list, dict]:
    """Elementwise groups (program order of their last member) and value id -> group."""
    owner: dict = {}  # value id -> Group (outputs of elementwise members)
    groups: list = []
    for op in prog.ops:
        if op.kind != "ew":
            for v in op.inputs:
                if v in owner:
                    owner[v].sealed = True
            continue
        shape = prog.values[op.outputs[0]].shape
        candidates = []
        for v in op.inputs:
            g = owner.get(v)
            if g is not None and not g.sealed and g.shape == shape and g not in candidates:
                candidates.append(g)
        if candidates:
            group = candidates[0]
            for other in candidates[1:]:  # unsealed groups read by one op: they may run as one kernel
                group.members.extend(other.members)
                for m in other.members:
                    owner[m.outputs[0]] = group
                groups.remove(other)
        else:
            group = Group(shape)
            groups.append(group)
        for v in op.inputs:
            g = owner.get(v)
            if g is not None and g is not group:
                g.sealed = True
        group.members.append(op)
        owner[op.outputs[0]] = group
    order = {id(op): i for i, op in enumerate(prog.ops)}
    for g in groups:
        g.members.sort(key=lambda m: order[id(m)])
    return groups, owner


BIAS_ADD = "({0} + {1})"
RELU = "ep_relu({0})"


def _only_ew_reader(prog: Program, users: dict, vid: int, expr: str):
    """The op reading `vid` when it is the only one, elementwise with `expr`, of the same shape,
    and `vid` is not a partition output; else None."""
    readers = users.get(vid, [])
    if len(readers) != 1 or vid in prog.outputs:
        return None
    op = readers[0]
    if op.kind != "ew" or op.attrs.get("expr") != expr or prog.values[op.outputs[0]].shape != prog.values[vid].shape:
        return None
    return op


def _bias_of(prog: Program, add: Op, gemm_out: int, n: int) -> int | None:
    """The other operand of `add` when it is a constant of N values along the last axis."""
    other = add.inputs[1] if add.inputs[0] == gemm_out else add.inputs[0]
    v = prog.values[other]
    if other == gemm_out or v.const is None or v.size != n or (v.shape and v.shape[-1] != n):
        return None
    if v.dtype != prog.values[gemm_out].dtype:  # cuBLASLt reads the bias in the output's type
        return None
    return other


def cublaslt_epilogues(prog: Program, tiled: bool) -> Program:
    """`prog` with each GEMM that runs on cuBLAS (not a generated kernel) and is followed by the
    addition of a constant bias over its last axis, and optionally a ReLU, as one op: a GEMM with
    cuBLASLt's BIAS or RELU_BIAS epilogue (plugin_cuda/device/cublaslt.py). The fused op takes the place of
    the last op it replaces; `prog` itself is not changed (the values are shared)."""
    users = _consumers(prog)
    replace: dict = {}  # id(op) -> the op to put there (None: drop it)
    for op in prog.ops:
        if op.kind != "gemm" or small_gemm(prog, op, tiled) or op.attrs["trans_a"] or op.attrs["trans_b"]:
            continue
        if len({prog.values[v].dtype or F32 for v in op.inputs + op.outputs}) != 1:
            continue  # one data type for A, B and D (cublaslt.EpilogueGemm); the bias is checked below
        b_shape = prog.values[op.inputs[1]].shape
        add = _only_ew_reader(prog, users, op.outputs[0], BIAS_ADD) if len(b_shape) == 2 else None
        bias = _bias_of(prog, add, op.outputs[0], b_shape[1]) if add is not None else None
        if bias is None:
            continue
        relu = _only_ew_reader(prog, users, add.outputs[0], RELU)
        last = relu or add
        replace[id(op)] = None
        for dropped in (add, relu):
            if dropped is not None:
                replace[id(dropped)] = None
        replace[id(last)] = Op("gemm", op.node, [op.inputs[0], op.inputs[1], bias], [last.outputs[0]],
                               {**op.attrs, "epilogue": "relu_bias" if relu else "bias"})
    if not replace:
        return prog
    ops = [replace.get(id(op), op) for op in prog.ops]
    return Program(prog.values, [op for op in ops if op is not None], prog.inputs, prog.outputs)


# id(weight) -> its (N, K) copy, while the weight lives: the per-signature plans of a partition share its
# constant arrays (signatures.specialize), so they share the copies too, and the ConstantStore finds them by
# identity (no transposition nor comparison of every weight at a new shape's first run).
_TRANSPOSED: dict = {}


def transposed_copy(const) -> np.ndarray:
    """`const` (a 2-D weight) transposed, float32, C-contiguous; one copy per weight array."""
    key = id(const)
    copy = _TRANSPOSED.get(key)
    if copy is None:
        copy = np.ascontiguousarray(np.asarray(const, np.float32).T)
        try:
            weakref.finalize(const, _TRANSPOSED.pop, key, None)
        except TypeError:  # not weakly referenceable: a copy per call, never kept
            return copy
        _TRANSPOSED[key] = copy
    return copy


def k_major_weights(prog: Program, tiled: bool) -> Program:
    """`prog` with each float32 GEMM that runs on cuBLAS over a constant 2-D B (K, N) reading a copy of
    B stored (N, K) instead, transposed by the call (trans_b): both operands K-major, the layout of
    PyTorch's Linear weights. With TF32, cuBLAS's kernels for it beat those for ONNX's (K, N) layout:
    BERT-base's 60 projection GEMMs at batch 8 took 801 us against PyTorch's 695 (H200, CUPTI), its 12
    FFN output GEMMs 322 against 263. A copy is made once per B, added to `prog`'s (shared) values;
    `prog`'s ops are not changed (a variant with generated GEMMs still reads B row-major)."""
    replace: dict = {}
    copies: dict = {}
    for op in prog.ops:
        if op.kind != "gemm" or small_gemm(prog, op, tiled) or op.attrs["trans_a"] or op.attrs["trans_b"]:
            continue
        b = prog.values[op.inputs[1]]
        if b.const is None or len(b.shape) != 2 or any((prog.values[v].dtype or F32) != F32
                                                       for v in (op.inputs[0], op.inputs[1], op.outputs[0])):
            continue
        bt = copies.get(op.inputs[1])
        if bt is None:
            bt = copies[op.inputs[1]] = prog.const_value(f"{b.name}^T", transposed_copy(b.const))
        replace[id(op)] = Op("gemm", op.node, [op.inputs[0], bt, *op.inputs[2:]], list(op.outputs),
                             {**op.attrs, "trans_b": True})
    if not replace:
        return prog
    return Program(prog.values, [replace.get(id(op), op) for op in prog.ops], prog.inputs, prog.outputs,
                   prog.symbols)


def build_steps(prog: Program, tiled: bool = True, cublaslt: bool = True, k_major: bool = False) -> list:
    """The plan's steps in execution order (aliases make no step). `tiled`: mid-size GEMMs become
    generated tiled kernels (fewest launches, for eager runs); otherwise cuBLAS (fastest kernels,
    for graph replay, where launches cost nothing). `cublaslt`: GEMMs on cuBLAS take their bias
    (and ReLU) into the call (cublaslt_epilogues). `k_major`: float32 GEMMs on cuBLAS read their
    constant weights transposed (k_major_weights; the plans do it under TF32)."""
    if cublaslt:
        prog = cublaslt_epilogues(prog, tiled)
    if k_major:
        prog = k_major_weights(prog, tiled)
    prog = cudnn_step.fold_epilogues(prog)  # ReLU (and a residual Add) into cuDNN convolutions
    groups, owner = group_ops(prog)
    users = _consumers(prog)
    outputs = set(prog.outputs)
    absorbed = set()
    for op in prog.ops:
        if not (small_gemm(prog, op, tiled) or op.kind in HEAD_KINDS):
            continue
        out = op.outputs[0]
        readers = users.get(out, [])
        targets = {id(owner.get(r.outputs[0])) for r in readers if r.kind == "ew"}
        group = owner.get(readers[0].outputs[0]) if readers and readers[0].kind == "ew" else None
        if (group is not None and len(targets) == 1 and all(r.kind == "ew" for r in readers)
                and out not in outputs and group.head is None and group.shape == prog.values[out].shape):
            group.head = op
            absorbed.add(id(op))
        else:
            groups.append(Group(prog.values[out].shape, [], op))  # a head with no epilogue
            absorbed.add(id(op))
    position = {id(op): i for i, op in enumerate(prog.ops)}
    entries = []  # (position, tie, step)
    for g in groups:
        _finish_group(prog, g, users, outputs)
        pos = max([position[id(m)] for m in g.members] + ([position[id(g.head)]] if g.head else []))
        reads = list(g.leaves) + (list(g.head.inputs) if g.head else [])
        names = [m.node for m in ([g.head] if g.head else []) + g.members]
        entries.append((pos, 1, Step("ew", None, g, reads, list(g.exports), _names(names))))
    for op in prog.ops:
        if op.kind in ("ew", "alias") or id(op) in absorbed:
            continue
        entries.append((position[id(op)], 0, Step(op.kind, op, None, list(op.inputs), list(op.outputs), op.node)))
    entries.sort(key=lambda e: (e[0], e[1]))
    return [e[2] for e in entries]


def _names(names: list) -> str:
    unique = list(dict.fromkeys(names))
    return unique[0] if len(unique) == 1 else f"{unique[0]} .. {unique[-1]} ({len(unique)} nodes)"


def _finish_group(prog: Program, g: Group, users: dict, outputs: set) -> None:
    produced = {m.outputs[0] for m in g.members}
    inside = {id(m) for m in g.members}
    head_out = g.head.outputs[0] if g.head is not None else None
    leaves = []
    for m in g.members:
        for v in m.inputs:
            if v not in produced and v != head_out and v not in leaves:
                leaves.append(v)
    g.leaves = leaves
    exports = []
    for v in ([head_out] if head_out is not None and not g.members else []) + [m.outputs[0] for m in g.members]:
        if v in outputs or any(id(u) not in inside for u in users.get(v, [])):
            exports.append(v)
    if not exports and g.members:
        exports.append(g.members[-1].outputs[0])  # a dead result still gets written (it has a buffer)
    g.exports = exports
