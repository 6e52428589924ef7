"""Profiling: SessionOptions.enable_profiling / profile_file_prefix, end_profiling(), the Chrome-trace
file it writes, `ephost run --profile`, and that profiling off leaves the run path alone."""

from __future__ import annotations

import gc
import json
import os
import re
import threading
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper

import host
from host.cli import app as cli
from host.errors import InvalidArgument
from host.runtime import profiling
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession


def chain_model():
    """Z = relu(X + Y) * X over (2, 3); nodes add, relu, mul."""
    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZ")
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "chain", [x, y], [z]), opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def feeds():
    rng = np.random.default_rng(2)
    return {k: rng.standard_normal((2, 3)).astype(np.float32) for k in "XY"}


@pytest.fixture
def env5(example_plugin):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(5))
    yield env
    gc.collect()
    env.close()


def profiled(tmp_path, **kw) -> tuple[InferenceSession, SessionOptions]:
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "traces" / "chain_")
    return InferenceSession(chain_model(), so, **kw), so


def complete(events, cat=None):
    return [e for e in events if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def inside(inner, outer) -> bool:
    eps = 1e-3  # µs: ts/dur are rounded to the nanosecond
    return outer["ts"] - eps <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + eps


def test_profile_holds_session_phases_and_every_node_of_every_run(tmp_path, env5, feeds):
    s, _ = profiled(tmp_path, providers=[("ExampleEP", {"ops": "Add,Mul"})], env=env5)
    for _ in range(3):
        s.run(None, feeds)
    path = s.end_profiling()
    assert path.startswith(str(tmp_path / "traces" / "chain_")) and path.endswith(".json")
    events = json.loads(open(path).read())
    assert isinstance(events, list)  # onnxruntime's format: a JSON list of events
    assert all(e["pid"] == os.getpid() and isinstance(e["tid"], int) for e in events)
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 for e in complete(events))
    session = {e["name"]: e for e in complete(events, "Session") if e["name"] != "model_run"}
    assert {"session_initialization", "model_loading", "optimization", "partitioning"} <= set(session)
    for phase in ("model_loading", "partitioning"):
        assert inside(session[phase], session["session_initialization"]), phase
    assert inside(session["optimization"], session["model_loading"])
    runs = [e for e in complete(events, "Session") if e["name"] == "model_run"]
    nodes = complete(events, "Node")
    assert len(runs) == 3
    # Each run holds each node once, with the provider that ran it.
    assignment = s.node_assignment()
    for run in runs:
        in_run = [n for n in nodes if inside(n, run)]
        assert sorted(n["name"] for n in in_run) == sorted(assignment)
        assert {n["name"]: n["args"]["provider"] for n in in_run} == assignment
        assert sum(n["dur"] for n in in_run) <= run["dur"]
    assert {n["name"]: n["args"]["op_name"] for n in nodes} == {"add": "Add", "relu": "Relu", "mul": "Mul"}
    # The plugin EP's run hooks are ABI crossings, once per run each.
    assert Counter(e["name"] for e in complete(events, "Api")) == {"OnRunStart": 3, "OnRunEnd": 3}
    assert s.get_profiling_start_time_ns() == profiling.metadata(events)["start_time_ns"] > 0


def test_copies_through_an_ep_data_transfer_are_recorded(tmp_path, env5, feeds):
    # ExampleEP's memory is host memory, so runs copy nothing; a copy through its data-transfer
    # table, as the executor makes at an EP boundary, is one CopyTensors crossing.
    from host.plugins.ep import CPU_LOCATION

    s, _ = profiled(tmp_path, providers=[("ExampleEP", {"ops": "Add"})], env=env5)
    s.run(None, feeds)
    copied = s.executor.transfer(feeds["X"], CPU_LOCATION, s.plan.eps[0], None)
    np.testing.assert_array_equal(copied, feeds["X"])
    events = profiling.load(s.end_profiling())
    copies = [e for e in complete(events, "Api") if e["name"] == "CopyTensors"]
    run = next(e for e in complete(events, "Session") if e["name"] == "model_run")
    assert len(copies) == 1 and not inside(copies[0], run)


def test_optimizer_passes_are_instants_inside_the_optimization_span(tmp_path):
    # MatMul + Add becomes Gemm at ORT_ENABLE_EXTENDED and above: one pass with a change.
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 4])
    c = helper.make_tensor_value_info("C", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], np.ones(12, np.float32))
    b = helper.make_tensor("B", TensorProto.FLOAT, [3], np.ones(3, np.float32))
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["M"]),
                                             helper.make_node("Add", ["M", "B"], ["C"])], "g", [a], [c],
                                            initializer=[w, b]), opset_imports=[helper.make_opsetid("", 17)])
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "opt_")
    s = InferenceSession(m, so)
    events = profiling.load(s.end_profiling())
    span = next(e for e in events if e["name"] == "optimization")
    passes = [e for e in events if e["cat"] == "Optimizer"]
    assert len(passes) == len(s.optimization.report) >= 1
    assert all(p["ph"] == "i" and p["ts"] == pytest.approx(span["ts"] + span["dur"], abs=1e-3) for p in passes)
    assert [p["args"]["change"] for p in passes] == [str(r) for r in s.optimization.report]


def test_end_profiling_stops_recording_and_a_second_call_returns_nothing(tmp_path, feeds):
    s, _ = profiled(tmp_path)
    s.run(None, feeds)
    path = s.end_profiling()
    s.run(None, feeds)
    assert s.end_profiling() == ""
    assert len([e for e in profiling.load(path) if e["name"] == "model_run"]) == 1


def test_runs_from_threads_are_on_their_own_tracks(tmp_path, feeds):
    s, _ = profiled(tmp_path)
    threads = [threading.Thread(target=s.run, args=(None, feeds)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runs = [e for e in profiling.load(s.end_profiling()) if e["name"] == "model_run"]
    assert len(runs) == 3 and len({r["tid"] for r in runs}) == 3


def test_iobinding_runs_are_profiled(tmp_path, feeds):
    s, _ = profiled(tmp_path)
    b = s.io_binding()
    for k, v in feeds.items():
        b.bind_input(k, v)
    b.bind_output("Z")
    s.run_with_iobinding(b)
    events = profiling.load(s.end_profiling())
    run = next(e for e in events if e["name"] == "model_run")
    assert run["args"] == {"iobinding": True}
    assert len([e for e in complete(events, "Node") if inside(e, run)]) == 3


def test_profiling_off_changes_nothing_on_the_run_path(feeds):
    s = InferenceSession(chain_model())
    kernels = [n.kernel for n in s.plan.nodes]
    assert all("run" not in vars(k) for k in kernels)  # the class's own run, not a timed wrapper
    assert not {"transfer", "on_run_start", "on_run_end"} & set(vars(s.executor))
    s.run(None, feeds)
    assert s.end_profiling() == "" and s.get_profiling_start_time_ns() == 0


def test_unwritable_prefix_is_a_typed_error(tmp_path, feeds):
    blocker = tmp_path / "file"
    blocker.write_text("")
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(blocker / "p_")
    s = InferenceSession(chain_model(), so)
    with pytest.raises(InvalidArgument, match=rf"^cannot write the profile to '{blocker}/p_.*\.json' "
                                              rf"\(profile_file_prefix '{blocker}/p_'\): "):
        s.end_profiling()


def test_cli_run_profile_writes_a_trace(tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    assert cli.main(["make-model", "mlp", str(model), "--layers", "2", "--hidden", "8"]) == 0
    prefix = str(tmp_path / "cli_")
    assert cli.main(["run", str(model), "--random-inputs", "--profile", prefix]) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("profile: ")]
    assert len(line) == 1
    path = line[0].removeprefix("profile: ")
    assert re.fullmatch(re.escape(prefix) + r"_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{3}\.json", path), path
    events = profiling.load(path)
    assert len([e for e in events if e["name"] == "model_run"]) == 1
    assert len(complete(events, "Node")) >= 2


# ---- GPU kernel time (CUDA events), with a stand-in for cupy.cuda ---------------------------------
class FakeCuda:
    """cupy.cuda's event API over a fake GPU clock: each recorded event takes the stream's time,
    and `work(stream, ms)` advances a stream as a kernel would."""

    def __init__(self):
        self.clock: dict[int, float] = {}
        self.capturing: set[int] = set()
        self.created = 0
        cuda = self

        class ExternalStream:
            def __init__(self, handle):
                self.handle = handle
                cuda.clock.setdefault(handle, 100.0)

        class Event:
            def __init__(self):
                self.t = None
                cuda.created += 1

            def record(self, stream):
                self.t = cuda.clock[stream.handle]

            def synchronize(self):
                assert self.t is not None

        class Device:
            def __init__(self, device_id):
                self.device_id = device_id

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class runtime:
            @staticmethod
            def streamIsCapturing(handle):
                return handle in cuda.capturing

        self.ExternalStream, self.Event, self.Device, self.runtime = ExternalStream, Event, Device, runtime

    def work(self, handle, ms):
        self.clock[handle] = self.clock.get(handle, 100.0) + ms

    @staticmethod
    def get_elapsed_time(a, b):
        return b.t - a.t


def test_gpu_timer_places_kernel_time_on_a_stream_track():
    cuda = FakeCuda()
    prof = profiling.Profiler("unused_")
    timer = profiling.GpuTimer(prof, cuda)
    handle = 0xABC0

    def compute(kernel_ptr, context, ms):
        cuda.work(handle, ms)  # the kernel's GPU time
        return "status"

    timed = timer.wrap(compute, "gemm", {"op_name": "Gemm"}, 0, lambda *a: handle)
    cuda.work(handle, 5.0)  # the stream was busy before the first node: the reference event sees it
    assert timed(1, 2, 2.0) == "status"
    cuda.work(handle, 1.0)
    timed(1, 2, 3.0)
    cuda.capturing.add(handle)
    timed(1, 2, 7.0)  # capturing: no events recorded
    untimed = timer.wrap(compute, "cpu", {}, 0, lambda *a: 0)
    untimed(1, 2, 0.5)  # no stream: nothing recorded
    timer.flush()
    gpu = [e for e in prof.events if e["cat"] == "GPU"]
    assert [(e["name"], e["dur"]) for e in gpu] == [("gemm", 2000.0), ("gemm", 3000.0)]  # ms -> µs
    assert gpu[1]["ts"] - gpu[0]["ts"] == pytest.approx(3000.0)  # 2 ms kernel + 1 ms gap
    assert {e["tid"] for e in gpu} == {profiling._stream_track(handle)}
    assert gpu[0]["args"] == {"op_name": "Gemm", "gpu": True}
    names = [e for e in prof.events if e["ph"] == "M"]
    assert names == [{"cat": "__metadata", "name": "thread_name", "ph": "M", "pid": os.getpid(),
                      "tid": profiling._stream_track(handle), "ts": 0.0, "args": {"name": "GPU stream 0xabc0"}}]
    assert cuda.created == 5  # one reference event, then two per timed call


def test_gpu_streams_of_kernel_contexts_and_call_frames():
    from types import SimpleNamespace

    from host.plugins.hostapi import CONTEXTS, ffi

    ctx = SimpleNamespace(stream=SimpleNamespace(handle=ffi.cast("void*", 0x5000)), active=True)
    handle = CONTEXTS.add(ctx)
    try:
        assert profiling._kernel_stream(None, handle) == 0x5000
        ctx.stream = None
        assert profiling._kernel_stream(None, handle) == 0
    finally:
        CONTEXTS.remove(handle)
    frame = ffi.new("EpCallFrame*")
    frame.stream = ffi.cast("void*", 0x7000)
    assert profiling._frame_stream(None, None, frame) == 0x7000
    frame.capturing = 1
    assert profiling._frame_stream(None, None, frame) == 0


def test_no_cupy_is_noted_in_the_profile(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name.startswith("cupy"):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    prof = profiling.Profiler(str(tmp_path / "p_"))
    assert profiling.GpuTimer.create(prof) is None
    meta = profiling.metadata(json.loads(open(prof.end()).read()))
    assert meta["gpu_kernel_time"] == "not recorded: CuPy cannot be imported (No module named 'cupy')"


@pytest.mark.gpu
def test_cuda_ep_profile_has_gpu_kernel_time(tmp_path):
    cupy = pytest.importorskip("cupy", reason="GPU kernel time is read through CuPy's CUDA events")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    from host.cli import zoo

    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "cuda_")
    s = InferenceSession(zoo.mlp(layers=2, hidden=256), so, providers=["CUDAExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    for _ in range(3):
        s.run(None, {"input": x})
    events = profiling.load(s.end_profiling())
    cuda_nodes = [n for n, ep in s.node_assignment().items() if ep == "CUDAExecutionProvider"]
    assert cuda_nodes
    gpu = [e for e in events if e.get("cat") == "GPU"]
    assert len(gpu) == 3 * len([n for n in s.plan.nodes if n.ep is not None])
    assert all(e["dur"] > 0 and e["tid"] >= 1 << 40 for e in gpu)
    assert any(e["ph"] == "M" and str(e.get("args", {}).get("name", "")).startswith("GPU stream") for e in events)
