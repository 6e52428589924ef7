"""The host-side logic of graph-API convolutions (no GPU): which calls a plan's cuDNN step makes per run
(graph for eager runs, legacy calls for the first run and for captures), its variant packs, the
fallbacks (no engine for the tail, a refused execution, an unaligned address, EPHOST_CUDNN_GRAPH=0),
the numerical-note filter, and the plan instance's rehearsal flag. The GPU side is
test_cudnn_graph_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from plugin_cuda.device import cudnn, cudnn_graph
from plugin_cuda.plan import cudnn_step
from plugin_cuda.plan.plan import _Instance


class FakeGraph:
    def __init__(self, epilogue=None, statuses=()):
        self.epilogue = epilogue or cudnn_graph.Epilogue()
        self.workspace_bytes = 0
        self.statuses = list(statuses)
        self.executed = []
        self.packed = []

    def pack(self, pointers, workspace):
        if any(p % cudnn_graph.ALIGNMENT for p in pointers):
            return None
        self.packed.append(tuple(pointers))
        return ("pack", tuple(pointers))

    def execute(self, handle_raw, pack):
        self.executed.append(pack)
        return self.statuses.pop(0) if self.statuses else 0


class Inst:
    def __init__(self):
        self.ext = [4096, 8192]  # x (an input) and y (an output) come from the run
        self.recording = False


def _step(graph, relu=False):
    """A CudnnStep whose legacy calls are recorded instead of made."""
    step = object.__new__(cudnn_step.CudnnStep)
    step.inst = Inst()
    step.name = "conv"
    step.handle = type("H", (), {"raw": "handle"})()
    step.relu = relu
    step.operands = [(0, 0), (None, 1 << 20), (1, 0), (None, 0), (None, 0)]
    step.workspace = 0
    step.calls = None
    step.tail = None
    step.packs = {}
    step._graph_ran = False
    step.graph = graph
    step.legacy = []
    if graph is not None:
        step._graph_operands = step.operands[:3]
        step._dynamic = [0, 1]

    def first_run():
        step.legacy.append("first")
        step.calls = ["prepared"]

    step._first_run = first_run
    step._run = lambda calls: step.legacy.append(tuple(calls))
    return step


def test_first_run_legacy_then_graph_and_captures_legacy():
    graph = FakeGraph()
    step = _step(graph)
    step()
    assert step.legacy == ["first"] and graph.executed == []  # the first run settles the legacy calls
    step()
    step()
    assert len(graph.executed) == 2 and len(graph.packed) == 1  # one pack for one address set
    step.inst.recording = True
    step()
    assert step.legacy == ["first", ("prepared",)] and len(graph.executed) == 2


def test_packs_follow_the_run_addresses_and_are_bounded():
    graph = FakeGraph()
    step = _step(graph)
    step()
    for k in range(cudnn_step.CudnnStep.PACKS + 3):
        step.inst.ext[0] = 4096 * (k + 2)
        step()
        step()  # the same addresses again: the kept pack
    assert len(graph.packed) == cudnn_step.CudnnStep.PACKS + 3
    assert len(step.packs) == cudnn_step.CudnnStep.PACKS
    assert (4096 * 2, 8192) not in step.packs  # the oldest went first
    assert step.packs[(step.inst.ext[0], 8192)][1] == (step.inst.ext[0], 1 << 20, 8192)


def test_an_unaligned_address_runs_the_legacy_calls():
    graph = FakeGraph()
    step = _step(graph)
    step()
    step.inst.ext[0] = 4096 + 4
    step()
    assert graph.executed == [] and step.legacy[-1] == ("prepared",)


def test_a_graph_refused_at_its_first_execution_is_dropped():
    graph = FakeGraph(statuses=[3000])
    step = _step(graph)
    step()
    step()
    assert step.graph is None and step.legacy == ["first", ("prepared",)]
    step()
    assert step.legacy[-1] == ("prepared",) and len(graph.executed) == 1


def test_a_failure_after_the_graph_ran_is_an_error():
    graph = FakeGraph(statuses=[0, 4000])
    step = _step(graph)
    step()
    step()
    with pytest.raises(cudnn.CudnnError, match="cuDNN convolution") as info:
        step()
    assert "plan step 'conv'" in "".join(getattr(info.value, "__notes__", []))


def test_a_conv_only_graph_is_followed_by_the_legacy_tail():
    graph = FakeGraph()
    step = _step(graph, relu=True)
    step.tail = ["relu"]
    step()
    step()
    assert len(graph.executed) == 1 and step.legacy[-1] == ("relu",)


def test_graph_choice_falls_back_from_the_tail_to_the_conv_alone_to_none(monkeypatch):
    asked = []

    def build(handle, geo, dtype, epilogue):
        asked.append(epilogue)
        if epilogue != cudnn_graph.Epilogue() or len(asked) > 2:
            raise cudnn.CudnnError("no engine")
        return "conv-only"

    monkeypatch.setattr(cudnn_graph, "build", build)
    full = cudnn_graph.Epilogue(True, True, True)
    assert cudnn_step._graph_for(None, None, np.float32, full) == "conv-only"
    assert asked == [full, cudnn_graph.Epilogue()]
    assert cudnn_step._graph_for(None, None, np.float32, full) is None  # both refused: the legacy calls
    monkeypatch.setenv("EPHOST_CUDNN_GRAPH", "0")
    asked.clear()
    assert cudnn_step._graph_for(None, None, np.float32, full) is None and asked == []


def test_strict_float32_refuses_tensor_core_and_down_converting_engines():
    allows = cudnn_graph.math_allows
    tc, down = cudnn_graph.NOTE_TENSOR_CORE, cudnn_graph.NOTE_DOWN_CONVERT_INPUTS
    assert allows(set(), np.float32, False) and allows({5}, np.float32, False)
    assert not allows({tc}, np.float32, False) and not allows({down}, np.float32, False)
    assert allows({tc, down}, np.float32, True) and allows({tc}, np.float16, False)


def test_variant_pack_uids_follow_the_epilogue():
    assert cudnn_graph._uids(cudnn_graph.Epilogue()) == (1, 2, 3)
    assert cudnn_graph._uids(cudnn_graph.Epilogue(True, True, True)) == (1, 2, 3, 4, 5)
    assert cudnn_graph._uids(cudnn_graph.Epilogue(True)) == (1, 2, 3, 4)


def test_rehearse_marks_the_run_as_recording():
    inst = object.__new__(_Instance)
    inst.recording = False
    inst.graph_seq = ["step"]
    seen = []
    inst.launch_all = lambda seq: seen.append((seq, inst.recording))
    inst.rehearse()
    assert seen == [(["step"], True)] and inst.recording is False

    def fail(seq):
        raise RuntimeError("launch failed")

    inst.launch_all = fail
    with pytest.raises(RuntimeError):
        inst.rehearse()
    assert inst.recording is False  # a failed capture leaves eager runs on the graph


_DESCRIPTORS_SCRIPT = """
import sys
import numpy as np
from plugin_cuda.device import cudnn, cudnn_conv, cudnn_graph
try:
    lib = cudnn.load_library()
except cudnn.CudnnError as e:
    print("SKIP cuDNN 9 is not installed here (pip install nvidia-cudnn-cu13): " + str(e)[:80])
    sys.exit(0)
geo = cudnn_conv.forward_geometry((2, 8, 9, 9), (16, 8, 3, 3), (2, 16, 9, 9), 1, (1, 1), (1, 1), (1, 1), (1, 1))
d = cudnn_graph.Descriptors(lib)
try:
    ops, uids = cudnn_graph.operations(d, geo, np.float32, cudnn_graph.Epilogue(True, True, True))
except cudnn.CudnnError as e:
    if "SUBLIBRARY" not in str(e):
        raise
    print("SKIP cuDNN's engine libraries do not load here (they need the CUDA driver, libcuda): " + str(e)[:80])
    sys.exit(0)
print("OPS", len(ops), "UIDS", list(uids))
bad = cudnn_conv.ConvGeometry((2, 8, 9, 9), (16, 8, 3, 3), (2, 16, 5, 5), (1, 1), (1, 1), (1, 1), 1)
try:
    cudnn_graph.operations(d, bad, np.float32, cudnn_graph.Epilogue())
    print("BAD ACCEPTED")
except cudnn.CudnnError as e:
    print("BAD REFUSED", "cudnnBackendFinalize" in str(e))
"""


def test_descriptors_finalize_where_cudnn_and_a_driver_are_installed():
    """Tensor, convolution and pointwise descriptors are host-side: where cuDNN 9 loads with its
    sub-libraries (which need libcuda), the graph of every epilogue builds with the uids expected, and a
    convolution whose output shape does not fit is refused. In a subprocess: cuDNN's sub-libraries loaded
    without a handle first can leave the process's later legacy calls on a mismatched sub-library."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _DESCRIPTORS_SCRIPT], capture_output=True, text=True, cwd=root,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip().splitlines()[-2:] if done.stdout.strip() else [""]
    if out[-1].startswith("SKIP"):
        pytest.skip(out[-1][5:])
    assert out == ["OPS 4 UIDS [1, 2, 3, 4, 5]", "BAD REFUSED True"], done.stdout
