"""If, Loop and Scan: models made with onnx.helper, each compared with onnxruntime; subgraph nodes
claimed by the example plugin EP; the optimizer on models with subgraphs; onnx's backend node tests
of the control-flow and sequence/optional categories through EphostBackend."""

from __future__ import annotations

import gc
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

import host
from host.errors import KernelError, ModelError
from host.optimizer import optimize
from host.runtime.model import MAX_OPSET
from host.runtime.session import InferenceSession, SessionOptions
from tests.conftest import example_record

F = TP.FLOAT
I64 = TP.INT64


def vi(name, t=F, shape=None):
    return h.make_tensor_value_info(name, t, shape)


def model(nodes, inputs, outputs, inits=(), opset=17):
    # IR 10: what onnxruntime 1.18+ reads (the GPU machine's onnxruntime stops at IR 13).
    m = h.make_model(h.make_graph(nodes, "m", inputs, outputs, list(inits)), opset_imports=[h.make_opsetid("", opset)],
                     ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    return m


def ort_run(m, feeds):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def check_against_ort(m, feeds, **kwargs):
    got = InferenceSession(m, **kwargs).run(None, feeds)
    want = ort_run(m, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        assert g.dtype == w.dtype and g.shape == w.shape
    return got


# ---- models ---------------------------------------------------------------------------------------------------
def if_model(cond=None):
    """z = relu(x * 2 if sum(x) > 0 else x - w); both branches read outer values (x, w). With `cond` a
    constant condition instead."""
    then = h.make_graph([h.make_node("Mul", ["x", "two"], ["t"])], "then", [], [vi("t", F, [2, 3])],
                        [h.make_tensor("two", F, [], [2.0])])
    other = h.make_graph([h.make_node("Sub", ["x", "w"], ["e"])], "else", [], [vi("e", F, [2, 3])])
    if cond is None:
        nodes = [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["c"])]
    else:
        nodes = [h.make_node("Constant", [], ["c"], value=h.make_tensor("cv", TP.BOOL, [], [cond]))]
    nodes += [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="if0"),
              h.make_node("Relu", ["y"], ["z"])]
    return model(nodes, [vi("x", F, [2, 3])], [vi("z", F, [2, 3])],
                 [h.make_tensor("zero", F, [], [0.0]), h.make_tensor("w", F, [2, 3], np.arange(6.0))])


def loop_body(with_if: bool = False):
    """(i, cond, acc) -> (acc_next < limit, acc_next, acc_next * i): acc_next = acc * 1.5 + w (w: outer)."""
    nodes = [h.make_node("Mul", ["acc_in", "k"], ["scaled"], name="mul"),
             h.make_node("Add", ["scaled", "w"], ["acc_out"], name="add"),
             h.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
             h.make_node("Less", ["total", "limit"], ["cond_out"]),
             h.make_node("Cast", ["i"], ["fi"], to=F)]
    if with_if:
        # Nested: even iterations scan acc * i, odd ones acc - limit (limit read two scopes out).
        even = h.make_graph([h.make_node("Mul", ["acc_out", "fi"], ["ev"])], "even", [], [vi("ev", F, [3])])
        odd = h.make_graph([h.make_node("Sub", ["acc_out", "limit"], ["od"])], "odd", [], [vi("od", F, [3])])
        nodes += [h.make_node("Mod", ["i", "two_i"], ["r"]), h.make_node("Equal", ["r", "zero_i"], ["is_even"]),
                  h.make_node("If", ["is_even"], ["scan"], then_branch=even, else_branch=odd, name="inner_if")]
    else:
        nodes += [h.make_node("Mul", ["acc_out", "fi"], ["scan"])]
    inits = [h.make_tensor("k", F, [], [1.5]), h.make_tensor("two_i", I64, [], [2]), h.make_tensor("zero_i", I64, [], [0])]
    return h.make_graph(nodes, "body", [vi("i", I64, []), vi("cond", TP.BOOL, []), vi("acc_in", F, [3])],
                        [vi("cond_out", TP.BOOL, []), vi("acc_out", F, [3]), vi("scan", F, [3])], inits)


def loop_model(trip=True, cond=True, with_if=False, opset=17):
    ins = ["M" if trip else "", "c0" if cond else "", "a0"]
    nodes = [h.make_node("Loop", ins, ["acc", "scans"], body=loop_body(with_if), name="loop0")]
    inputs = ([vi("M", I64, [])] if trip else []) + ([vi("c0", TP.BOOL, [])] if cond else []) + [vi("a0", F, [3])]
    return model(nodes, inputs, [vi("acc", F, [3]), vi("scans", F, ["n", 3])],
                 [h.make_tensor("w", F, [3], [0.5, -1.0, 2.0]), h.make_tensor("limit", F, [], [40.0])], opset=opset)


def scan_model():
    """Scan-9 with two scan inputs (one along axis 1, one reversed), two states, and two scan outputs
    (one stacked along axis 1, one in reverse order)."""
    body = h.make_graph(
        [h.make_node("Add", ["s_in", "xa"], ["s_out"]), h.make_node("Mul", ["p_in", "xb"], ["p_out"]),
         h.make_node("Sub", ["s_out", "p_out"], ["d"]), h.make_node("Mul", ["s_out", "bias"], ["e"])],
        "scan_body", [vi("s_in", F, [2]), vi("p_in", F, [2]), vi("xa", F, [2]), vi("xb", F, [2])],
        [vi("s_out", F, [2]), vi("p_out", F, [2]), vi("d", F, [2]), vi("e", F, [2])])
    node = h.make_node("Scan", ["s0", "p0", "xa", "xb"], ["s", "p", "ds", "es"], body=body, num_scan_inputs=2,
                       scan_input_axes=[1, 0], scan_input_directions=[0, 1], scan_output_axes=[1, 0],
                       scan_output_directions=[0, 1])
    return model([node], [vi("s0", F, [2]), vi("p0", F, [2]), vi("xa", F, [2, 4]), vi("xb", F, [4, 2])],
                 [vi("s", F, [2]), vi("p", F, [2]), vi("ds", F, [2, 4]), vi("es", F, [4, 2])],
                 [h.make_tensor("bias", F, [2], [0.5, -2.0])])


# ---- results against onnxruntime -------------------------------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_with_a_data_dependent_condition(sign):
    x = sign * np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    check_against_ort(if_model(), {"x": x})


@pytest.mark.parametrize("trip,cond", [(True, True), (True, False), (False, True)])
def test_loop_carried_values_and_scan_outputs(trip, cond):
    m = loop_model(trip, cond)
    feeds = {"a0": np.array([1.0, 2.0, 3.0], np.float32)}
    if trip:
        feeds["M"] = np.array(6, np.int64)
    if cond:
        feeds["c0"] = np.array(True)
    acc, scans = check_against_ort(m, feeds)
    assert scans.shape[0] >= 2  # the loop ran


def test_loop_of_zero_iterations():
    feeds = {"M": np.array(0, np.int64), "c0": np.array(True), "a0": np.ones(3, np.float32)}
    acc, scans = check_against_ort(loop_model(), feeds)
    np.testing.assert_array_equal(acc, feeds["a0"])
    assert scans.shape == (0, 3)


def test_if_nested_in_a_loop_reads_values_two_scopes_out():
    feeds = {"M": np.array(5, np.int64), "c0": np.array(True), "a0": np.array([0.5, 0.0, -1.0], np.float32)}
    check_against_ort(loop_model(with_if=True), feeds)


def test_scan_axes_and_directions():
    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal(2).astype(np.float32), "p0": rng.standard_normal(2).astype(np.float32),
             "xa": rng.standard_normal((2, 4)).astype(np.float32), "xb": rng.standard_normal((4, 2)).astype(np.float32)}
    check_against_ort(scan_model(), feeds)


def test_the_subgraph_plan_is_prepared_once():
    """Each subgraph is partitioned and planned at session creation; runs reuse the same runner."""
    s = InferenceSession(loop_model(with_if=True))
    (loop,) = [n for n in s.plan.nodes if n.op_type == "Loop"]
    body = loop.kernel.runners["body"]
    (inner,) = [n for n in body.plan.nodes if n.op_type == "If"]
    assert set(inner.kernel.runners) == {"then_branch", "else_branch"}
    # The outer initializer 'limit' reaches the inner If's branch as a constant of the body (and of the
    # branch): an outer constant is the body's initializer, not a value fed at every iteration.
    assert "limit" in body.graph.initializers and "limit" not in [v.name for v in body.graph.inputs]
    assert "limit" in inner.kernel.runners["else_branch"].graph.initializers
    feeds = {"M": np.array(4, np.int64), "c0": np.array(True), "a0": np.ones(3, np.float32)}
    s.run(None, feeds)
    s.run(None, feeds)
    assert loop.kernel.runners["body"] is body


def test_a_failing_body_node_is_named():
    body = h.make_graph([h.make_node("Identity", ["c"], ["c_out"]),
                         h.make_node("Reshape", ["v", "bad_shape"], ["v_out"], name="body_reshape")], "b",
                        [vi("i", I64, []), vi("c", TP.BOOL, []), vi("v", F, [4])],
                        [vi("c_out", TP.BOOL, []), vi("v_out", F, ["d"])])
    m = model([h.make_node("Loop", ["M", "", "v0"], ["v"], body=body)], [vi("M", I64, []), vi("v0", F, [4])],
              [vi("v", F, ["d"])], [h.make_tensor("bad_shape", I64, [1], [3])])
    s = InferenceSession(m, sess_options=_no_optimizer())
    with pytest.raises(KernelError, match="^node 'body_reshape' \\(Reshape\\) on CPUExecutionProvider failed"):
        s.run(None, {"M": np.array(2, np.int64), "v0": np.ones(4, np.float32)})


def test_an_unsupported_body_op_is_refused_at_creation():
    body = h.make_graph([h.make_node("Custom", ["x"], ["y"], domain="my.domain", name="odd")], "b", [],
                        [vi("y", F, [2])])
    m = h.make_model(h.make_graph([h.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body)], "m",
                                  [vi("c", TP.BOOL, []), vi("x", F, [2])], [vi("z", F, [2])]),
                     opset_imports=[h.make_opsetid("", 17), h.make_opsetid("my.domain", 1)])
    with pytest.raises(ModelError, match=r"^no execution provider supports 1 node\(s\): 'odd' \(my.domain::Custom"):
        InferenceSession(m)


def _no_optimizer() -> SessionOptions:
    so = SessionOptions()
    so.graph_optimization_level = host.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


# ---- plugin EPs claim body nodes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env6(example_plugin):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(6))
    yield env
    gc.collect()
    env.close()


LOOP_FEEDS = {"M": np.array(5, np.int64), "c0": np.array(True), "a0": np.array([1.0, 2.0, 3.0], np.float32)}


@pytest.mark.parametrize("fuse", ["0", "1"])
def test_body_nodes_claimed_by_the_plugin(env6, fuse):
    """GetCapability sees the body's nodes: the example EP takes its Mul and Add (per node, or fused into
    one compiled partition), and the loop gives onnxruntime's results."""
    rec = example_record(6)
    rec.clear()
    s = InferenceSession(loop_model(), providers=[("ExampleEP", {"ops": "Add,Mul", "fuse": fuse})], env=env6,
                         sess_options=_no_optimizer())
    body = next(n for n in s.plan.nodes if n.op_type == "Loop").kernel.runners["body"]
    on_plugin = [n for n in body.plan.nodes if n.ep is not None]
    assert {m for n in on_plugin for m in (n.members or (n.name,))} >= {"mul", "add"}
    got = s.run(None, LOOP_FEEDS)
    for g, w in zip(got, ort_run(loop_model(), LOOP_FEEDS)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    iterations = got[1].shape[0]
    if fuse == "0":  # one kernel call per claimed body node and iteration
        assert rec.host_calls["KernelContext_GetIO"] == iterations * len(on_plugin)
    else:  # compiled partitions (consecutive claimed nodes fused), one Compute each per iteration
        assert all(n.members for n in on_plugin) and ("mul", "add") in [n.members for n in on_plugin]
        assert rec.fallbacks["frame_preallocated"] == iterations * len(on_plugin)
    assert s.plan.eps and s.plan.eps[0].name == "ExampleEP"  # gets OnRunStart / OnRunEnd for the whole run
    s.close()


def test_if_branches_are_partitioned_for_the_plugin(env6):
    """The If stays with the host; the example EP takes the Mul of its then branch and the Sub of its
    else branch (float nodes reading outer values), and runs whichever the condition picks."""
    rec = example_record(6)
    s = InferenceSession(if_model(), providers=[("ExampleEP", {"ops": "Mul,Sub"})], env=env6,
                         sess_options=_no_optimizer())
    assert s.node_assignment()["if0"] == "CPUExecutionProvider"
    branches = next(n for n in s.plan.nodes if n.op_type == "If").kernel.runners
    assert {n.op_type: n.ep.name for r in branches.values() for n in r.plan.nodes} == {"Mul": "ExampleEP",
                                                                                        "Sub": "ExampleEP"}
    for sign in (1, -1):
        rec.clear()
        x = sign * np.arange(1, 7, dtype=np.float32).reshape(2, 3)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ort_run(if_model(), {"x": x})[0])
        assert rec.host_calls["KernelContext_GetIO"] == 1  # one branch's node ran on the plugin


# ---- the optimizer on models with subgraphs --------------------------------------------------------------------
@pytest.mark.parametrize("cond", [True, False])
def test_optimizer_folds_an_if_with_a_constant_condition(cond):
    m = if_model(cond)
    result = optimize(m, host.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert "If" not in {n.op_type for n in result.model.graph.node}
    x = np.array([[1, -2, 3], [4, 5, -6]], np.float32)
    got = InferenceSession(result.model, sess_options=_no_optimizer()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ort_run(m, {"x": x})[0], rtol=1e-6)


def test_optimizer_keeps_an_identity_that_outputs_an_outer_value():
    """An If branch that returns an outer value through Identity (what exporters write): onnx-ir's pass
    raised 'already an output of a different graph' and the model ran unoptimized, with a warning."""
    then = h.make_graph([h.make_node("Identity", ["y"], ["t"])], "then", [], [vi("t", F, [3])])
    other = h.make_graph([h.make_node("Identity", ["x"], ["e0"]), h.make_node("Neg", ["e0"], ["e"])], "else", [],
                         [vi("e", F, [3])])
    m = model([h.make_node("Relu", ["x"], ["y"]), h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
               h.make_node("Greater", ["s", "zero"], ["c"]),
               h.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other)],
              [vi("x", F, [3])], [vi("z", F, [3])], [h.make_tensor("zero", F, [], [0.0])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "graph optimization failed" would be an error here
        s = InferenceSession(m)
    assert s.optimization is not None
    # The else branch's Identity (of an outer value, not an output) went; the then branch's stays.
    branches = {a.name: [n.op_type for n in a.g.node] for a in s.optimization.model.graph.node[-1].attribute}
    assert branches == {"then_branch": ["Identity"], "else_branch": ["Neg"]}
    for x in (np.array([1, -2, 3], np.float32), np.array([-1, -2, 3], np.float32)):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ort_run(m, {"x": x})[0])


def test_optimizer_optimizes_inside_a_loop_body():
    """Constant folding and dead-code removal reach the body; the loop still gives onnxruntime's results."""
    m = loop_model()
    body = m.graph.node[0].attribute[0].g
    body.node.extend([h.make_node("Add", ["k", "k"], ["k2"]), h.make_node("Mul", ["k2", "k2"], ["unused"])])
    result = optimize(m, host.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    new_body = result.model.graph.node[0].attribute[0].g
    assert len(new_body.node) < len(body.node)
    got = InferenceSession(result.model, sess_options=_no_optimizer()).run(None, LOOP_FEEDS)
    for g, w in zip(got, ort_run(loop_model(), LOOP_FEEDS)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


# ---- onnx's backend node tests of these categories --------------------------------------------------------------
CATEGORIES = re.compile(r"^test_(if|loop|scan|sequence|optional|split_to_sequence|concat_from_sequence|"
                        r"identity_opt|identity_sequence)")
# Fail on onnxruntime too: onnx's runner cannot compare a sequence of differently shaped tensors
# ("Unable to compare expected type ... and runtime type ...").
BOTH_FAIL = {"test_loop16_seq_none": "onnx's runner compares a ragged sequence with np.array and fails"}


def _node_cases():
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [tc for tc in load_model_tests(kind="node") if CATEGORIES.match(tc.name)]


def _signature(schema) -> tuple:
    """What a node of the op may hold: attributes, inputs and outputs (the type lists may differ)."""
    return (sorted(schema.attributes), [(i.name, i.option) for i in schema.inputs],
            [(o.name, o.option) for o in schema.outputs])


def in_window(m: onnx.ModelProto) -> onnx.ModelProto | None:
    """`m` at opset MAX_OPSET when it uses a newer one whose ops (subgraphs included) have the same
    attributes, inputs and outputs there; None when an op changed."""
    version = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    if version <= MAX_OPSET:
        return m
    ops = set()
    stack = [m.graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            ops.add(n.op_type)
            stack += [a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    for op in ops:
        if _signature(onnx.defs.get_schema(op, version)) != _signature(onnx.defs.get_schema(op, MAX_OPSET)):
            return None
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = MAX_OPSET
    return out


def test_backend_node_tests_of_control_flow_sequences_and_optionals():
    from onnx.backend.test.runner import Runner

    from host.runtime.backend import EphostBackend

    passed, failed, outside = [], [], []
    cases = _node_cases()
    for tc in cases:
        m = in_window(tc.model)
        if m is None:
            outside.append(tc.name)
            continue
        try:
            rep = EphostBackend.prepare(m)
            for inputs, outputs in tc.data_sets:
                Runner.assert_similar_outputs(outputs, rep.run(inputs), rtol=tc.rtol, atol=tc.atol)
            passed.append(tc.name)
        except Exception as exc:  # noqa: BLE001 - collected, then asserted below
            failed.append((tc.name, f"{type(exc).__name__}: {exc}"[:200]))
    print(f"\n{len(cases)} node tests: {len(passed)} pass, {len(failed)} fail, {len(outside)} use an op changed "
          f"after opset {MAX_OPSET}: {outside}")
    unexpected = [f for f in failed if f[0] not in BOTH_FAIL]
    assert not unexpected, unexpected
    assert len(passed) >= 35
