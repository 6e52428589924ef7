"""Shape arithmetic evaluated on the host once per input-shape signature (host/runtime/shape_program.py),
on hand-built dynamic-axes models (tests/models/dynamic.py), against onnxruntime CPU at several shapes
per session."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import host
from host.optimizer import GraphOptimizationLevel
from host.runtime import dims, shape_program
from tests.models import dynamic

# (batch, seq): new shapes, then two seen before.
SHAPES = [(1, 16), (8, 128), (3, 50), (8, 128), (1, 16)]
PATTERNS = {  # builder, width of the last axis, nodes that must become host arithmetic
    "reshape_heads": (dynamic.reshape_heads, 8, {"Shape", "Gather", "Unsqueeze", "Concat"}),
    "class_token": (dynamic.class_token, 8, {"Shape", "Slice", "Concat", "Expand"}),
    "positions": (dynamic.positions, 8, {"Shape", "Range", "Unsqueeze", "Cast", "Sqrt", "Reciprocal"}),
    "symbolic_value_info": (dynamic.symbolic_value_info, 4, {"Shape"}),
}


# Ops host/runtime/shape_constants.py rewrites away before the program when optimizing.
REWRITTEN = {"reshape_heads": {"Shape", "Gather", "Unsqueeze", "Concat"}, "class_token": {"Slice"}}


def _session(model: onnx.ModelProto, level=None, **config) -> host.InferenceSession:
    so = host.SessionOptions()
    if level is not None:
        so.graph_optimization_level = level
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return host.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])


def _reference(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _absorbed_ops(s: host.InferenceSession) -> set[str]:
    return {s.graph.nodes[i].op_type for i in s.shape_program.nodes}


@pytest.mark.parametrize("level", [GraphOptimizationLevel.ORT_DISABLE_ALL, GraphOptimizationLevel.ORT_ENABLE_ALL])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_exporter_patterns_match_onnxruntime_at_every_shape(pattern, level):
    build, width, must = PATTERNS[pattern]
    model = build()
    s, ref = _session(model, level), _reference(model)
    # Absorbed by the program or, optimizing, rewritten before (host/runtime/shape_constants.py):
    # reshape_heads' targets are the input's own dims, a constant [0, 0, heads, -1]; class_token's
    # batch is read as Shape(X, 0, 1). Either way no such node is left in the plan.
    gone = REWRITTEN.get(pattern, set()) if level != GraphOptimizationLevel.ORT_DISABLE_ALL else set()
    folded = gone == must
    assert must - gone <= _absorbed_ops(s)
    assert not gone & {n.op_type for n in s.plan.nodes}
    planned = {n.index for n in s.plan.nodes}
    assert not planned & s.shape_program.nodes  # absorbed nodes are not plan steps
    rng = np.random.default_rng(0)
    for batch, seq in SHAPES:
        x = rng.standard_normal((batch, seq, width)).astype(np.float32)
        got, want = s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # A shape seen before is not evaluated again (nothing is evaluated where the arithmetic was folded).
    assert s.shape_program.evaluations == (0 if folded else len(set(SHAPES)))


@pytest.mark.parametrize("level", [GraphOptimizationLevel.ORT_DISABLE_ALL, GraphOptimizationLevel.ORT_ENABLE_ALL])
def test_bert_like_runs_its_shape_arithmetic_once_per_shape(level):
    model = dynamic.bert_like()
    s, ref = _session(model, level), _reference(model)
    absorbed = {s.graph.nodes[i].name for i in s.shape_program.nodes}
    shapes = [n for n in s.graph.nodes if n.op_type == "Shape"]
    assert shapes and all(n.name in absorbed for n in shapes)  # no Shape node is a plan step
    assert not absorbed & set(s.node_assignment())
    if level == GraphOptimizationLevel.ORT_DISABLE_ALL:  # every reshape's shape and the positions
        assert len(shapes) == 9 and {"Range", "Concat", "Gather", "Unsqueeze"} <= _absorbed_ops(s)
    else:  # the reshapes' shapes became constants and the attention fused, as on a static export
        assert "Attention" in {n.op_type for n in s.plan.nodes} and "Reshape" not in {n.op_type for n in s.plan.nodes}
    for batch, seq in SHAPES:
        feeds = dynamic.bert_feeds(batch, seq)
        np.testing.assert_allclose(s.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    assert s.shape_program.evaluations == 3


def test_absorbed_nodes_leave_no_profile_events(tmp_path):
    model = dynamic.reshape_heads()
    so = host.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    s = host.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
    for batch, seq in SHAPES:
        s.run(None, {"X": np.ones((batch, seq, 8), np.float32)})
    events = json.loads(open(s.end_profiling()).read())
    ran = [e["name"] for e in events if e.get("cat") == "Node"]
    absorbed = {s.graph.nodes[i].name for i in s.shape_program.nodes}
    planned = {n.name for n in s.plan.nodes}
    assert planned and all(ran.count(name) == len(SHAPES) for name in planned)
    assert not absorbed & set(ran)


def test_the_cache_is_bounded_and_least_recently_used_goes_first():
    model = dynamic.class_token()  # reshape_heads' arithmetic is folded
    s, ref = _session(model, **{shape_program.CACHE_KEY: "2"}), _reference(model)
    # (1,4) was used after (2,4): (3,4) evicts (2,4), so (1,4) is still there (first-in-first-out would
    # have evicted it: 4 evaluations).
    order = [(1, 4), (2, 4), (1, 4), (3, 4), (1, 4)]
    for batch, seq in order:
        x = np.full((batch, seq, 8), float(batch), np.float32)
        np.testing.assert_array_equal(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0])
    assert s.shape_program.cached_signatures() == 2
    assert s.shape_program.evaluations == 3


def test_cache_size_zero_runs_shapes_as_nodes():
    model = dynamic.class_token()  # reshape_heads' arithmetic is folded
    s = _session(model, **{shape_program.CACHE_KEY: "0"})
    assert not s.shape_program.nodes and "Shape" in {n.op_type for n in s.plan.nodes}
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    np.testing.assert_array_equal(s.run(None, {"X": x})[0], _reference(model).run(None, {"X": x})[0])


def test_a_bad_cache_size_is_refused():
    with pytest.raises(host.InvalidArgument, match=rf"^session config '{shape_program.CACHE_KEY}' = '-1': expected a decimal "
                                                   r"integer >= 0 \(signatures kept; 0 evaluates shapes as nodes; "
                                                   r"default 64\)$"):
        _session(dynamic.reshape_heads(), **{shape_program.CACHE_KEY: "-1"})


def test_inputs_fed_against_their_shared_symbol_are_refused():
    s = _session(dynamic.bert_like())
    feeds = {"input_ids": np.zeros((2, 16), np.int64), "attention_mask": np.ones((2, 17), np.int64)}
    with pytest.raises(host.InvalidArgument, match=r"^inputs declare the same symbolic dim 'seq' but were fed different "
                                                   r"sizes \('attention_mask' dim 1 = 17, 'input_ids' dim 1 = 16\); "):
        s.run(None, feeds)


def test_a_shape_that_depends_on_data_stays_a_node():
    """Shape(NonZero(X)) depends on X's values: it must run at every run."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("Y", TensorProto.INT64, [1])
    nodes = [helper.make_node("NonZero", ["X"], ["nz"]), helper.make_node("Shape", ["nz"], ["s"]),
             helper.make_node("Slice", ["s", "one", "two"], ["Y"])]
    inits = [onnx.numpy_helper.from_array(np.array([1], np.int64), "one"),
             onnx.numpy_helper.from_array(np.array([2], np.int64), "two")]
    model = helper.make_model(helper.make_graph(nodes, "nz", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)])
    s = _session(model)
    assert not s.shape_program.nodes
    for data in ([0, 1, 2, 0], [3, 1, 2, 5], [0, 0, 0, 0]):
        arr = np.array(data, np.float32)
        np.testing.assert_array_equal(s.run(None, {"X": arr})[0], [np.count_nonzero(arr)])


def test_dims_compile_only_arithmetic_over_known_symbols():
    fn, names = dims.compile_dim("((s0 - 1)//2) + 2*s1", {"s0", "s1"})
    assert fn({"s0": 9, "s1": 5}) == ((9 - 1) // 2) + 2 * 5 and names == {"s0", "s1"}
    sympy_style = {"floor(s0/2)": lambda n: n // 2, "ceiling(s0/2)": lambda n: -(-n // 2),
                   "Max(1, s0 - 3)": lambda n: max(1, n - 3), "Min(s0, 4) % 3": lambda n: min(n, 4) % 3}
    for text, want in sympy_style.items():
        fn, _ = dims.compile_dim(text, {"s0"})
        assert [fn({"s0": n}) for n in range(1, 9)] == [want(n) for n in range(1, 9)], text
    for bad in ("unk__0", "s0 ** 2", "sqrt(s0)", "Max()", "", None, -1, "s0 +", "s1 + 1"):
        assert dims.compile_dim(bad, {"s0"}) is None, bad
    half, _ = dims.compile_dim("s0/2", {"s0"})
    assert half({"s0": 6}) == 3
    with pytest.raises(ValueError, match=r"^dim 's0/2' is 5/2 for sizes \{'s0': 5\}, not a whole number$"):
        half({"s0": 5})


def test_values_are_shared_read_only_between_runs():
    s = _session(dynamic.class_token())  # reshape_heads' arithmetic is folded (shape_constants.py)
    feeds = s._feeds({"X": np.ones((2, 3, 8), np.float32)})
    first = s.shape_program.with_values(feeds)
    again = s.shape_program.with_values(feeds)
    vids = s.shape_program.exported
    assert vids and all(first[v] is again[v] and not first[v].flags.writeable for v in vids)


def test_build_without_shape_arithmetic_is_empty():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "r", [x],
                                                [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n"])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    s = _session(model)
    assert len(s.shape_program) == 0 and s.shape_program.nodes == frozenset()
    feeds = {0: np.ones(3, np.float32)}
    assert s.shape_program.with_values(feeds) is feeds
    assert shape_program.DEFAULT_CAPACITY == 64


@pytest.fixture(scope="module")
def mock_device_env(example_plugin):
    """An environment whose ExampleEP computes in device memory the host must copy to."""
    import gc

    from tests.plugins.example_ep import mock_device

    with mock_device():  # read when the plugin registers
        env = host.Environment()
        env.register_plugin("ex", example_plugin(6))
    yield env
    gc.collect()
    env.close()


@pytest.mark.parametrize("fuse", ["0", "1"])
def test_program_values_reach_plugin_nodes_on_a_device(mock_device_env, fuse):
    """positions(): the position table slice and the 1/sqrt(seq) scale come from the program and are
    read by Add and Mul on the (mock) device, per node or in one compiled partition."""
    model = dynamic.positions()
    s = host.InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"ops": "Add,Mul", "fuse": fuse})],
                              env=mock_device_env)
    assert set(s.node_assignment().values()) == {"ExampleEP"}  # the rest is host arithmetic
    ref = _reference(model)
    rng = np.random.default_rng(3)
    for batch, seq in SHAPES:
        x = rng.standard_normal((batch, seq, 8)).astype(np.float32)
        np.testing.assert_allclose(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0], rtol=1e-5, atol=1e-6)
    assert s.shape_program.evaluations == 3
    s.close()


def _every_other_row(dim: str) -> onnx.ModelProto:
    """Y = X[::2] reshaped through its own Shape, with value_info declaring its rows as `dim`."""
    inits = [onnx.numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("st", 0), ("en", 2**62), ("ax", 0), ("step", 2))]
    nodes = [helper.make_node("Slice", ["X", "st", "en", "ax", "step"], ["half"]),
             helper.make_node("Shape", ["half"], ["hs"]),
             helper.make_node("Flatten", ["half"], ["flat"], axis=1),
             helper.make_node("Reshape", ["flat", "hs"], ["Y"])]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["s0", 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [dim, 3])
    vi = [helper.make_tensor_value_info("half", TensorProto.FLOAT, [dim, 3])]
    graph = helper.make_graph(nodes, "half", [x], [y], inits, value_info=vi)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sympy_dims_from_the_dynamo_exporter_are_computed():
    model = _every_other_row("ceiling(s0/2)")
    # Optimizer off: it would see that the Reshape restores Flatten's input shape and drop both.
    s, ref = _session(model, GraphOptimizationLevel.ORT_DISABLE_ALL), _reference(model)
    assert "Shape" in _absorbed_ops(s)
    for rows in (4, 5, 1, 5):
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        np.testing.assert_array_equal(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0])
    assert s.shape_program.evaluations == 3


def test_sizes_that_a_declared_dim_does_not_divide_are_refused():
    s = _session(_every_other_row("s0/2"), GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_array_equal(s.run(None, {"X": np.ones((4, 3), np.float32)})[0], np.ones((2, 3), np.float32))
    with pytest.raises(host.InvalidArgument, match=r"^the fed shapes do not fit the model's declared dims: dim 's0/2' "
                                                   r"is 5/2 for sizes \{'s0': 5\}, not a whole number$"):
        s.run(None, {"X": np.ones((5, 3), np.float32)})


def test_sizes_at_which_a_declared_dim_divides_by_zero_are_refused_and_the_session_goes_on():
    """A dim such as '(s0 + 1) // (s0 - 1)' has no value at s0 = 1: the run gets a typed InvalidArgument
    naming the dim and the sizes (a bare ZeroDivisionError escaped before; the thorough property profile
    found it), and the session keeps serving other sizes."""
    s = _session(_every_other_row("(s0 + 1) // (s0 - 1)"), GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_array_equal(s.run(None, {"X": np.ones((3, 3), np.float32)})[0], np.ones((2, 3), np.float32))
    with pytest.raises(host.InvalidArgument, match=r"^the fed shapes do not fit the model's declared dims: dim "
                                                   r"'\(s0 \+ 1\) // \(s0 - 1\)' divides by zero for sizes "
                                                   r"\{'s0': 1\}$"):
        s.run(None, {"X": np.ones((1, 3), np.float32)})
    np.testing.assert_array_equal(s.run(None, {"X": np.ones((3, 3), np.float32)})[0], np.ones((2, 3), np.float32))
