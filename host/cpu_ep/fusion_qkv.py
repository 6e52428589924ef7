"""The q, k and v projections of an Attention node as one GEMM, read by the attention kernel in place.

BERT and ViT exports optimized for the CPU EP run three products of one input over bound weights
(FusedMatMul or MatMul, with or without a bias), each read by one ONNX Attention node alone (a mask
Expand may sit between them). At small shapes each node's fixed cost dominates (issue 23: three
16x64x64 products cost 6 us, the attention 5 us), so the run loop joins them (host/cpu_ep/fusion.py):
the weights (and biases) are concatenated once into a (K, 3N) matrix, one compiled GEMM writes
[q | k | v] per row, and ep_attention reads the three column blocks through their strides.

Each column of the joint product is the dot product the separate GEMMs compute (same kernel, same
order over k) while the products stay within the small GEMM (native.gemm_fits); beyond it the packed
GEMM serves, as for any large product. Input the compiled path does not take (other dtypes, layouts,
masks, no library) runs the four nodes' own kernels in turn. A profiler's wrapped nodes are never
joined (each keeps its event).
"""

from __future__ import annotations

import numpy as np

from host.cpu_ep import native, packed_gemm
from host.cpu_ep.base import int_list
from host.cpu_ep.fusion import FusedNode, _call  # fusion.py imports this module inside fuse() only
from host.cpu_ep.ops_attention import native_threads
from host.cpu_ep.ops_math import bound_gemm
from host.cpu_ep.ops_shape import broadcast_shape, contents_key

_PRODUCTS = {("", "MatMul"), ("ai.ephost", "FusedMatMul")}
F32 = native.F32
WINDOW = 3  # nodes between the third projection and the Attention node that may be passed over


def _op(node) -> tuple[str, str]:
    domain = node.kernel.node.domain
    return ("" if domain in ("", "ai.onnx") else domain), node.op_type


def _projection(node, constants):
    """(input id, weight, bias or None) of a product over a bound float32 2-D weight and 1-D bias, else None."""
    if _op(node) not in _PRODUCTS or len(node.outputs) != 1 or "run" in node.kernel.__dict__:
        return None
    if getattr(node.kernel, "activation", "") or not 2 <= len(node.inputs) <= 3:
        return None
    w = constants.get(node.inputs[1])
    bias = constants.get(node.inputs[2]) if len(node.inputs) == 3 else None
    if w is None or w.dtype != F32 or w.ndim != 2 or (len(node.inputs) == 3 and bias is None):
        return None
    if bias is not None and (bias.dtype != F32 or bias.shape != (w.shape[1],)):
        return None
    return node.inputs[0], w, bias


def match_qkv_attention(nodes, i: int, consumers, keep, constants):
    """(nodes to emit in place of nodes[i:i+count], count) for three projections of one input at nodes[i:i+3]
    read only as an Attention node's q, k and v within WINDOW nodes after them, else None."""
    projections = [_projection(n, constants) for n in nodes[i:i + 3]]
    if len(projections) < 3 or None in projections or len({p[0] for p in projections}) != 1:
        return None
    if len({p[2] is None for p in projections}) != 1 or len({p[1].shape[0] for p in projections}) != 1:
        return None
    outs = [n.outputs[0] for n in nodes[i:i + 3]]
    if any(v < 0 or v in keep or consumers.get(v, 0) != 1 for v in outs):
        return None
    for j in range(i + 3, min(i + 4 + WINDOW, len(nodes))):
        node = nodes[j]
        if _op(node) == ("", "Attention") and sorted(node.inputs[:3]) == sorted(outs):
            break
        if any(v in outs or v == projections[0][0] for v in node.inputs):
            return None  # reads a projection, or the input (whose free may then come before the join runs)
    else:
        return None
    attn = node
    if (len(attn.inputs) > 4 and any(v >= 0 for v in attn.inputs[4:])) or len(attn.outputs) != 1 \
            or "run" in attn.kernel.__dict__ or not attn.kernel._plain:
        return None
    order = [outs.index(v) for v in attn.inputs[:3]]  # the products as q, k, v (exports write them in any order)
    projections = [projections[o] for o in order]
    used = [*(nodes[i + o] for o in order), attn]
    mask = attn.inputs[3] if len(attn.inputs) > 3 and attn.inputs[3] >= 0 else -1
    between = nodes[i + 3:j]
    expand = next((n for n in between if _mask_expand(n, mask, consumers, keep)), None)
    if expand is not None:  # the attention reads the mask before its Expand, broadcasting it itself
        between = [n for n in between if n is not expand]
        used.insert(3, expand)
    kernel = _QkvAttention([n.kernel for n in used], projections, mask if expand is None else expand.inputs[0],
                           None if expand is None else (expand.inputs[1], expand.kernel))
    ins = (projections[0][0], *([mask] if mask >= 0 and expand is None else []), *(expand.inputs if expand else ()))
    fused = FusedNode(kernel, ins, tuple(attn.outputs), tuple(v for n in used for v in n.frees),
                      tuple(n.name for n in used))
    return [*between, fused], j - i + 1


def _mask_expand(node, mask: int, consumers, keep) -> bool:
    """`node` is an Expand whose output is the attention's mask and read by nothing else."""
    return (mask >= 0 and _op(node) == ("", "Expand") and len(node.outputs) == 1 and node.outputs[0] == mask
            and consumers.get(mask, 0) == 1 and mask not in keep and "run" not in node.kernel.__dict__
            and len(node.inputs) == 2 and min(node.inputs) >= 0)


class _QkvAttention:
    """Attention(x Wq + bq, x Wk + bk, x Wv + bv, mask) with the three products as one GEMM."""

    def __init__(self, kernels, projections, mask: int, expand=None):
        self.kernels = kernels  # q, k, v products, [the mask's Expand], then the Attention
        self.attn = kernels[-1]
        self.x_id, self.mask_id = projections[0][0], mask
        # (shape value id, Expand kernel) when the mask is read before its Expand (mask_id: the Expand's input)
        self.expand = expand
        self._full: dict[tuple, tuple | None] = {}  # (mask shape, target contents) -> the Expand's output shape
        self.arg_ids = ()  # reads its inputs from the values itself
        self.weights = [p[1] for p in projections]
        self.biases = [p[2] for p in projections]
        self.w = np.ascontiguousarray(np.concatenate(self.weights, axis=1))
        packed_gemm.declare_weight(self.w)  # unchanged while the join lives: large products may pack it
        self.bias = None if self.biases[0] is None else np.ascontiguousarray(np.concatenate(self.biases))
        self.widths = [w.shape[1] for w in self.weights]
        self._runs: dict[tuple, tuple | bool] = {}
        self._layouts: dict[tuple, tuple] = {}  # (x, mask, target) -> (library, _prepare's tuple or None)
        self.name, self.op_type = self.attn.name, self.attn.op_type

    def failure(self, exc):
        return self.attn.failure(exc)

    def _run(self, values, _args):
        x = values[self.x_id]
        mask = values[self.mask_id] if self.mask_id >= 0 else None
        target = values[self.expand[0]] if self.expand is not None else None
        lib = native.LIB
        if lib is not None and x.dtype == F32 and x.ndim == 3 and x.flags.c_contiguous:
            y = self._joint(lib, x, mask, target)
            if y is not None:
                return (y,)
        if self.expand is not None:
            mask = _call(self.expand[1], mask, target)[0]
        return self._one_by_one(x, mask)

    def _joint(self, lib, x, mask, target=None):
        """The joint GEMM and the compiled attention over its column blocks, or None where they do not serve.
        With the mask's Expand absorbed, `mask` is its input and `target` its shape input. The checks and the
        layout are worked out once per (x, mask, target) and kept (`_prepare`)."""
        key = (x.shape, None if mask is None else (mask.shape, mask.dtype, mask.flags.c_contiguous),
               None if target is None else contents_key(target))
        entry = self._layouts.get(key)
        if entry is None or entry[0] is not lib:
            if len(self._layouts) >= 16:
                self._layouts = {}
            entry = self._layouts[key] = (lib, self._prepare(lib, x, mask, target))
        prepared = entry[1]
        if prepared is None:
            return None
        gemm, args, out_shape, offsets = prepared
        qkv = gemm(x)
        y = np.empty(out_shape, dtype=F32)
        base = native.ptr(qkv)
        if lib.ep_attention(base, base + offsets[0], base + offsets[1], native.NULL if mask is None else native.ptr(mask),
                            args[0], native.ptr(y), *args[1:], self.attn.is_causal, native_threads(args[1:8])):
            return None
        return y

    def _prepare(self, lib, x, mask, target):
        """(the GEMM's function, ep_attention's arguments after the mask pointer, the output shape, k's and v's
        byte offsets in a row of the product) for these shapes, or None where the compiled path does not serve."""
        if mask is not None and not (mask.flags.c_contiguous and (mask.dtype == F32 or mask.dtype == np.bool_)):
            return None
        full = None if self.expand is None else self._expanded(mask, target)
        if self.expand is not None and full is None:
            return None
        gemm = bound_gemm(self._runs, lib, x, self.w, self.bias, 0)
        if not gemm:
            return None
        nq, nk, _ = self.widths
        qkv = np.empty((*x.shape[:-1], self.w.shape[1]), dtype=F32)  # the layout depends on shapes alone
        layout = self.attn._native_layout(qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:], mask)
        if layout is None:
            return None
        dims, strides, out_shape, mask_kind, scale = layout
        if full is not None and (len(full) > 4 or any(f not in (1, want) for f, want in
                                                      zip((1,) * (4 - len(full)) + full, dims[:4]))):
            return None  # the expanded mask would not broadcast over the scores: the nodes say how
        return gemm, (mask_kind, *dims, *strides, scale), out_shape, (4 * nq, 4 * (nq + nk))

    def _expanded(self, mask, target):
        """The shape Expand(mask, target) has (kept per mask shape and target contents), or None where the
        target is not a small integer vector or does not broadcast (the nodes then run and say why)."""
        key = (mask.shape, contents_key(target))
        if key[1] is None:
            return None
        full = self._full.get(key, False)
        if full is False:
            try:
                full = broadcast_shape(mask.shape, int_list(target))
            except ValueError:
                full = None
            if len(self._full) >= 16:
                self._full = {}
            self._full[key] = full
        return full

    def _one_by_one(self, x, mask):
        """The nodes' kernels in turn (what the plan would run without the join); `mask` as the Attention
        reads it (expanded)."""
        qkv = [_call(kern, x, w, *([] if b is None else [b]))[0]
               for kern, w, b in zip(self.kernels[:3], self.weights, self.biases)]
        return _call(self.attn, *qkv, *([] if mask is None else [mask]))
