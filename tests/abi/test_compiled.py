"""Compiled partitions (ABI v6): fused claims, Ep.Compile, one Compute per partition per run.

The example EP (option fuse=1) fuses every run of consecutive claimed nodes and compiles it into
a NumPy closure; the C plugin fuses chains of float32 Adds. Results are checked against
onnx.reference.ReferenceEvaluator; ABI crossings are counted by the plugins' own records.
"""

from __future__ import annotations

import functools
import re
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import abi
import build
from abi import sdk
from host.errors import InvalidArgument, KernelError
from host.plugins.environment import Environment
from host.plugins.hostapi import FUSE_GROUPS, _api_table, ffi
from host.runtime.model import build_graph
from host.runtime.partition import claims
from host.runtime.partition import compile as compiled_
from host.runtime.session import InferenceSession, RunOptions
from tests.abi.conftest import GraphView, Node, Value
from tests.conftest import built_plugin

EP = "ExampleEP"


def chain_model(ops=("Add", "Relu", "Mul"), shape=(2, 3), dynamic=False) -> onnx.ModelProto:
    """x -> op0 -> op1 -> ... -> y; binary ops take a weight initializer (Add) or x itself."""
    dims = ["N", shape[1]] if dynamic else list(shape)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    w = onnx.numpy_helper.from_array(np.linspace(-1, 1, shape[1], dtype=np.float32), "w")
    nodes, prev = [], "x"
    for i, op in enumerate(ops):
        out = "y" if i == len(ops) - 1 else f"t{i}"
        ins = [prev] if op in ("Relu", "Sigmoid", "Identity") else [prev, "w" if op == "Add" else "x"]
        nodes.append(helper.make_node(op, ins, [out], name=f"{op.lower()}{i}"))
        prev = out
    graph = helper.make_graph(nodes, "chain", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds)


def record(version: int) -> sdk.Record:
    return sdk.runtime(build.module_name("example", version)).record


@pytest.fixture
def env6(plugins):
    with Environment() as env:
        env.register_plugin("ex6", plugins.example[6])
        record(6).clear()
        yield env


def session(env, model, **options) -> InferenceSession:
    opts = {"fuse": "1", **options}
    return InferenceSession(model.SerializeToString(), providers=[(EP, opts)], env=env)


def _x(n=2, cols=3, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, cols)).astype(np.float32)


# ---- one crossing per partition ---------------------------------------------------------------

def test_whole_chain_is_one_partition_with_one_compute_per_run(env6):
    model = chain_model(("Add", "Relu", "Mul", "Sigmoid"))
    with session(env6, model) as s:
        assert [n.name for n in s.plan.nodes] == [f"{EP}_fused_0"]
        assert s.node_assignment() == {"add0": EP, "relu1": EP, "mul2": EP, "sigmoid3": EP}
        rec = record(6)
        released = rec.live["compute_state_released"]  # a running total: Record.clear() keeps `live`
        for run in range(1, 4):
            x = _x(seed=run)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
            assert rec.slot_calls["EpNodeComputeInfo.Compute"] == run
        assert rec.slot_calls["Ep.Compile"] == 1
        assert rec.slot_calls["EpNodeComputeInfo.CreateState"] == 1
        assert rec.slot_calls["EpKernel.Compute"] == 0 and rec.slot_calls["Ep.CreateKernel"] == 0
        assert rec.host_calls["KernelContext_GetIO"] == 0
        assert rec.host_calls["Graph_AddNodesToFuse"] == 1
    assert rec.live["EpNodeComputeInfo"] == 0, "closing the session releases the compute info"
    assert rec.live["compute_state_released"] - released == 1


def test_two_partitions_around_a_cpu_node_compile_in_one_call(env6):
    model = chain_model(("Add", "Mul", "Sigmoid", "Add", "Relu"))
    with session(env6, model, ops="Add,Mul,Relu") as s:
        plan = [(n.name, n.ep.name if n.ep else "CPU") for n in s.plan.nodes]
        assert plan == [(f"{EP}_fused_0", EP), ("sigmoid2", "CPU"), (f"{EP}_fused_1", EP)]
        rec = record(6)
        for run in range(1, 3):
            x = _x(seed=run)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
        assert rec.slot_calls["Ep.Compile"] == 1, "one Compile call per EP with all its groups"
        assert rec.slot_calls["EpNodeComputeInfo.Compute"] == 2 * 2
        assert rec.slot_calls["EpKernel.Compute"] == 0


# ---- outputs: preallocated (static) or through the callback (dynamic) ---------------------------

def test_static_outputs_are_preallocated_and_no_callback_is_made(env6):
    model = chain_model(("Add", "Relu"))
    with session(env6, model) as s:
        for run in range(3):
            x = _x(seed=run)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
    rec = record(6)
    assert rec.fallbacks["frame_preallocated"] == 3
    assert rec.host_calls["AllocateOutput"] == 0


def test_dynamic_outputs_come_through_the_allocation_callback(env6):
    model = chain_model(("Add", "Relu", "Mul"), dynamic=True)
    with session(env6, model) as s:
        part = s.plan.nodes[0].kernel
        assert part.static_shapes == [None]
        for n in (1, 4, 7):
            x = _x(n=n, seed=n)
            got = s.run(None, {"x": x})[0]
            assert got.shape == (n, 3)
            np.testing.assert_allclose(got, reference(model, {"x": x})[0], rtol=1e-6)
    rec = record(6)
    assert rec.host_calls["AllocateOutput"] == 3
    assert rec.fallbacks["frame_preallocated"] == 0


def test_bound_output_is_written_in_place(env6):
    model = chain_model(("Add", "Relu"))
    with session(env6, model) as s:
        x = _x(seed=3)
        out = np.zeros((2, 3), np.float32)
        b = s.io_binding()
        b.bind_input("x", x)
        b.bind_output("y", out)
        s.run_with_iobinding(b)
        np.testing.assert_allclose(out, reference(model, {"x": x})[0], rtol=1e-6)


# ---- compile failures and run-time errors -----------------------------------------------------

def test_compile_failure_falls_back_to_per_node_kernels_with_a_warning(env6):
    model = chain_model(("Add", "Relu", "Mul"))
    with pytest.warns(RuntimeWarning, match=rf"^{EP}: fused node '{EP}_fused_0' could not be compiled \(.*"
                                            r"injected compile failure.*\); its 3 node\(s\) run as per-node kernels$"):
        s = session(env6, model, compile_fails="all")
    with s:
        assert [n.name for n in s.plan.nodes] == ["add0", "relu1", "mul2"]
        assert s.fallbacks["compile_failed"] == 1
        x = _x(seed=5)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
        rec = record(6)
        assert rec.slot_calls["EpKernel.Compute"] == 3
        assert rec.slot_calls["EpNodeComputeInfo.Compute"] == 0


def test_only_the_partition_that_fails_to_compile_falls_back(env6):
    model = chain_model(("Add", "Mul", "Sigmoid", "Add", "Relu"))
    with pytest.warns(RuntimeWarning, match=rf"^{EP}: fused node '{EP}_fused_1' could not be compiled"):
        s = session(env6, model, ops="Add,Mul,Relu", compile_fails="relu4")
    with s:
        assert [n.name for n in s.plan.nodes] == [f"{EP}_fused_0", "sigmoid2", "add3", "relu4"]
        x = _x(seed=6)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
        rec = record(6)
        assert rec.slot_calls["Ep.Compile"] == 3, "the batch, then each group alone"
        assert rec.slot_calls["EpNodeComputeInfo.Compute"] == 1
        assert rec.slot_calls["EpKernel.Compute"] == 2


def test_an_error_inside_compute_names_the_fused_node_and_the_original_node(env6):
    model = chain_model(("Add", "Relu", "Mul"))
    with session(env6, model, fail_node="relu1") as s:
        with pytest.raises(KernelError, match=rf"^fused node '{EP}_fused_0' \(nodes 'add0', 'relu1', 'mul2'\) on "
                                              rf"{EP}, at node 'relu1' \(Relu\) failed \(FAIL\): .*injected failure "
                                              r"in node 1") as info:
            s.run(None, {"x": _x()})
        assert (info.value.node, info.value.ep) == (f"{EP}_fused_0", EP)


# ---- graph capture -----------------------------------------------------------------------------

def test_capture_flag_is_set_only_on_capture_runs_and_replay_recomputes(env6):
    model = chain_model(("Add", "Relu", "Mul"))
    with session(env6, model, enable_graph="1", min_runs="1") as s:
        rec = record(6)
        x = np.zeros((2, 3), np.float32)
        out = np.zeros((2, 3), np.float32)
        b = s.io_binding()
        b.bind_input("x", x)
        b.bind_output("y", out)
        s.run(None, {"x": _x()})
        assert rec.fallbacks["frame_capturing"] == 0, "a plain run is not a capture run"
        ro = RunOptions()
        ro.add_run_config_entry("gpu_graph_id", "1")
        x[...] = _x(seed=1)
        s.run_with_iobinding(b, ro)  # warm-up + capture, both marked in the frame
        assert rec.fallbacks["frame_capturing"] == 2
        assert s.capture.captured(1)
        computes = rec.slot_calls["EpNodeComputeInfo.Compute"]
        for seed in (2, 3):
            x[...] = _x(seed=seed)
            s.run_with_iobinding(b, ro)  # replay: no Compute crossing, the recording runs
            np.testing.assert_allclose(out, reference(model, {"x": x})[0], rtol=1e-6)
        assert rec.slot_calls["EpNodeComputeInfo.Compute"] == computes
        assert rec.fallbacks["frame_capturing"] == 2


# ---- version gating both ways ------------------------------------------------------------------

@pytest.mark.parametrize(("host", "plugin"), [(5, 6), (6, 5), (4, 6), (6, 6)])
def test_compiled_path_only_when_both_sides_are_v6(plugins, host, plugin):
    model = chain_model(("Add", "Relu", "Mul"))
    with Environment(api_version=host) as env:
        env.register_plugin("ex", plugins.example[plugin])
        rec = record(plugin)
        rec.clear()
        with session(env, model) as s:
            x = _x(seed=host + plugin)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
            compiled_path = min(host, plugin) >= 6
            assert [n.name for n in s.plan.nodes] == ([f"{EP}_fused_0"] if compiled_path
                                                      else ["add0", "relu1", "mul2"])
        assert rec.slot_calls["Ep.Compile"] == int(compiled_path)
        assert rec.slot_calls["EpKernel.Compute"] == (0 if compiled_path else 3)
        assert rec.host_calls["Graph_AddNodesToFuse"] == int(compiled_path)
        # The SDK installs the kernel path by itself: claim_fused is never asked on an older host.
        assert rec.fallbacks["kernels_instead_of_compile"] == (0 if compiled_path else 1)


# ---- the host API and the partitioner ------------------------------------------------------------

def _add_nodes_to_fuse(view, nodes, count=None):
    arr = ffi.new("int32_t[]", list(nodes) or [0])
    return _api_table(6).Graph_AddNodesToFuse(view.ptr, arr, len(nodes) if count is None else count)


def _status_text(status) -> str:
    from host.plugins import hostapi

    code, message = hostapi.STATUSES.get(status)
    hostapi.STATUSES.release(status)
    return f"{abi.STATUS_NAMES[code]}: {message}"


def test_add_nodes_to_fuse_validates_its_arguments():
    view = GraphView([Value("a"), Value("b"), Value("c"), Value("d")],
                     [Node("n0", "Add", (0, 1), (2,)), Node("n1", "Add", (2, 1), (3,))])
    assert _status_text(_add_nodes_to_fuse(view, [0, 1])).startswith(
        "INVALID_ARGUMENT: Graph_AddNodesToFuse: the graph is not in GetCapability")
    groups = FUSE_GROUPS.begin(view.ptr)
    try:
        assert _add_nodes_to_fuse(view, [1, 0]) == ffi.NULL
        assert _status_text(_add_nodes_to_fuse(view, [0, 2])) == (
            "INVALID_ARGUMENT: Graph_AddNodesToFuse: node indices [2] out of range; allowed 0..1")
        assert _status_text(_add_nodes_to_fuse(view, [1, 1])) == (
            "INVALID_ARGUMENT: Graph_AddNodesToFuse: node indices [1, 1] repeat a node")
        assert _status_text(_add_nodes_to_fuse(view, [], count=0)) == (
            "INVALID_ARGUMENT: Graph_AddNodesToFuse: expected 1 or more node indices; got count 0")
        assert groups == [(1, 0)]
    finally:
        FUSE_GROUPS.end(view.ptr)


def test_convexity_and_unit_order():
    # a -> n0 -> b ; b -> n1 (outside) -> c ; (b, c) -> n2 -> d : {n0, n2} is not convex.
    x = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])
    d = helper.make_tensor_value_info("d", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["a"], ["b"], name="n0"), helper.make_node("Relu", ["b"], ["c"], name="n1"),
             helper.make_node("Add", ["b", "c"], ["d"], name="n2")]
    g = build_graph(helper.make_model(helper.make_graph(nodes, "g", [x], [d]),
                                      opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    assert claims.is_convex(g, {0, 2}) is False
    assert claims.is_convex(g, {0, 1}) is True and claims.is_convex(g, {1, 2}) is True
    assert claims.is_convex(g, {0, 1, 2}) is True
    # Contracting {n1, n2} into one unit: it must run after n0.
    assert claims.unit_order(g, [(1, 2), (0,)]) == [1, 0]
    # a -> m0 -> b ; a -> m1 -> c ; (b, c) -> m2 -> d : {m0, m2} is convex, and as one unit it waits
    # for m1, although its first node comes before m1 in the model.
    nodes = [helper.make_node("Relu", ["a"], ["b"], name="m0"), helper.make_node("Relu", ["a"], ["c"], name="m1"),
             helper.make_node("Add", ["b", "c"], ["d"], name="m2")]
    g = build_graph(helper.make_model(helper.make_graph(nodes, "g", [x], [d]),
                                      opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    assert claims.is_convex(g, {0, 2}) is True
    assert claims.unit_order(g, [(0, 2), (1,)]) == [1, 0]


def test_static_shape_needs_every_dimension_known():
    from host.runtime.model import ValueMeta

    assert compiled_.static_shape(ValueMeta("v", 1, (2, 0, 3))) == (2, 0, 3)
    assert compiled_.static_shape(ValueMeta("v", 1, ("N", 3))) is None
    assert compiled_.static_shape(ValueMeta("v", 1, None)) is None
    assert compiled_.inferred_dims(ValueMeta("v", 1, ("N", 3))) == (-1, 3)


def test_a_group_overlapping_a_higher_priority_claim_is_dropped(cc, plugins):
    """ExampleCEP (first) fuses the two Adds; ExampleEP's group of all three nodes overlaps it and is
    dropped, its single claim of the Relu stands."""
    path, _ = c_plugin_at(abi.ABI_VERSION)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Add", ["x", "x"], ["a"], name="add0"),
             helper.make_node("Add", ["a", "x"], ["b"], name="add1"),
             helper.make_node("Relu", ["b"], ["y"], name="relu2")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    with Environment() as env:
        env.register_plugin("c", path)
        env.register_plugin("ex", plugins.example[6])
        providers = ["ExampleCEP", (EP, {"fuse": "1"})]
        with InferenceSession(model.SerializeToString(), providers=providers, env=env) as s:
            assert [(n.name, n.ep.name) for n in s.plan.nodes] == [("ExampleCEP_fused_0", "ExampleCEP"),
                                                                   ("relu2", EP)]
            assert s.fallbacks["fused_group_overlaps"] == 1
            xv = _x(seed=11)
            np.testing.assert_allclose(s.run(None, {"x": xv})[0], reference(model, {"x": xv})[0], rtol=1e-6)


# ---- the C plugin --------------------------------------------------------------------------------

@functools.cache
def c_plugin_at(version: int):
    """The C plugin built for `version` and its counters (the cached lib keeps the library loaded)."""
    # The current version comes from the suite's one build cache (a library is loaded once per process).
    path = built_plugin("example_c") if version == abi.ABI_VERSION else build.build_c_plugin("example_c",
                                                                                            version=version)
    return path, _counters_ffi().dlopen(str(path))


def add_chain(n_adds: int, shape=(2, 3)) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    w = onnx.numpy_helper.from_array(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), "w")
    nodes, prev = [], "x"
    for i in range(n_adds):
        out = "y" if i == n_adds - 1 else f"t{i}"
        nodes.append(helper.make_node("Add", [prev, "w" if i % 2 == 0 else "x"], [out], name=f"add{i}"))
        prev = out
    return helper.make_model(helper.make_graph(nodes, "adds", [x], [y], [w]),
                             opset_imports=[helper.make_opsetid("", 17)])


_C_COUNTERS = "int ExampleC_ComputeCalls(void); int ExampleC_KernelCalls(void); int ExampleC_LiveObjects(void);"


@functools.cache
def _counters_ffi():
    import cffi

    f = cffi.FFI()
    f.cdef(_C_COUNTERS)
    return f


C_PAIRS = [(h, p) for h in abi.SUPPORTED_VERSIONS for p in abi.SUPPORTED_VERSIONS]


@pytest.mark.parametrize(("host", "plugin"), C_PAIRS, ids=[f"host{h}-plugin{p}" for h, p in C_PAIRS])
def test_c_plugin_fuses_a_chain_of_adds(cc, host, plugin):
    """The C plugin built for each ABI version (build.py -DEXAMPLE_C_ABI=N) on each host version."""
    path, lib = c_plugin_at(plugin)
    model = add_chain(4)
    with Environment(api_version=host) as env:
        env.register_plugin("c", path)
        computes, kernels = lib.ExampleC_ComputeCalls(), lib.ExampleC_KernelCalls()
        with InferenceSession(model.SerializeToString(), providers=["ExampleCEP"], env=env) as s:
            for seed in range(3):
                x = _x(seed=seed)
                np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
            live_in_session = lib.ExampleC_LiveObjects()
        if min(host, plugin) >= 6:
            assert (lib.ExampleC_ComputeCalls() - computes, lib.ExampleC_KernelCalls() - kernels) == (3, 0)
        else:
            assert (lib.ExampleC_ComputeCalls() - computes, lib.ExampleC_KernelCalls() - kernels) == (0, 3 * 4)
        assert live_in_session > lib.ExampleC_LiveObjects(), "the session's objects are released"


def test_c_plugin_dynamic_shape_is_not_fused(cc):
    """The C plugin fuses only chains of one known shape; a symbolic dim keeps the CPU EP."""
    path, _ = c_plugin_at(abi.ABI_VERSION)
    model = add_chain(2)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    with Environment() as env:
        env.register_plugin("c", path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with InferenceSession(model.SerializeToString(), providers=["ExampleCEP"], env=env) as s:
                assert set(s.node_assignment().values()) == {"CPUExecutionProvider"}
                x = _x(seed=9)
                np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)


def test_module_names_every_test_plugin_build():
    assert re.fullmatch(r"libephost_example_c_v5\.so", build.library_path("example_c", 5).name)
    assert build.library_path("example_c", abi.ABI_VERSION).name == "libephost_example_c.so"


# ---- the frame: scratch memory, in-place outputs, the SDK's view of it ---------------------------

def _example_ep(version: int = 6):
    rt = sdk.runtime(build.module_name("example", version))
    [ep] = [o for o in rt._objects.values() if type(o).__name__ == "ExampleEp"]
    return ep


def test_scratch_is_stream_tagged_and_what_compute_keeps_is_freed_after_it(env6):
    model = chain_model(("Add", "Relu"))
    with session(env6, model, scratch="256") as s:
        rec = record(6)
        s.run(None, {"x": _x()})  # first run: streams and output memory settle
        live, tagged = rec.live["allocation"], rec.host_calls["stream_tagged_alloc"]
        for run in range(1, 4):
            x = _x(seed=run)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
            assert rec.live["allocation"] == live, "both scratch blocks are gone after Compute"
        assert rec.host_calls["scratch"] == 2 * 4
        assert rec.host_calls["stream_tagged_alloc"] - tagged >= 2 * 3


def test_bound_output_is_the_frame_output(env6):
    model = chain_model(("Add", "Relu"))
    with session(env6, model) as s:
        out = np.zeros((2, 3), np.float32)
        b = s.io_binding()
        b.bind_input("x", _x())
        b.bind_output("y", out)
        s.run_with_iobinding(b)
        assert _example_ep().last_output_ptrs == [out.ctypes.data]
        assert record(6).host_calls["AllocateOutput"] == 0


def _frame(inputs: list[tuple[np.ndarray, tuple]], outputs: list[tuple[int, tuple | None]]):
    """An EpCallFrame by hand: inputs (array, dims as declared), outputs (data pointer, dims or None)."""
    keep = []
    f = ffi.new("EpCallFrame*")
    ins = ffi.new("EpFrameTensor[]", max(len(inputs), 1))
    outs = ffi.new("EpFrameTensor[]", max(len(outputs), 1))
    for t, (arr, dims) in zip(ins, inputs):
        d = ffi.new("int64_t[]", list(dims) or [0])
        keep.append(d)
        t.data, t.dims, t.rank, t.elem_type = ffi.cast("void*", arr.ctypes.data), d, len(dims), 1
    for t, (ptr, dims) in zip(outs, outputs):
        d = ffi.new("int64_t[]", list(dims or ()) or [0])
        keep.append(d)
        t.data, t.dims, t.rank, t.elem_type = ffi.cast("void*", ptr), d, -1 if dims is None else len(dims), 1
    f.struct_size, f.version = ffi.sizeof("EpCallFrame"), 6
    f.num_inputs, f.num_outputs, f.inputs, f.outputs = len(inputs), len(outputs), ins, outs
    f.capturing, f.error_node = 1, -1
    return f, (ins, outs, keep)


def test_sdk_call_frame_reads_what_the_host_laid_out():
    a = np.ones((2, 3), np.float32)
    frame, keep = _frame([(a, (2, 3))], [(0, (-1, 3)), (0, None), (a.ctypes.data, (2, 3))])
    cf = sdk.CallFrame(ffi, None, frame)
    assert cf.capturing is True and cf.stream == 0
    assert cf.input_ptrs() == [a.ctypes.data]
    assert cf.inputs == [sdk.FrameTensor(a.ctypes.data, 1, (2, 3))]
    assert cf.outputs == [sdk.FrameTensor(0, 1, (None, 3)), sdk.FrameTensor(0, 1, None),
                          sdk.FrameTensor(a.ctypes.data, 1, (2, 3))]
    assert cf.output_ptrs() == [0, 0, a.ctypes.data]
    with pytest.raises(sdk.PluginError, match=r"^allocate_output: index 3 out of range 0\.\.2$"):
        cf.allocate_output(3, (2, 3))


def test_sdk_fused_graph_describes_inputs_outputs_and_constants(env6):
    model = chain_model(("Add", "Relu", "Mul"), dynamic=True)
    with session(env6, model):
        compute = _example_ep().last_compiled[0]
    g = compute.fused.graph
    assert compute.fused.name == f"{EP}_fused_0" and g.name == f"{EP}_fused_0"
    assert [n.name for n in g.nodes] == ["add0", "relu1", "mul2"]
    assert [(v.name, v.dtype, v.shape) for v in g.inputs] == [("x", TensorProto.FLOAT, (None, 3))]
    assert [(v.name, v.dtype, v.shape) for v in g.outputs] == [("y", TensorProto.FLOAT, (None, 3))]
    constants = {v.name: v.constant for v in g.values if v.constant is not None}
    np.testing.assert_array_equal(constants["w"], np.linspace(-1, 1, 3, dtype=np.float32))
    assert [g.values[i].name for i in g.input_ids] == ["x"]


def test_allocate_output_refuses_bad_dims_and_a_second_shape(env6):
    model = chain_model(("Add", "Relu"), dynamic=True)
    with session(env6, model) as s:
        s.run(None, {"x": _x()})
        node = s.plan.nodes[0]
        ctx = next(c for c in s.executor.state().contexts if c.node is node)
        with pytest.raises(InvalidArgument, match=r"^output 0 \('y'\): dims \[-1, 3\] must be >= 0 and hold at most "):
            ctx.allocate_output(0, (-1, 3))
        with pytest.raises(InvalidArgument, match=r"^output 0 \('y'\): dims \[4611686018427387904, 3\] must be "):
            ctx.allocate_output(0, (1 << 62, 3))
        with pytest.raises(InvalidArgument, match=r"^output index 1 out of range 0\.\.0$"):
            ctx.allocate_output(1, (2, 3))
        ctx.outputs[0].data = ffi.NULL  # as the host leaves it before a call
        first = ctx.allocate_output(0, (2, 3))
        assert ctx.allocate_output(0, (2, 3)) == first, "asking again for the same shape gives the same memory"
        with pytest.raises(InvalidArgument, match=r"^output 0 \('y'\) is already allocated with shape \[2, 3\]; "
                                                  r"asked for \[5, 3\]$"):
            ctx.allocate_output(0, (5, 3))


def test_compute_that_leaves_a_dynamic_output_unallocated_is_an_error(env6):
    model = chain_model(("Add", "Relu"), dynamic=True)
    with session(env6, model) as s:
        # The plugin runs in this interpreter: make its compiled function return without output.
        _example_ep().last_compiled[0].compute = lambda state, frame: None
        with pytest.raises(KernelError, match=rf"^fused node '{EP}_fused_0' \(nodes 'add0', 'relu1'\) on {EP} "
                                              r"returned without producing output\(s\) \['y'\]$"):
            s.run(None, {"x": _x()})
