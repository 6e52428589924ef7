"""Every op the CPU EP serves in float32, in float16 and bfloat16 (generated from the op registry).

For each default-domain op of `host.cpu_ep.CPU_KERNELS` whose schema admits float32, the first node case
of onnx's backend suite with float32 inputs is converted to the half type (host.precision, no op kept in
float32) and run on ephost with the case's inputs rounded to that type. The reference is onnxruntime CPU
on the same half model where it has the kernel, else onnx's ReferenceEvaluator on the float32 model fed
the same rounded inputs; outputs must have exactly the declared element type and lie within 2e-2 of the
reference (relative to its largest magnitude). ephost's own fused ops (ai.ephost) have cases here with
NumPy references; com.microsoft's quantized ops are listed with their reason.
"""

from __future__ import annotations

import warnings
from functools import cache

import numpy as np
import onnx
import onnxruntime
import pytest
import scipy.special
from onnx import TensorProto, helper
from onnx.backend.test.loader import load_model_tests
from onnx.reference import ReferenceEvaluator

import host
from abi.dtypes import BFLOAT16, FLOAT16, to_numpy
from host.cpu_ep import CPU_KERNELS
from host.errors import ModelError
from host.precision import convert_precision

PRECISIONS = {"fp16": FLOAT16, "bf16": BFLOAT16}
TOLERANCE = 2e-2
# Ops whose float32 cases cannot say anything about half precision, with the reason.
NOT_APPLICABLE = {
    "Cast": "its cases convert between fixed types (float8, string...); Cast from and to half types is run by "
            "every converted model (test_half_models.py)",
    "CastLike": "as Cast",
    "BitCast": "reinterprets bits: a float32 case says nothing about half types (the converter keeps it float32)",
    **{op: "carries values without computing on them: test_containers_carry_half_values" for op in (
        "ConcatFromSequence", "If", "Loop", "Optional", "OptionalHasElement", "Scan", "SequenceAt",
        "SequenceConstruct", "SequenceInsert", "SequenceMap", "SplitToSequence")},
    **{f"com.microsoft:{op}": "quantized: its float inputs are quantization scales, float32 in onnxruntime's "
                              "contrib schemas and in every quantizer's output" for op in (
        "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QLinearAdd", "QLinearAveragePool", "QLinearConcat",
        "QLinearGlobalAveragePool", "QLinearLeakyRelu", "QLinearMul", "QLinearSigmoid", "QLinearSoftmax")},
}
_R = np.random.default_rng(0)
# Ops whose backend cases have no float32 one-node case: a small case of ours (node, float32 inputs).
EXTRA_CASES = {
    "CumSum": (helper.make_node("CumSum", ["x", "axis"], ["y"]),
               {"x": _R.standard_normal((3, 4)).astype(np.float32), "axis": np.array(1, np.int64)}),
    "CumProd": (helper.make_node("CumProd", ["x", "axis"], ["y"]),
                {"x": _R.uniform(0.5, 1.5, (3, 4)).astype(np.float32), "axis": np.array(0, np.int64)}),
    "Einsum": (helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik"),
               {"a": _R.standard_normal((3, 4)).astype(np.float32), "b": _R.standard_normal((4, 2)).astype(np.float32)}),
    "Equal": (helper.make_node("Equal", ["a", "b"], ["y"]),
              {"a": np.array([1.0, 2.5, -3.0], np.float32), "b": np.array([1.0, 2.0, -3.0], np.float32)}),
    "GlobalLpPool": (helper.make_node("GlobalLpPool", ["x"], ["y"], p=2),
                     {"x": _R.standard_normal((1, 2, 3, 3)).astype(np.float32)}),
    "NonZero": (helper.make_node("NonZero", ["x"], ["y"]), {"x": np.array([[0.0, 1.5], [-2.0, 0.0]], np.float32)}),
    "Trilu": (helper.make_node("Trilu", ["x"], ["y"], upper=0), {"x": _R.standard_normal((3, 3)).astype(np.float32)}),
    "ai.ephost:FusedMatMul": (
        helper.make_node("FusedMatMul", ["a", "b", "bias"], ["y"], domain="ai.ephost", activation="Relu"),
        {"a": _R.standard_normal((2, 3, 8)).astype(np.float32), "b": _R.standard_normal((8, 5)).astype(np.float32),
         "bias": _R.standard_normal(5).astype(np.float32)}),
    "ai.ephost:BiasGelu": (
        helper.make_node("BiasGelu", ["x", "bias"], ["y"], domain="ai.ephost"),
        {"x": _R.standard_normal((2, 3, 8)).astype(np.float32), "bias": _R.standard_normal(8).astype(np.float32)}),
    "ai.ephost:SkipLayerNormalization": (
        helper.make_node("SkipLayerNormalization", ["x", "skip", "scale", "bias"], ["y"], domain="ai.ephost",
                         epsilon=1e-5),
        {"x": _R.standard_normal((2, 3, 8)).astype(np.float32), "skip": _R.standard_normal((2, 3, 8)).astype(np.float32),
         "scale": _R.uniform(0.5, 1.5, 8).astype(np.float32), "bias": _R.standard_normal(8).astype(np.float32)}),
    "com.microsoft:MatMulNBits": (
        helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft", K=8, N=4, bits=4,
                         block_size=16),
        {"a": _R.standard_normal((3, 8)).astype(np.float32), "b": _R.integers(0, 256, (4, 1, 8)).astype(np.uint8),
         "scales": _R.uniform(0.05, 0.2, 4).astype(np.float32)}),
}
# The output shapes of the cases whose op onnx cannot infer (other domains).
_EXTRA_SHAPES = {"ai.ephost:FusedMatMul": [2, 3, 5], "ai.ephost:BiasGelu": [2, 3, 8],
                 "ai.ephost:SkipLayerNormalization": [2, 3, 8], "com.microsoft:MatMulNBits": [3, 4]}


def _layer_norm(v, scale, bias, eps=1e-5):
    v = v.astype(np.float64)
    mean = v.mean(-1, keepdims=True)
    return (v - mean) / np.sqrt(((v - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def _float_ops() -> list[str]:
    """Default-domain ops with a CPU kernel whose schema admits tensor(float), and the ops of the other
    domains as "domain:op" (all of them take float tensors)."""
    ops = []
    for domain, op in sorted(CPU_KERNELS):
        if domain == "ai.onnx.ml":
            continue  # float32-only kernels: the converters keep them in float32 (their block lists)
        if domain != "":
            ops.append(f"{domain}:{op}")
            continue
        try:
            schema = onnx.defs.get_schema(op, onnx.defs.onnx_opset_version(), "")
        except onnx.defs.SchemaError:
            continue
        if any("tensor(float)" in c.allowed_type_strs for c in schema.type_constraints):
            ops.append(op)
    return ops


def _single_float_node(tc) -> str | None:
    """The op of a one-node case whose inputs and outputs include float32 tensors and no subgraph."""
    g = tc.model.graph
    if len(g.node) != 1 or any(a.g.node or a.graphs for a in g.node[0].attribute):
        return None
    types = [vi.type.tensor_type.elem_type for vi in (*g.input, *g.output) if vi.type.HasField("tensor_type")]
    if onnx.TensorProto.FLOAT not in types or len(types) != len(g.input) + len(g.output):
        return None
    return g.node[0].op_type


# Where neither onnxruntime nor the ReferenceEvaluator has the op: NumPy, on the float32 feeds.
NUMPY_REFERENCE = {
    "GlobalLpPool": lambda x: [np.sqrt((x.astype(np.float64) ** 2).sum(axis=(2, 3), keepdims=True))],
    "FusedMatMul": lambda a, b, bias: [np.maximum(a.astype(np.float64) @ b + bias, 0)],
    "BiasGelu": lambda x, bias: [0.5 * (x + bias) * (1 + scipy.special.erf((x.astype(np.float64) + bias) / np.sqrt(2)))],
    "SkipLayerNormalization": lambda x, skip, scale, bias: [_layer_norm(x + skip, scale, bias)],
}


def _extra_case(op: str) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    node, feeds = EXTRA_CASES[op]
    if op in _EXTRA_SHAPES:  # another domain: no schema, no inference
        inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                  for k, v in feeds.items()]
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, _EXTRA_SHAPES[op])
        graph = helper.make_graph([node], f"test_{node.op_type.lower()}_half", inputs, [out])
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid(node.domain, 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=10), list(feeds.values())
    opset = onnx.defs.get_schema(op, onnx.defs.onnx_opset_version(), "").since_version
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    out_type = {"Equal": onnx.TensorProto.BOOL, "NonZero": onnx.TensorProto.INT64}.get(op, onnx.TensorProto.FLOAT)
    graph = helper.make_graph([node], f"test_{op.lower()}_half", inputs, [helper.make_tensor_value_info("y", out_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)  # the output's shape
    out = model.graph.output[0].type.tensor_type
    if not out.HasField("shape"):  # ops whose inference keeps no shape (CumProd): the input's
        out.shape.CopyFrom(model.graph.input[0].type.tensor_type.shape)
    return model, list(feeds.values())


def _retyped(model: onnx.ModelProto, half: int) -> onnx.ModelProto:
    """The one-node model with its float32 inputs and outputs declared `half`, nothing else changed: for
    ops the converter keeps in float32 (their schema at the case's opset lacks the half type), so that
    ephost's kernel still runs on half tensors (its loader does not hold models to the schema's types)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in (*out.graph.input, *out.graph.output):
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = half
    return out


@cache
def _cases() -> dict[str, object]:
    """op -> its first float32 backend node case (by name), for the registry's float ops."""
    wanted = set(_float_ops())
    with warnings.catch_warnings():  # the cases' generators overflow on purpose
        warnings.simplefilter("ignore")
        all_cases = sorted(load_model_tests(kind="node"), key=lambda tc: tc.name)
    out = {}
    for tc in all_cases:
        op = _single_float_node(tc)
        if op in wanted and op not in out and "expanded" not in tc.name:
            out[op] = tc
    return out


def _rounded(arr, half: int):
    """(the half-precision feed, the same values in float32 for the float32 reference)."""
    arr = np.asarray(arr)
    if arr.dtype != np.float32:
        return arr, arr
    h = arr.astype(to_numpy(half))
    return h, h.astype(np.float32)


def _ort(model: onnx.ModelProto, feeds: dict):
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # a missing half kernel is expected here, not an error to print
    sess = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _reference(model16: onnx.ModelProto, feeds16: dict, model32: onnx.ModelProto, feeds32: dict):
    """onnxruntime on the half model where it has the kernel, else onnxruntime on the float32 model fed
    the same rounded values, else onnx's ReferenceEvaluator on that."""
    op = model32.graph.node[0].op_type
    if op in NUMPY_REFERENCE and model32.graph.node[0].domain == "ai.ephost":
        return "numpy", NUMPY_REFERENCE[op](*feeds32.values())
    for who, model, feeds in (("onnxruntime", model16, feeds16), ("onnxruntime float32", model32, feeds32)):
        try:
            return who, _ort(model, feeds)
        except Exception:  # noqa: BLE001, S112 - NOT_IMPLEMENTED, type errors alike: no kernel there
            continue
    if op in NUMPY_REFERENCE:
        return "numpy", NUMPY_REFERENCE[op](*feeds32.values())
    return "reference", ReferenceEvaluator(model32).run(None, feeds32)


def _check_close(name: str, got: np.ndarray, want: np.ndarray, who: str) -> None:
    assert got.shape == np.shape(want), f"{name}: shape {got.shape}, {who} {np.shape(want)}"
    want = np.asarray(want)
    if want.dtype.kind not in "fV" and got.dtype.kind not in "fV":
        np.testing.assert_array_equal(got, want, err_msg=f"{name} vs {who}")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{name}: NaNs differ from {who}"
    finite = np.isfinite(w)
    assert np.array_equal(g[~finite], w[~finite]), f"{name}: infinities differ from {who}"
    if finite.any():
        scale = max(float(np.abs(w[finite]).max()), 1e-3)
        err = float(np.abs(g[finite] - w[finite]).max())
        assert err <= TOLERANCE * scale, f"{name}: max |ephost - {who}| = {err:.3g} > {TOLERANCE} x {scale:.3g}"


OPS = _float_ops()


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("op", OPS)
def test_op_in_half_precision(op, precision):
    if op in NOT_APPLICABLE:
        pytest.skip(NOT_APPLICABLE[op])
    half = PRECISIONS[precision]
    tc = _cases().get(op)
    model32, inputs = (tc.model, tc.data_sets[0][0]) if tc is not None else _extra_case(op)
    try:
        model16 = convert_precision(model32, precision, op_block_list=())
    except ModelError:  # onnx cannot infer the converted model (MeanVarianceNormalization's function body)
        model16 = _retyped(model32, half)
    if any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT for n in model16.graph.node):
        model16 = _retyped(model32, half)  # kept float32 by the converter: retype the node's io only
    names = [vi.name for vi in model32.graph.input]
    pairs = {n: _rounded(a, half) for n, a in zip(names, inputs)}
    feeds16 = {n: p[0] for n, p in pairs.items()}
    feeds32 = {n: p[1] for n, p in pairs.items()}
    session = host.InferenceSession(model16)
    got = session.run(None, feeds16)
    who, want = _reference(model16, feeds16, model32, feeds32)
    for meta, g, w in zip(session.get_outputs(), got, want):
        declared = to_numpy(model16.graph.output[[o.name for o in model16.graph.output].index(meta.name)]
                            .type.tensor_type.elem_type)
        where = f"{model32.graph.name} output '{meta.name}'"
        assert g.dtype == declared, f"{where}: dtype {g.dtype}, declared {declared}"
        _check_close(where, g, w, who)


def test_every_float_op_has_a_case():
    """Every float op of the registry is covered: a backend case, a case of ours, or a stated reason."""
    missing = sorted(set(OPS) - set(_cases()) - set(EXTRA_CASES) - set(NOT_APPLICABLE))
    assert missing == [], f"float ops of the CPU EP with no half-precision case: {missing}"


def test_compiled_float16_conversions_match_numpy():
    """half.widen / half.narrow (the compiled F16C path from 512 elements) give NumPy's bits: rounding
    ties to even, subnormals, overflow to infinity, NaN."""
    from host.cpu_ep import half, native

    if native.LIB is None:
        pytest.skip(f"the CPU EP's compiled kernels are not loaded ({native.LOAD_ERROR})")
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65520.0, 70000.0, -1e6, 6e-8, 3e-8, 1e-7, -5.9e-8,
               1 + 2.0**-11, 1 + 3 * 2.0**-11, 2049.0, 2051.0]
    x = np.concatenate([np.array(special, np.float32),
                        np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 1000]).reshape(-1, 17 + 1000)
    with np.errstate(over="ignore"):
        want16 = x.astype(np.float16)
    got16 = half.narrow(x, np.dtype(np.float16))
    assert got16.dtype == np.float16 and np.array_equal(np.isnan(got16), np.isnan(want16))
    finite = ~np.isnan(want16)
    np.testing.assert_array_equal(got16.view(np.uint16)[finite], want16.view(np.uint16)[finite])
    wide = half.widen(want16)
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.view(np.uint32)[finite], want16.astype(np.float32).view(np.uint32)[finite])
