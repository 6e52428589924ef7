"""host.serving's pure parts (no Ray): datatypes, request decoding, signatures, batching and buckets.

References are NumPy (concatenate, slicing) and onnxruntime's NodeArgs; errors are pinned with match="^...".
"""

from __future__ import annotations

import io
import json
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from host.cli import zoo
from host.errors import InvalidArgument, ModelError
from host.runtime.session import InferenceSession
from host.serving import datatypes, protocol
from host.serving.batching import BatchPolicy, Piece, power_of_two_buckets, resolve_buckets
from host.serving.signature import DYNAMIC, STATIC, UNBATCHED, Signature


def _node_args(*specs):
    return [SimpleNamespace(name=n, shape=s, type=t) for n, s, t in specs]


def _signature(inputs, outputs) -> Signature:
    return Signature.from_session(SimpleNamespace(get_inputs=lambda: _node_args(*inputs),
                                                  get_outputs=lambda: _node_args(*outputs)))


DYN = _signature([("a", ["batch", 3], "tensor(float)"), ("b", ["batch"], "tensor(int64)")],
                 [("y", ["batch", 3], "tensor(float)")])
STATIC4 = _signature([("a", [4, 3], "tensor(float)")], [("y", [4, 3], "tensor(float)")])


# ---- datatypes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(datatypes.KSERVE_TO_NUMPY))
def test_every_datatype_round_trips(name):
    assert datatypes.to_kserve(datatypes.to_numpy(name)) == name


def test_type_strings_of_ephost_and_onnxruntime_agree():
    model = zoo.mlp(layers=1, hidden=4, dynamic_batch=True)
    ours = InferenceSession(model.SerializeToString())
    theirs = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert Signature.from_session(ours) == Signature.from_session(theirs)
    assert [datatypes.from_type_string(t) for t in ("tensor(float16)", "tensor(bool)", "tensor(string)",
                                                    "tensor(bfloat16)", "tensor(double)")] == \
        [np.float16, np.bool_, np.dtype(object), np.dtype(ml_dtypes.bfloat16), np.float64]


def test_unknown_datatype_is_refused():
    with pytest.raises(InvalidArgument, match=r"^datatype 'F32' is not a KServe v2 datatype; allowed: \['BF16', "):
        datatypes.to_numpy("F32")


# ---- requests ----------------------------------------------------------------------------------------
def test_list_and_dict_forms_decode_to_the_same_feeds():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    as_list = {"id": "7", "inputs": [{"name": "a", "shape": [2, 3], "datatype": "FP32", "data": x.ravel().tolist()}]}
    as_dict = {"inputs": {"a": {"shape": [2, 3], "datatype": "FP32", "data": x.tolist()}}}  # nested data too
    one, two = protocol.decode_json(json.dumps(as_list).encode()), protocol.decode_json(json.dumps(as_dict).encode())
    assert (one.id, two.id) == ("7", None)
    np.testing.assert_array_equal(one.feeds["a"], x)
    np.testing.assert_array_equal(two.feeds["a"], x)
    assert one.feeds["a"].dtype == np.float32


@pytest.mark.parametrize(("body", "message"), [
    (b"\xff", r"^request body is not valid JSON \("),
    (b"[1]", r'^request body must be a JSON object with "inputs"; got list$'),
    (b'{"inputs": 3}', r'^"inputs" must be a list of tensors or a dict of name to tensor; got int$'),
    (b'{"inputs": [{"shape": [1]}]}', r'^each entry of "inputs" must be an object with a string "name"'),
    (b'{"inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]},'
     b' {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}]}', r"^input 'a' is given twice; each input once$"),
    (b'{"inputs": {"a": {"shape": [1], "data": [1]}}}',
     r"^input 'a': missing \['datatype'\]; a tensor has shape, datatype and data$"),
    (b'{"inputs": {"a": {"shape": [-1], "datatype": "FP32", "data": [1]}}}',
     r"^input 'a': shape must be a list of non-negative ints; got \[-1\]$"),
    (b'{"inputs": {"a": {"shape": [1], "datatype": "INT8", "data": [300]}}}',
     r"^input 'a': data cannot be read as INT8 \("),
    (b'{"inputs": {"a": {"shape": [2], "datatype": "FP32", "data": [[1], [2, 3]]}}}',
     r"^input 'a': data cannot be read as FP32 \("),
    (b'{"id": 5, "inputs": {}}', r'^"id" must be a string; got int$'),
    (b'{"inputs": {}, "outputs": ["y"]}', r'^"outputs" must be a list of objects with a string "name"'),
])
def test_malformed_json_bodies_are_invalid_arguments(body, message):
    with pytest.raises(InvalidArgument, match=message):
        protocol.decode_json(body)


def test_npz_round_trip_and_answer():
    feeds = {"a": np.ones((2, 3), np.float32), "b": np.arange(2)}
    buffer = io.BytesIO()
    np.savez(buffer, **feeds)
    decoded = protocol.decode_npz(buffer.getvalue())
    assert sorted(decoded) == ["a", "b"] and all(np.array_equal(decoded[k], feeds[k]) for k in feeds)
    with np.load(io.BytesIO(protocol.encode_npz(["y"], [feeds["a"]]))) as answer:
        np.testing.assert_array_equal(answer["y"], feeds["a"])


def test_a_single_npy_is_not_an_npz():
    buffer = io.BytesIO()
    np.save(buffer, np.ones(3))
    with pytest.raises(InvalidArgument, match=r"^request body is a single \.npy array; expected an \.npz archive"):
        protocol.decode_npz(buffer.getvalue())


def test_answer_and_metadata_documents():
    y = np.array([[1.5, -2.0]], np.float32)
    doc = protocol.encode_json("m", "id1", ["y"], [y], {"k": 1})
    assert doc == {"model_name": "m", "id": "id1", "parameters": {"k": 1},
                   "outputs": [{"name": "y", "shape": [1, 2], "datatype": "FP32", "data": [1.5, -2.0]}]}
    meta = protocol.model_metadata("m", DYN, "ephost_onnx")
    assert meta["inputs"] == [{"name": "a", "datatype": "FP32", "shape": [-1, 3]},
                              {"name": "b", "datatype": "INT64", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]
    with pytest.raises(InvalidArgument, match=r"^unknown output name\(s\) \['z'\]; model outputs: \['y'\]$"):
        protocol.select_outputs(DYN, ["z"])


# ---- signatures ---------------------------------------------------------------------------------------
def test_batch_axis_kinds():
    assert (DYN.batch_kind, STATIC4.batch_kind, STATIC4.static_batch) == (DYNAMIC, STATIC, 4)
    mixed = _signature([("a", [4, 3], "tensor(float)")], [("y", ["n", 3], "tensor(float)")])
    scalar = _signature([("a", [], "tensor(float)")], [("y", [], "tensor(float)")])
    assert mixed.batch_kind == UNBATCHED and scalar.batch_kind == UNBATCHED


def test_check_counts_rows_and_refuses_disagreement():
    assert DYN.check({"a": np.zeros((5, 3), np.float32), "b": np.zeros(5, np.int64)}, pad_static=False) == 5
    with pytest.raises(InvalidArgument, match=r"^inputs disagree on the batch dimension \(axis 0\): \{'a': 2, 'b': 3\}"):
        DYN.check({"a": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.int64)}, pad_static=False)
    with pytest.raises(InvalidArgument, match=r"^input 'a': dimension 1 must be 3, got 4 \(expected shape \[-1, 3\]"):
        DYN.check({"a": np.zeros((2, 4), np.float32), "b": np.zeros(2, np.int64)}, pad_static=False)


def test_static_batch_takes_fewer_rows_only_when_padded():
    x = np.zeros((2, 3), np.float32)
    assert STATIC4.check({"a": x}, pad_static=True) == 2
    with pytest.raises(InvalidArgument, match=r"^input 'a': dimension 0 must be 4, got 2 "):
        STATIC4.check({"a": x}, pad_static=False)
    with pytest.raises(InvalidArgument, match=r"^batch dimension \(axis 0\) is 5; this model's batch is fixed at 4, "
                                              r"so a request may carry 1\.\.4 rows$"):
        STATIC4.check({"a": np.zeros((5, 3), np.float32)}, pad_static=True)


# ---- batching -----------------------------------------------------------------------------------------
def test_bucket_lists():
    assert power_of_two_buckets(8) == (1, 2, 4, 8)
    assert power_of_two_buckets(6) == (1, 2, 4, 6)
    assert power_of_two_buckets(1) == (1,)
    assert resolve_buckets("auto", 8, gpu=False) == () and resolve_buckets("auto", 8, gpu=True) == (1, 2, 4, 8)
    assert resolve_buckets([8, 2, 2], 8, gpu=False) == (2, 8) and resolve_buckets(None, 8, gpu=True) == ()
    with pytest.raises(InvalidArgument, match=r"^buckets=\[0, 2\]: every bucket must be a positive int"):
        resolve_buckets([0, 2], 8, gpu=False)
    with pytest.raises(InvalidArgument, match=r"^buckets='pow2': expected 'auto', True, False, None or a list"):
        resolve_buckets("pow2", 8, gpu=False)


def _pieces(rng, rows_list, width=3):
    return [Piece({"a": rng.standard_normal((r, width)).astype(np.float32), "b": np.arange(r) + 10 * i}, r)
            for i, r in enumerate(rows_list)]


def _fake_model(feeds):
    """y = a * 2 + b (per row): a batched model whose rows are independent, so splits are checkable."""
    return [feeds["a"] * 2 + feeds["b"][:, None].astype(np.float32)]


def test_runs_join_pad_to_buckets_and_split_back():
    rng = np.random.default_rng(0)
    pieces = _pieces(rng, [1, 3, 2, 4, 1])
    policy = BatchPolicy(DYN, max_batch_size=8, buckets=(1, 2, 4, 8))
    runs = policy.plan(pieces)
    assert [(r.members, r.rows, r.padded_rows) for r in runs] == [([0, 1, 2], 6, 8), ([3, 4], 5, 8)]
    answers = {}
    for run in runs:
        assert all(v.shape[0] == run.padded_rows for v in run.feeds.values())
        for member, values in zip(run.members, policy.split(pieces, run, _fake_model(run.feeds))):
            answers[member] = values
    for i, piece in enumerate(pieces):  # each request's answer is what it alone would get
        np.testing.assert_array_equal(answers[i][0], _fake_model(piece.feeds)[0])


def test_without_buckets_nothing_is_padded_and_other_shapes_run_apart():
    rng = np.random.default_rng(1)
    pieces = _pieces(rng, [2, 1]) + _pieces(rng, [1], width=5)
    runs = BatchPolicy(DYN, max_batch_size=8, buckets=()).plan(pieces)
    assert sorted((r.members, r.rows, r.padded_rows) for r in runs) == [([0, 1], 3, 3), ([2], 1, 1)]


def test_a_request_larger_than_max_batch_size_runs_alone_at_its_size():
    pieces = _pieces(np.random.default_rng(2), [2, 9, 1])
    runs = BatchPolicy(DYN, max_batch_size=4, buckets=(1, 2, 4)).plan(pieces)
    assert [(r.members, r.rows, r.padded_rows) for r in runs] == [([0], 2, 2), ([1], 9, 9), ([2], 1, 1)]


def test_static_batch_pads_only_when_it_is_a_bucket():
    pieces = [Piece({"a": np.full((r, 3), i, np.float32)}, r) for i, r in enumerate([1, 2, 3])]
    padded = BatchPolicy(STATIC4, max_batch_size=8, buckets=(1, 2, 4, 8))
    assert padded.pads_static
    runs = padded.plan(pieces)
    assert [(r.members, r.rows, r.padded_rows) for r in runs] == [([0, 1], 3, 4), ([2], 3, 4)]
    np.testing.assert_array_equal(runs[0].feeds["a"][:, 0], [0, 1, 1, 1])  # padding repeats the last real row
    assert not BatchPolicy(STATIC4, max_batch_size=8, buckets=(1, 2, 8)).pads_static


def test_outputs_without_the_batch_on_axis_0_are_a_model_error():
    pieces = _pieces(np.random.default_rng(3), [1, 1])
    policy = BatchPolicy(DYN, max_batch_size=8, buckets=())
    (run,) = policy.plan(pieces)
    with pytest.raises(ModelError, match=r"^output 'y' has shape \[3\] after a run of 2 rows; a batched model's "):
        policy.split(pieces, run, [np.zeros(3, np.float32)])


def test_deployment_options_are_checked_before_ray_starts(tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[serve]')")
    from host.serving import ephost_deployment

    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])), path)
    with pytest.raises(ModelError, match=r"^model '.*nope\.onnx' is not a file; a deployment serves an ONNX model"):
        ephost_deployment(tmp_path / "nope.onnx")
    with pytest.raises(InvalidArgument, match=r"^max_batch_size must be an int >= 1 \(1 turns batching off\); got 0$"):
        ephost_deployment(path, max_batch_size=0)
    with pytest.raises(InvalidArgument, match=r"^model name 'a/b' cannot be a URL path segment"):
        ephost_deployment(path, name="a/b")
    with pytest.raises(InvalidArgument, match=r"^backend 'tvm' is not known; allowed: \['ephost', 'onnxruntime'\]$"):
        ephost_deployment(path, backend="tvm")
    app = ephost_deployment(path, num_replicas=3)  # binding starts nothing
    assert app is not None


# ---- ephost serve (what it would deploy; the Ray tests run it for real) ---------------------------------
def _serve_args(*argv):
    from host.cli import app as cli

    return cli.build_parser().parse_args(["serve", "m.onnx", *argv])


def test_serve_options_map_to_the_deployment():
    from host.cli.serve import deployment_options

    opts = deployment_options(_serve_args("--ep", "cuda", "--ep-option", "use_tf32=1", "--replicas", "3",
                                          "--max-batch-size", "16", "--batch-wait-ms", "2", "--buckets", "1,4,16",
                                          "--num-cpus", "2", "--plugin", "x=/lib/x.so", "--name", "net"))
    assert opts == {"providers": ["CUDAExecutionProvider"], "provider_options": [{"use_tf32": "1"}],
                    "plugins": {"x": "/lib/x.so"}, "max_batch_size": 16, "batch_wait_timeout_s": 0.002,
                    "buckets": [1, 4, 16], "num_replicas": 3, "name": "net", "num_gpus": None,
                    "ray_actor_options": {"num_cpus": 2.0}}
    assert deployment_options(_serve_args("--buckets", "off"))["buckets"] is False
    with pytest.raises(InvalidArgument, match=r"^--buckets 'x2': expected auto, on, off or a comma-separated list"):
        deployment_options(_serve_args("--buckets", "x2"))


def test_serve_refuses_a_missing_model_before_starting_ray(tmp_path, capsys):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[serve]')")
    from host.cli import app as cli

    assert cli.main(["serve", str(tmp_path / "none.onnx")]) == 2
    assert capsys.readouterr().err.startswith(f"error: model '{tmp_path / 'none.onnx'}' is not a file; ")
    import ray

    assert not ray.is_initialized()


def test_serve_without_ray_says_how_to_install_it(monkeypatch, capsys):
    from host.cli import app as cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert cli.main(["serve", "m.onnx"]) == 2
    assert capsys.readouterr().err.startswith("error: serving needs Ray Serve, which cannot be imported (")


def test_the_config_builder_converts_and_checks_its_args(tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[serve]')")
    import pydantic

    from host.serving.builder import ServeArgs, app

    path = tmp_path / "m.onnx"
    onnx.save(zoo.mlp(layers=1, hidden=4, dynamic_batch=True), path)
    args = ServeArgs.model_validate({"model_path": str(path), "max_batch_size": "16", "buckets": [1, 2],
                                     "num_gpus": "0"})  # strings, as `serve run ... key=value` passes them
    assert (args.max_batch_size, args.buckets, args.num_replicas, args.num_gpus) == (16, [1, 2], 1, 0.0)
    assert app(args) is not None  # binds; starts nothing
    with pytest.raises(pydantic.ValidationError, match="max_batch_sise"):
        ServeArgs.model_validate({"model_path": "m.onnx", "max_batch_sise": 4})


def test_a_request_that_fails_a_joined_run_fails_alone(tmp_path):
    """One request's values break the joined run (a Gather index out of range): its neighbours are
    rerun alone and answered; only it gets the error. The replica class runs here without Ray."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[serve]')")
    from host.serving.backend import ModelSpec
    from host.serving.deployment import ServedModel

    table = np.arange(15, dtype=np.float32).reshape(5, 3)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "index"], ["row"], axis=0)], "g",
        [helper.make_tensor_value_info("index", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("row", TensorProto.FLOAT, ["n", 3])],
        [onnx.numpy_helper.from_array(table, "table")])
    path = tmp_path / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    replica = ServedModel(ModelSpec(str(path)), "gather", max_batch_size=8, batch_wait_timeout_s=0.0, buckets=False)
    indexes = [np.array([1, 4]), np.array([9]), np.array([2])]
    pieces = [Piece({"index": i}, replica.signature.check({"index": i}, pad_static=False)) for i in indexes]
    outcomes = replica._run_batch(pieces)
    assert outcomes[1].values is None and isinstance(outcomes[1].error, Exception)
    for i in (0, 2):
        assert outcomes[i].error is None
        np.testing.assert_array_equal(outcomes[i].values[0], table[indexes[i]])
    assert (replica.stats["runs"], replica.stats["failed_runs"], replica.stats["batches"]) == (4, 2, 1)


def test_cuda_replicas_ask_ray_for_a_gpu_each():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[serve]')")
    from host.serving.backend import ModelSpec
    from host.serving.deployment import replica_options

    cuda = ModelSpec("m.onnx", providers=("CUDAExecutionProvider",))
    cpu = ModelSpec("m.onnx")
    assert replica_options(cuda, 8, 2, None, None) == {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1},
                                                       "max_ongoing_requests": 16}
    assert replica_options(cuda, 8, 1, 0.5, {"num_cpus": 2})["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.5}
    assert replica_options(cpu, 1, 1, None, None)["ray_actor_options"] == {}
    assert ModelSpec("m.onnx", providers=(("CUDAExecutionProvider", {"device_id": "0"}),)).uses_gpu
