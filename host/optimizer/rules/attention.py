"""Scaled dot-product attention -> Attention (opset 23), 4-D (batch, heads, seq, head_size) form.

The pattern is the one onnxscript's ORT fusions recognise (ort_fusions/sdpa.py), re-targeted at
the standard op: softmax(scale * Q @ K^T + mask) @ V, with
- K^T as Transpose(K, [0, 1, 3, 2]) of a BHSd key, or Transpose(K, [0, 2, 3, 1]) of a BSHd key
  (the head split and the transpose composed, as the zoo transformer and some exporters write it);
- the scale as Mul or Div on Q, on K^T and / or on the scores (their product becomes `scale`);
- an optional additive float mask; an optional Where(IsNaN(p), 0, p) after the Softmax (torch's
  SDPA export), which is what Attention does for fully masked rows anyway.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import _fusion_utils, _ir_utils, pattern
from onnxscript.rewriter._basics import MatchFailureError

from host.optimizer.rules.base import Family, has_float_type


def _scaled(op, x, scale, tag: str):
    return pattern.OrValue([op.Mul(x, scale), op.Div(x, scale), x], tag_var=tag, tag_values=["Mul", "Div", "None"])


class AttentionFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, query, key, value, mask, query_scale, key_scale, qk_scale):
        key_t = pattern.OrValue([op.Transpose(key, perm=[0, 1, 3, 2]), op.Transpose(key, perm=[0, 2, 3, 1])],
                                tag_var="key_format", tag_values=["BHSd", "BSHd"])
        scores = op.MatMul(_scaled(op, query, query_scale, "q_scaling"), _scaled(op, key_t, key_scale, "k_scaling"))
        scores = _scaled(op, scores, qk_scale, "qk_scaling")
        scores = pattern.OrValue([op.Add(scores, mask), scores], tag_var="has_mask", tag_values=[True, False])
        probs = op.Softmax(scores, axis=-1)
        probs = pattern.OrValue([op.Where(op.IsNaN(probs), 0.0, probs), probs])
        return op.MatMul(probs, value)

    def check(self, context, query, key, value, mask, key_format, **bindings):
        result = pattern.MatchResult()
        dims: dict = {}
        _fusion_utils.check_shape(dims, query, ["B", "H", "S", "Dh"])
        key_dims = ["B", "H", "Skv", "Dh"] if key_format == "BHSd" else ["B", "Skv", "H", "Dh"]
        _fusion_utils.check_shape(dims, key, key_dims)
        _fusion_utils.check_shape(dims, value, ["B", "H", "Skv", "Dv"])
        if not (has_float_type(query) and query.dtype == key.dtype == value.dtype):
            return result.fail("Q, K, V are not all of one float type", query)
        if mask is not None and (mask.dtype != query.dtype or mask.shape is None or mask.shape.rank() > 4):
            return result.fail("mask is not a float mask of rank <= 4 of Q's type", mask)
        # onnxruntime's Attention wants the mask's query dim to be the query length, not a broadcast 1
        # (the spec allows broadcasting): a mask [B, 1, 1, Skv] is expanded to [B, 1, S, Skv] then.
        # A dynamic query length (a dynamic-axes export) is read from Q's shape at run time: the host
        # evaluates that Shape once per input-shape signature (host/runtime/shape_program.py).
        self._expand_mask = None
        if mask is not None and (mask.shape.rank() < 2 or mask.shape[-2] != dims["S"]):
            self._expand_mask = dims["S"] if isinstance(dims["S"], int) else "dynamic"
        scale = 1.0
        for tag, name in (("q_scaling", "query_scale"), ("k_scaling", "key_scale"), ("qk_scaling", "qk_scale")):
            scale *= _scale_value(bindings.get(tag, "None"), bindings.get(name))
        if not math.isfinite(scale) or scale <= 0:
            return result.fail(f"scale {scale} is not a positive finite number")
        self._scale = scale
        return result

    def rewrite(self, op, query, key, value, mask, key_format, **_):
        if key_format == "BSHd":
            key = op.Transpose(key, perm=[0, 2, 1, 3])
        if mask is not None and self._expand_mask == "dynamic":
            rows = op.Concat(_query_length(op, query), op.Constant(value_ints=[1]), axis=0)
            mask = op.Expand(mask, rows)
        elif mask is not None and self._expand_mask is not None:
            mask = op.Expand(mask, op.Constant(value_ints=[self._expand_mask, 1]))
        args = [query, key, value] + ([mask] if mask is not None else [])
        return op.Attention(*args, scale=self._scale)


class Attention3D(pattern.RewriteRuleClassBase):
    """The head split and merge around a 4-D Attention -> the 3-D form (q_num_heads / kv_num_heads).

    Reshape([B, S, H*D] -> [B, S, H, D]) + Transpose([0, 2, 1, 3]) on Q, K and V, and
    Transpose([0, 2, 1, 3]) + Reshape(-> [B, S, H*Dv]) on the output, are what Attention does
    itself when given 3-D inputs. The output Reshape may also flatten to [B*S, H*Dv] for a 2-D
    Gemm (GPT-2's Conv1D after its packed Q/K/V Split); that Reshape is kept, on the 3-D output,
    and FlattenedGemm (matmul.py) then takes it with the Gemm.
    """

    def pattern(self, op, q3, k3, v3, q_shape, k_shape, v_shape, y_shape):
        q4 = op.Transpose(op.Reshape(q3, q_shape, _outputs=["q_split"]), perm=[0, 2, 1, 3])
        k4 = op.Transpose(op.Reshape(k3, k_shape, _outputs=["k_split"]), perm=[0, 2, 1, 3])
        v4 = op.Transpose(op.Reshape(v3, v_shape, _outputs=["v_split"]), perm=[0, 2, 1, 3])
        y4 = op.Attention(q4, k4, v4, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y4"])
        return op.Reshape(op.Transpose(y4, perm=[0, 2, 1, 3]), y_shape, _outputs=["y3"])

    def check(self, context, q3, k3, v3, q_split, k_split, v_split, y4, y3, **_):
        result = pattern.MatchResult()
        node = y4.producer()
        if len(node.outputs) > 1 and any(o.uses() for o in node.outputs[1:]):
            return result.fail("Attention's extra outputs are used", node)
        if len(node.inputs) > 4:
            return result.fail("Attention has past key / value inputs", node)
        dims: dict = {}
        for name, x3, split in (("q", q3, q_split), ("k", k3, k_split), ("v", v3, v_split)):
            seq = "S" if name == "q" else "Skv"
            _fusion_utils.check_shape(dims, x3, ["B", seq, f"{name}_hidden"])
            _fusion_utils.check_shape(dims, split, ["B", seq, "Hq" if name == "q" else "Hkv", f"{name}_head"])
            hidden, heads, head = dims[f"{name}_hidden"], split.shape[2], split.shape[3]
            if not all(isinstance(d, int) for d in (hidden, heads, head)) or hidden != heads * head:
                return result.fail(f"{name}: the Reshape does not split the last dim into heads", split)
        self._flat = None
        if y3.shape is not None and y3.shape.rank() == 2:
            flat = _flattened(dims, y3)
            if flat is None:
                return result.fail("the 2-D output Reshape does not flatten [B, S, H*Dv] to [B*S, H*Dv]", y3)
            self._flat = flat
            self._unflat = [dims["B"], dims["S"], flat[1]]
        else:
            _fusion_utils.check_shape(dims, y3, ["B", "S", "y_hidden"])
            if dims["y_hidden"] != dims["Hq"] * dims["v_head"]:
                return result.fail("the output Reshape does not merge the heads", y3)
        self._heads = (dims["Hq"], dims["Hkv"])
        return result

    def rewrite(self, op, q3, k3, v3, y4, **_):
        node = y4.producer()
        attrs = {k: v for k, v in node.attributes.items()}
        args = [q3, k3, v3, *node.inputs[3:4]]
        y = op.Attention(*args, q_num_heads=self._heads[0], kv_num_heads=self._heads[1], **attrs)
        if self._flat is not None:
            # The 3-D value is new (onnxscript carries types over to replaced outputs only), and
            # FlattenedGemm needs its shape.
            y.dtype, y.shape = q3.dtype, ir.Shape(self._unflat)
            y = op.Reshape(y, op.Constant(value_ints=self._flat))
        return y


class Rotary3D(pattern.RewriteRuleClassBase):
    """The head split in front of a 4-D RotaryEmbedding -> the 3-D form (num_heads), the split after it.

    RotaryEmbedding(Transpose(Reshape(x3 [B, S, H*D] -> [B, S, H, D]), [0, 2, 1, 3])) equals
    Transpose(Reshape(RotaryEmbedding(x3, num_heads=H))): a 3-D input is split into heads the same way.
    Moved behind the rotation, the split meets Attention3D's pattern, which then takes it with the
    Attention (Llama's Q and K: the eight Reshape / Transpose nodes around each attention go)."""

    def pattern(self, op, x3, shape):
        x4 = op.Transpose(op.Reshape(x3, shape, _outputs=["split"]), perm=[0, 2, 1, 3])
        return op.RotaryEmbedding(x4, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y4"])

    def check(self, context, x3, split, y4, **_):
        result = pattern.MatchResult()
        dims: dict = {}
        _fusion_utils.check_shape(dims, x3, ["B", "S", "hidden"])
        _fusion_utils.check_shape(dims, split, ["B", "S", "H", "D"])
        if not all(isinstance(dims[d], int) for d in ("hidden", "H", "D")) or dims["hidden"] != dims["H"] * dims["D"]:
            return result.fail("the Reshape does not split the last dim into heads", split)
        self._heads = dims["H"]
        return result

    def rewrite(self, op, x3, shape, split, y4, **_):
        node = y4.producer()
        attrs = {k: v for k, v in node.attributes.items() if k != "num_heads"}
        extra = list(node.inputs[1:])
        while extra and extra[-1] is None:
            extra.pop()
        y3 = op.RotaryEmbedding(x3, *extra, num_heads=self._heads, **attrs)
        # New values carry no type (onnxscript types replaced outputs only); Attention3D reads these.
        y3.dtype, y3.shape = x3.dtype, ir.Shape(list(x3.shape))
        heads = op.Reshape(y3, shape)
        heads.dtype, heads.shape = split.dtype, ir.Shape(list(split.shape))
        return op.Transpose(heads, perm=[0, 2, 1, 3])


class GroupedKV(pattern.RewriteRuleClassBase):
    """K and V heads repeated for grouped-query attention before a 4-D Attention -> K and V as they
    were: Unsqueeze(axis 2) + Expand([B, G, R, S, D]) + Reshape([B, G*R, S, D]) (Llama's repeat_kv) is
    what Attention-23 does itself when K and V have fewer heads than Q (query head h reads kv head
    h // R), without the copies."""

    def pattern(self, op, query, key, value, k_axes, v_axes, k_target, v_target, k_shape, v_shape):
        k4 = op.Reshape(op.Expand(op.Unsqueeze(key, k_axes), k_target, _outputs=["k5"]), k_shape)
        v4 = op.Reshape(op.Expand(op.Unsqueeze(value, v_axes), v_target, _outputs=["v5"]), v_shape)
        return op.Attention(query, k4, v4, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, query, key, value, k_axes, v_axes, k5, v5, y, **_):
        result = pattern.MatchResult()
        node = y.producer()
        if len(node.inputs) > 4 or any(o.uses() for o in node.outputs[1:]):
            return result.fail("Attention has past key / value inputs or uses its extra outputs", node)
        dims: dict = {}
        _fusion_utils.check_shape(dims, query, ["B", "Hq", "S", "Dh"])
        for name, x, axes, x5 in (("k", key, k_axes, k5), ("v", value, v_axes, v5)):
            _fusion_utils.check_shape(dims, x, ["B", "G", f"{name}_len", f"{name}_head"])
            _fusion_utils.check_shape(dims, x5, ["B", "G", "R", f"{name}_len", f"{name}_head"])
            if [int(a) for a in (_ir_utils.get_numpy_value(axes) if axes is not None else [])] not in ([2], [-3]):
                return result.fail(f"{name}: the Unsqueeze does not add axis 2", axes)
        if not all(isinstance(dims[d], int) for d in ("Hq", "G", "R")) or dims["G"] * dims["R"] != dims["Hq"]:
            return result.fail("the repeated K/V heads do not give the query's heads", query)
        return result

    def rewrite(self, op, query, key, value, y, **_):
        node = y.producer()
        attrs = {k: v for k, v in node.attributes.items()}
        return op.Attention(query, key, value, *node.inputs[3:4], **attrs)


def _flattened(dims: dict, y2) -> list[int] | None:
    """[B*S, H*Dv] when the 2-D value y2 is the 3-D output with batch and sequence flattened, else None."""
    batch, seq, heads, head = dims["B"], dims["S"], dims["Hq"], dims["v_head"]
    if not all(isinstance(d, int) for d in (batch, seq, heads, head)):
        return None
    want = [batch * seq, heads * head]
    return want if list(y2.shape) == want else None


def _query_length(op, query):
    """[S] of a BHSd query at run time. From the 3-D input when the query is its head split
    (Transpose(Reshape(q3))): a Shape of the split itself would give it a second use, and
    Attention3D, which folds the split into the Attention, matches single-use values only."""
    node = query.producer()
    split = node.inputs[0] if node is not None and node.op_type == "Transpose" else None
    reshape = split.producer() if split is not None else None
    if reshape is not None and reshape.op_type == "Reshape" and list(node.attributes.get_ints("perm", [])) == [0, 2, 1, 3]:
        q3 = reshape.inputs[0]
        if q3.shape is not None and q3.shape.rank() == 3 and split.shape is not None and split.shape.rank() == 4 \
                and _same_dim(q3.shape[1], split.shape[1]):
            return op.Shape(q3, start=1, end=2)
    return op.Shape(query, start=2, end=3)


def _same_dim(a, b) -> bool:
    """Two dims known to be equal: the same int, or the same symbol."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.value is not None and a.value == b.value


def _scale_value(kind: str, scale) -> float:
    if kind == "None":
        return 1.0
    value = _ir_utils.get_singleton_value(scale)
    if value is None:
        raise MatchFailureError("the scale is not a constant scalar", scale)
    return float(value) if kind == "Mul" else 1.0 / float(value)


def attention_rules() -> list:
    return [AttentionFusion.rule()]


def attention_3d_rules() -> list:
    # In one pass over the graph: the rotations come before the Attention, the Attention before its
    # output Reshape (Attention3D's root), so each rule sees what the ones before it rewrote.
    return [Rotary3D.rule(), GroupedKV.rule(), Attention3D.rule()]


ATTENTION = Family("Attention", attention_rules, min_opset=23, triggers=frozenset({"Softmax"}),
                   emits=(("", "Attention"),))
ATTENTION_3D = Family("Attention3D", attention_3d_rules, min_opset=23, triggers=frozenset({"Attention"}), emits=())
