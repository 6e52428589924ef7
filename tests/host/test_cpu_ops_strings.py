"""String tensors on the CPU EP (element type 8: object arrays of str, as onnxruntime returns them) through
InferenceSession.run, the string ops against onnxruntime, and element types named in ONNX words in errors.
The onnx backend node tests of these ops run through tests/host/test_backend.py."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from abi.dtypes import type_name
from host.errors import InvalidArgument, ModelError
from host.optimizer.levels import GraphOptimizationLevel
from host.runtime.model import build_graph
from host.runtime.options import SessionOptions
from host.runtime.ortvalue import OrtValue
from host.runtime.partition import claims
from host.runtime.session import InferenceSession

S, F, I64 = TensorProto.STRING, TensorProto.FLOAT, TensorProto.INT64
# The ops this module checks against onnxruntime (test_cpu_ops.py's every-op check reads it).
TESTED_OPS = {"StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer"}
WORDS = np.array([["Hello", "wörld", ""], ["a b", "MONDAY", "ünïcode"]], dtype=object)


def _model(nodes, inputs, outputs, inits=(), opset=20):
    # None: a dim of unknown size (the checker wants every graph input and output ranked).
    graph = helper.make_graph(nodes, "strings", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _both(model, feeds, level=GraphOptimizationLevel.ORT_ENABLE_ALL):
    """(ephost outputs, onnxruntime outputs) for the same feeds."""
    options = SessionOptions()
    options.graph_optimization_level = level
    ours = InferenceSession(model, sess_options=options).run(None, feeds)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return ours, theirs


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tolist() == b.tolist()


def _structural_model():
    """Identity, Reshape, Concat with a string initializer, Gather, StringConcat, Equal, Cast. (No Transpose:
    onnxruntime 1.32 returns wrong strings for Gather of a transposed string tensor.)"""
    suffix = numpy_helper.from_array(np.array(["!", "?"], dtype=object), "suffix")
    extra = numpy_helper.from_array(np.array([["x", "y", "z"]], dtype=object), "extra")
    shape = numpy_helper.from_array(np.array([3, 2], np.int64), "shape")
    index = numpy_helper.from_array(np.array([2, 0], np.int64), "index")
    nodes = [
        helper.make_node("Identity", ["x"], ["ident"]),
        helper.make_node("Concat", ["ident", "extra"], ["cat"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["flat"]),
        helper.make_node("Gather", ["ident", "index"], ["picked"], axis=1),
        helper.make_node("StringConcat", ["flat", "suffix"], ["joined"]),
        helper.make_node("Equal", ["x", "x"], ["same"]),
        helper.make_node("Cast", ["numbers"], ["as_text"], to=S),
        helper.make_node("Cast", ["as_text"], ["back"], to=F),
    ]
    return _model(nodes, [("x", S, [2, 3]), ("numbers", F, [4])],
                  [("cat", S, [3, 3]), ("picked", S, [2, 2]), ("joined", S, [3, 2]),
                   ("same", TensorProto.BOOL, [2, 3]), ("as_text", S, [4]), ("back", F, [4])], inits=[suffix, extra, shape, index])


@pytest.mark.parametrize("level", [GraphOptimizationLevel.ORT_DISABLE_ALL, GraphOptimizationLevel.ORT_ENABLE_ALL])
def test_string_values_through_run_match_onnxruntime(level):
    feeds = {"x": WORDS, "numbers": np.array([1.5, -2.0, 0.25, 3e6], np.float32)}
    ours, theirs = _both(_structural_model(), feeds, level)
    _assert_same(ours, theirs)
    assert all(type(s) is str for s in ours[0].flat)  # Python str, as onnxruntime returns


def test_numpy_text_arrays_are_accepted_as_string_feeds():
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [("x", S, [2])], [("y", S, [2])])
    (y,) = InferenceSession(model).run(None, {"x": np.array(["ab", "c"])})  # dtype '<U2'
    assert y.dtype == object and y.tolist() == ["ab", "c"]


def test_string_input_type_is_named_in_onnx_words():
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [("x", S, [2])], [("y", S, [2])])
    session = InferenceSession(model)
    assert session.get_inputs()[0].type == "tensor(string)"
    with pytest.raises(InvalidArgument, match=r"^input 'x': expected dtype object \(tensor\(string\)\), "
                                              r"got int64 \(tensor\(int64\)\)$"):
        session.run(None, {"x": np.array([1, 2], np.int64)})
    with pytest.raises(InvalidArgument, match=r"^input 'x': a tensor\(string\) input holds Python str only; "
                                              r"got an object array holding bytes$"):
        session.run(None, {"x": np.array([b"a", b"b"], dtype=object)})


def test_unsupported_element_type_is_named_in_onnx_words():
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [("x", TensorProto.COMPLEX64, [2])],
                   [("y", TensorProto.COMPLEX64, [2])])
    with pytest.raises(ModelError, match=r"^value 'x': ONNX element type tensor\(complex64\) is not supported; "
                                         r"supported: tensor\(float\), tensor\(uint8\), "):
        InferenceSession(model)
    assert [type_name(t) for t in (1, 8, 11, 16, 17)] == [
        "tensor(float)", "tensor(string)", "tensor(double)", "tensor(bfloat16)", "tensor(float8e4m3fn)"]


def test_string_nodes_stay_off_plugin_eps():
    """claims.collect_claims starts from these nodes as taken: no plugin can read Python str objects."""
    graph = build_graph(_structural_model())
    names = {graph.nodes[i].op_type for i in claims.string_nodes(graph)}
    assert names == {"Identity", "Concat", "Reshape", "Gather", "StringConcat", "Equal", "Cast"}


def _one_node(op, inputs, outputs, opset=20, **attrs):
    node = helper.make_node(op, [i[0] for i in inputs], [o[0] for o in outputs], **attrs)
    return _model([node], inputs, outputs, opset=opset)


STRING_OP_CASES = [
    pytest.param(_one_node("StringSplit", [("x", S, [None])], [("y", S, [None, None]), ("n", I64, [None])], delimiter="-",
                           maxsplit=2), {"x": np.array(["a-b-c-d", "", "--x", "no"], dtype=object)}, id="split-max"),
    pytest.param(_one_node("StringSplit", [("x", S, [None, None])], [("y", S, [None, None, None]),
                                                          ("n", I64, [None, None])]),
                 {"x": np.array([["  two  words", "one"], ["", "a\tb c"]], dtype=object)}, id="split-whitespace"),
    pytest.param(_one_node("StringNormalizer", [("x", S, [None])], [("y", S, [None])], opset=10,
                           case_change_action="UPPER", stopwords=["monday", "the"]),
                 {"x": np.array(["The", "Monday", "week", "x"], dtype=object)}, id="normalizer-insensitive"),
    pytest.param(_one_node("StringNormalizer", [("x", S, [1, None])], [("y", S, [1, None])], opset=10,
                           is_case_sensitive=1, stopwords=["a", "b"]),
                 {"x": np.array([["a", "b"]], dtype=object)}, id="normalizer-all-dropped"),
    pytest.param(_one_node("RegexFullMatch", [("x", S, [None, None])], [("y", TensorProto.BOOL, [None, None])],
                           pattern=r"[a-z]+@(example|test)\.(com|org)"),
                 {"x": np.array([["me@example.com", "me@example.com.au"], ["x@test.org", ""]], dtype=object)},
                 id="regex"),
    pytest.param(_one_node("TfIdfVectorizer", [("x", S, [None, None])], [("y", F, [None, None])], opset=9, mode="TFIDF",
                           min_gram_length=1, max_gram_length=2, max_skip_count=1, ngram_counts=[0, 3],
                           ngram_indexes=[0, 1, 2, 3, 4], pool_strings=["a", "b", "c", "a", "b", "b", "c"],
                           weights=[0.5, 1.0, 2.0, 3.0, 4.0]),
                 {"x": np.array([["a", "b", "a", "c", "b"], ["c", "c", "b", "a", "b"]], dtype=object)}, id="tfidf"),
]


@pytest.mark.parametrize("model, feeds", STRING_OP_CASES)
def test_string_ops_match_onnxruntime(model, feeds):
    if model.graph.node[0].op_type == "StringNormalizer":
        # onnxruntime's StringNormalizer needs the en_US.UTF-8 locale, which CI machines may lack: onnx's
        # reference instead (ASCII words: it also strips accents, which onnxruntime does not).
        ours = InferenceSession(model).run(None, feeds)
        theirs = [np.asarray(y, dtype=object) for y in ReferenceEvaluator(model).run(None, feeds)]
    else:
        ours, theirs = _both(model, feeds)
    _assert_same(ours, theirs)


def test_string_split_follows_onnxruntime_on_spaces():
    """No delimiter: runs of spaces separate (tabs do not); the empty string has no pieces."""
    model = STRING_OP_CASES[1].values[0]
    (y, n) = InferenceSession(model).run(None, {"x": np.array([["  a  b ", "c\td"], ["", "e"]], dtype=object)})
    assert y.tolist() == [[["a", "b"], ["c\td", ""]], [["", ""], ["e", ""]]]
    assert n.tolist() == [[2, 1], [0, 1]]


@pytest.mark.parametrize("elem, values", [
    (F, [0.1, 1 / 3, 123456789.0, 1e-7, -0.0, np.nan, np.inf, -np.inf]),
    (TensorProto.DOUBLE, [0.1, 1 / 3, 1e20, -2.0]),
    (TensorProto.FLOAT16, [0.1, 1.5, -65504]),
    (I64, [5, -3, 2**40]),
    (TensorProto.BOOL, [True, False]),
], ids=["float", "double", "float16", "int64", "bool"])
def test_cast_numbers_to_strings_matches_onnxruntime(elem, values):
    model = _one_node("Cast", [("x", elem, [None])], [("y", S, [None])], opset=19, to=S)
    x = np.array(values, dtype=helper.tensor_dtype_to_np_dtype(elem))
    ours, theirs = _both(model, {"x": x})
    _assert_same(ours, theirs)


def test_string_values_through_ortvalue_and_iobinding():
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [("x", S, [2])], [("y", S, [2])])
    session = InferenceSession(model)
    value = OrtValue.ortvalue_from_numpy(np.array(["a", "b"], dtype=object))
    # onnxruntime makes no string OrtValue from NumPy; its type text for the input is the reference.
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).get_inputs()[0].type
    assert value.data_type() == theirs == "tensor(string)"
    assert session.run(None, {"x": value})[0].tolist() == ["a", "b"]
    binding = session.io_binding()
    binding.bind_cpu_input("x", np.array(["q", "r"], dtype=object))
    binding.bind_output("y")
    session.run_with_iobinding(binding)
    assert binding.copy_outputs_to_cpu()[0].tolist() == ["q", "r"]


def test_optimizer_keeps_string_constants_and_succeeds():
    """Constant string results (Cast of a Shape, StringConcat of constants) are not folded: onnx-ir cannot
    serialize the NumPy text arrays onnx's reference kernels return, which made the whole pass fail."""
    const = numpy_helper.from_array(np.array(["-x"], dtype=object), "c")
    nodes = [helper.make_node("Constant", [], ["c"], value=const),
             helper.make_node("StringConcat", ["c", "c"], ["cc"]),
             helper.make_node("StringConcat", ["x", "cc"], ["y"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["s"], ["st"], to=S)]
    model = _model(nodes, [("x", S, [2])], [("y", S, [2]), ("st", S, [1])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, theirs = _both(model, {"x": np.array(["a", "b"], dtype=object)})
    assert not [w for w in caught if "graph optimization failed" in str(w.message)]
    _assert_same(ours, theirs)
