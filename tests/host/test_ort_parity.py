"""Short onnxruntime scripts run unchanged against onnxruntime and against ephost (`import host as ort`).

Each script below is written for onnxruntime: its first line is `import onnxruntime as ort`. The
test runs it once as written and once with that line replaced by `import host as ort`, and compares
what each run left in `result` (arrays to float tolerance, everything else exactly). The model is a
small MLP with a Gemm, a Relu, a MatMul with an initializer also listed as a graph input, and
metadata, written to MODEL.
"""

from __future__ import annotations

import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ort_reference = pytest.importorskip("onnxruntime", reason="the parity scripts compare against onnxruntime")


def parity_model() -> onnx.ModelProto:
    """y = relu(x @ W1 + b1) @ W2 + bias;  `bias` is an initializer that is also a graph input."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((8,)).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "W2"),
             numpy_helper.from_array(rng.standard_normal((3,)).astype(np.float32), "bias")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="gemm"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "bias"], ["y"], name="add")]
    graph = helper.make_graph(
        nodes, "parity_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], initializer=inits,
        doc_string="graph doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="parity-test",
                              producer_version="1.0", domain="test.domain", model_version=7, doc_string="model doc")
    helper.set_model_props(model, {"author": "ephost", "purpose": "parity"})
    model.ir_version = 8
    return model


SCRIPTS = {
    "run_with_options": """
        import onnxruntime as ort
        import numpy as np
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        sess = ort.InferenceSession(MODEL, sess_options=so, providers=["CPUExecutionProvider"])
        x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
        inp = sess.get_inputs()[0]
        out = sess.get_outputs()[0]
        result = {
            "inputs": [(i.name, i.shape, i.type) for i in sess.get_inputs()],
            "outputs": [(o.name, o.shape, o.type) for o in sess.get_outputs()],
            "y": sess.run([out.name], {inp.name: x})[0],
            "y_none": sess.run(None, {inp.name: x})[0],
            "providers": sess.get_providers(),
            "threads": sess.get_session_options().intra_op_num_threads,
            "level": int(sess.get_session_options().graph_optimization_level),
        }
    """,
    "bytes_and_provider_forms": """
        import onnxruntime as ort
        import numpy as np
        with open(MODEL, "rb") as f:
            data = f.read()
        x = np.ones((3, 4), np.float32)
        a = ort.InferenceSession(data, providers=[("CPUExecutionProvider", {})])
        b = ort.InferenceSession(data, providers=["CPUExecutionProvider"], provider_options=[{}])
        result = {
            "a": a.run(None, {"x": x})[0], "b": b.run(None, {"x": x})[0],
            "options": b.get_provider_options(), "providers": a.get_providers(),
        }
    """,
    "modelmeta": """
        import onnxruntime as ort
        meta = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"]).get_modelmeta()
        result = {"producer": meta.producer_name, "graph": meta.graph_name, "domain": meta.domain,
                  "description": meta.description, "graph_description": meta.graph_description,
                  "version": meta.version, "custom": meta.custom_metadata_map}
    """,
    "ortvalue": """
        import onnxruntime as ort
        import numpy as np
        sess = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
        x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
        v = ort.OrtValue.ortvalue_from_numpy(x)
        empty = ort.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float32)
        empty.update_inplace(np.full((2, 3), 5, np.float32))
        outs = sess.run_with_ort_values(["y"], {"x": v})
        result = {
            "device": v.device_name(), "shape": v.shape(), "type": v.data_type(), "elem": v.element_type(),
            "is_tensor": v.is_tensor(), "same_memory": v.data_ptr() == x.ctypes.data,
            "roundtrip": v.numpy(), "filled": empty.numpy(), "empty_shape": empty.shape(),
            "y": outs[0].numpy(), "y_type": outs[0].data_type(), "y_from_run": sess.run(None, {"x": v})[0],
        }
    """,
    "iobinding": """
        import onnxruntime as ort
        import numpy as np
        sess = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
        x = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
        io = sess.io_binding()
        io.bind_cpu_input("x", x)
        io.bind_output("y")
        sess.run_with_iobinding(io)
        first = io.get_outputs()[0].numpy().copy()
        copied = io.copy_outputs_to_cpu()[0]
        target = ort.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float32)
        io.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x * 2))
        io.bind_ortvalue_output("y", target)
        sess.run_with_iobinding(io)
        buf = np.zeros((2, 3), np.float32)
        io.bind_output("y", "cpu", 0, np.float32, [2, 3], buf.ctypes.data)
        sess.run_with_iobinding(io)
        result = {"first": first, "copied": copied, "target": target.numpy(), "buffer": buf,
                  "device": io.get_outputs()[0].device_name()}
    """,
    "run_async": """
        import onnxruntime as ort
        import numpy as np
        import threading
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        sess = ort.InferenceSession(MODEL, so, providers=["CPUExecutionProvider"])
        done = threading.Event()
        got = {}
        def callback(results, user_data, err):
            got["results"], got["user_data"], got["err"] = results, user_data, err
            done.set()
        sess.run_async(None, {"x": np.ones((1, 4), np.float32)}, callback, "my data")
        done.wait(10)
        result = {"y": got["results"][0], "user_data": got["user_data"], "err": got["err"]}
        done.clear()
        sess.run_async(None, {"x": np.ones((1, 4), np.float64)}, callback, None)
        done.wait(10)
        result["bad_results"], result["bad_has_err"] = got["results"], bool(got["err"])
    """,
    "errors_by_capi_class": """
        import onnxruntime as ort
        import numpy as np
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, NoSuchFile
        sess = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
        caught = []
        try:
            sess.run(None, {"x": np.ones((2, 4), np.float64)})
        except InvalidArgument:
            caught.append("dtype")
        try:
            sess.run(None, {"x": np.ones((2, 5), np.float32)})
        except InvalidArgument:
            caught.append("shape")
        try:
            ort.InferenceSession(MODEL + ".missing", providers=["CPUExecutionProvider"])
        except NoSuchFile:
            caught.append("no such file")
        ro = ort.RunOptions()
        ro.terminate = True
        try:
            sess.run(None, {"x": np.ones((2, 4), np.float32)}, ro)
        except Fail:
            caught.append("terminated")
        ro.terminate = False
        result = {"caught": caught, "after": sess.run(None, {"x": np.ones((2, 4), np.float32)}, ro)[0]}
    """,
    "module_functions_and_devices": """
        import onnxruntime as ort
        import numpy as np
        devices = ort.get_ep_devices()
        cpu = [d for d in devices if d.ep_name == "CPUExecutionProvider"]
        so = ort.SessionOptions()
        so.add_provider_for_devices(cpu, {})
        a = ort.InferenceSession(MODEL, so)
        so2 = ort.SessionOptions()
        so2.set_provider_selection_policy(ort.OrtExecutionProviderDevicePolicy.PREFER_CPU)
        b = ort.InferenceSession(MODEL, so2)
        x = np.ones((1, 4), np.float32)
        result = {
            "cpu_available": "CPUExecutionProvider" in ort.get_available_providers(),
            "device": ort.get_device(),
            "cpu_device_type": cpu[0].device.type == ort.OrtHardwareDeviceType.CPU,
            "a": a.get_providers(), "b": b.get_providers(),
            "ya": a.run(None, {"x": x})[0], "yb": b.run(None, {"x": x})[0],
        }
    """,
    "overridable_and_fallback": """
        import onnxruntime as ort
        sess = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
        sess.disable_fallback()
        sess.enable_fallback()
        result = {"overridable": [(i.name, i.shape, i.type) for i in sess.get_overridable_initializers()],
                  "inputs": [i.name for i in sess.get_inputs()]}
    """,
    "profiling": """
        import onnxruntime as ort
        import numpy as np
        import json, os, re
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(TMP, "prof_")
        sess = ort.InferenceSession(MODEL, so, providers=["CPUExecutionProvider"])
        sess.run(None, {"x": np.ones((2, 4), np.float32)})
        path = sess.end_profiling()
        with open(path) as f:
            events = json.load(f)
        nodes = [e for e in events if e.get("cat") == "Node"]
        result = {"list": isinstance(events, list),
                  "name": bool(re.fullmatch(r"prof__\\d{4}-\\d\\d-\\d\\d_\\d\\d-\\d\\d-\\d\\d_\\d{3}\\.json",
                                            os.path.basename(path))),
                  "indexable": events[0]["ph"] in ("X", "M") and all("dur" in e for e in events),
                  "has_nodes": len(nodes) > 0, "complete": all(e["ph"] == "X" and e["dur"] >= 0 for e in nodes),
                  "again": sess.end_profiling(), "start_ns": sess.get_profiling_start_time_ns() > 0}
    """,
    "missing_config_entry": """
        import onnxruntime as ort
        so, ro = ort.SessionOptions(), ort.RunOptions()
        so.add_session_config_entry("session.k", "v")
        result = {"present": so.get_session_config_entry("session.k")}
        for name, get in (("session", so.get_session_config_entry), ("run", ro.get_run_config_entry)):
            try:
                get("no.such.key")
                result[name] = "no error"
            except RuntimeError as exc:
                result[name] = str(exc)
    """,
    "enum_strings": """
        import onnxruntime as ort
        so = ort.SessionOptions()
        default = so.graph_optimization_level
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        level = so.graph_optimization_level
        result = {"default": (str(default), f"{default}", repr(default), int(default)),
                  "basic": (str(level), f"{level}", repr(level), level == 1, int(level)),
                  "levels": [str(v) for v in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                              ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                              ort.GraphOptimizationLevel.ORT_ENABLE_ALL)],
                  "mode": (str(so.execution_mode), str(ort.ExecutionMode.ORT_PARALLEL), int(so.execution_mode))}
    """,
    "empty_model": """
        import onnxruntime as ort
        import os
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
        path = os.path.join(TMP, "empty.onnx")
        open(path, "wb").close()
        result = {}
        for name, model in (("file", path), ("bytes", b"")):
            try:
                ort.InferenceSession(model, providers=["CPUExecutionProvider"])
                result[name] = "no error"
            except InvalidArgument as exc:
                text = str(exc)
                result[name] = ("No graph was found in the protobuf" in text, (path in text) == (name == "file"))
    """,
}

# Keys where ephost answers differently on purpose (docs/onnxruntime.md lists each difference).
EXPECTED_DIFFERENCES: dict[str, set[str]] = {}


def run_script(source: str, module: str, model_path: str, tmp: str) -> dict:
    code = textwrap.dedent(source).lstrip()
    assert code.startswith("import onnxruntime as ort\n")
    if module == "host":
        code = code.replace("import onnxruntime as ort\n", "import host as ort\n", 1)
        code = code.replace("from onnxruntime.capi.", "from host.capi.")
    namespace = {"MODEL": model_path, "TMP": tmp}
    exec(compile(code, f"<{module} script>", "exec"), namespace)
    return namespace["result"]


def assert_same(got, want, where: str) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: ephost gave {type(got).__name__}, onnxruntime an array"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape} vs {want.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=where)
    elif isinstance(want, (list, tuple)) and want and any(isinstance(w, np.ndarray) for w in want):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: ephost {got!r} != onnxruntime {want!r}"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("parity") / "parity.onnx"
    onnx.save(parity_model(), path)
    return str(path)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_onnxruntime_script_runs_unchanged(name, model_path, tmp_path):
    (tmp_path / "ort").mkdir()
    (tmp_path / "ephost").mkdir()
    want = run_script(SCRIPTS[name], "onnxruntime", model_path, str(tmp_path / "ort"))
    got = run_script(SCRIPTS[name], "host", model_path, str(tmp_path / "ephost"))
    assert sorted(got) == sorted(want)
    for key in want:
        if key not in EXPECTED_DIFFERENCES.get(name, set()):
            assert_same(got[key], want[key], f"{name}: {key}")


def test_scripts_compute_what_numpy_computes(model_path, tmp_path):
    """The shared answers are right, not only equal: y against NumPy on the model's weights."""
    m = parity_model()
    w = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    want = np.maximum(x @ w["W1"] + w["b1"], 0) @ w["W2"] + w["bias"]
    got = run_script(SCRIPTS["run_with_options"], "host", model_path, str(tmp_path))
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-6)


# ---- ephost-side checks of the same API (no onnxruntime counterpart to compare with) -------------
def test_ortvalue_bad_arguments():
    from host.errors import InvalidArgument
    from host.runtime.ortvalue import OrtValue

    with pytest.raises(InvalidArgument, match=r"^device_type must be 'cpu' or 'cuda'; got 'tpu'$"):
        OrtValue.ortvalue_from_numpy(np.ones(2, np.float32), "tpu")
    with pytest.raises(InvalidArgument, match=r"^device_id must be an integer >= 0; got -1$"):
        OrtValue.ortvalue_from_numpy(np.ones(2, np.float32), "cpu", -1)
    with pytest.raises(InvalidArgument, match=r"^shape must be a list of integers >= 0; got \[2, -1\]$"):
        OrtValue.ortvalue_from_shape_and_type([2, -1], np.float32)
    with pytest.raises(InvalidArgument, match=r"^element_type must be a NumPy dtype or an ONNX element type with "):
        OrtValue.ortvalue_from_shape_and_type([2], np.complex64)
    v = OrtValue.ortvalue_from_shape_and_type([2, 3], TensorProto.INT64)  # an ONNX element type
    assert v.data_type() == "tensor(int64)" and v.element_type() == TensorProto.INT64
    with pytest.raises(InvalidArgument, match=r"^update_inplace: expected shape \[2, 3\] and dtype int64; got shape "
                                              r"\[3\] and dtype int64$"):
        v.update_inplace(np.zeros(3, np.int64))
    with pytest.raises(InvalidArgument, match=r"^OrtValue wraps a NumPy array or a DeviceTensor; got list"):
        OrtValue([1, 2])


def test_ortvalue_shares_host_memory_both_ways():
    from host.runtime.ortvalue import OrtValue

    x = np.zeros((2, 2), np.float32)
    v = OrtValue.ortvalue_from_numpy(x)
    v.update_inplace(np.full((2, 2), 3, np.float32))
    assert (x == 3).all() and np.asarray(v) is x and v.tensor_size_in_bytes() == 16


def test_iobinding_rejects_non_ortvalues(model_path):
    import host
    from host.errors import InvalidArgument

    io = host.InferenceSession(model_path).io_binding()
    with pytest.raises(InvalidArgument, match=r"^bind_ortvalue_input needs an OrtValue; got ndarray"):
        io.bind_ortvalue_input("x", np.ones((1, 4), np.float32))


def test_register_execution_provider_library_uses_the_default_environment(example_plugin, model_path):
    import host

    host.register_execution_provider_library("parity_example", str(example_plugin(5)))
    try:
        assert "ExampleEP" in host.get_available_providers()
        devices = [d for d in host.get_ep_devices() if d.ep_name == "ExampleEP"]
        assert len(devices) == 1 and devices[0].ep_metadata["registration"] == "parity_example"
        s = host.InferenceSession(model_path, providers=[("ExampleEP", {"ops": "Relu"})])
        assert s.node_assignment()["relu"] == "ExampleEP"
        x = np.ones((2, 4), np.float32)
        ref = ort_reference.InferenceSession(model_path, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
        s.close()
    finally:
        host.unregister_execution_provider_library("parity_example")
    assert "ExampleEP" not in host.get_available_providers()


@pytest.mark.gpu
def test_cuda_ortvalues_and_binding_match_onnxruntime_cpu(model_path):
    """GPU: OrtValues on the device, the CUDA EP found by name, outputs left on the device."""
    cupy = pytest.importorskip("cupy", reason="CuPy places OrtValues on the GPU")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    import host as ort

    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    want = ort_reference.InferenceSession(model_path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # TF32 off (on by default, as in onnxruntime's CUDA EP) to compare at float32 tolerances.
    sess = ort.InferenceSession(model_path, providers=[("CUDAExecutionProvider", {"use_tf32": "0"}),
                                                       "CPUExecutionProvider"])
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
    v = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    assert v.device_name() == "cuda" and v.shape() == [2, 4]
    np.testing.assert_array_equal(v.numpy(), x)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", v)
    io.bind_output("y", "cuda")
    sess.run_with_iobinding(io)
    out = io.get_outputs()[0]
    assert out.device_name() == "cuda"
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-3, atol=1e-4)
    target = ort.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float32, "cuda", 0)
    io.bind_ortvalue_output("y", target)
    sess.run_with_iobinding(io)
    np.testing.assert_allclose(target.numpy(), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(sess.run(None, {"x": v})[0], want, rtol=1e-3, atol=1e-4)
