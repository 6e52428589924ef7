"""Property 1: whatever the graph, the version pair, the NULL slots and the (valid) options, a
session with ExampleEP gives the outputs of onnxruntime's CPU EP and of onnx's ReferenceEvaluator
within the tolerances stated in harness.py: eagerly, from several threads, and replayed from a
captured graph (v3..v5, ALL_NODES_ON_EP: a graph with a node ExampleEP does not take must be
refused at session creation, naming that node).
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import abi
from host.errors import GraphCaptureError
from tests.property import harness as h
from tests.property import strategies as s

pytestmark = pytest.mark.filterwarnings("ignore:ExampleEP did not capture graph:RuntimeWarning")


@given(case=s.graphs(), host=s.versions, plugin=s.versions, null_slots=s.null_slot_sets,
       opts=s.example_ep_options(graph=False), intra=st.sampled_from([0, 1, 2]))
@example(case=h.chain_case(), host=5, plugin=5, null_slots=(), opts={}, intra=1)
@settings(deadline=None)
def test_eager_run_matches_references(case, host, plugin, null_slots, opts, intra):
    """Also with intra_op_num_threads set (the session bounds the BLAS threads around a run)."""
    refs = h.References(case)
    with h.example_env(host, [plugin]) as env:
        sess = h.session(case, env, h.with_null_slots(opts, null_slots), intra_op_threads=intra)
        cpu = h.session(case, env, providers=[], intra_op_threads=intra)
        try:
            expected_on_ep = {n for n, op in case.nodes.items() if op in h.claimed_ops(opts)}
            assert {n for n, ep in sess.node_assignment().items() if ep == h.EXAMPLE_EP} == expected_on_ep
            refs.check(sess.run(None, case.feeds), case.feeds, "ExampleEP eager run")
            refs.check(sess.run(None, case.feeds2), case.feeds2, "ExampleEP second eager run")
            refs.check(cpu.run(None, case.feeds), case.feeds, "host CPU EP run")
            # Output names asked in another order come back in that order.
            names = list(case.outputs)[::-1]
            got = sess.run(names, case.feeds)
            ref, scale = refs.reference(case.feeds)
            by_name = dict(zip(refs.names, ref))
            for n, g in zip(names, got):
                np.testing.assert_allclose(g, by_name[n], **refs.tolerance(scale))
        finally:
            sess.close()
            cpu.close()


@given(case=s.graphs(), host=s.versions, plugin=s.versions, null_slots=s.null_slot_sets,
       opts=s.example_ep_options(graph=False), threads=s.thread_counts)
@settings(deadline=None, max_examples=s.budget(15))
def test_runs_from_threads_match_references(case, host, plugin, null_slots, opts, threads):
    refs = h.References(case)
    feeds = [case.feeds, case.feeds2]
    expected = [refs.reference(f) for f in feeds]
    errors: list[BaseException] = []
    with h.example_env(host, [plugin]) as env:
        sess = h.session(case, env, h.with_null_slots(opts, null_slots))
        try:
            negotiated = min(host, plugin)
            on_ep = any(op in h.claimed_ops(opts) for op in case.nodes.values())
            want = h.concurrent(negotiated, null_slots, opts) or not on_ep
            assert sess.fallbacks["concurrent_runs" if want else "serialised_runs"] == 1

            def worker(i: int) -> None:
                try:
                    for j in range(3):
                        k = (i + j) % 2
                        got = sess.run(None, feeds[k])
                        for g, r in zip(got, expected[k][0]):
                            np.testing.assert_allclose(g, r, **refs.tolerance(expected[k][1]))
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    errors.append(exc)

            ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        finally:
            sess.close()
    if errors:
        raise errors[0]


capture_versions = st.sampled_from([3, 4, 5, 6])


@given(case=s.graphs(max_nodes=5), host=capture_versions, plugin=capture_versions, null_slots=s.null_slot_sets,
       opts=s.example_ep_options(graph=True), ro=s.run_options)
@settings(deadline=None)
def test_replay_matches_references(case, host, plugin, null_slots, opts, ro):
    refs = h.References(case)
    negotiated = min(host, plugin)
    state = h.capture_state(negotiated, null_slots, opts)
    ops = h.claimed_ops(opts)
    with h.example_env(host, [plugin]) as env:
        if state != "off" and not case.claimable_by(ops):
            with pytest.raises(GraphCaptureError, match=r"^graph capture on ExampleEP requires all nodes on the EP; "
                                                        r"offending node\(s\): ") as info:
                h.session(case, env, h.with_null_slots(opts, null_slots))
            listed = str(info.value)
            for name, op in case.nodes.items():
                named = f"'{name}' ({op} on CPUExecutionProvider)" in listed
                assert named is (name in case.offending(ops)), listed
            return
        sess = h.session(case, env, h.with_null_slots(opts, null_slots))
        try:
            assert sess.capture.enabled is (state != "off")
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            run_opts = ro.make()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sess.run_with_iobinding(b, run_opts)  # warm-up runs and the capture, in one call
            refs.check([outs[n] for n in refs.names], case.feeds, "capturing run")
            captures = state == "on" and ro.gid != -1
            gave_up = state == "never" and ro.gid != -1
            assert sess.fallbacks["graph_captured"] == int(captures)
            assert sess.fallbacks["capture_not_reached"] == int(gave_up)
            assert any("did not capture graph" in str(w.message) for w in caught) is gave_up
            assert [o is outs[n] for n, o in zip(refs.names, b.get_output_values())] == [True] * len(refs.names)
            rec = h.record(plugin)
            steps_before = rec.slot_calls["replayed_steps"]
            h.refill(ins, case.feeds2)
            for o in outs.values():
                o[...] = np.nan  # a replay that writes nothing is caught
            sentinels = h.Sentinels(case)
            sess.run_with_iobinding(b, run_opts)
            assert sentinels.overwritten() == 0, "the replay wrote into memory its graph does not own"
            refs.check([outs[n] for n in refs.names], case.feeds2, "replayed run" if captures else "eager bound run")
            assert rec.slot_calls["replayed_steps"] - steps_before == (len(case.nodes) if captures else 0)
        finally:
            sess.close()


@given(case=s.elementwise_graphs(max_nodes=4), version=capture_versions, threads=st.integers(2, 4),
       min_runs=st.integers(0, 2))
@settings(deadline=None, max_examples=s.budget(10))
def test_replay_from_threads_matches_references(case, version, threads, min_runs):
    """Threads capture and replay their own graphs, each into its own bound buffers. Each thread
    uses its own graph id: ExampleEP keeps one graph per id for all threads (the same id from two
    threads is test_regressions.py::test_threads_capturing_the_same_graph_id_get_their_own_graphs)."""
    refs = h.References(case)
    want = [refs.reference(case.feeds), refs.reference(case.feeds2)]
    errors: list[BaseException] = []
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": str(min_runs)})
        try:
            def worker(i: int) -> None:
                try:
                    b, ins, outs = h.bind(sess, case.feeds, case.outputs)
                    ro = s.RunOpts(str(i), None).make()
                    for k in (0, 1, 0):
                        h.refill(ins, case.feeds if k == 0 else case.feeds2)
                        for o in outs.values():
                            o[...] = np.nan
                        sess.run_with_iobinding(b, ro)
                        for n, r in zip(refs.names, want[k][0]):
                            np.testing.assert_allclose(outs[n], r, **refs.tolerance(want[k][1]))
                    assert sorted(sess.capture.signatures) == [i]
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    errors.append(exc)

            ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert sess.fallbacks["graph_captured"] == threads
            assert sess.fallbacks["replay_stream_sync" if version >= abi.since("Ep", "ReplayGraphWithSync") else "replay_device_sync"] == 2 * threads
        finally:
            sess.close()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("on_example_ep", [False, True])
def test_results_are_the_callers_own(on_example_ep):
    """Outputs that are views (an Identity or a Reshape of a feed, on the CPU EP) come back as copies:
    neither overwriting the feeds afterwards nor the next run changes results already returned."""
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, [3, 2])
    nodes = [helper.make_node("Identity", ["X"], ["A"], name="id"), helper.make_node("Reshape", ["X", "S"], ["B"], name="r")]
    shape = numpy_helper.from_array(np.array([3, 2], np.int64), "S")
    model = helper.make_model(helper.make_graph(nodes, "views", [x], [a, b], [shape]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    first = np.arange(6, dtype=np.float32).reshape(2, 3)
    with h.example_env(5, [5]) as env:
        sess = h.session(model, env, {"ops": "Add"}, providers=None if on_example_ep else [])
        try:
            feeds = {"X": first.copy()}
            got = sess.run(None, feeds)
            feeds["X"].fill(np.nan)
            sess.run(None, {"X": np.full((2, 3), -1.0, np.float32)})
            np.testing.assert_array_equal(got[0], first)
            np.testing.assert_array_equal(got[1], first.reshape(3, 2))
        finally:
            sess.close()


@given(x=hnp.arrays(np.float32, (2, 4), elements=st.floats(-2, 2, width=32)), on_example_ep=st.booleans())
@settings(deadline=None, max_examples=s.budget(10))
def test_omitted_optional_inputs_and_outputs(x, on_example_ep):
    """Clip with its `min` omitted ("") and LayerNormalization with its Mean output omitted, next to
    values used later: an omitted name is no value at all, never another value of the graph."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    nodes = [helper.make_node("Clip", ["X", "", "hi"], ["C"], name="clip"),
             helper.make_node("LayerNormalization", ["X", "sc", "bi"], ["L", "", "I"], name="ln"),
             helper.make_node("Add", ["X", "Y"], ["A"], name="add")]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "hi"),
             numpy_helper.from_array(np.ones(4, np.float32), "sc"), numpy_helper.from_array(np.zeros(4, np.float32), "bi")]
    graph = helper.make_graph(nodes, "optional", [vi("X", [2, 4]), vi("Y", [2, 4])],
                              [vi("C", [2, 4]), vi("L", [2, 4]), vi("I", [2, 1]), vi("A", [2, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    feeds = {"X": x, "Y": x + 3.0}
    want = ReferenceEvaluator(model).run(None, feeds)
    with h.example_env(5, [5]) as env:
        sess = h.session(model, env, {"ops": "Add"}, providers=None if on_example_ep else [])
        try:
            for got, ref in zip(sess.run(None, feeds), want):
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        finally:
            sess.close()
