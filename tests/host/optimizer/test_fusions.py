"""Each EXTENDED fusion: the fused op appears (node counts before/after) and the outputs do not change.

Equivalence is checked on hypothesis-generated inputs with onnxruntime CPU and onnx's reference
evaluator, original model vs optimized model (ai.ephost nodes expanded for the references).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given
from onnx import helper

from host.optimizer import GraphOptimizationLevel, optimize
from tests.host.optimizer.common import References, assert_same, float_arrays, make_model, ops

EXTENDED = GraphOptimizationLevel.ORT_ENABLE_EXTENDED
RNG = np.random.default_rng(7)


def _pair(model):
    """(original references, optimized model, optimized references)."""
    optimized = optimize(model, EXTENDED).model
    return References(model), optimized, References(optimized)


# ---- GELU ----------------------------------------------------------------------------------------
def _gelu_erf_model(where: str, div: bool, const_left: bool):
    def mul(a, b, out):
        return helper.make_node("Mul", [b, a] if const_left and b in ("half",) else [a, b], [out])

    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["s"]) if div else helper.make_node("Mul", ["x", "isqrt2"], ["s"]),
             helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", ["one", "e"] if const_left else ["e", "one"], ["t"])]
    if where == "x":
        nodes += [mul("x", "half", "h"), helper.make_node("Mul", ["h", "t"], ["y"])]
    elif where == "term":
        nodes += [mul("t", "half", "h"), helper.make_node("Mul", ["h", "x"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["t", "x"], ["p"]), mul("p", "half", "y")]
    inits = {"sqrt2": np.float32(math.sqrt(2)), "isqrt2": np.float32(1 / math.sqrt(2)),
             "one": np.float32(1), "half": np.float32(0.5)}
    return make_model(nodes, [("x", [3, 8])], [("y", [3, 8])], {k: inits[k] for k in inits if any(
        k in n.input for n in nodes)})


def _gelu_tanh_model(pow_cube: bool, where: str):
    nodes = []
    if pow_cube:
        nodes.append(helper.make_node("Pow", ["x", "three"], ["c"]))
    else:
        nodes += [helper.make_node("Mul", ["x", "x"], ["xx"]), helper.make_node("Mul", ["x", "xx"], ["c"])]
    nodes += [helper.make_node("Mul", ["kappa", "c"], ["kc"]), helper.make_node("Add", ["x", "kc"], ["i"]),
              helper.make_node("Mul", ["beta", "i"], ["bi"]), helper.make_node("Tanh", ["bi"], ["th"]),
              helper.make_node("Add", ["one", "th"], ["t"])]
    if where == "x":
        nodes += [helper.make_node("Mul", ["half", "x"], ["h"]), helper.make_node("Mul", ["h", "t"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["x", "t"], ["p"]), helper.make_node("Mul", ["half", "p"], ["y"])]
    inits = {"three": np.float32(3), "kappa": np.float32(0.044715), "beta": np.float32(math.sqrt(2 / math.pi)),
             "one": np.float32(1), "half": np.float32(0.5)}
    used = {i for n in nodes for i in n.input}
    return make_model(nodes, [("x", [3, 8])], [("y", [3, 8])], {k: v for k, v in inits.items() if k in used})


GELU_ERF = [(w, d, c) for w in ("x", "term", "product") for d in (True, False) for c in (False, True)]


@functools.cache
def gelu_erf(where, div, const_left):
    return _pair(_gelu_erf_model(where, div, const_left))


@pytest.mark.parametrize("where,div,const_left", GELU_ERF)
@given(x=float_arrays([3, 8]))
def test_erf_gelu_becomes_gelu(where, div, const_left, x):
    original, optimized, fused = gelu_erf(where, div, const_left)
    assert ops(optimized) == {"Gelu": 1}
    assert optimized.graph.node[0].attribute[0].s == b"none"
    assert_same(original, fused, {"x": x})


@functools.cache
def gelu_tanh(pow_cube, where):
    return _pair(_gelu_tanh_model(pow_cube, where))


@pytest.mark.parametrize("pow_cube", [True, False])
@pytest.mark.parametrize("where", ["x", "product"])
@given(x=float_arrays([3, 8]))
def test_tanh_gelu_becomes_gelu_tanh(pow_cube, where, x):
    original, optimized, fused = gelu_tanh(pow_cube, where)
    assert ops(optimized) == {"Gelu": 1}
    assert helper.get_attribute_value(optimized.graph.node[0].attribute[0]) == b"tanh"
    assert_same(original, fused, {"x": x})


def test_gelu_with_a_wrong_constant_is_not_fused():
    model = _gelu_erf_model("x", True, False)
    for t in model.graph.initializer:
        if t.name == "half":
            t.CopyFrom(helper.make_tensor("half", 1, [], [0.6]))
    assert "Gelu" not in ops(optimize(model, EXTENDED).model)


# ---- LayerNorm / RMSNorm ---------------------------------------------------------------------
def _layer_norm_model(scale_shape=(16,), pow_square=True):
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]) if pow_square else helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["v"], axes=[-1]), helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]), helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "scale"], ["ns"]), helper.make_node("Add", ["ns", "bias"], ["y"])]
    inits = {"two": np.float32(2), "eps": np.float32(1e-5),
             "scale": (1 + 0.1 * RNG.standard_normal(scale_shape)).astype(np.float32),
             "bias": (0.1 * RNG.standard_normal(16)).astype(np.float32)}
    if not pow_square:
        del inits["two"]
    return make_model(nodes, [("x", [2, 5, 16])], [("y", [2, 5, 16])], inits)


@functools.cache
def layer_norm(pow_square):
    return _pair(_layer_norm_model(pow_square=pow_square))


@pytest.mark.parametrize("pow_square", [True, False])
@given(x=float_arrays([2, 5, 16]))
def test_layer_norm_decomposition_becomes_layer_normalization(pow_square, x):
    original, optimized, fused = layer_norm(pow_square)
    assert ops(optimized) == {"LayerNormalization": 1}
    assert len(_layer_norm_model().graph.node) == 9
    assert_same(original, fused, {"x": x})


def _rms_norm_model():
    nodes = [helper.make_node("Pow", ["x", "two"], ["x2"]), helper.make_node("ReduceMean", ["x2", "axes"], ["m"]),
             helper.make_node("Add", ["m", "eps"], ["me"]), helper.make_node("Sqrt", ["me"], ["r"]),
             helper.make_node("Reciprocal", ["r"], ["ir"]), helper.make_node("Mul", ["x", "ir"], ["n"]),
             helper.make_node("Mul", ["scale", "n"], ["y"])]
    inits = {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(1e-6),
             "scale": (1 + 0.1 * RNG.standard_normal(16)).astype(np.float32)}
    return make_model(nodes, [("x", [2, 5, 16])], [("y", [2, 5, 16])], inits, opset=18)


@functools.cache
def rms_norm():
    return _pair(_rms_norm_model())


@given(x=float_arrays([2, 5, 16]))
def test_rms_norm_decomposition_becomes_rms_normalization(x):
    original, optimized, fused = rms_norm()
    assert ops(optimized) == {"RMSNormalization": 1}
    assert_same(original, fused, {"x": x})


# ---- MatMul + Add ------------------------------------------------------------------------------
def _linear_model(x_shape, bias_first=False, act=None, opset=17):
    k, n = x_shape[-1], 6
    out_shape = [*x_shape[:-1], n]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["b", "mm"] if bias_first else ["mm", "b"], ["y" if act is None else "z"])]
    if act == "Relu":
        nodes.append(helper.make_node("Relu", ["z"], ["y"]))
    elif act == "Gelu":
        nodes.append(helper.make_node("Gelu", ["z"], ["y"], approximate="tanh"))
    inits = {"w": RNG.standard_normal((k, n)).astype(np.float32), "b": RNG.standard_normal(n).astype(np.float32)}
    return make_model(nodes, [("x", x_shape)], [("y", out_shape)], inits, opset=opset)


@functools.cache
def linear(x_shape, bias_first, act, opset):
    return _pair(_linear_model(list(x_shape), bias_first, act, opset))


@pytest.mark.parametrize("bias_first", [False, True])
@given(x=float_arrays([4, 5]))
def test_2d_matmul_add_becomes_gemm(bias_first, x):
    original, optimized, fused = linear((4, 5), bias_first, None, 17)
    assert ops(optimized) == {"Gemm": 1}
    assert_same(original, fused, {"x": x})


@pytest.mark.parametrize("act,expected", [(None, ""), ("Relu", "Relu"), ("Gelu", "GeluTanh")])
@given(x=float_arrays([2, 3, 5]))
def test_nd_matmul_add_becomes_fused_matmul(act, expected, x):
    original, optimized, fused = linear((2, 3, 5), False, act, 20 if act == "Gelu" else 17)
    assert ops(optimized) == {"ai.ephost::FusedMatMul": 1}
    node = optimized.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["activation"] == expected.encode()
    assert_same(original, fused, {"x": x})


# ---- attention -------------------------------------------------------------------------------
def _attention_model(heads=2, head=4, seq=5, batch=2, mask=True, scale_op="Div", nan_guard=False):
    hidden = heads * head
    split = np.array([batch, seq, heads, head], np.int64)
    nodes = []
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [name, "split"], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}t"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Transpose", ["kt"], ["ktt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qt", "ktt"], ["s"]),
              helper.make_node(scale_op, ["s", "scale"], ["ss"])]
    scores = "ss"
    if mask:
        nodes.append(helper.make_node("Add", ["ss", "mask"], ["sm"]))
        scores = "sm"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1))
    probs = "p"
    if nan_guard:
        nodes += [helper.make_node("IsNaN", ["p"], ["isnan"]), helper.make_node("Where", ["isnan", "zero", "p"], ["pg"])]
        probs = "pg"
    nodes += [helper.make_node("MatMul", [probs, "vt"], ["c"]),
              helper.make_node("Transpose", ["c"], ["ct"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ct", "merge"], ["y"])]
    scale = math.sqrt(head) if scale_op == "Div" else 1 / math.sqrt(head)
    inits = {"split": split, "merge": np.array([batch, seq, hidden], np.int64), "scale": np.float32(scale),
             "zero": np.float32(0)}
    if not nan_guard:
        del inits["zero"]
    inputs = [(n, [batch, seq, hidden]) for n in "qkv"] + ([("mask", [batch, 1, 1, seq])] if mask else [])
    return make_model(nodes, inputs, [("y", [batch, seq, hidden])], inits, opset=18)


@functools.cache
def attention(mask, scale_op, nan_guard):
    return _pair(_attention_model(mask=mask, scale_op=scale_op, nan_guard=nan_guard))


@pytest.mark.parametrize("mask,scale_op,nan_guard", [(True, "Div", False), (False, "Mul", False),
                                                     (True, "Mul", True)])
@given(q=float_arrays([2, 5, 8]), k=float_arrays([2, 5, 8]), v=float_arrays([2, 5, 8]),
       m=float_arrays([2, 1, 1, 5], -10.0, 0.0))
def test_attention_pattern_becomes_3d_attention(mask, scale_op, nan_guard, q, k, v, m):
    original, optimized, fused = attention(mask, scale_op, nan_guard)
    # A [B, 1, 1, S] mask is expanded over the query length (onnxruntime's Attention wants it so).
    assert ops(optimized) == {"Attention": 1} | ({"Expand": 1} if mask else {})
    node = next(n for n in optimized.graph.node if n.op_type == "Attention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["q_num_heads"] == attrs["kv_num_heads"] == 2
    assert math.isclose(attrs["scale"], 0.5, rel_tol=1e-6)
    feeds = {"q": q, "k": k, "v": v, **({"mask": m} if mask else {})}
    assert_same(original, fused, feeds)


# ---- HardSwish / HardSigmoid / Conv+BN ---------------------------------------------------------
def _hard_model(swish: bool):
    nodes = [helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Clip", ["a", "zero", "six"], ["c"])]
    if swish:
        nodes += [helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Div", ["m", "six"], ["y"])]
    else:
        nodes.append(helper.make_node("Div", ["c", "six"], ["y"]))
    inits = {"three": np.float32(3), "zero": np.float32(0), "six": np.float32(6)}
    return make_model(nodes, [("x", [4, 8])], [("y", [4, 8])], inits)


@functools.cache
def hard(swish):
    return _pair(_hard_model(swish))


@pytest.mark.parametrize("swish,op", [(True, "HardSwish"), (False, "HardSigmoid")])
@given(x=float_arrays([4, 8], -8.0, 8.0))
def test_hard_decompositions_become_ops(swish, op, x):
    original, optimized, fused = hard(swish)
    assert ops(optimized) == {op: 1}
    assert_same(original, fused, {"x": x})


# ---- SkipLayerNormalization / BiasGelu -------------------------------------------------------------
def _skip_ln_model(sum_used: bool, with_bias: bool = True):
    ln_inputs = ["s", "gamma"] + (["beta"] if with_bias else [])
    nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ln_inputs, ["y"], axis=-1, epsilon=1e-5)]
    outputs = [("y", [2, 3, 8])]
    if sum_used:
        nodes.append(helper.make_node("Add", ["s", "x"], ["z"]))
        outputs.append(("z", [2, 3, 8]))
    inits = {"gamma": (1 + 0.1 * RNG.standard_normal(8)).astype(np.float32),
             "beta": (0.1 * RNG.standard_normal(8)).astype(np.float32)}
    if not with_bias:
        del inits["beta"]
    return make_model(nodes, [("x", [2, 3, 8]), ("skip", [2, 3, 8])], outputs, inits)


@functools.cache
def skip_ln(sum_used, with_bias):
    return _pair(_skip_ln_model(sum_used, with_bias))


@pytest.mark.parametrize("sum_used,with_bias", [(False, True), (True, True), (False, False)])
@given(x=float_arrays([2, 3, 8]), skip=float_arrays([2, 3, 8]))
def test_add_layer_norm_becomes_skip_layer_normalization(sum_used, with_bias, x, skip):
    original, optimized, fused = skip_ln(sum_used, with_bias)
    expected = {"ai.ephost::SkipLayerNormalization": 1} | ({"Add": 1} if sum_used else {})
    assert ops(optimized) == expected
    assert_same(original, fused, {"x": x, "skip": skip})


def test_broadcasting_add_is_not_a_skip_connection():
    nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma"], ["y"], axis=-1)]
    model = make_model(nodes, [("x", [2, 3, 8]), ("skip", [1, 3, 8])], [("y", [2, 3, 8])],
                       {"gamma": np.ones(8, np.float32)})
    assert ops(optimize(model, EXTENDED).model) == {"Add": 1, "LayerNormalization": 1}


def _bias_gelu_model():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Gelu", ["a"], ["y"])]
    return make_model(nodes, [("x", [3, 8])], [("y", [3, 8])], {"b": RNG.standard_normal(8).astype(np.float32)},
                      opset=20)


@functools.cache
def bias_gelu():
    return _pair(_bias_gelu_model())


@given(x=float_arrays([3, 8]))
def test_add_gelu_becomes_bias_gelu(x):
    original, optimized, fused = bias_gelu()
    assert ops(optimized) == {"ai.ephost::BiasGelu": 1}
    assert_same(original, fused, {"x": x})


# ---- rotary --------------------------------------------------------------------------------------
def _rotary_model(b=1, h=2, s=4, d=8):
    half = d // 2
    nodes = [helper.make_node("Concat", ["freqs", "freqs"], ["f2"], axis=-1),
             helper.make_node("Cos", ["f2"], ["cos"]), helper.make_node("Sin", ["f2"], ["sin"]),
             helper.make_node("Unsqueeze", ["cos", "one"], ["cos4"]),
             helper.make_node("Unsqueeze", ["sin", "one"], ["sin4"]),
             helper.make_node("Slice", ["x", "zero", "half", "three", "one"], ["x1"]),
             helper.make_node("Slice", ["x", "half", "big", "three", "one"], ["x2"]),
             helper.make_node("Neg", ["x2"], ["nx2"]), helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["x", "cos4"], ["a"]), helper.make_node("Mul", ["rot", "sin4"], ["c"]),
             helper.make_node("Add", ["a", "c"], ["y"])]
    inits = {"one": np.array([1], np.int64), "zero": np.array([0], np.int64), "half": np.array([half], np.int64),
             "three": np.array([3], np.int64), "big": np.array([2**62], np.int64)}
    return make_model(nodes, [("x", [b, h, s, d]), ("freqs", [b, s, half])], [("y", [b, h, s, d])], inits, opset=18)


@functools.cache
def rotary():
    return _pair(_rotary_model())


@given(x=float_arrays([1, 2, 4, 8]), freqs=float_arrays([1, 4, 4], -3.0, 3.0))
def test_rotate_half_pattern_becomes_rotary_embedding(x, freqs):
    original, optimized, fused = rotary()
    assert ops(optimized)["RotaryEmbedding"] == 1
    assert "Neg" not in ops(optimized)
    assert_same(original, fused, {"x": x, "freqs": freqs})


def _flattened_gemm_model(bias: bool):
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["f"]),
             helper.make_node("Gemm", ["f", "w"] + (["b"] if bias else []), ["g"]),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    inits = {"flat": np.array([-1, 5], np.int64), "back": np.array([2, 3, 6], np.int64),
             "w": RNG.standard_normal((5, 6)).astype(np.float32), "b": RNG.standard_normal(6).astype(np.float32)}
    if not bias:
        del inits["b"]
    return make_model(nodes, [("x", [2, 3, 5])], [("y", [2, 3, 6])], inits)


@functools.cache
def flattened_gemm(bias):
    return _pair(_flattened_gemm_model(bias))


@pytest.mark.parametrize("bias,expected", [(True, "ai.ephost::FusedMatMul"), (False, "MatMul")])
@given(x=float_arrays([2, 3, 5]))
def test_reshape_gemm_reshape_becomes_an_nd_matmul(bias, expected, x):
    """GPT-2's Conv1D: the flatten / restore Reshapes around a 2-D Gemm go."""
    original, optimized, fused = flattened_gemm(bias)
    assert ops(optimized) == {expected: 1}
    assert_same(original, fused, {"x": x})


# ---- grouped K/V heads -------------------------------------------------------------------------------
def _repeat_kv_model(axis: int) -> tuple:
    """Attention (opset 23) of Q with 4 heads over K and V of 2 heads repeated to 4 (Llama's repeat_kv
    when `axis` is 2: query head h reads kv head h // 2; axis 1 tiles them instead: h % 2), with a
    float mask."""
    target = [1, 2, 2, 5, 8]
    nodes = []
    for name in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [name, "axes"], [f"{name}5"]),
                  helper.make_node("Expand", [f"{name}5", "target"], [f"{name}x"]),
                  helper.make_node("Reshape", [f"{name}x", "heads"], [f"{name}4"])]
    nodes.append(helper.make_node("Attention", ["q", "k4", "v4", "m"], ["y"], scale=0.3))
    inputs = [("q", [1, 4, 5, 8]), ("k", [1, 2, 5, 8]), ("v", [1, 2, 5, 8]), ("m", [1, 1, 5, 5])]
    consts = {"axes": np.array([axis], np.int64), "target": np.array(target, np.int64),
              "heads": np.array([1, 4, 5, 8], np.int64)}
    return make_model(nodes, inputs, [("y", [1, 4, 5, 8])], consts, opset=23), inputs


@pytest.mark.parametrize("axis, folded", [(2, True), (-3, True), (1, False)])
def test_repeated_kv_heads_are_left_to_attention(axis, folded):
    model, inputs = _repeat_kv_model(axis)
    optimized = optimize(model, EXTENDED).model
    assert ("Expand" not in ops(optimized)) == folded
    if folded:
        (node,) = [n for n in optimized.graph.node if n.op_type == "Attention"]
        assert list(node.input[1:3]) == ["k", "v"]
    rng = np.random.default_rng(axis + 5)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs}
    assert_same(References(model), References(optimized), feeds)


# ---- rotary between the head split and a 4-D Attention (Llama) -----------------------------------------
def _rotary_attention_model(position_ids: bool, v_split: bool = True):
    """Q (1, 5, 32) in 4 heads and K, V (1, 5, 16) in 2, each split by Reshape + Transpose; Q and K rotated
    by a 4-D RotaryEmbedding; a 4-D grouped Attention with a float mask; its heads merged back."""
    b, s, d = 1, 5, 8
    nodes, inits = [], {"cos": np.cos(RNG.standard_normal((b, s, d // 2))).astype(np.float32),
                        "sin": np.sin(RNG.standard_normal((b, s, d // 2))).astype(np.float32),
                        "merge": np.array([b, s, 32], np.int64)}
    if position_ids:
        inits["cos"], inits["sin"] = (np.cos(RNG.standard_normal((9, d // 2))).astype(np.float32),
                                      np.sin(RNG.standard_normal((9, d // 2))).astype(np.float32))
        inits["pos"] = np.array([[3, 1, 4, 1, 5]], np.int64)
    for name, heads in (("q", 4), ("k", 2), ("v", 2)):
        inits[f"{name}_split"] = np.array([b, s, heads, d], np.int64)
        if name != "v" or v_split:
            nodes += [helper.make_node("Reshape", [name, f"{name}_split"], [f"{name}4"]),
                      helper.make_node("Transpose", [f"{name}4"], [f"{name}t"], perm=[0, 2, 1, 3])]
        if name != "v":
            rope_in = [f"{name}t", "cos", "sin"] + (["pos"] if position_ids else [])
            nodes.append(helper.make_node("RotaryEmbedding", rope_in, [f"{name}r"]))
    v4 = "vt" if v_split else "v"
    nodes += [helper.make_node("Attention", ["qr", "kr", v4, "m"], ["a"], scale=0.3),
              helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["at", "merge"], ["y"])]
    inputs = [("q", [b, s, 32]), ("k", [b, s, 16]), ("v", [b, s, 16] if v_split else [b, 2, s, d]),
              ("m", [b, 1, s, s])]
    return make_model(nodes, inputs, [("y", [b, s, 32])], inits, opset=23), inputs


@pytest.mark.parametrize("position_ids", [False, True])
@pytest.mark.parametrize("v_split", [True, False])
def test_rotary_moves_behind_the_head_split_for_3d_attention(position_ids, v_split):
    model, inputs = _rotary_attention_model(position_ids, v_split)
    optimized = optimize(model, EXTENDED).model
    got = ops(optimized)
    if v_split:  # every split and merge goes: the 3-D forms take them
        assert got == {"RotaryEmbedding": 2, "Attention": 1}, got
        attention = next(n for n in optimized.graph.node if n.op_type == "Attention")
        attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
        assert (attrs["q_num_heads"], attrs["kv_num_heads"]) == (4, 2)
        heads = sorted(helper.get_attribute_value(a) for n in optimized.graph.node if n.op_type == "RotaryEmbedding"
                       for a in n.attribute if a.name == "num_heads")
        assert heads == [2, 4]
    else:  # V is 4-D already: the rotations go 3-D, Attention keeps its 4-D inputs
        assert got["Attention"] == 1 and got["Transpose"] >= 2, got
    rng = np.random.default_rng(11)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs}
    assert_same(References(model), References(optimized), feeds)
