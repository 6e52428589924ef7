"""Half-precision models as users make them, on the CPU EP: converted with onnxconverter-common and with
`ephost convert`, run next to torch's float32 outputs and onnxruntime; declared output types kept;
the optimizer's fusions in half precision; bfloat16 through the loader, feeds, IOBinding and OrtValue."""

from __future__ import annotations

import collections
import warnings

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from abi.dtypes import to_numpy, type_name
from host.cli import app as cli
from host.errors import InvalidArgument, ModelError
from host.precision import convert_precision
from tests.models import available_models, load

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = 2e-2  # max |ephost - reference| / max |reference|, the accuracy goal
MODELS = available_models()
HALF = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _feeds(model: onnx.ModelProto, feeds: dict) -> dict:
    """The fixture's feeds in the types the (converted) model declares."""
    types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    return {k: v.astype(to_numpy(types[k])) for k, v in feeds.items()}


def _ort(model: onnx.ModelProto, feeds: dict):
    """onnxruntime CPU's outputs, or None where it cannot run the model (no bfloat16 kernels; the
    Cast(to=FLOAT) that onnxconverter-common leaves behind with a float16 declaration)."""
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    try:
        sess = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    except Exception:  # noqa: BLE001 - refusals at load (type errors, NOT_IMPLEMENTED) alike
        return None


def _check_model(name: str, model: onnx.ModelProto) -> None:
    """Runs `model` (a conversion of fixture `name`): every output of exactly its declared type, and
    within TOLERANCE of torch's float32 output; for float16 MobileNetV3, whose logits (~2e-7) lie below
    float16's normal range (any float16 run differs from float32 by ~15%), within two subnormal steps
    of onnxruntime's."""
    _, feeds, expected = load(name)
    feeds = _feeds(model, feeds)
    session = host.InferenceSession(model)
    got = session.run(None, feeds)
    declared = [o.type.tensor_type.elem_type for o in model.graph.output]
    assert [g.dtype for g in got] == [to_numpy(t) for t in declared]
    assert [o.type for o in session.get_outputs()] == [type_name(t) for t in declared]
    underflows = name.startswith("mobilenetv3") and TensorProto.FLOAT16 in {
        vi.type.tensor_type.elem_type for vi in model.graph.value_info}
    if underflows:
        want = _ort(model, feeds)
        assert want is not None, "onnxruntime runs float16 MobileNetV3"
    else:
        want = [expected[o.name] for o in model.graph.output]
    for g, w in zip(got, want):
        if underflows:  # values a few float16 subnormal steps (2**-24) large: off by at most two steps
            assert np.abs(g.astype(np.float64) - np.asarray(w, np.float64)).max() <= 2 * 2.0**-24
        else:
            assert _relative_error(g, w) <= TOLERANCE


def _onnxconverter_float16():
    # In the [test] extra; machines with the base dependencies only (the GPU runner) skip these.
    return pytest.importorskip("onnxconverter_common.float16",
                               reason="onnxconverter-common (the [test] extra) is not installed")


# -- the output-type contract (the bug: float32 returned where float16 is declared) --------------------


def test_converted_llama_returns_the_declared_float16():
    """onnxconverter-common declares its Casts to FLOAT as float16 (onnxruntime refuses that model);
    ephost returned the Cast's float32 through to the output declared float16."""
    float16 = _onnxconverter_float16()
    path, feeds, expected = load("llama_torchscript")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter warns about values it truncates
        model = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=False)
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    session = host.InferenceSession(model)
    (out,) = session.run(None, _feeds(model, feeds))
    assert session.get_outputs()[0].type == "tensor(float16)"
    assert out.dtype == np.float16
    assert _relative_error(out, expected["last_hidden_state"]) <= TOLERANCE


@pytest.mark.parametrize("keep_io_types", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_onnxconverter_common_models(name, keep_io_types):
    float16 = _onnxconverter_float16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = float16.convert_float_to_float16(onnx.load(str(load(name)[0])), keep_io_types=keep_io_types)
    _check_model(name, model)


@pytest.mark.parametrize("precision", sorted(HALF))
@pytest.mark.parametrize("name", MODELS)
def test_ephost_converted_models(name, precision):
    keep_io_types = name.endswith("torchscript")  # both settings, over the fixtures
    model = convert_precision(onnx.load(str(load(name)[0])), precision, keep_io_types=keep_io_types)
    assert not keep_io_types or model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    if precision == "fp16" and not name.startswith("mobilenetv3"):
        # onnxruntime runs these float16 models: an independent second opinion on the same model.
        _, feeds, _ = load(name)
        ours = host.InferenceSession(model).run(None, _feeds(model, feeds))
        theirs = _ort(model, _feeds(model, feeds))
        assert theirs is not None
        assert _relative_error(ours[0], theirs[0]) <= TOLERANCE
    _check_model(name, model)


# -- the optimizer in half precision --------------------------------------------------------------------


def _optimized_ops(model: onnx.ModelProto, tmp_path, tag: str) -> collections.Counter:
    options = host.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{tag}.onnx")
    host.InferenceSession(model, options)
    return collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


FUSED = ("Attention", "Gelu", "RMSNormalization", "SkipLayerNormalization", "RotaryEmbedding", "FusedMatMul",
         "LayerNormalization", "BiasGelu")


@pytest.mark.parametrize("precision", sorted(HALF))
@pytest.mark.parametrize("name", ["bert_dynamo", "llama_dynamo"])
def test_fusions_match_half_models(name, precision, tmp_path):
    """The fusions that fire on the float32 model fire on its half conversion too (Gelu's constants are
    rounded to the half type; RMSNorm has no Cast to float32 around its statistics there), and the
    optimized half model computes what the unoptimized one does."""
    model32 = onnx.load(str(load(name)[0]))
    model = convert_precision(model32, precision)
    want = _optimized_ops(model32, tmp_path, "fp32")
    got = _optimized_ops(model, tmp_path, precision)
    assert sum(want[op] for op in FUSED) > 0
    del got["Cast"], want["Cast"]
    assert got == want  # the same fused graph: no decomposition left unfused in half precision
    _, feeds, _ = load(name)
    off = host.SessionOptions()
    off.graph_optimization_level = host.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = host.InferenceSession(model, off).run(None, _feeds(model, feeds))[0]
    fused = host.InferenceSession(model).run(None, _feeds(model, feeds))[0]
    assert fused.dtype == plain.dtype == to_numpy(HALF[precision])
    assert _relative_error(fused, plain) <= TOLERANCE


def test_fusions_across_the_converters_casts(tmp_path):
    """onnxconverter-common's Llama keeps `Cast(to=FLOAT)` nodes declared float16: the optimizer follows
    the declarations (host/optimizer/declared.py), so RMSNorm, rotary and attention fuse as in float32."""
    float16 = _onnxconverter_float16()
    path, feeds, expected = load("llama_torchscript")
    model32 = onnx.load(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = float16.convert_float_to_float16(model32, keep_io_types=False)
    want = _optimized_ops(model32, tmp_path, "fp32")
    got = _optimized_ops(model, tmp_path, "fp16")
    assert want["RMSNormalization"] > 0 and want["Attention"] > 0
    del got["Cast"], want["Cast"]
    assert got == want
    (out,) = host.InferenceSession(model).run(None, _feeds(model, feeds))
    assert out.dtype == np.float16
    assert _relative_error(out, expected["last_hidden_state"]) <= TOLERANCE


@pytest.fixture(scope="module")
def torch_half_block(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="exporting from model.half() needs torch (not a test dependency)")
    from tests.models import export_half

    return export_half.export(torch, tmp_path_factory.mktemp("half_block"))


@pytest.mark.parametrize("precision", sorted(HALF))
def test_torch_half_exports(torch_half_block, precision, tmp_path):
    """Exports from `model.half()` / `model.to(torch.bfloat16)`: bfloat16 initializers load, the output
    has the declared type, the fusions are the float32 export's (RMSNorm across the exporter's Casts to
    float32, attention, GELU), and the output is within TOLERANCE of torch's float32 output."""
    data = np.load(torch_half_block / "block.npz")
    model = onnx.load(str(torch_half_block / f"block_{precision}.onnx"))
    dtype = to_numpy(HALF[precision])
    assert {t.data_type for t in model.graph.initializer} >= {HALF[precision]}
    (out,) = host.InferenceSession(model).run(None, {"x": data["x"].astype(dtype)})
    assert out.dtype == dtype
    assert _relative_error(out, data["y"]) <= TOLERANCE
    want = _optimized_ops(onnx.load(str(torch_half_block / "block_fp32.onnx")), tmp_path, "fp32")
    got = _optimized_ops(model, tmp_path, precision)
    assert want["RMSNormalization"] == want["Attention"] == 1
    assert got == want


# -- bfloat16 through the stack ----------------------------------------------------------------------------


def _bf16_model() -> onnx.ModelProto:
    """y = MatMul(x, w) + b in bfloat16, its weights bfloat16 initializers (as torch's bf16 exports)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(BF16), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(BF16), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])]
    graph = helper.make_graph(nodes, "bf16", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _bf16_reference(model, x):
    w, b = (numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer)
    return (x.astype(np.float32) @ w + b).astype(BF16)


def test_bfloat16_initializers_load_and_run():
    model = _bf16_model()
    session = host.InferenceSession(model)
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(BF16)
    (y,) = session.run(None, {"x": x})
    assert y.dtype == BF16 and session.get_outputs()[0].type == "tensor(bfloat16)"
    assert _relative_error(y, _bf16_reference(model, x)) <= 1e-2


def test_bfloat16_feed_of_another_type_is_refused():
    session = host.InferenceSession(_bf16_model())
    with pytest.raises(InvalidArgument, match=r"^input 'x': expected dtype bfloat16 \(tensor\(bfloat16\)\), "
                                              r"got float32 \(tensor\(float\)\)$"):
        session.run(None, {"x": np.zeros((2, 4), np.float32)})


def test_bfloat16_iobinding_and_ortvalue():
    model = _bf16_model()
    session = host.InferenceSession(model)
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(BF16)
    value = host.OrtValue.ortvalue_from_numpy(x)
    assert (value.data_type(), value.element_type()) == ("tensor(bfloat16)", TensorProto.BFLOAT16)
    out = host.OrtValue.ortvalue_from_shape_and_type([2, 3], TensorProto.BFLOAT16)
    assert out.numpy().dtype == BF16
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_ortvalue_output("y", out)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(out.numpy().astype(np.float32), _bf16_reference(model, x).astype(np.float32))


def test_containers_carry_half_values():
    """Sequence ops and If carry bfloat16 and float16 tensors as they are (they compute nothing)."""
    for elem in (TensorProto.BFLOAT16, TensorProto.FLOAT16):
        then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                                 [helper.make_tensor_value_info("t", elem, [4])])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                                  [helper.make_tensor_value_info("e", elem, [4])])
        nodes = [helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
                 helper.make_node("SequenceAt", ["seq", "one"], ["second"]),
                 helper.make_node("SequenceInsert", ["seq", "second"], ["seq2"]),
                 helper.make_node("ConcatFromSequence", ["seq2"], ["cat"], axis=0),
                 helper.make_node("If", ["flag"], ["branch"], then_branch=then, else_branch=other)]
        graph = helper.make_graph(
            nodes, "containers",
            [helper.make_tensor_value_info("x", elem, [4]), helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("cat", elem, [5]), helper.make_tensor_value_info("branch", elem, [4])],
            [numpy_helper.from_array(np.array(1, np.int64), "one")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
        x = np.array([1.5, -2.25, 3.0, 0.125], np.float32).astype(to_numpy(elem))
        cat, branch = host.InferenceSession(model).run(None, {"x": x, "flag": np.array(True)})
        assert cat.dtype == branch.dtype == to_numpy(elem)
        np.testing.assert_array_equal(cat.astype(np.float32), np.r_[x, x[1]].astype(np.float32))
        np.testing.assert_array_equal(branch.astype(np.float32), -x.astype(np.float32))


# -- the converter and `ephost convert` ------------------------------------------------------------------


def test_convert_keeps_blocked_ops_in_float32():
    """TopK is on the block list: it runs in float32 between Casts, the rest in the half type."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("TopK", ["r", "k"], ["v", "i"], axis=-1)]
    graph = helper.make_graph(nodes, "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 2]),
                               helper.make_tensor_value_info("i", TensorProto.INT64, [2, 2])],
                              [numpy_helper.from_array(np.array([2], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    converted = convert_precision(model, "bf16")
    casts = [(n.input[0], helper.get_attribute_value(n.attribute[0])) for n in converted.graph.node if n.op_type == "Cast"]
    assert casts == [("r", TensorProto.FLOAT), ("v_fp32", TensorProto.BFLOAT16)]
    x = np.random.default_rng(3).standard_normal((2, 5)).astype(np.float32)
    v, i = host.InferenceSession(converted).run(None, {"x": x.astype(BF16)})
    want = np.sort(np.maximum(x.astype(BF16).astype(np.float32), 0), axis=-1)[:, ::-1][:, :2]
    assert v.dtype == BF16
    np.testing.assert_array_equal(v.astype(np.float32), want)


def _conv_sin_model(opset: int) -> onnx.ModelProto:
    """Conv -> Cos -> GlobalAveragePool at `opset`: none of the three admits bfloat16 before opset 22."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Cos", ["c"], ["s"]),
             helper.make_node("GlobalAveragePool", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "conv_sin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 1])],
                              [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_bf16_convert_raises_the_opset_where_ops_take_bfloat16_only_since_22():
    """At opset 17, Conv/Cos/GlobalAveragePool stay float32 between two Casts; by default the converter
    raises the model to opset 22, where they take bfloat16, and the result still matches float32."""
    model = _conv_sin_model(17)
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    kept = convert_precision(model, "bf16", upgrade_opset=False)
    assert kept.opset_import[0].version == 17
    # the three in float32 between two Casts, passing float32 values between them
    assert [n.op_type for n in kept.graph.node] == ["Cast", "Conv", "Cos", "GlobalAveragePool", "Cast"]
    raised = convert_precision(model, "bf16")
    assert raised.opset_import[0].version == 22
    assert "Cast" not in [n.op_type for n in raised.graph.node]
    types = {v.name: v.type.tensor_type.elem_type for v in [*raised.graph.value_info, *raised.graph.output]}
    assert types["c"] == types["s"] == types["y"] == TensorProto.BFLOAT16
    got = host.InferenceSession(raised).run(None, {"x": x.astype(BF16)})[0]
    assert got.dtype == BF16
    assert _relative_error(got, want[0]) <= TOLERANCE
    # float16 admits the three ops at opset 17 already: nothing to raise
    assert convert_precision(model, "fp16").opset_import[0].version == 17


def test_bf16_convert_keeps_the_opset_when_onnx_cannot_raise_it(monkeypatch):
    from onnx import version_converter

    def refuse(model, target):
        raise RuntimeError("no adapter")
    monkeypatch.setattr(version_converter, "convert_version", refuse)
    with pytest.warns(RuntimeWarning, match=r"^convert: raising the model from opset 17 to 22 \(where "
                                            r"Conv, Cos, GlobalAveragePool admit the half type\) failed \(no adapter\)"):
        converted = convert_precision(_conv_sin_model(17), "bf16")
    assert converted.opset_import[0].version == 17
    assert [n.op_type for n in converted.graph.node].count("Cast") == 2  # around the float32 chain


def test_convert_refuses_bad_precision_and_subgraphs():
    model = onnx.load(str(load("bert_dynamo")[0]))
    with pytest.raises(InvalidArgument, match=r"^precision is 'fp8'; allowed: 'fp16', 'bf16'$"):
        convert_precision(model, "fp8")
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["z"], then_branch=branch, else_branch=branch)], "g",
                              [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])])
    with pytest.raises(ModelError, match=r"^convert: the model has control-flow subgraphs \(If, Loop, Scan\)"):
        convert_precision(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), "fp16")


def test_cli_convert(tmp_path, capsys):
    out = tmp_path / "half" / "vit_bf16.onnx"
    rc = cli.main(["convert", str(load("vit_dynamo")[0]), "-o", str(out), "--precision", "bf16"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: bf16, ")
    assert printed.rstrip().endswith("; opset raised from 18 to 22")  # the patch embedding's Conv
    model = onnx.load(str(out))
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.BFLOAT16
    _check_model("vit_dynamo", model)
    kept = tmp_path / "vit_bf16_18.onnx"
    assert cli.main(["convert", str(load("vit_dynamo")[0]), "-o", str(kept), "--precision", "bf16", "--keep-opset"]) == 0
    assert "opset raised" not in capsys.readouterr().out
    assert onnx.load(str(kept)).opset_import[0].version == 18
    rc = cli.main(["convert", str(tmp_path / "missing.onnx"), "-o", str(out), "--precision", "fp16"])
    assert rc == cli.EXIT_ERROR
    assert "missing.onnx' does not exist" in capsys.readouterr().err


# -- half values carried in float32 between CPU nodes ----------------------------------------------------------


def _chain_model(elem: int) -> onnx.ModelProto:
    """y = (x * a) * b and t = Identity(x * a); a and b half initializers."""
    a = numpy_helper.from_array(np.array([1 / 3], np.float32).astype(to_numpy(elem)), "a")
    b = numpy_helper.from_array(np.array([3.0], np.float32).astype(to_numpy(elem)), "b")
    nodes = [helper.make_node("Mul", ["x", "a"], ["xa"]), helper.make_node("Mul", ["xa", "b"], ["y"]),
             helper.make_node("Identity", ["xa"], ["t"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", elem, [256])],
                              [helper.make_tensor_value_info("y", elem, [256]),
                               helper.make_tensor_value_info("t", elem, [256])], [a, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("precision", sorted(HALF))
def test_inner_half_values_stay_float32(precision, monkeypatch):
    """xa = x * a is read only by CPU nodes that widen it or move it (Identity): it stays float32, so y is
    rounded once, as onnxruntime's CPU EP computes; the graph outputs y and t have their declared type.
    With EPHOST_HALF_ROUNDING=node every value is rounded to its declared type."""
    elem = HALF[precision]
    dtype, f32 = to_numpy(elem), np.float32
    model = _chain_model(elem)
    a, b = (numpy_helper.to_array(t).astype(f32) for t in model.graph.initializer)
    x = np.random.default_rng(5).uniform(-4, 4, 256).astype(dtype)
    off = host.SessionOptions()
    off.graph_optimization_level = host.GraphOptimizationLevel.ORT_DISABLE_ALL  # the nodes as written
    y, t = host.InferenceSession(model, off).run(None, {"x": x})
    assert y.dtype == t.dtype == dtype
    np.testing.assert_array_equal(t.astype(f32), (x.astype(f32) * a).astype(dtype).astype(f32))
    carried = (x.astype(f32) * a * b).astype(dtype).astype(f32)
    np.testing.assert_array_equal(y.astype(f32), carried)
    monkeypatch.setenv("EPHOST_HALF_ROUNDING", "node")
    y_strict, _ = host.InferenceSession(model, off).run(None, {"x": x})
    strict = ((x.astype(f32) * a).astype(dtype).astype(f32) * b).astype(dtype).astype(f32)
    np.testing.assert_array_equal(y_strict.astype(f32), strict)
    assert not np.array_equal(carried, strict)  # the case tells the two apart


def test_half_values_read_by_a_plugin_or_returned_are_rounded():
    """The carry rule (host/cpu_ep/half_carry.py) on a plan: xa = Mul(x, a) read by a CPU Relu stays
    float32; read by a plugin EP's node (float16 is what the plugin is told it gets), or returned as a
    graph output, it is stored as declared."""
    from host.cpu_ep import create_kernel, half_carry
    from host.runtime.model import build_graph
    from host.runtime.plan import PlanNode

    a = numpy_helper.from_array(np.array([1 / 3], np.float16), "a")
    nodes = [helper.make_node("Mul", ["x", "a"], ["xa"], name="mul"), helper.make_node("Relu", ["xa"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "to_plugin", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4])], [a])
    g = build_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))

    def plan(relu_ep):
        mul, relu = (create_kernel(n, g.values) for n in g.nodes)
        return mul, [PlanNode(0, "mul", "Mul", (0, 1), (2,), None, mul),
                     PlanNode(1, "relu", "Relu", (2,), (3,), relu_ep, relu)]

    mul, nodes_cpu = plan(None)
    assert half_carry.carry_float32(nodes_cpu, {3}) == 1
    assert mul.half.targets == [False]  # carried
    assert mul._run(np.ones(4, np.float16), numpy_helper.to_array(a))[0].dtype == np.float32
    mul, nodes_plugin = plan(object())  # a plugin EP's node reads xa
    assert half_carry.carry_float32(nodes_plugin, {3}) == 0
    assert mul._run(np.ones(4, np.float16), numpy_helper.to_array(a))[0].dtype == np.float16
    mul, nodes_out = plan(None)
    assert half_carry.carry_float32(nodes_out, {2, 3}) == 0  # xa is also a graph output
