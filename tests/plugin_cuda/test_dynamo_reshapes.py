"""The dynamo exporter's Reshapes with computed targets join compiled partitions (issue 23, GPT-2).

torch's dynamo exporter writes GPT-2's views as Reshape(x, Concat(Shape(x)..., consts), allowzero=1):
the target is a value of the host's shape program (VALUE_HOST_COMPUTED), so the CUDA plans refused
the node ("input 1 must be a constant") and every such Reshape split the partitions (49 on GPT-2
small). The plans now take such a target per input-shape signature (plan/lower.py SIGNATURE_INPUTS,
plan/signatures.py host_value_inputs and specialize); the host hands it over in host memory
(abi/host_inputs.host_only_values, host/runtime/partition/compile.py). Pure Python here: the
graph the plugin sees is read from a real session's view; GPU runs are in test_dynamo_reshapes_gpu.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

import host
from abi.graph_spec import GraphSpec, read_graph
from abi.host_inputs import host_only_values
from host.plugins.hostapi import ffi
from host.runtime.partition.compile import describe_group, host_computed_names
from plugin_cuda.plan import codegen, fuse
from plugin_cuda.plan.lower import PROBE_DIM, lower, unsupported_reason
from plugin_cuda.plan.partition import fusable_groups
from plugin_cuda.plan.signatures import host_constant, host_value_inputs, specialize
from plugin_cuda.plan.symint import SymInt
from tests.plugin_cuda import dynamo_models

SHAPES = [(1, 16), (8, 128), (3, 50), (8, 8)]  # (8, 8): batch = seq = the head size


def session_spec(model):
    """The session (CPU EP) and the graph its view shows a plugin, flags included."""
    s = host.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s, read_graph(ffi, s._partitioner.view.ptr)


def unflagged(spec: GraphSpec) -> GraphSpec:
    """The same graph with no value flagged host-computed (what a plan saw before)."""
    return dataclasses.replace(spec, values=[dataclasses.replace(v, flags=0) for v in spec.values])


def group_graph(spec: GraphSpec, group: list[int]) -> tuple[GraphSpec, list[int]]:
    """The fused graph of `group` as Compile gets it, and its input ids in frame order."""
    nodes = [spec.nodes[i] for i in group]
    produced = {v for n in nodes for v in n.outputs}
    ins = []
    for n in nodes:
        for v in n.inputs:
            if v >= 0 and v not in produced and spec.values[v].constant is None and v not in ins:
                ins.append(v)
    used_outside = {v for n in spec.nodes if n.index not in group for v in n.inputs}
    outs = [v for n in nodes for v in n.outputs if v in used_outside or v in spec.output_ids]
    return GraphSpec(nodes, spec.values, [spec.values[i] for i in ins], [spec.values[o] for o in outs],
                     tuple(ins), tuple(outs)), ins


def signature(s, spec: GraphSpec, ins: list[int], batch: int, seq: int) -> list[tuple]:
    """The call's signature: each device input's shape, each host input's value (the shape program's)."""
    sizes = {"batch": batch, "seq": seq}
    feed = {s._partitioner.view.value_index["x"]: np.zeros((batch, seq, 16), np.float32)}
    values = s._partitioner.shape_program.with_values(feed)
    host_pos = host_value_inputs(spec, ins)
    meta = s._partitioner.graph.values
    return [tuple(int(d) for d in np.asarray(values[v]).reshape(-1)) if j in host_pos
            else tuple(sizes.get(d, d) for d in meta[spec.values[v].name].shape) for j, v in enumerate(ins)]


def plan_source(s, spec, group, batch, seq):
    sub, ins = group_graph(spec, group)
    prog = lower(specialize(sub, ins, signature(s, sub, ins, batch, seq), host=host_value_inputs(sub, ins)))
    return prog, codegen.generate(prog, fuse.build_steps(prog, tiled=False), "ep_k")[0]


@pytest.mark.parametrize("layers", [1, 2])
def test_computed_reshape_targets_no_longer_split_the_partition(layers):
    s, spec = session_spec(dynamo_models.gpt2_block(layers))
    shape_nodes = set(s._partitioner.graph.shape_nodes)
    data_nodes = sorted(n.index for n in spec.nodes if n.index not in shape_nodes)
    assert fusable_groups(spec, dynamic=True) == [data_nodes]
    before = fusable_groups(unflagged(spec), dynamic=True)  # targets not known as host values
    assert len(before) == 2 * layers + 1
    reshapes = {n.index for n in spec.nodes if n.op_type == "Reshape" and n.attrs.get("allowzero") == 1}
    assert len(reshapes) == 2 * layers and not reshapes & {i for g in before for i in g}
    s.close()


def test_a_computed_target_needs_the_flag_and_a_probe():
    s, spec = session_spec(dynamo_models.gpt2_block(1))
    reshape = next(n for n in spec.nodes if n.op_type == "Reshape" and n.attrs.get("allowzero") == 1)
    assert unsupported_reason(spec, reshape, probe=PROBE_DIM) == ""
    assert unsupported_reason(spec, reshape, need_static=False) == "input 1 must be a constant"  # no probe
    assert unsupported_reason(unflagged(spec), reshape, probe=PROBE_DIM) == \
        "input 1 must be a constant or a host-computed shape"
    s.close()


def test_every_signature_plans_one_source_with_its_own_shapes():
    s, spec = session_spec(dynamo_models.gpt2_block(2))
    (group,) = fusable_groups(spec, dynamic=True)
    sub, ins = group_graph(spec, group)
    assert [spec.values[ins[j]].name for j in host_value_inputs(sub, ins)] == ["t4", "t3"]
    sources = []
    for batch, seq in SHAPES:
        prog, source = plan_source(s, spec, group, batch, seq)
        assert [prog.values[o].shape for o in prog.outputs] == [(batch, seq, 16)]
        assert [s.expr for s in prog.symbols] == ["S0", "S1"] and list(prog.symbols) == [batch, seq]
        assert len(prog.inputs) == 1  # the targets are the plan's constants, not call inputs
        sources.append(source)
    assert all(src == sources[0] for src in sources)  # one NVRTC compile serves every shape
    s.close()


def _exprs(arr) -> list:
    return [getattr(e, "expr", e) for e in arr]


def test_host_constant_maps_symbolic_entries_and_keeps_declared_literals():
    placed = [(0, SymInt(8, "S0")), (1, SymInt(128, "S1"))]
    got = host_constant([8, 128, 2, 8], placed, declared=(-1, -1, 2, 8))
    assert _exprs(got) == ["S0", "S1", 2, 8]  # head size 8 is not the batch
    assert _exprs(host_constant([8, 128, 2, 8], placed)) == ["S0", "S1", 2, "S0"]  # undeclared: taken
    assert _exprs(host_constant([-1, 0, 128], placed)) == [-1, 0, "S1"]
    plain = host_constant([2, 3], placed)
    assert plain.dtype == np.int64 and plain.tolist() == [2, 3]


def test_host_constant_picks_the_symbol_at_the_entrys_axis_when_values_coincide():
    # x [batch, seq, 16] and a mask [batch, 1, seq, seq] at batch = seq = 8
    placed = [(0, SymInt(8, "S0")), (1, SymInt(8, "S1")), (0, SymInt(8, "S2")), (2, SymInt(8, "S3")),
              (3, SymInt(8, "S4"))]
    assert _exprs(host_constant([8, 8, 16], placed, declared=(-1, -1, 16))) == ["S0", "S1", 16]
    assert _exprs(host_constant([-1, 8, 16], placed, declared=(-1, -1, 16))) == [-1, "S1", 16]
    assert _exprs(host_constant([8, 8, 8, 8], placed[2:], declared=(-1, -1, -1, -1))) == ["S2", "S2", "S3", "S4"]


def test_only_values_read_on_the_host_everywhere_come_in_host_memory():
    triples = [("Reshape", "", ("a", "t")), ("Reshape", "", ("b", "u")), ("Add", "", ("u", "c"))]
    assert host_only_values(triples, {"t", "u"}) == {"t"}  # u is also Add's data


@pytest.mark.parametrize("negotiated,expected", [(7, ("t4", "t3")), (6, ())])
def test_the_group_hands_its_computed_targets_over_in_host_memory(negotiated, expected):
    s, spec = session_spec(dynamo_models.gpt2_block(1))
    p = s._partitioner
    (group,) = fusable_groups(spec, dynamic=True)
    ep = SimpleNamespace(name="EP", slots=SimpleNamespace(negotiated=negotiated))
    g = describe_group(p.graph, ep, tuple(group), "EP_fused_0", host_computed_names(p.view))
    assert g.inputs == ("x", "t4", "t3")
    assert tuple(g.inputs[j] for j in g.host_inputs) == expected
    flagged = {v.name for v in read_graph(ffi, g.view.ptr).values if v.host_computed}
    assert flagged == set(expected)  # the group's view flags them too (read by the plugin's compile)
    s.close()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the CUDA C cannot be compiled here")
def test_the_plan_module_compiles_with_nvcc(tmp_path):
    s, spec = session_spec(dynamo_models.gpt2_block(2))
    (group,) = fusable_groups(spec, dynamic=True)
    _, source = plan_source(s, spec, group, 3, 50)
    (tmp_path / "plan.cu").write_text(source)
    subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "-o", str(tmp_path / "plan.ptx"), str(tmp_path / "plan.cu")],
                   check=True, capture_output=True, timeout=120)
    assert (tmp_path / "plan.ptx").read_text().count(".entry") >= 3
    s.close()


SHIM = r"""
#include <math.h>
#include <string.h>
struct ep_dim3 { int x, y, z; };
static ep_dim3 blockIdx, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__
""" + codegen.SCALAR_PRELUDE


def run_views_on_cpu(s, spec, group, x: np.ndarray, tmp_path) -> np.ndarray:
    """The views plan of one signature, its CUDA C built by g++ (grid and block as loops)."""
    batch, seq, _ = x.shape
    sub, ins = group_graph(spec, group)
    prog = lower(specialize(sub, ins, signature(s, sub, ins, batch, seq), host=host_value_inputs(sub, ins)))
    steps = fuse.build_steps(prog, tiled=False)
    assert {st.kind for st in steps} <= {"ew", "transpose", "copy"}
    source, specs = codegen.generate(prog, steps, prelude=False)
    syms = ", ".join(f"int {sym.expr}" for sym in prog.symbols)
    launches = []
    for k, sp in enumerate(specs):
        params = ", ".join(f"float* a{j}" for j in range(len(sp.params)))
        args = ", ".join([sym.expr for sym in prog.symbols] + [f"a{j}" for j in range(len(sp.params))])
        launches.append(f'extern "C" void launch{k}({syms}, {params}) {{\n'
                        f"  for (int b = 0; b < {int(sp.grid[0])}; ++b) for (int t = 0; t < {int(sp.block[0])}; ++t)"
                        f" {{ blockIdx.x = b; threadIdx.x = t; {sp.name}({args}); }}\n}}\n")
    (tmp_path / "plan.cpp").write_text(SHIM + source.replace("const float*", "float*") + "\n".join(launches))
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "plan.so"), str(tmp_path / "plan.cpp")],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(tmp_path / "plan.so"))
    alias = {op.outputs[0]: op.inputs[0] for op in prog.ops if op.kind == "alias"}

    def base(vid):  # a view's bytes are its source's (Plan._base)
        while vid in alias:
            vid = alias[vid]
        return vid

    buffers = {prog.inputs[0]: np.ascontiguousarray(x)}
    for k, sp in enumerate(specs):
        for vid in sp.params:
            v = prog.values[vid]
            if v.const is not None:
                buffers.setdefault(base(vid), np.ascontiguousarray(v.const, np.float32))
            buffers.setdefault(base(vid), np.full(v.shape, np.nan, np.float32))
        getattr(lib, f"launch{k}")(*[ctypes.c_int(int(sym)) for sym in prog.symbols],
                                   *[buffers[base(v)].ctypes.data_as(ctypes.c_void_p) for v in sp.params])
    (out,) = prog.outputs
    return buffers[base(out)].reshape(prog.values[out].shape)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed: cannot build the shim")
@pytest.mark.parametrize("batch,seq", [(3, 5), (2, 7)])
def test_the_generated_views_compute_what_onnx_reference_does(batch, seq, tmp_path):
    from onnx.reference import ReferenceEvaluator

    model = dynamo_models.views()
    s, spec = session_spec(model)
    (group,) = fusable_groups(spec, dynamic=True)
    x = dynamo_models.feeds(batch, seq)["x"]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = run_views_on_cpu(s, spec, group, x, tmp_path)
    assert got.shape == want.shape == (batch, 2, seq * 8)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    s.close()


def _host_frame(arrays: list[np.ndarray]):
    """An EpCallFrame whose inputs are host arrays (what the host lays out for host inputs)."""
    keep = []
    f = ffi.new("EpCallFrame*")
    ins = ffi.new("EpFrameTensor[]", len(arrays))
    for t, arr in zip(ins, arrays):
        d = ffi.new("int64_t[]", list(arr.shape) or [0])
        keep.append(d)
        t.data, t.dims, t.rank = ffi.cast("void*", arr.ctypes.data), d, arr.ndim
        t.elem_type = 7 if arr.dtype == np.int64 else 1
    f.num_inputs, f.inputs = len(arrays), ins
    return f, keep


def test_the_sdk_reads_a_host_input_as_ints_and_refuses_other_tensors():
    from abi import sdk

    target, data = np.array([3, 50, 2, -1], np.int64), np.zeros((2, 2), np.float32)
    frame, keep = _host_frame([target, data])
    cf = sdk.CallFrame(ffi, None, frame)
    assert cf.input_ints(0) == (3, 50, 2, -1)
    with pytest.raises(sdk.PluginError, match=r"^input 1: expected a host int64 vector; got element type 1, "
                                              r"rank 2$"):
        cf.input_ints(1)


class _FakePlan:
    def __init__(self, graph):
        self.graph = graph
        self.output_shapes = [graph.values[o].shape for o in graph.output_ids]
        self.arena_bytes = 0
        self.runs = []

    def run(self, stream, ins, outs, capturing):
        self.runs.append(list(ins))

    def close(self):
        pass


class _Frame:
    """What ShapePlanFunction.compute reads of a call frame: input 0 data on the device, the
    targets in host memory."""

    stream, capturing = 0, False

    def __init__(self, shape, values):
        self.inputs = [SimpleNamespace(shape=shape, ptr=1000)] + [SimpleNamespace(shape=(len(v),), ptr=0)
                                                                   for v in values]
        self._values = values

    def input_ints(self, j):
        return tuple(self._values[j - 1])

    def input_ptrs(self):
        return [1000, 2000, 3000]

    def output_ptrs(self):
        return [4000]


def test_the_compute_function_plans_per_target_value_and_passes_device_inputs_only(monkeypatch):
    from abi.graph_spec import FusedGraph
    from plugin_cuda.plan import compute

    s, spec = session_spec(dynamo_models.gpt2_block(1))
    (group,) = fusable_groups(spec, dynamic=True)
    sub, _ = group_graph(spec, group)
    built = []
    monkeypatch.setattr(compute.Plan, "build", lambda graph, ep, **kw: built.append(_FakePlan(graph)) or built[-1])
    opts = SimpleNamespace(plan_auto_graph=False, enable_cuda_graph=False, min_num_runs_before_cuda_graph_capture=1,
                           plan_shape_cache=4, plan_shape_cache_mb=64)
    fn = compute.make_function(SimpleNamespace(opts=opts, streams={}), FusedGraph("EP_fused_0", sub))
    assert isinstance(fn, compute.ShapePlanFunction) and fn.context() is None
    for batch, seq in [(3, 50), (8, 128), (3, 50)]:
        fn.compute(None, _Frame((batch, seq, 16), [(batch, seq, 2, -1), (batch, seq, 16)]))
    assert len(built) == 2  # (3, 50) came back: its plan is reused
    assert all(p.runs and all(r == [1000] for r in p.runs) for p in built)  # the plan's one input: x
    target = next(v for v in built[1].graph.values if v.name == "t4")
    assert [int(d) for d in target.constant] == [8, 128, 2, -1] and target.constant[0].expr == "S0"
    assert list(built[1].graph.input_ids) == [sub.input_ids[0]]
    s.close()
