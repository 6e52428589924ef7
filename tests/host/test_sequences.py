"""Sequence and optional values: the ops, feeds and outputs of run() (lists of arrays, None), types in
ONNX words, and sequences carried through a Loop; each result compared with onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from host.errors import InvalidArgument, KernelError, ModelError
from host.runtime.session import InferenceSession

F = TP.FLOAT
I64 = TP.INT64
SEQ_F = h.make_sequence_type_proto(h.make_tensor_type_proto(F, None))
OPT_F = h.make_optional_type_proto(h.make_tensor_type_proto(F, [2]))
OPT_SEQ = h.make_optional_type_proto(SEQ_F)


def vi(name, t=F, shape=None):
    return h.make_tensor_value_info(name, t, shape)


def model(nodes, inputs, outputs, inits=(), opset=18):
    m = h.make_model(h.make_graph(nodes, "m", inputs, outputs, list(inits)), opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


def both(m, feeds):
    got = InferenceSession(m).run(None, feeds)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return got, want


def assert_same(got, want):
    if want is None:
        assert got is None
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_sequence_ops_against_onnxruntime():
    nodes = [h.make_node("SplitToSequence", ["x"], ["parts"], axis=1, keepdims=1),
             h.make_node("SequenceConstruct", ["a", "b"], ["ab"]),
             h.make_node("SequenceInsert", ["ab", "a", "pos"], ["aab"]),
             h.make_node("SequenceErase", ["aab"], ["aa"]),
             h.make_node("SequenceAt", ["aab", "neg"], ["last"]),
             h.make_node("SequenceLength", ["parts"], ["n"]),
             h.make_node("ConcatFromSequence", ["parts"], ["joined"], axis=0),
             h.make_node("ConcatFromSequence", ["aa"], ["stacked"], axis=-1, new_axis=1),
             h.make_node("SequenceEmpty", [], ["empty"], dtype=F),
             h.make_node("SequenceLength", ["empty"], ["n_empty"])]
    m = model(nodes, [vi("x", F, [2, 3]), vi("a", F, [2]), vi("b", F, [2])],
              [vi("n", I64, []), vi("joined", F, [6, 1]), vi("stacked", F, [2, 2]), vi("last", F, [2]),
               vi("n_empty", I64, []), h.make_value_info("aa", SEQ_F), h.make_value_info("parts", SEQ_F)],
              [h.make_tensor("pos", I64, [], [0]), h.make_tensor("neg", I64, [], [-1])])
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1, 2], np.float32),
             "b": np.array([3, 4], np.float32)}
    got, want = both(m, feeds)
    assert isinstance(got[6], list) and len(got[6]) == 3  # parts: three (2, 1) tensors, as a list
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("split", [None, np.array(2, np.int64), np.array([1, 3], np.int64)])
def test_split_to_sequence_forms(split):
    inputs = [vi("x", F, [4, 2])]
    feeds = {"x": np.arange(8, dtype=np.float32).reshape(4, 2)}
    ins = ["x"]
    if split is not None:
        inputs.append(vi("split", I64, list(split.shape)))
        feeds["split"] = split
        ins.append("split")
    m = model([h.make_node("SplitToSequence", ins, ["s"], axis=0, keepdims=0 if split is None else 1)], inputs,
              [h.make_value_info("s", SEQ_F)])
    assert_same(*both(m, feeds))


def test_sequence_and_optional_feeds_and_outputs():
    """Feeds: a list for seq(...), None or a value for optional(...); outputs come back the same way,
    as onnxruntime's Python API returns them."""
    nodes = [h.make_node("OptionalHasElement", ["o"], ["has"]), h.make_node("Identity", ["o"], ["o2"]),
             h.make_node("SequenceLength", ["s"], ["n"]), h.make_node("Identity", ["s"], ["s2"]),
             h.make_node("Optional", ["s"], ["os"])]
    m = model(nodes, [h.make_value_info("o", OPT_F), h.make_value_info("s", SEQ_F)],
              [vi("has", TP.BOOL, []), h.make_value_info("o2", OPT_F), vi("n", I64, []), h.make_value_info("s2", SEQ_F),
               h.make_value_info("os", OPT_SEQ)])
    s = InferenceSession(m)
    assert [(a.name, a.type) for a in s.get_inputs()] == [("o", "optional(tensor(float))"), ("s", "seq(tensor(float))")]
    assert s.get_outputs()[4].type == "optional(seq(tensor(float)))"
    feeds_list = [{"o": np.ones(2, np.float32), "s": [np.ones(2, np.float32), np.zeros((1, 3), np.float32)]},
                  {"o": None, "s": []}]
    for feeds in feeds_list:
        got, want = both(m, feeds)
        for g, w in zip(got, want):
            assert_same(g, w)
    # Outputs are the caller's own: changing a returned array leaves the feed alone.
    seq = [np.ones(2, np.float32)]
    out = s.run(["s2"], {"o": None, "s": seq})[0]
    out[0][0] = 9
    assert seq[0][0] == 1


def test_type_errors_name_types_in_onnx_words():
    m = model([h.make_node("SequenceLength", ["s"], ["n"]), h.make_node("OptionalHasElement", ["o"], ["has"])],
              [h.make_value_info("s", SEQ_F), h.make_value_info("o", OPT_F)], [vi("n", I64, []), vi("has", TP.BOOL, [])])
    s = InferenceSession(m)
    with pytest.raises(InvalidArgument, match=r"^input 's': expected seq\(tensor\(float\)\), got tensor\(float\)$"):
        s.run(None, {"s": np.ones(2, np.float32), "o": None})
    with pytest.raises(InvalidArgument, match=r"^input 's': expected seq\(tensor\(float\)\), got seq\(tensor\(int64\)\)$"):
        s.run(None, {"s": [np.ones(2, np.int64)], "o": None})
    with pytest.raises(InvalidArgument, match=r"^input 'o': expected optional\(tensor\(float\)\), got seq\(tensor\(float\)\)$"):
        s.run(None, {"s": [], "o": [np.ones(2, np.float32)]})


def test_a_sparse_graph_input_is_refused_in_onnx_words():
    sparse = onnx.TypeProto()
    sparse.sparse_tensor_type.elem_type = F
    sparse.sparse_tensor_type.shape.dim.add().dim_value = 2
    m = h.make_model(h.make_graph([h.make_node("Identity", ["x"], ["y"])], "m", [h.make_value_info("x", sparse)],
                                  [h.make_value_info("y", sparse)]), opset_imports=[h.make_opsetid("", 18)])
    with pytest.raises(ModelError, match=r"^graph input 'x' has type sparse_tensor\(float\); supported: tensor, seq"):
        InferenceSession(m)


def test_sequence_position_out_of_range_is_a_kernel_error():
    m = model([h.make_node("SequenceAt", ["s", "p"], ["y"], name="at")], [h.make_value_info("s", SEQ_F), vi("p", I64, [])],
              [vi("y", F, [1])])
    with pytest.raises(KernelError, match=r"^node 'at' \(SequenceAt\) on CPUExecutionProvider failed: position 2 is out of "
                                          r"range for a sequence of 2 tensor\(s\); allowed: -2\.\.1$"):
        InferenceSession(m).run(None, {"s": [np.ones(1, np.float32)] * 2, "p": np.array(2, np.int64)})


def test_a_sequence_carried_through_a_loop():
    """A Loop whose carried value is a sequence (SequenceInsert per iteration), and an optional
    read inside the body; the result stacked with ConcatFromSequence."""
    body = h.make_graph([h.make_node("Identity", ["c"], ["c_out"]), h.make_node("Cast", ["i"], ["fi"], to=F),
                         h.make_node("Mul", ["x", "fi"], ["xi"]),
                         h.make_node("SequenceInsert", ["seq_in", "xi"], ["seq_out"])], "body",
                        [vi("i", I64, []), vi("c", TP.BOOL, []), h.make_value_info("seq_in", SEQ_F)],
                        [vi("c_out", TP.BOOL, []), h.make_value_info("seq_out", SEQ_F)])
    nodes = [h.make_node("SequenceEmpty", [], ["empty"], dtype=F),
             h.make_node("Loop", ["M", "", "empty"], ["seq"], body=body),
             h.make_node("ConcatFromSequence", ["seq"], ["stacked"], axis=0, new_axis=1)]
    m = model(nodes, [vi("M", I64, []), vi("x", F, [3])], [h.make_value_info("seq", SEQ_F), vi("stacked", F, ["n", 3])])
    got, want = both(m, {"M": np.array(4, np.int64), "x": np.array([1, 2, 3], np.float32)})
    assert len(got[0]) == 4
    for g, w in zip(got, want):
        assert_same(g, w)
