"""Bad models and bad feeds: typed errors (ModelError, InvalidArgument, ...), never a crash or a raw
exception.

Models are mutated by hypothesis (bytes of the protobuf flipped or cut, element types, shapes,
missing initializers, cycles, unknown domains and ops, opsets) and loaded and run in a worker
process (tests/hostile/fuzz_worker.py) with a memory limit: a mutation that crashed the onnx
checker, shape inference or the host would kill the worker, not the test, and the test names it.
Bad feeds cannot crash (the host checks them before anything runs): they run in this process.
The number of examples comes from the hypothesis profile (ci: 25 each; EPHOST_HYPOTHESIS_PROFILE=thorough: 500).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from host.errors import EpError, InvalidArgument, ModelError
from host.runtime.session import InferenceSession
from host.runtime.tensor import tensor_from_pointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TYPED = {"ModelError", "InvalidArgument", "EpError", "KernelError", "OutOfMemoryError", "NoSuchFile"}


def base_model() -> onnx.ModelProto:
    """Y = MatMul(Relu(X + B), W): inputs, initializers, three ops, static shapes."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 4])
    b = numpy_helper.from_array(np.arange(3, dtype=np.float32), "B")
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "W")
    nodes = [helper.make_node("Add", ["X", "B"], ["S"], name="add"),
             helper.make_node("Relu", ["S"], ["R"], name="relu"),
             helper.make_node("MatMul", ["R", "W"], ["Y"], name="mm")]
    graph = helper.make_graph(nodes, "fuzz", [x], [y], [b, w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class Worker:
    """One fuzz worker process for the module; restarted (and the model reported) if it dies."""

    def __init__(self) -> None:
        self.proc = None

    def ask(self, data: bytes) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.hostile.fuzz_worker"], cwd=ROOT, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONPATH": ROOT})
        self.proc.stdin.write(base64.b64encode(data).decode() + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"outcome": "crash", "message": f"worker died (exit {code})", "model": base64.b64encode(data)[:200]}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _typed(r: dict) -> None:
    assert r["outcome"] == "ok" or r["outcome"] in TYPED, r


def test_worker_runs_the_unmutated_model(worker):
    assert worker.ask(base_model().SerializeToString()) == {"outcome": "ok", "stage": "run"}


@given(data=st.data())
def test_mutated_protobuf_bytes(worker, data):
    raw = bytearray(base_model().SerializeToString())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        for _ in range(data.draw(st.integers(1, 6), label="flips")):
            pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
            raw[pos] = data.draw(st.integers(0, 255), label="byte")
    _typed(worker.ask(bytes(raw)))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the optimizer leaves the model to the loader: no warning
def test_name_that_is_not_utf8():
    """Found by the thorough profile: a name with a byte flipped to 0x80 came back from protobuf as
    bytes and failed as a raw UnicodeDecodeError (onnx checker) or AttributeError (graph view).
    The optimizer used to try it first and warn 'graph optimization failed (SerdeError ...)'."""
    raw = bytearray(base_model().SerializeToString())
    pos = raw.index(b"fuzz")  # the graph's name
    raw[pos] = 0x80
    with pytest.raises(ModelError, match=r"^model is not valid ONNX: a graph name is not UTF-8 text \(b'\\x80uzz'\)$"):
        InferenceSession(bytes(raw), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fields", [("raw_data", "float_data"), ()], ids=["two", "none"])
def test_a_large_weight_needs_exactly_one_value_field(fields):
    """The checker sees large weights as typed inputs (so it does not serialise them); their value fields are
    checked apart, with the checker's words."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    if "float_data" in fields:
        w.float_data.extend([1.0])
    if not fields:
        w.ClearField("raw_data")
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 64])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match=r"^model is not valid ONNX: TensorProto \(tensor name: W\) should contain "
                                         r"one and only one value field; it has "):
        InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


ELEM_TYPES = st.sampled_from([0, 2, 6, 7, 8, 9, 10, 11, 16, 17, 21, 99, 1000])


def _mutate(kind: str, data) -> tuple[onnx.ModelProto, bool]:  # noqa: C901 - one branch per kind
    """A mutated model and whether the mutation certainly makes it invalid (typed error at creation)."""
    m = base_model()
    g = m.graph
    if kind == "input_dtype":
        g.input[0].type.tensor_type.elem_type = data.draw(ELEM_TYPES, label="elem_type")
        return m, False
    if kind == "initializer_dtype":
        t = g.initializer[data.draw(st.integers(0, 1), label="which")]
        t.data_type = data.draw(ELEM_TYPES, label="elem_type")
        return m, False
    if kind == "shape":
        dims = data.draw(st.lists(st.integers(-3, 7), min_size=0, max_size=4), label="dims")
        del g.input[0].type.tensor_type.shape.dim[:]
        for d in dims:
            g.input[0].type.tensor_type.shape.dim.add().dim_value = d
        return m, False
    if kind == "initializer_shape":
        t = g.initializer[1]
        t.dims[:] = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=3), label="dims")
        return m, False
    if kind == "missing_initializer":
        del g.initializer[data.draw(st.integers(0, 1), label="which")]
        return m, True
    if kind == "cycle":
        g.node[0].input[0] = data.draw(st.sampled_from(["R", "Y"]), label="from")
        return m, True
    if kind == "unknown_domain":
        g.node[data.draw(st.integers(0, 2), label="node")].domain = data.draw(
            st.sampled_from(["com.nowhere", "ai.onnx.ml.bogus", "\u00e9t\u00e9"]), label="domain")
        return m, True
    if kind == "unknown_op":
        g.node[data.draw(st.integers(0, 2), label="node")].op_type = data.draw(
            st.sampled_from(["NoSuchOp", "", "add", "Relu\x00"]), label="op")
        return m, True
    if kind == "opset":
        # Outside the host's window (1..the newest opset onnx defines).
        newest = onnx.defs.onnx_opset_version()
        m.opset_import[0].version = data.draw(st.sampled_from([0, newest + 1, 999, -5]), label="opset")
        return m, True
    if kind == "duplicate_output":
        g.node[1].output[0] = "S"
        return m, True
    raise AssertionError(kind)


KINDS = ["input_dtype", "initializer_dtype", "shape", "initializer_shape", "missing_initializer", "cycle",
         "unknown_domain", "unknown_op", "opset", "duplicate_output"]


@given(kind=st.sampled_from(KINDS), data=st.data())
def test_mutated_models(worker, kind, data):
    model, invalid = _mutate(kind, data)
    r = worker.ask(model.SerializeToString())
    _typed(r)
    if invalid:
        assert r["outcome"] in ("ModelError", "InvalidArgument") and r["stage"] == "create", r


@pytest.mark.parametrize("kind", ["missing_initializer", "cycle", "unknown_domain", "unknown_op", "opset"])
def test_invalid_model_messages(kind):
    """In process (these are refused before anything runs): the message says what is wrong."""
    model, _ = _mutate(kind, _First())  # deterministic: the first choice of every draw
    with pytest.raises(ModelError, match=r"^(model is not valid ONNX|shape inference failed|model uses ONNX opset"
                                         r"|no execution provider supports)"):
        InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


class _First:
    """A stand-in for hypothesis' data: always the first choice of a sampled_from / integers."""

    def draw(self, strategy, label=None):
        elements = getattr(strategy.wrapped_strategy if hasattr(strategy, "wrapped_strategy") else strategy,
                           "elements", None)
        return elements[0] if elements is not None else 0


# ---- bad feeds -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session():
    with InferenceSession(base_model().SerializeToString(), providers=["CPUExecutionProvider"]) as s:
        yield s


def _x():
    return np.arange(6, dtype=np.float32).reshape(2, 3) - 2


def _reference(x):
    return np.maximum(x + np.arange(3, dtype=np.float32), 0) @ np.ones((3, 4), np.float32)


def test_feed_wrong_dtype(session):
    with pytest.raises(InvalidArgument, match=r"^input 'X': expected dtype float32 \(tensor\(float\)\), got float64 \(tensor\(double\)\)$"):
        session.run(None, {"X": _x().astype(np.float64)})


def test_feed_wrong_shape(session):
    with pytest.raises(InvalidArgument, match=r"^input 'X': dimension 1 must be 3, got 4 \(expected shape \[2, 3\], "
                                              r"got \[2, 4\]\)$"):
        session.run(None, {"X": np.zeros((2, 4), np.float32)})
    with pytest.raises(InvalidArgument, match=r"^input 'X': expected rank 2 \(shape \[2, 3\]\), got rank 1"):
        session.run(None, {"X": np.zeros(6, np.float32)})


def test_feed_missing_and_unknown(session):
    with pytest.raises(InvalidArgument, match=r"^missing input\(s\) \['X'\]; model inputs: \['X'\]$"):
        session.run(None, {})
    with pytest.raises(InvalidArgument, match=r"^unknown input name\(s\) \['Z'\]; model inputs: \['X'\]$"):
        session.run(None, {"X": _x(), "Z": _x()})


def test_feed_not_contiguous_is_read_correctly(session):
    big = np.arange(24, dtype=np.float32).reshape(4, 6) - 5
    view = big[::2, ::2]  # strided: the host must read the values, not the memory behind the pointer
    assert not view.flags.c_contiguous
    np.testing.assert_allclose(session.run(None, {"X": view})[0], _reference(np.ascontiguousarray(view)))


def test_feed_on_a_device_no_ep_can_read(session):
    x = _x()
    dev = tensor_from_pointer(x.ctypes.data, x.shape, TensorProto.FLOAT)  # "cuda" memory, no CUDA EP here
    with pytest.raises(EpError, match=r"^no data transfer can copy from \(1, 0\) to \(0, 0\)$"):
        session.run(None, {"X": dev})
    np.testing.assert_allclose(session.run(None, {"X": x})[0], _reference(x))  # the session is unharmed
