"""A CPU segment's compiled calls recorded per input signature and replayed (host/runtime/steps/cpu_replay.py):
the same bits as the usual run on every later input, fresh outputs, a replay that stops or is refused
falls back to the usual run, signatures apart, threads, and the check that refuses a recording missing
work. References: onnxruntime, and the same session with the replay off."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.cpu_ep import native
from host.runtime.session import InferenceSession
from host.runtime.steps import cpu_replay
from tests.models import available_models, load

pytestmark = pytest.mark.skipif(native.LIB is None, reason="the compiled CPU kernels are not built "
                                                           "(build.py; CI builds them): nothing to replay")


def _cnn(batch="N"):
    """x (batch, 4, 12, 12) -> Conv 3x3 + Relu -> depthwise Conv + HardSwish -> Conv 1x1 (+ residual Add)
    -> GlobalAveragePool -> Flatten -> Gemm: chains the compiled convolutions take at batch 1."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 3).astype(np.float32), name)

    inits = [init("w1", 8, 4, 3, 3), init("b1", 8), init("w2", 8, 1, 3, 3), init("b2", 8), init("w3", 8, 8, 1, 1),
             init("b3", 8), init("wf", 8, 5), init("bf", 5)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("HardSwish", ["c2"], ["h2"]),
             helper.make_node("Conv", ["h2", "w3", "b3"], ["c3"]),
             helper.make_node("Add", ["c3", "r1"], ["a3"]),
             helper.make_node("GlobalAveragePool", ["a3"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model.SerializeToString()


def _feeds(seed, batch=1):
    return {"x": np.random.default_rng(seed).standard_normal((batch, 4, 12, 12)).astype(np.float32)}


@pytest.fixture
def counts(monkeypatch):
    monkeypatch.setattr(cpu_replay, "stats", dict.fromkeys(cpu_replay.stats, 0))
    return cpu_replay.stats


def _ort(model: bytes):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_later_runs_are_replayed_with_the_usual_runs_bits_and_onnxruntimes_values(counts, monkeypatch):
    model = _cnn()
    replayed = InferenceSession(model, providers=["CPUExecutionProvider"])
    monkeypatch.setattr(cpu_replay, "ENABLED", False)
    usual = [InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, _feeds(s))[0] for s in range(6)]
    monkeypatch.setattr(cpu_replay, "ENABLED", True)
    ref = _ort(model)
    for seed in range(6):  # a new input every run: a replay that reused a stale buffer would show
        got = replayed.run(None, _feeds(seed))[0]
        assert got.tobytes() == usual[seed].tobytes(), seed
        np.testing.assert_allclose(got, ref.run(None, _feeds(seed))[0], rtol=1e-5, atol=1e-6)
    assert counts["recorded"] == 1 and counts["replayed"] == 5 and counts["refused"] == counts["stopped"] == 0
    (program,) = replayed.executor.steps[0][0].replay._programs.values()
    kinds = [kind for kind, _ in program.actions]
    assert kinds.count("calls") >= 2 and "rerun" in kinds, kinds  # the chains replayed; pool, Flatten, Gemm rerun


def test_outputs_are_fresh_arrays_the_caller_may_keep_and_change():
    s = InferenceSession(_cnn(), providers=["CPUExecutionProvider"])
    outs = [s.run(None, _feeds(1))[0] for _ in range(4)]
    want = outs[0].copy()
    outs[2][:] = 7.0  # the caller writes into a replayed run's output
    assert np.shares_memory(outs[2], outs[3]) is False
    np.testing.assert_array_equal(s.run(None, _feeds(1))[0], want)


def test_signatures_record_apart_and_the_oldest_is_dropped(counts, monkeypatch):
    monkeypatch.setattr(cpu_replay, "MAX_SIGNATURES", 2)
    model = _cnn()
    s = InferenceSession(model, providers=["CPUExecutionProvider"])
    ref = _ort(model)
    for batch in (1, 2, 3, 1, 2, 3, 1):
        for seed in range(3):
            feeds = _feeds(seed, batch)
            np.testing.assert_allclose(s.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-5, atol=1e-6)
    replay = s.executor.steps[0][0].replay
    assert len(replay._programs) == 2 and counts["recorded"] >= 3


def test_a_call_answering_otherwise_stops_the_replay_and_the_run_goes_the_usual_way(counts):
    s = InferenceSession(_cnn(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        s.run(None, _feeds(0))
    (program,) = s.executor.steps[0][0].replay._programs.values()
    kind, calls = next(a for a in program.actions if a[0] == "calls")
    fn, args, result = calls[0]
    calls[0] = (fn, args, "not what it returns")
    got = s.run(None, _feeds(3))[0]
    assert counts["stopped"] == 1
    np.testing.assert_allclose(got, _ort(_cnn()).run(None, _feeds(3))[0], rtol=1e-5, atol=1e-6)


def test_the_check_refuses_a_recording_that_misses_work():
    """_agrees compares the usual run with the replay on other inputs: a recording without one of its
    steps' calls (work the replay would skip) gives other bits there and is refused."""
    s = InferenceSession(_cnn(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        s.run(None, _feeds(0))
    segment = s.executor.steps[0][0]
    replay = segment.replay
    (program,) = replay._programs.values()
    values = list(s.executor._blank)
    values[segment.entering[0]] = _feeds(0)["x"]
    assert replay._agrees(program, values)
    index = next(i for i, (kind, _) in enumerate(program.actions) if kind == "calls")
    program.actions[index] = ("calls", [])  # the first chain's work left out
    assert not replay._agrees(program, values)


def test_a_recording_beyond_the_byte_bound_is_refused(counts, monkeypatch):
    monkeypatch.setattr(cpu_replay, "MAX_BYTES", 1024)
    s = InferenceSession(_cnn(), providers=["CPUExecutionProvider"])
    ref = _ort(_cnn())
    for seed in range(4):
        np.testing.assert_allclose(s.run(None, _feeds(seed))[0], ref.run(None, _feeds(seed))[0], rtol=1e-5, atol=1e-6)
    assert counts["refused"] == 1 and counts["replayed"] == 0


def test_threads_share_a_segment_without_mixing_their_runs():
    model = _cnn()
    s = InferenceSession(model, providers=["CPUExecutionProvider"])
    ref = _ort(model)
    want = {seed: ref.run(None, _feeds(seed))[0] for seed in range(8)}
    errors = []

    def work(offset):
        try:
            for k in range(40):
                seed = (offset + k) % 8
                np.testing.assert_allclose(s.run(None, _feeds(seed))[0], want[seed], rtol=1e-5, atol=1e-6)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.skipif("mobilenetv3_dynamo" not in available_models(), reason="the MobileNetV3 fixture is not checked out")
def test_mobilenet_replays_its_chains_and_matches_torch(counts):
    path, feeds, expected = load("mobilenetv3_dynamo")
    s = InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = expected.values()
    for k in range(4):
        x = {name: (v * (1 + 0.1 * k)).astype(v.dtype) for name, v in feeds.items()} if k else feeds
        got = s.run(None, x)[0]
        if k == 0:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert counts["replayed"] >= 2 and counts["refused"] == 0


def test_the_count_of_signatures_seen_is_bounded(monkeypatch):
    monkeypatch.setattr(cpu_replay, "MAX_SEEN", 3)
    s = InferenceSession(_cnn(), providers=["CPUExecutionProvider"])
    for batch in range(1, 9):
        s.run(None, _feeds(0, batch))
    assert len(s.executor.steps[0][0].replay._seen) <= 3


def test_an_input_a_step_fails_on_is_reported_and_a_later_run_still_records(counts):
    """A Gather's index out of range fails the recording run as it fails the usual one (the same typed
    error); the signature is recorded at a later good run, not given up."""
    from host.errors import EphostError

    data = numpy_helper.from_array(np.arange(24, dtype=np.float32).reshape(6, 4), "data")
    w = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")
    nodes = [helper.make_node("Gather", ["data", "idx"], ["g"]),
             helper.make_node("Reshape", ["g", "shape"], ["g4"]),
             helper.make_node("Conv", ["g4", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    shape = numpy_helper.from_array(np.array([1, 4, 2, 1], np.int64), "shape")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 1])], [data, w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    s = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = _ort(model.SerializeToString())
    good = {"idx": np.array([1, 4], np.int64)}
    s.run(None, good)
    with pytest.raises(EphostError):
        s.run(None, {"idx": np.array([1, 40], np.int64)})
    for idx in ([1, 4], [5, 0], [2, 3]):
        feeds = {"idx": np.array(idx, np.int64)}
        np.testing.assert_allclose(s.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-6)
    assert counts["recorded"] == 1 and counts["replayed"] >= 2
