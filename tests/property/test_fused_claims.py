"""Property 10: fused-group claims (ABI v6) of two plugin EPs in one session.

The C plugin (ExampleCEP) claims every run of two or more same-shape float32 Adds as one fused
group; the example EP with fuse=1 claims each maximal run of consecutive nodes it takes. On a
model where their groups overlap, provider order decides: a later EP's group that shares a node with
an earlier claim is dropped (counted once per group in `fused_group_overlaps`), its other groups
stand, and the dropped group's free nodes still go to it one by one. The number of compiled
partitions each EP runs per call, the node assignment and the answers are checked; no graph view is
left open for Graph_AddNodesToFuse once the session exists.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from host.errors import KernelError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.conftest import built_plugin
from tests.property import harness as h

C_EP, EX, CPU = "ExampleCEP", "ExampleEP", "CPUExecutionProvider"
EX_FUSING = (EX, {"ops": "Add,Relu", "fuse": "1"})


def overlap_model(tail: bool):
    """a1, a2: same-shape Adds (both EPs take them); s: Sub (neither); r: Relu and b1: a broadcasting
    Add (only the example EP); with `tail`, two more same-shape Adds c1, c2 after b1."""
    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    nodes = [helper.make_node("Add", ["X", "Y"], ["a1"], name="a1"),
             helper.make_node("Add", ["a1", "Y"], ["a2"], name="a2"),
             helper.make_node("Sub", ["a2", "Y"], ["s"], name="s"),
             helper.make_node("Relu", ["s"], ["r"], name="r"),
             helper.make_node("Add", ["r", "B"], ["b" if tail else "Z"], name="b1")]
    if tail:
        nodes += [helper.make_node("Add", ["b", "Y"], ["c"], name="c1"),
                  helper.make_node("Add", ["c", "Y"], ["Z"], name="c2")]
    graph = helper.make_graph(nodes, "overlap", [vi("X", [2, 3]), vi("Y", [2, 3]), vi("B", [3])], [vi("Z", [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


FEEDS = {"X": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3), "Y": np.full((2, 3), 0.25, np.float32),
         "B": np.array([-1.0, 0.5, 2.0], np.float32)}


def reference(feeds, tail: bool):
    x, y, b = feeds["X"], feeds["Y"], feeds["B"]
    z = np.maximum(x + y + y - y, 0) + b
    return z + y + y if tail else z


# (providers, node assignment, overlapping groups dropped, the example EP's compiled partitions per run);
# "+tail": the example EP's second group [r, b1, c1, c2] overlaps the C EP's [c1, c2] too.
ONE, TWO = {"a1": C_EP, "a2": C_EP, "s": CPU, "r": EX, "b1": EX}, {"a1": EX, "a2": EX, "s": CPU, "r": EX, "b1": EX}
CASES = {
    "c-then-fusing+tail": ([C_EP, EX_FUSING], {**ONE, "c1": C_EP, "c2": C_EP}, 2, 0),
    "fusing-then-c+tail": ([EX_FUSING, C_EP], {**TWO, "c1": EX, "c2": EX}, 2, 2),
    "c-then-fusing": ([C_EP, EX_FUSING], {"a1": C_EP, "a2": C_EP, "s": CPU, "r": EX, "b1": EX}, 1, 1),
    "fusing-then-c": ([EX_FUSING, C_EP], {"a1": EX, "a2": EX, "s": CPU, "r": EX, "b1": EX}, 1, 2),
    "fusing-alone": ([EX_FUSING], {"a1": EX, "a2": EX, "s": CPU, "r": EX, "b1": EX}, 0, 2),
    "c-then-plain": ([C_EP, (EX, {"ops": "Add,Relu"})], {"a1": C_EP, "a2": C_EP, "s": CPU, "r": EX, "b1": EX}, 0, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlapping_fused_groups_follow_the_provider_order(case):
    order, assignment, overlaps, partitions = CASES[case]
    tail = case.endswith("+tail")
    gc.collect()
    h.clear_record(6)
    env = Environment(api_version=6)
    try:
        env.register_plugin("ex", built_plugin("example", 6))
        env.register_plugin("c", built_plugin("example_c"))
        sess = InferenceSession(overlap_model(tail), h.session_options(), providers=order, env=env)
        try:
            assert hostapi.FUSE_GROUPS.open_views() == 0
            assert sess.node_assignment() == assignment
            assert sess.fallbacks["fused_group_overlaps"] == overlaps
            rec = h.record(6)
            for run in (1, 2):
                (z,) = sess.run(None, FEEDS)
                np.testing.assert_allclose(z, reference(FEEDS, tail), rtol=1e-6)
                assert rec.slot_calls["EpNodeComputeInfo.Compute"] == partitions * run
        finally:
            sess.close()
    finally:
        gc.collect()
        env.close()


def _around_the_cpu_model():
    """a1 -> s -> a2 with a1 also feeding a2: a group {a1, a2} without s is not convex."""
    def vi(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3])

    nodes = [helper.make_node("Add", ["X", "Y"], ["a"], name="a1"), helper.make_node("Sub", ["a", "Y"], ["s"], name="s"),
             helper.make_node("Add", ["s", "a"], ["Z"], name="a2")]
    model = helper.make_model(helper.make_graph(nodes, "g", [vi("X"), vi("Y")], [vi("Z")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("fuse, refused, computes", [("all", 1, 0), ("all+all+runs", 2, 2)])
def test_a_group_that_is_not_convex_is_refused_with_a_warning_at_the_callers_line(fuse, refused, computes):
    """fuse=all claims a1 and a2 as one group around the CPU's Sub (a1 -> s -> a2): fusing it would
    make a cycle, so the host counts it, warns (pointing at the InferenceSession call), and runs
    both Adds as per-node kernels of the EP. fuse=all+all+runs proposes that group twice, then a1 and
    a2 as groups of one: both refusals are counted, and the later groups are still judged and
    compiled (one Compute each per run), not dropped with the refused ones."""
    version = 6
    model = _around_the_cpu_model()
    gc.collect()
    h.clear_record(version)
    env = Environment(api_version=version)
    try:
        reg = env.register_plugin("ex", built_plugin("example", version))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sess = InferenceSession(model, h.session_options(), providers=[(EX, {"ops": "Add", "fuse": fuse})],
                                    env=env)
        try:
            want = (f"EP 'ExampleEP' of plugin 'ex' ({reg.path}): fused group [0, 2] is not convex (a path leaves it "
                    "and comes back); its nodes are not fused")
            assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, want)] * refused
            assert all(h.warned_at(w.filename, __file__) for w in caught), [w.filename for w in caught]
            assert sess.fallbacks["fused_group_not_convex"] == refused
            assert sess.node_assignment() == {"a1": EX, "s": CPU, "a2": EX}
            x, y = FEEDS["X"], FEEDS["Y"]
            (z,) = sess.run(None, {"X": x, "Y": y})
            np.testing.assert_allclose(z, (x + y - y) + (x + y), rtol=1e-6)
            assert h.record(version).slot_calls["EpNodeComputeInfo.Compute"] == computes
        finally:
            sess.close()
    finally:
        gc.collect()
        env.close()


@pytest.mark.parametrize("c_first, ops, node, fused, members, index", [
    (False, "Add,Relu", "a2", "ExampleEP_fused_0", "'a1', 'a2'", 1),
    (False, "Add,Relu", "r", "ExampleEP_fused_1", "'r', 'b1', 'c1', 'c2'", 0),
    (True, "Relu", "r", "ExampleEP_fused_0", "'r'", 0),  # after the C EP's two groups: numbered per EP
])
def test_a_failing_node_is_named_with_its_fused_node_numbered_per_ep(c_first, ops, node, fused, members, index):
    """Fused nodes are numbered per EP in model order (EP_fused_0, _1, ...); a failure inside one
    names the fused node, its members and the node."""
    gc.collect()
    env = Environment(api_version=6)
    try:
        env.register_plugin("ex", built_plugin("example", 6))
        env.register_plugin("c", built_plugin("example_c"))
        ex = (EX, {"ops": ops, "fuse": "1", "fail_node": node})
        providers = [C_EP, ex] if c_first else [ex, C_EP]
        sess = InferenceSession(overlap_model(True), h.session_options(), providers=providers, env=env)
        try:
            op = "Add" if node == "a2" else "Relu"
            want = (f"fused node '{fused}' (nodes {members}) on ExampleEP, at node '{node}' ({op}) failed (FAIL): "
                    f"_ephost_example_v6: EpNodeComputeInfo.Compute failed: injected failure in node {index} of "
                    f"'{fused}'")
            with pytest.raises(KernelError) as info:
                sess.run(None, FEEDS)
            assert str(info.value) == want
        finally:
            sess.close()
    finally:
        gc.collect()
        env.close()


def test_an_unknown_fuse_mode_is_refused_by_the_example_ep():
    from tests.plugins.example_ep import _fuse_modes
    assert _fuse_modes("1") == ["runs"] and _fuse_modes("all+runs") == ["all", "runs"] and _fuse_modes("0") == []
    with pytest.raises(Exception, match=r"fuse='all\+some': unknown mode\(s\) \['some'\]"):
        _fuse_modes("all+some")


def test_a_profiled_run_names_each_compiled_partition_as_the_ep_numbers_it():
    """One Node event per compiled partition per run, under the fused node's name (the EP's own
    numbering, <EP>_fused_<k>), with op FusedPartition, the EP and the original nodes it holds."""
    import glob
    import json
    import tempfile

    gc.collect()
    env = Environment(api_version=6)
    try:
        env.register_plugin("ex", built_plugin("example", 6))
        with tempfile.TemporaryDirectory() as tmp:
            so = h.session_options(f"{tmp}/trace_")
            sess = InferenceSession(overlap_model(tail=False), so, providers=[EX_FUSING], env=env)
            try:
                sess.run(None, FEEDS)
                sess.end_profiling()
            finally:
                sess.close()
            (path,) = glob.glob(f"{tmp}/trace_*.json")
            with open(path, encoding="utf-8") as f:
                events = [e for e in json.load(f) if e["cat"] == "Node"]
        got = sorted((e["name"], e["args"]["op_name"], e["args"]["provider"], tuple(e["args"].get("fused_nodes", ())))
                     for e in events)
        assert got == [("ExampleEP_fused_0", "FusedPartition", EX, ("a1", "a2")),
                       ("ExampleEP_fused_1", "FusedPartition", EX, ("r", "b1")),
                       ("s", "Sub", CPU, ())]
    finally:
        gc.collect()
        env.close()


@pytest.mark.parametrize("host", [1, 5])
def test_a_compiling_plugin_on_an_older_host_records_the_kernel_fallback_per_session(host):
    """A v6 example EP asked to fuse, on a host older than v6: each session's GetCapability records
    one kernels_instead_of_compile (per-node kernels run instead), so two sessions record two."""
    gc.collect()
    h.clear_record(6)
    env = Environment(api_version=host)
    try:
        env.register_plugin("ex", built_plugin("example", 6))
        for n in (1, 2):
            sess = InferenceSession(overlap_model(tail=False), h.session_options(), providers=[EX_FUSING], env=env)
            try:
                np.testing.assert_allclose(sess.run(None, FEEDS)[0], reference(FEEDS, tail=False), rtol=1e-6)
            finally:
                sess.close()
            assert h.record(6).fallbacks["kernels_instead_of_compile"] == n
    finally:
        gc.collect()
        env.close()
