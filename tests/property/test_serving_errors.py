"""Serving errors (host/serving): bad requests answered 400 and kept out of batches, without a Ray cluster.

`ServedModel` is the deployment's class; here it is made directly (no cluster, no HTTP server) over a
session with the example plugin, and called with Starlette requests, several at once so that good ones
are batched together while bad ones arrive. For a random mix of request kinds: each answer's status is
the kind's (200, 400 for a body or tensor that does not fit the model, 404 for another model), a 400
carries the typed error (`InvalidArgument`), the good answers equal onnxruntime's, and only the good
requests reach a batch (the replica's request count). A failing run answers 500 and the replica serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import built_plugin
from tests.property import strategies as s

if "MUTANT_UNDER_TEST" in os.environ:  # set by mutmut in its runs; serving is not one of its targets
    pytest.skip("under mutmut, a forked child's Ray Serve batch thread waits forever on a lock taken before the "
                "fork (seen with py-spy); the serving code is not a mutation target", allow_module_level=True)
serve_batching = pytest.importorskip("ray.serve.batching", reason="Ray Serve is not installed ('.[serve]')")
from starlette.requests import Request  # noqa: E402 - Ray Serve brings Starlette

from host.serving.backend import ModelSpec  # noqa: E402
from host.serving.deployment import ServedModel  # noqa: E402

V = 7
B = numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "b")
MODEL = helper.make_model(helper.make_graph(
    [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Add", ["r", "b"], ["y"], name="add")],
    "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [B]),
    opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
REFERENCE = ort.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"])
# One event loop per process for every replica of this module: serve.batch keeps its queue task on the loop it
# first ran on, so a second asyncio.run() would wait on a loop that no longer runs; and a loop made before a
# fork (mutmut runs each mutant in a forked child) shares its epoll instance with the parent's: a hang.
_LOOPS: dict[int, asyncio.AbstractEventLoop] = {}


def _run(coroutine):
    loop = _LOOPS.get(os.getpid())
    if loop is None:
        loop = _LOOPS[os.getpid()] = asyncio.new_event_loop()
    return loop.run_until_complete(coroutine)


STATUS = {"good": 200, "good_npz": 200, "bad_json": 400, "bad_datatype": 400, "bad_shape": 400, "bad_name": 400,
          "no_inputs": 400, "bad_output": 400, "short_data": 400, "other_model": 404}


@contextlib.contextmanager
def _served(options: dict[str, str]):
    """A replica outside Ray: serve.batch's queue asks the replica context only for a warning about
    max_ongoing_requests, which a replica made without a cluster does not have."""
    warn = serve_batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests
    serve_batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m.onnx"
            onnx.save(MODEL, path)
            spec = ModelSpec(str(path), providers=(("ExampleEP", options),),
                             plugins=(("ex", str(built_plugin("example", V))),))
            served = ServedModel(spec, "m", 4, 0.002, None)
            try:
                yield served
            finally:
                served.session.close()
    finally:
        serve_batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = warn


def _request(path: str, body: bytes, content_type: str = "application/json") -> Request:
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-type", content_type.encode())]}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def _body(kind: str, x: np.ndarray) -> tuple[str, bytes, str]:
    """(path, body, content type) of a request of `kind` for the input `x`."""
    path = "/v2/models/m/infer"
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
    if kind == "good_npz":
        buf = io.BytesIO()
        np.savez(buf, x=x)
        return path, buf.getvalue(), "application/x-npz"
    if kind == "bad_json":
        return path, b'{"inputs": [', "application/json"
    if kind == "bad_datatype":
        tensor["datatype"] = "INT32"
        tensor["data"] = [int(v) for v in tensor["data"]]
    elif kind == "bad_shape":
        tensor["shape"] = [x.shape[0] * 3, 1]
    elif kind == "bad_name":
        tensor["name"] = "z"
    elif kind == "short_data":
        tensor["data"] = tensor["data"][:-1]
    elif kind == "other_model":
        path = "/v2/models/other/infer"
    doc = {"inputs": [] if kind == "no_inputs" else [tensor]}
    if kind == "bad_output":
        doc["outputs"] = [{"name": "nope"}]
    return path, json.dumps(doc).encode(), "application/json"


def _values(kind: str, response) -> np.ndarray:
    if kind == "good_npz":
        return np.load(io.BytesIO(response.body))["y"]
    (out,) = json.loads(response.body)["outputs"]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


requests = st.lists(st.tuples(st.sampled_from(sorted(STATUS)), st.integers(1, 3)), min_size=1, max_size=8)


@given(mix=requests, seed=st.integers(0, 3))
@example(mix=[("good", 2), ("bad_shape", 1), ("good_npz", 1), ("bad_datatype", 2), ("good", 3)], seed=0)
@settings(deadline=None, max_examples=s.budget(6))
def test_bad_requests_get_400_and_never_join_a_batch(mix, seed):
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal((rows, 3)).astype(np.float32) for _, rows in mix]
    with _served({"ops": "Relu,Add"}) as served:
        assert {n.provider for n in served.session.plan.nodes} == {"ExampleEP"}

        async def send_all():
            return await asyncio.gather(*(served(_request(*_body(kind, x))) for (kind, _), x in zip(mix, inputs)))

        answers = _run(send_all())
        stats = dict(served.stats)
    for (kind, _), x, answer in zip(mix, inputs, answers):
        assert answer.status_code == STATUS[kind], (kind, answer.body)
        if STATUS[kind] == 200:
            np.testing.assert_allclose(_values(kind, answer), REFERENCE.run(None, {"x": x})[0], rtol=1e-6)
        else:
            body = json.loads(answer.body)
            assert body["error_type"] == ("InvalidArgument" if STATUS[kind] == 400 else "NotFound"), body
    good = sum(STATUS[kind] == 200 for kind, _ in mix)
    assert stats["requests"] == good and stats["failed_runs"] == 0


def test_a_failing_run_answers_500_and_the_replica_serves_on():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with _served({"ops": "Relu,Add", "fail_node": "add"}) as served:

        async def send():
            return [await served(_request(*_body(kind, x))) for kind in ("good", "bad_shape", "good")]

        failed, bad, again = _run(send())
        assert failed.status_code == again.status_code == 500 and bad.status_code == 400
        assert json.loads(failed.body)["error"].startswith("KernelError: ")
        assert served.stats["failed_runs"] == 2 and served.stats["requests"] == 2
