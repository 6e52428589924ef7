"""Property 9: more than one plugin EP in a session.

The Python example EP (ExampleEP, any ABI version, a drawn subset of its ops) and the plain-C
plugin (ExampleCEP: float32 Add of one known shape, no broadcasting) claim overlapping nodes.
Provider order decides: each node goes to the first provider in the list that claims it, the rest
to the CPU EP; the answers, eager and bound, equal both references.
"""

from __future__ import annotations

import gc

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

import abi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.conftest import built_plugin
from tests.property import harness as h
from tests.property import strategies as s

C_EP = "ExampleCEP"
CPU = "CPUExecutionProvider"


def shapes_of(case) -> dict[str, tuple[int, ...]]:
    """Every value's static shape: graph inputs, initializers, node outputs."""
    out = {k: tuple(v.shape) for k, v in case.feeds.items()}
    out.update({t.name: tuple(numpy_helper.to_array(t).shape) for t in case.model.graph.initializer})
    out.update(case.intermediates)
    return out


def float32(case) -> set[str]:
    """Names of float32 values (initializers of shape ops are int64)."""
    names = set(case.feeds) | set(case.intermediates)
    names |= {t.name for t in case.model.graph.initializer if t.data_type == 1}
    return names


def claims(case, ep: str, ops: set[str]) -> set[str]:
    """The nodes `ep` claims, by its documented rules."""
    shapes, floats = shapes_of(case), float32(case)
    out = set()
    for node in case.model.graph.node:
        if ep == h.EXAMPLE_EP:
            if node.op_type in ops and all(i in floats for i in node.input if i):
                out.add(node.name)
        elif node.op_type == "Add" and len(node.input) == 2:
            a, b, c = node.input[0], node.input[1], node.output[0]
            if all(v in floats for v in (a, b, c)) and shapes[a] == shapes[b] == shapes[c]:
                out.add(node.name)
    return out


def providers_for(order, ops):
    return [(h.EXAMPLE_EP, {"ops": ",".join(sorted(ops))}) if p == h.EXAMPLE_EP else p for p in order]


orders = st.sampled_from([(h.EXAMPLE_EP, C_EP), (C_EP, h.EXAMPLE_EP), (C_EP,), (h.EXAMPLE_EP,)])
op_sets = st.lists(st.sampled_from(s.EXAMPLE_EP_OPS), min_size=1, unique=True).map(frozenset)


def same_shape_adds(n: int):
    """Graphs with Add nodes both EPs can take (the C EP needs one shape, no broadcasting)."""
    return s.graphs(ops=("Add", "Add", "Add", "Mul", "Relu", "Reshape"), max_nodes=n)


@given(case=st.one_of(same_shape_adds(5), s.graphs(max_nodes=4)), host=s.versions, plugin=s.versions,
       order=orders, ops=op_sets)
@example(case=h.chain_case(), host=5, plugin=5, order=(h.EXAMPLE_EP, C_EP), ops=frozenset({"Add", "Mul"}))
@example(case=h.chain_case(), host=5, plugin=5, order=(C_EP, h.EXAMPLE_EP), ops=frozenset({"Add", "Mul"}))
@example(case=h.chain_case(), host=1, plugin=3, order=(C_EP, h.EXAMPLE_EP), ops=frozenset({"Add", "Relu"}))
@example(case=h.chain_case(), host=2, plugin=5, order=(h.EXAMPLE_EP, C_EP), ops=frozenset({"Add"}))
@settings(deadline=None, max_examples=s.budget(10))
def test_provider_order_decides_and_answers_equal_the_references(case, host, plugin, order, ops):
    refs = h.References(case)
    claimed = {ep: claims(case, ep, set(ops)) for ep in order}
    want = {}
    for name in case.nodes:
        want[name] = next((ep for ep in order if name in claimed[ep]), CPU)
    gc.collect()
    env = Environment(api_version=host)
    try:
        env.register_plugin("ex", built_plugin("example", plugin))
        env.register_plugin("c", built_plugin("example_c"))
        sess = InferenceSession(case.model, h.session_options(), providers=providers_for(order, ops), env=env)
        try:
            assert sess.node_assignment() == want
            # One count per plugin EP asked for that negotiated no v3 capture slots (the C plugin is built at
            # the current ABI version).
            negotiated = {h.EXAMPLE_EP: min(host, plugin), C_EP: min(host, abi.ABI_VERSION)}
            assert sess.fallbacks["no_graph_capture"] == sum(negotiated[ep] < 3 for ep in order)
            refs.check(sess.run(None, case.feeds), case.feeds, f"eager run, providers {order}")
            b, ins, outs = h.bind(sess, case.feeds2, case.outputs)
            sess.run_with_iobinding(b)
            refs.check([outs[n] for n in refs.names], case.feeds2, f"bound run, providers {order}")
            for o in outs.values():
                o[...] = np.nan
            h.refill(ins, case.feeds)
            sess.run_with_iobinding(b)
            refs.check([outs[n] for n in refs.names], case.feeds, f"second bound run, providers {order}")
        finally:
            sess.close()
    finally:
        gc.collect()
        env.close()
