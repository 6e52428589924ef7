"""Sessions through the full ABI path with the example plugin: partitioning, errors, IO binding,
graph capture orchestration and its version fallbacks, threads and lifetimes."""

from __future__ import annotations

import gc
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import host
from host.errors import GraphCaptureError, InvalidArgument, KernelError, ModelError
from host.runtime.session import InferenceSession, RunOptions
from tests.conftest import example_record


def chain_model(shape=(2, 3), opset=17) -> onnx.ModelProto:
    """Z = relu(X + Y) * X, nodes named add/relu/mul."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(shape))
    z = helper.make_tensor_value_info("Z", TensorProto.FLOAT, list(shape))
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "chain", [x, y], [z]),
                             opset_imports=[helper.make_opsetid("", opset)])


def expected(x, y):
    return np.maximum(x + y, 0) * x


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)


@pytest.fixture
def env5(example_plugin):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(5))
    yield env
    gc.collect()  # sessions a test left open are closed by their finalizer
    env.close()


def make_env(example_plugin, plugin_version: int, host_version: int = 5):
    env = host.Environment(api_version=host_version)
    env.register_plugin("ex", example_plugin(plugin_version))
    return env


# ---- partitioning and results ---------------------------------------------------------------------
def test_split_model_matches_cpu_and_reports_assignment(env5, xy):
    x, y = xy
    cpu = InferenceSession(chain_model(), env=env5)
    split = InferenceSession(chain_model(), providers=[("ExampleEP", {"ops": "Add,Mul"})], env=env5)
    assert split.node_assignment() == {"add": "ExampleEP", "relu": "CPUExecutionProvider", "mul": "ExampleEP"}
    assert cpu.node_assignment() == {n: "CPUExecutionProvider" for n in ("add", "relu", "mul")}
    np.testing.assert_allclose(split.run(None, {"X": x, "Y": y})[0], cpu.run(None, {"X": x, "Y": y})[0])
    np.testing.assert_allclose(split.run(["Z"], {"X": x, "Y": y})[0], expected(x, y), rtol=1e-6)


def test_kernel_path_uses_host_functions_and_notifications(env5, xy):
    rec = example_record(5)
    rec.clear()
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"ops": "Add,Mul"})], env=env5)
    s.run(None, {"X": xy[0], "Y": xy[1]})
    assert rec.host_calls["KernelContext_GetIO"] == 2
    assert rec.host_calls["KernelContext_GetOutput"] == 2
    assert rec.host_calls["KernelContext_GetSyncStream"] == 2
    # relu (CPU EP) consumes add's output from the plugin's stream: the host waited on it.
    assert rec.host_calls["notification_wait_host"] >= 1


def test_model_inputs_and_outputs_are_described(env5):
    s = InferenceSession(chain_model(), env=env5)
    assert [(a.name, a.shape, a.type) for a in s.get_inputs()] == [
        ("X", [2, 3], "tensor(float)"), ("Y", [2, 3], "tensor(float)")]
    assert [a.name for a in s.get_outputs()] == ["Z"]
    assert s.get_providers() == ["CPUExecutionProvider"]


def test_symbolic_dims_are_kept():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    s = InferenceSession(m)
    assert s.get_inputs()[0].shape == ["batch", 4]
    out = s.run(None, {"X": -np.ones((3, 4), np.float32)})[0]
    assert out.shape == (3, 4) and not out.any()


# ---- errors ---------------------------------------------------------------------------------------
def test_unknown_feed_name(env5, xy):
    s = InferenceSession(chain_model(), env=env5)
    with pytest.raises(InvalidArgument, match=r"^unknown input name\(s\) \['W'\]; model inputs: \['X', 'Y'\]$"):
        s.run(None, {"X": xy[0], "Y": xy[1], "W": xy[0]})


def test_unknown_output_name(env5, xy):
    s = InferenceSession(chain_model(), env=env5)
    with pytest.raises(InvalidArgument, match=r"^unknown output name\(s\) \['Q'\]; model outputs: \['Z'\]$"):
        s.run(["Q"], {"X": xy[0], "Y": xy[1]})


def test_wrong_dtype_rank_and_dim(env5, xy):
    s = InferenceSession(chain_model(), env=env5)
    with pytest.raises(InvalidArgument, match=r"^input 'X': expected dtype float32 \(tensor\(float\)\), got float64 \(tensor\(double\)\)$"):
        s.run(None, {"X": xy[0].astype(np.float64), "Y": xy[1]})
    with pytest.raises(InvalidArgument, match=r"^input 'X': expected rank 2 \(shape \[2, 3\]\), got rank 1"):
        s.run(None, {"X": np.zeros(6, np.float32), "Y": xy[1]})
    with pytest.raises(InvalidArgument, match=r"^input 'Y': dimension 1 must be 3, got 4"):
        s.run(None, {"X": xy[0], "Y": np.zeros((2, 4), np.float32)})
    np.testing.assert_allclose(s.run(None, {"X": xy[0], "Y": xy[1]})[0], expected(*xy), rtol=1e-6)


def test_unsupported_ops_listed_at_creation():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["X"], ["A"], name="ok"),
             helper.make_node("Custom", ["A"], ["B"], name="c1", domain="my.domain"),
             helper.make_node("Custom", ["B"], ["Y"], name="c2", domain="my.domain")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    with pytest.raises(ModelError, match=r"^no execution provider supports 2 node\(s\): 'c1' \(my.domain::Custom"):
        InferenceSession(m)


def test_malformed_model_file_names_the_path(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage-not-protobuf\xff\xff")
    with pytest.raises(ModelError, match=rf"^model file '{bad}' could not be parsed"):
        InferenceSession(str(bad))
    with pytest.raises(ModelError, match=r"^model file '.*missing.onnx' does not exist$"):
        InferenceSession(str(tmp_path / "missing.onnx"))


def test_unknown_provider_is_an_error(env5):
    with pytest.raises(InvalidArgument, match=r"^execution provider 'NopeEP' is not registered; available: "):
        InferenceSession(chain_model(), providers=["NopeEP"], env=env5)


def test_unknown_plugin_option_is_invalid_argument(env5):
    with pytest.raises(InvalidArgument, match=r"unknown option\(s\) \['bogus'\] for ExampleEP"):
        InferenceSession(chain_model(), providers=[("ExampleEP", {"bogus": "1"})], env=env5)


def test_plugin_kernel_failure_names_node_and_ep_and_session_survives(env5, xy):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"ops": "Add,Mul", "fail_node": "mul"})], env=env5)
    with pytest.raises(KernelError, match=r"^node 'mul' \(Mul\) on ExampleEP failed \(FAIL\): .*injected kernel "
                                          r"failure in node 'mul'") as info:
        s.run(None, {"X": xy[0], "Y": xy[1]})
    assert info.value.node == "mul" and info.value.ep == "ExampleEP"
    ok = InferenceSession(chain_model(), providers=[("ExampleEP", {"ops": "Add"})], env=env5)
    np.testing.assert_allclose(ok.run(None, {"X": xy[0], "Y": xy[1]})[0], expected(*xy), rtol=1e-6)
    with pytest.raises(KernelError):  # the failing session is still usable: same error, no crash
        s.run(None, {"X": xy[0], "Y": xy[1]})


# ---- IO binding and graph capture -------------------------------------------------------------------
def bound(session, x, y):
    b = session.io_binding()
    out = np.zeros((2, 3), np.float32)
    b.bind_input("X", x)
    b.bind_input("Y", y)
    b.bind_output("Z", out)
    return b, out


def test_iobinding_without_capture(env5, xy):
    s = InferenceSession(chain_model(), providers=["ExampleEP"], env=env5)
    b, out = bound(s, *xy)
    s.run_with_iobinding(b)
    np.testing.assert_allclose(out, expected(*xy), rtol=1e-6)
    assert b.get_outputs()[0].numpy() is out
    np.testing.assert_allclose(b.copy_outputs_to_cpu()[0], out)


@pytest.mark.parametrize("version, sync_kind", [(3, "replay_device_sync"), (4, "replay_device_sync"),
                                                (5, "replay_stream_sync")])
def test_capture_replay_and_sync_fallbacks(example_plugin, xy, version, sync_kind):
    env = make_env(example_plugin, version)
    rec = example_record(version)
    rec.clear()
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1", "min_runs": "2"})], env=env)
    x, y = xy[0].copy(), xy[1].copy()
    b, out = bound(s, x, y)
    s.run_with_iobinding(b)  # warm-up x2 and capture inside one call
    assert s.fallbacks["graph_captured"] == 1
    x[...] = 3.0  # new data copied into the bound buffer
    s.run_with_iobinding(b)
    np.testing.assert_allclose(out, expected(x, y), rtol=1e-6)
    assert rec.slot_calls["replayed_steps"] == 3
    assert s.fallbacks[sync_kind] == 1
    assert rec.fallbacks["ep_device_sync" if version < 5 else "ep_stream_sync"] == 1
    ro = RunOptions()
    ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
    s.run_with_iobinding(b, ro)
    assert s.fallbacks["replay_async"] == 1
    s.close()
    env.close()


def test_v2_plugin_runs_eagerly_without_capture(example_plugin, xy):
    env = make_env(example_plugin, 2)
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env)
    assert not s.capture.enabled and s.fallbacks["no_graph_capture"] == 1
    b, out = bound(s, *xy)
    for _ in range(4):
        s.run_with_iobinding(b)
    np.testing.assert_allclose(out, expected(*xy), rtol=1e-6)
    s.close()
    env.close()


def test_rebinding_after_capture_is_an_error(env5, xy):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env5)
    b, out = bound(s, *xy)
    s.run_with_iobinding(b)
    b.bind_input("X", xy[0].copy())
    with pytest.raises(GraphCaptureError, match=r"^graph 0 was captured with input 'X' at a fixed buffer; it moved "
                                                r"from address 0x[0-9a-f]+ to 0x[0-9a-f]+\. Copy new data into"):
        s.run_with_iobinding(b)
    b.bind_output("Z", np.zeros((2, 3), np.float32))
    b.bind_input("X", xy[0])
    with pytest.raises(GraphCaptureError, match=r"^graph 0 was captured with (input 'X'|output 'Z')"):
        s.run_with_iobinding(b)


def test_graph_ids_are_captured_separately_and_minus_one_runs_eagerly(env5, xy):
    rec = example_record(5)
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1", "min_runs": "1"})], env=env5)
    b, out = bound(s, *xy)
    for gid in ("1", "2", "3"):
        ro = RunOptions()
        ro.add_run_config_entry("gpu_graph_id", gid)
        s.run_with_iobinding(b, ro)
    assert sorted(s.capture.signatures) == [1, 2, 3]
    rec.slot_calls["replayed_steps"] = 0
    eager = RunOptions()
    eager.add_run_config_entry("gpu_graph_id", "-1")
    s.run_with_iobinding(b, eager)
    assert rec.slot_calls["replayed_steps"] == 0
    np.testing.assert_allclose(out, expected(*xy), rtol=1e-6)


@pytest.mark.parametrize("value", ["abc", "-2", "1.5", ""])
def test_malformed_graph_id(env5, xy, value):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env5)
    b, _ = bound(s, *xy)
    ro = RunOptions()
    ro.add_run_config_entry("gpu_graph_id", value)
    with pytest.raises(InvalidArgument, match=r"^run option gpu_graph_id must be an integer >= -1"):
        s.run_with_iobinding(b, ro)


def test_capture_needs_bound_outputs(env5, xy):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env5)
    b = s.io_binding()
    b.bind_input("X", xy[0])
    b.bind_input("Y", xy[1])
    b.bind_output("Z")
    with pytest.raises(GraphCaptureError, match=r"^graph capture needs every output bound to a fixed buffer; "
                                                r"unbound: \['Z'\]"):
        s.run_with_iobinding(b)


def test_policy_violation_lists_offending_nodes(env5):
    with pytest.raises(GraphCaptureError, match=r"^graph capture on ExampleEP requires all nodes on the EP; "
                                                r"offending node\(s\): 'relu' \(Relu on CPUExecutionProvider\)"):
        InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1", "ops": "Add,Mul"})],
                         env=env5)


def test_release_captured_graph_v4_and_refusal_v3(example_plugin, xy):
    for version in (3, 4):
        env = make_env(example_plugin, version)
        s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env)
        b, out = bound(s, *xy)
        s.run_with_iobinding(b)
        if version == 3:
            with pytest.raises(GraphCaptureError, match=r"^ExampleEP \(ABI v3\) cannot release a single graph"):
                s.capture.release(0)
        else:
            s.capture.release(0)
            assert not s.capture.captured(0)
            s.run_with_iobinding(b)  # captures again
            assert s.capture.captured(0)
        s.close()
        env.close()


# ---- threads and lifetimes ----------------------------------------------------------------------------
def test_threads_get_right_results(env5):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"ops": "Add,Mul"})], env=env5)
    assert s.fallbacks["concurrent_runs"] == 1
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(50):
            x, y = rng.standard_normal((2, 3), np.float32), rng.standard_normal((2, 3), np.float32)
            got = s.run(None, {"X": x, "Y": y})[0]
            if not np.allclose(got, expected(x, y), rtol=1e-6):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_v1_plugin_runs_are_serialised(example_plugin, xy):
    env = make_env(example_plugin, 1)
    s = InferenceSession(chain_model(), providers=["ExampleEP"], env=env)
    assert s.fallbacks["serialised_runs"] == 1
    np.testing.assert_allclose(s.run(None, {"X": xy[0], "Y": xy[1]})[0], expected(*xy), rtol=1e-6)
    s.close()
    env.close()


def test_close_twice_gc_and_no_leaks(example_plugin, xy):
    env = make_env(example_plugin, 5)
    rec = example_record(5)
    base = dict(rec.live)
    s = InferenceSession(chain_model(), providers=["ExampleEP"], env=env)
    out = s.run(None, {"X": xy[0], "Y": xy[1]})[0]
    s.close()
    s.close()
    with pytest.raises(InvalidArgument, match=r"^this InferenceSession is closed$"):
        s.run(None, {"X": xy[0], "Y": xy[1]})
    np.testing.assert_allclose(out, expected(*xy), rtol=1e-6)  # results outlive the session
    s2 = InferenceSession(chain_model(), providers=["ExampleEP"], env=env)
    s2.run(None, {"X": xy[0], "Y": xy[1]})
    del s2
    gc.collect()
    live = {k: v for k, v in rec.live.items() if v != base.get(k, 0)}
    assert live == {}
    env.close()


def test_unregister_refused_while_session_lives(example_plugin):
    env = make_env(example_plugin, 5)
    s = InferenceSession(chain_model(), providers=["ExampleEP"], env=env)
    with pytest.raises(host.PluginLoadError, match=r"^plugin 'ex' \(.*\) is still used by 1 session\(s\)"):
        env.unregister_plugin("ex")
    s.close()
    env.unregister_plugin("ex")
    assert env.plugins == {}
