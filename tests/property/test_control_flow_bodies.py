"""Control-flow bodies partitioned for the example plugin (host/runtime/partition ControlFlowStep bodies,
host/runtime/subgraph.py).

Random If branches and Loop bodies, chains of elementwise nodes over the outer input and the loop's
carried value, with ExampleEP claiming a random subset of the ops. A body's nodes are offered to every
EP of the session, as a graph's are: on the host (ExampleEP's default device) and as a mock GPU
(EPHOST_TEST_MOCK_DEVICE=1, device values then pass into the body and stay there between iterations)
it runs the claimed body nodes at every iteration; no fallback is counted. Every output equals
onnxruntime's; the plugin's Compute calls are what the model and the fed condition or trip count say.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import onnxruntime as ort
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property import strategies as s

V = 6
F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
OPS = ("Add", "Mul", "Sub", "Relu", "Sigmoid", "Neg")
BINARY = {"Add", "Mul", "Sub"}
EXAMPLE_OPS = ("Add", "Mul", "Sub", "Relu", "Sigmoid", "Identity")  # Neg is never claimed
MOCK_ENV = "EPHOST_TEST_MOCK_DEVICE"


@st.composite
def chains(draw, prefix: str, sources: tuple[str, ...]):
    """Nodes of a body: each reads the body's earlier values or `sources`; the last one is the result."""
    names = list(sources)
    nodes = []
    for i in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(OPS))
        ins = [draw(st.sampled_from(names)) for _ in range(2 if op in BINARY else 1)]
        out = f"{prefix}{i}"
        nodes.append(helper.make_node(op, ins, [out], name=out))
        names.append(out)
    return nodes


def vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, shape)


# On the mock device a claimed Identity leaves x in device memory: the If/Loop step copies it to the host.
BEFORE = helper.make_node("Identity", ["x_in"], ["x"], name="before")


def _if_model(then_nodes, else_nodes):
    then = helper.make_graph(then_nodes, "then", [], [vi(then_nodes[-1].output[0], F, [2, 3])])
    other = helper.make_graph(else_nodes, "else", [], [vi(else_nodes[-1].output[0], F, [2, 3])])
    nodes = [BEFORE, helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["total", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["cf"], then_branch=then, else_branch=other, name="if0"),
             helper.make_node("Relu", ["cf"], ["y"], name="after")]
    zero = helper.make_tensor("zero", F, [], [0.0])
    graph = helper.make_graph(nodes, "m", [vi("x_in", F, [2, 3])], [vi("y", F, [2, 3])], [zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _loop_model(body_nodes):
    last = body_nodes[-1].output[0]
    nodes = [*body_nodes, helper.make_node("Identity", ["cond_in"], ["cond_out"], name="cond"),
             helper.make_node("Identity", [last], ["scan_out"], name="scan")]
    body = helper.make_graph(nodes, "body", [vi("i", I64, []), vi("cond_in", B, []), vi("a_in", F, [2, 3])],
                             [vi("cond_out", B, []), vi(last, F, [2, 3]), vi("scan_out", F, [2, 3])])
    main = [BEFORE, helper.make_node("Loop", ["M", "", "x"], ["cf", "scans"], body=body, name="loop0"),
            helper.make_node("Relu", ["cf"], ["y"], name="after")]
    graph = helper.make_graph(main, "m", [vi("M", I64, []), vi("x_in", F, [2, 3])],
                              [vi("y", F, [2, 3]), vi("scans", F, [None, 2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@contextlib.contextmanager
def _mock_device(on: bool):
    """ExampleEP's factory reads the variable when the plugin is registered (inside example_env)."""
    old = os.environ.get(MOCK_ENV)
    os.environ[MOCK_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MOCK_ENV, None)
        else:
            os.environ[MOCK_ENV] = old


def _claimed(nodes, ops) -> int:
    return sum(n.op_type in ops for n in nodes)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["If", "Loop"]))
    if kind == "If":
        then, other = draw(chains("t", ("x",))), draw(chains("e", ("x",)))
        return kind, _if_model(then, other), (then, other)
    body = draw(chains("b", ("x", "a_in")))
    return kind, _loop_model(body), (body,)


@given(case=cases(), ops=st.lists(st.sampled_from(EXAMPLE_OPS), min_size=1, unique=True), device=st.booleans(),
       fuse=st.sampled_from(["0", "1"]), trips=st.integers(0, 3), sign=st.sampled_from([1.0, -1.0]))
@example(case=("Loop", _loop_model([helper.make_node("Add", ["a_in", "x"], ["b0"], name="b0")]),
               ([helper.make_node("Add", ["a_in", "x"], ["b0"], name="b0")],)),
         ops=["Add", "Relu"], device=True, fuse="0", trips=2, sign=1.0)
@settings(deadline=None, max_examples=s.budget(12))
def test_body_nodes_are_offered_to_every_ep(case, ops, device, fuse, trips, sign):
    kind, model, bodies = case
    x = sign * np.abs(np.random.default_rng(trips).standard_normal((2, 3))).astype(np.float32) + sign * 0.1
    feeds = {"x_in": x} if kind == "If" else {"M": np.array(trips, np.int64), "x_in": x}
    options = {"ops": ",".join(ops), "fuse": fuse}
    with _mock_device(device), h.example_env(V, (V,)) as env:
        with InferenceSession(model, h.session_options(), providers=[(h.EXAMPLE_EP, options)], env=env) as sess:
            got = sess.run(None, feeds)
            fallbacks = +sess.fallbacks
            (cf,) = [n for n in sess.plan.nodes if n.op_type == kind]
            body_eps = {n.provider for r in cf.kernel.runners.values() for n in r.plan.nodes}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **h.TIGHT)
    assert "subgraph_without_device_eps" not in fallbacks  # bodies are partitioned like graphs, device EPs included
    assert body_eps <= {h.EXAMPLE_EP, "CPUExecutionProvider"}
    if any(_claimed(body, ops) for body in bodies):
        assert h.EXAMPLE_EP in body_eps
    if fuse == "1":
        return  # compiled partitions: one Compute per group, counted in test_compiled_groups.py
    # The body that ran: the branch the sign picks, or the loop body `trips` times (plus its scan Identity).
    if kind == "If":
        ran = _claimed(bodies[0] if sign > 0 else bodies[1], ops)
    else:
        ran = trips * (_claimed(bodies[0], ops) + ("Identity" in ops))  # the cond Identity is bool: never claimed
    main = int("Relu" in ops) + int("Identity" in ops)
    assert h.record(V).slot_calls["EpKernel.Compute"] == main + ran
