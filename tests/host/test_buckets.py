"""Shape buckets (session.ephost.shape_buckets): padded runs against onnxruntime on the unpadded inputs,
fewer distinct shapes, and the refusals where padding would change the results."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from host.errors import InvalidArgument, ModelError
from host.runtime import buckets
from tests.models import dynamic

SHAPES = [(1, 16), (3, 50), (8, 128), (5, 70), (4, 50), (3, 60)]
KEY = buckets.CONFIG_KEY


def session(model, rules: str | None):
    so = host.SessionOptions()
    if rules is not None:
        so.add_session_config_entry(KEY, rules)
    return host.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def bert():
    model = dynamic.bert_like(layers=1, hidden=32, inter=64)
    return model, onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def bucket(n: int, rule: str | None) -> int:
    """The reference: the next power of two (math.log2) or multiple of N; n itself with no rule."""
    if rule is None:
        return n
    return 2 ** math.ceil(math.log2(n)) if rule == "pow2" else math.ceil(n / int(rule)) * int(rule)


@pytest.mark.parametrize("rules", [None, "batch:pow2", "seq:64", "batch:pow2,seq:64", "seq:pow2, batch:3"])
def test_padded_runs_match_onnxruntime_on_the_real_inputs(bert, rules):
    model, ref = bert
    sess = session(model, rules)
    for batch, seq in SHAPES:
        feeds = dynamic.bert_feeds(batch, seq)
        (got,) = sess.run(None, feeds)
        assert got.shape == (batch, seq, 32)
        np.testing.assert_allclose(got, ref.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    by_axis = dict(item.strip().split(":") for item in rules.split(",")) if rules else {}
    padded = {(bucket(b, by_axis.get("batch")), bucket(s, by_axis.get("seq"))) for b, s in SHAPES}
    assert sess.shape_program.evaluations == len(padded)  # one per distinct padded shape the session ran


def test_bucket_sizes():
    pow2, by64 = buckets.Rule(0), buckets.Rule(64)
    assert [pow2.size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [by64.size(n) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]


def _model(nodes, inputs, outputs, inits=()):
    return helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, list(inits)),
                             opset_imports=[helper.make_opsetid("", 18)])


def _xy(x_dims=("batch", 4), y_dims=("batch", 4)):
    return ([helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_dims))],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(y_dims))])


def test_a_row_wise_model_pads_its_batch():
    x, y = _xy()
    model = _model([helper.make_node("Softmax", ["X"], ["Y"], axis=1, name="sm")], x, y)
    sess = session(model, "batch:pow2")
    feeds = {"X": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}
    ref = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-6)


@pytest.mark.parametrize("node, inits, y_dims, why", [
    (helper.make_node("Softmax", ["X"], ["Y"], axis=0, name="sm"), [], ("batch", 4),
     r"node 'sm' \(Softmax\) works along the batch axis"),
    (helper.make_node("ReduceSum", ["X", "ax"], ["Y"], name="sum"), [numpy_helper.from_array(np.array([0]), "ax")],
     (1, 4), None),
    (helper.make_node("Transpose", ["X"], ["Y"], perm=[1, 0], name="t"), [], (4, "batch"), None),
], ids=["softmax_axis0", "reducesum_axis0", "transpose"])
def test_batch_mixing_is_refused(node, inits, y_dims, why):
    x, y = _xy(y_dims=y_dims)
    model = _model([node], x, y, inits)
    if why is None:  # the output's dim 0 is not the batch: the first rule refuses
        why = r"every input and output must carry one symbolic batch dim as dim 0; the model's dim 0 are"
        with pytest.raises(ModelError, match=rf"^'{KEY}' batch: {why}"):
            session(model, "batch:pow2")
        return
    with pytest.raises(ModelError, match=rf"^'{KEY}' batch: padding the batch axis 'batch' would change the "
                                         rf"results: {why}\. Remove the batch rule"):
        session(model, "batch:pow2")


def test_a_reduction_inside_over_the_batch_is_refused():
    x, y = _xy()
    nodes = [helper.make_node("ReduceMean", ["X", "ax"], ["m"], name="mean"),  # [1, 4]
             helper.make_node("Sub", ["X", "m"], ["Y"], name="sub")]
    model = _model(nodes, x, y, [numpy_helper.from_array(np.array([0]), "ax")])
    with pytest.raises(ModelError, match=rf"^'{KEY}' batch: padding the batch axis 'batch' would change the results: "
                                         r"node 'mean' \(ReduceMean\) takes the batch axis in but its output 'm' does "
                                         r"not carry it as dim 0 \(shape \[1, 4\]\)"):
        session(model, "batch:pow2")


def test_the_batch_size_read_as_data_is_refused():
    x, y = _xy()
    nodes = [helper.make_node("Shape", ["X"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["b"], axis=0, name="g"),
             helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Div", ["X", "bf"], ["Y"], name="div")]  # X / batch size
    model = _model(nodes, x, y, [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    with pytest.raises(ModelError, match=rf"^'{KEY}' batch: padding the batch axis 'batch' would change the results: "
                                         r"node 'shape' \(Shape\) reads the batch size, which reaches node 'div' \(Div\) "
                                         r"as data: padding would change what it computes"):
        session(model, "batch:pow2")


def test_seq_needs_a_mask_and_outputs_that_carry_it():
    x, y = _xy(("batch", "seq"), ("batch", "seq"))
    model = _model([helper.make_node("Relu", ["X"], ["Y"])], x, y)
    with pytest.raises(ModelError, match=rf"^'{KEY}' seq: padding the sequence axis needs an attention mask input "
                                         r"\(attention_mask or input_mask or mask\) of shape \[batch, seq\]"):
        session(model, "seq:64")
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
    pooled = helper.make_tensor_value_info("P", TensorProto.FLOAT, ["batch"])
    nodes = [helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["mf", "ax"], ["P"], keepdims=0)]
    model = _model(nodes, [mask], [pooled], [numpy_helper.from_array(np.array([1]), "ax")])
    with pytest.raises(ModelError, match=rf"^'{KEY}' seq: output\(s\) \['P'\] do not carry the sequence axis 'seq'"):
        session(model, "seq:64")


@pytest.mark.parametrize("text", ["batch", "batch:pow3", "seq:0", "time:64", "batch:2,batch:4"])
def test_malformed_rules_are_refused(text):
    with pytest.raises(InvalidArgument, match=rf"^session config '{KEY}' = '{text}': item '[^']*' is not one of "
                                              r"'batch:R' or 'seq:R'"):
        buckets.parse(text)


def test_inputs_that_disagree_on_the_padded_axis_are_refused(bert):
    sess = session(bert[0], "seq:64")
    feeds = dynamic.bert_feeds(2, 16)
    feeds["attention_mask"] = np.ones((2, 20), np.int64)
    with pytest.raises(InvalidArgument, match=r"^inputs disagree on the seq axis that 'session.ephost.shape_buckets' "
                                              r"pads: \{'input_ids': 16, 'attention_mask': 20\}"):
        sess.run(None, feeds)


@pytest.mark.parametrize("case", ["matmul", "gather"])
def test_ops_that_mix_rows_without_changing_shapes_are_refused(case):
    """Shapes that keep the batch as dim 0 are not enough: M @ X contracts X's rows, X[I] permutes them."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])
    if case == "matmul":
        other = helper.make_tensor_value_info("M", TensorProto.FLOAT, ["batch", "batch"])
        node = helper.make_node("MatMul", ["M", "X"], ["Y"], name="mm")
        why = r"node 'mm' \(MatMul\) contracts the batch axis \(it is the right operand's row axis\)"
    else:
        other = helper.make_tensor_value_info("I", TensorProto.INT64, ["batch"])
        node = helper.make_node("Gather", ["X", "I"], ["Y"], axis=0, name="rows")
        why = r"node 'rows' \(Gather\) selects along the batch axis"
    model = _model([node], [x, other], [y])
    with pytest.raises(ModelError, match=rf"^'{KEY}' batch: padding the batch axis 'batch' would change the "
                                         rf"results: {why}\. Remove the batch rule"):
        session(model, "batch:pow2")
