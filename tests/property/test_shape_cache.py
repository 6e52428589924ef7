"""The host's shape program and its LRU bound (host/runtime/shape_program.py), with the example plugin.

A dynamic-axes model computes a Reshape target from `Shape(x)`; those nodes leave the plan and the
host evaluates them once per input-shape signature, keeping at most `session.ephost.shape_cache_signatures`
signatures (0: no program, the nodes run in the plan). For a random sequence of input shapes and a bound
of 0..3: every output equals onnxruntime's, the evaluations are exactly the misses of an LRU cache of that
bound (modelled here with an OrderedDict), the cache never holds more than its bound, and the plugin runs
the Relu at every run whatever the bound.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from host.errors import InvalidArgument
from host.runtime import shape_program
from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property import strategies as s

V = 6


def _model():
    """y = Relu(Reshape(x, [shape(x)[0], -1])) + shape(x)[1:2] (as float): the program's values are read by
    the plan twice (the Reshape target and the added dim), so a stale value shows in both."""
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one1"),
             numpy_helper.from_array(np.array([2], np.int64), "two1"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
             numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             # Slice with its optional axes omitted (""): the program passes an absent input as None.
             helper.make_node("Slice", ["s", "one1", "two1", "", "one1"], ["h"]),
             helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Relu", ["r"], ["a"]),
             helper.make_node("Add", ["a", "hf"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", None])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


MODEL = _model()
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2))


def _lru_misses(signatures, bound: int) -> tuple[int, int]:
    """(evaluations, signatures kept) of an LRU cache of `bound` entries over `signatures`."""
    cache: OrderedDict = OrderedDict()
    misses = 0
    for sig in signatures:
        if sig in cache:
            cache.move_to_end(sig)
            continue
        misses += 1
        cache[sig] = True
        if len(cache) > bound:
            cache.popitem(last=False)
    return misses, len(cache)


def _session(env, bound: int | None):
    so = h.session_options()
    if bound is not None:
        so.add_session_config_entry(shape_program.CACHE_KEY, str(bound))
    return InferenceSession(MODEL, so, providers=[(h.EXAMPLE_EP, {"ops": "Relu"})], env=env)


@given(shapes=st.lists(SHAPES, min_size=1, max_size=8), bound=st.integers(0, 3))
@example(shapes=[(1, 1, 1), (2, 1, 1), (1, 1, 1), (3, 1, 1), (2, 1, 1), (1, 1, 1)], bound=2)  # LRU order matters
@example(shapes=[(2, 2, 1), (2, 2, 2), (2, 3, 1)], bound=1)  # a bound of 1: every new shape evicts
@settings(deadline=None, max_examples=s.budget(10))
def test_shape_cache_bound_and_results(shapes, bound):
    reference = ort.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(len(shapes) * 7 + bound)
    with h.example_env(V, (V,)) as env:
        with _session(env, bound) as sess:
            program = sess.shape_program
            assert (len(program.nodes) > 0) is (bound > 0)
            assert program.capacity == bound  # the entry's bound, also 0 (no program)
            if bound == 0:  # the shape nodes stay in the plan, on the CPU EP
                assert {"Shape", "Gather"} <= {n.op_type for n in sess.plan.nodes}
            for shape in shapes:
                x = rng.standard_normal(shape).astype(np.float32)
                got = sess.run(None, {"x": x})[0]
                np.testing.assert_array_equal(got, reference.run(None, {"x": x})[0])
                assert program.cached_signatures() <= bound
            assert [n.provider for n in sess.plan.nodes if n.op_type == "Relu"] == [h.EXAMPLE_EP]
    computes = h.record(V).slot_calls["EpKernel.Compute"]
    assert computes == len(shapes)
    if bound:
        # The signature is the shape of x: every dim is read (Shape of the whole input).
        misses, kept = _lru_misses([tuple(sh) for sh in shapes], bound)
        assert program.evaluations == misses
        assert program.cached_signatures() == kept


def test_cache_bound_text_is_checked():
    with h.example_env(V, (V,)) as env:
        for bad in ("-1", "two", "1.5", "\u0661"):
            with pytest.raises(InvalidArgument, match=rf"^session config '{shape_program.CACHE_KEY}' = "
                                                      rf"'{bad}': expected a decimal integer >= 0"):
                _session(env, bad)
        with _session(env, None) as sess:
            assert sess.shape_program.capacity == shape_program.DEFAULT_CAPACITY


def _symbolic_model():
    """Shape of an inner value whose dims are the inputs' symbols ('b', 'h') and an expression ('2*b'): the
    program computes it from the symbols' sizes, which both inputs bind (they must agree)."""
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero")]
    nodes = [helper.make_node("Add", ["x", "y"], ["z"]),
             helper.make_node("Concat", ["z", "x"], ["c"], axis=0),
             helper.make_node("Shape", ["c"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Add", ["r", "nf"], ["out"])]
    xy = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "h"]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", xy, [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["2*b", "h"])],
                              inits, value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, ["2*b", "h"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


SYMBOLIC = _symbolic_model()


@given(feeds=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2)), min_size=1, max_size=6),
       bound=st.integers(1, 3))
@example(feeds=[(2, 2, 1), (2, 3, 1), (1, 1, 2), (2, 2, 1)], bound=1)
@settings(deadline=None, max_examples=s.budget(8))
def test_symbolic_dims_bind_the_inputs_shapes(feeds, bound):
    """(rows of x, rows of y, columns): equal rows give onnxruntime's outputs; different rows for the one
    symbol 'b' are refused with the symbol and both sizes named. Evaluations are the LRU model's misses
    over (x's shape, y's shape), refused ones included (they are evaluated, and never kept)."""
    reference = ort.InferenceSession(SYMBOLIC.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(bound)
    kept: OrderedDict = OrderedDict()
    misses = 0
    with h.example_env(V, (V,)) as env:
        so = h.session_options()
        so.add_session_config_entry(shape_program.CACHE_KEY, str(bound))
        with InferenceSession(SYMBOLIC, so, providers=[(h.EXAMPLE_EP, {"ops": "Relu"})], env=env) as sess:
            assert "Shape" not in {n.op_type for n in sess.plan.nodes}
            for bx, by, cols in feeds:
                x = rng.standard_normal((bx, cols)).astype(np.float32)
                y = rng.standard_normal((by, cols)).astype(np.float32)
                sig = ((bx, cols), (by, cols))
                if sig in kept:
                    kept.move_to_end(sig)
                else:
                    misses += 1
                if bx != by:
                    with pytest.raises(InvalidArgument, match=rf"^inputs declare the same symbolic dim 'b' but were "
                                                              rf"fed different sizes \('x' dim 0 = {bx}, 'y' dim 0 = "
                                                              rf"{by}\); this session computes shapes from the "
                                                              r"declared dims: feed equal sizes \(docs/dynamic_shapes.md\)$"):
                        sess.run(None, {"x": x, "y": y})
                    continue
                kept[sig] = True
                if len(kept) > bound:
                    kept.popitem(last=False)
                got = sess.run(None, {"x": x, "y": y})[0]
                np.testing.assert_allclose(got, reference.run(None, {"x": x, "y": y})[0], **h.TIGHT)
            assert sess.shape_program.evaluations == misses
            assert sess.shape_program.cached_signatures() == len(kept)


def _selection_model():
    """Nodes the program must leave in the plan, placed before the ones it takes (so a scan that stops at the
    first refusal takes nothing): Relu (not shape arithmetic), Add over x (output not small), Shape of
    NonZero's output (an unknown dim), Identity of a constant alone, Add of a shape and the input k (k is
    fed), Sigmoid (not shape arithmetic, though over shape values) and the Cast after it. Taken: Shape of an
    inner value, Size of x, Gather, Unsqueeze, Concat of two program values, Slice with its optional axes
    omitted, Cast."""
    i64 = TensorProto.INT64
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one1"),
             numpy_helper.from_array(np.array([2], np.int64), "two1"),
             numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.array([5, 6], np.int64), "cw")]
    kept = [helper.make_node("Relu", ["x"], ["rx"], name="relu"),
            helper.make_node("Add", ["x", "x"], ["xx"], name="add_big"),
            helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
            helper.make_node("Shape", ["nz"], ["snz"], name="shape_of_nonzero"),
            helper.make_node("Identity", ["cw"], ["cwi"], name="constant_alone")]
    taken = [helper.make_node("Shape", ["rx"], ["s"], name="shape"),
             helper.make_node("Size", ["x"], ["size"], name="size"),
             helper.make_node("Unsqueeze", ["size", "axes"], ["size1"], name="size1"),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="gather"),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="unsqueeze"),
             helper.make_node("Concat", ["n1", "n1"], ["nn"], axis=0, name="concat_produced"),
             helper.make_node("Slice", ["s", "one1", "two1", "", "one1"], ["hs"], name="slice_no_axes"),
             helper.make_node("Cast", ["nn"], ["nnf"], to=TensorProto.FLOAT, name="cast_float")]
    late = [helper.make_node("Add", ["s", "k"], ["sk"], name="add_fed"),
            helper.make_node("Sigmoid", ["nnf"], ["sig"], name="sigmoid"),
            helper.make_node("Cast", ["sig"], ["snn"], to=i64, name="cast_back"),
            helper.make_node("Concat", ["s", "size1", "nn", "hs", "sk", "snn", "cwi", "snz"], ["all"], axis=0,
                             name="concat_out"),
            helper.make_node("Add", ["xx", "rx"], ["y"], name="add_out")]
    graph = helper.make_graph(kept + taken + late, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "h", "w"]),
                               helper.make_tensor_value_info("k", i64, [3])],
                              [helper.make_tensor_value_info("all", i64, [None]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "h", "w"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model, {n.name for n in taken}


def test_the_program_takes_exactly_the_shape_arithmetic():
    """build()'s selection, each rule met once (see _selection_model), with onnxruntime's outputs."""
    model, taken = _selection_model()
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    with h.example_env(V, (V,)) as env:
        with InferenceSession(model, h.session_options(), providers=[(h.EXAMPLE_EP, {"ops": "Relu"})], env=env) as sess:
            assert {sess.graph.nodes[i].name for i in sess.shape_program.nodes} == taken
            for shape in [(2, 3, 1), (1, 2, 2), (2, 3, 1)]:
                feeds = {"x": rng.standard_normal(shape).astype(np.float32), "k": np.array([7, -1, 4], np.int64)}
                for got, want in zip(sess.run(None, feeds), reference.run(None, feeds)):
                    np.testing.assert_array_equal(got, want)


def test_an_op_the_cpu_ep_cannot_run_stays_for_the_plugin():
    """Opset 6: the CPU EP has no Mul of that opset (its broadcasting predates opset 7), so the Mul over
    shape values stays in the plan, where ExampleEP runs it; the program still takes the shape nodes after
    it (Shape of Relu's output, its Cast)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["sf", "sf"], ["sq"], name="mul_v6"),
             helper.make_node("Relu", ["x"], ["rx"], name="relu"),
             helper.make_node("Shape", ["rx"], ["s2"], name="shape_after"),
             helper.make_node("Cast", ["s2"], ["s2f"], to=TensorProto.FLOAT, name="cast_after"),
             helper.make_node("Add", ["sq", "s2f"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=8)
    with h.example_env(V, (V,)) as env:
        with InferenceSession(model, h.session_options(), providers=[(h.EXAMPLE_EP, {"ops": "Mul,Add,Relu"})],
                              env=env) as sess:
            assert {sess.graph.nodes[i].name for i in sess.shape_program.nodes} == {"shape", "cast", "shape_after",
                                                                                     "cast_after"}
            assert [n.provider for n in sess.plan.nodes if n.op_type == "Mul"] == [h.EXAMPLE_EP]
            for shape in [(2, 3, 1), (1, 2, 4)]:
                dims = np.array(shape, np.float32)  # onnxruntime has no Mul(6) kernel either: NumPy's answer
                np.testing.assert_array_equal(sess.run(None, {"x": np.ones(shape, np.float32)})[0], dims * dims + dims)
