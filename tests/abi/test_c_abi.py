"""The ABI across languages: a C host loads the Python plugin, the Python host loads the C plugin."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig

import cffi
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import abi
from host.errors import EpError
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from tests.abi.conftest import (
    ABI_DIR,
    ROOT,
    GraphView,
    KernelContext,
    Node,
    Value,
    add_graph,
    claimed_nodes,
    compute,
    kernel,
    raw_ep,
)

C_HOST_SRC = ROOT / "tests" / "abi" / "c_host" / "load_python_plugin.c"
V = abi.ABI_VERSION


# ---- a C host loading the Python plugin -----------------------------------------------------------

@pytest.fixture(scope="module")
def c_host(cc, tmp_path_factory):
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("this Python has no shared libpython: a C program cannot start an interpreter from a "
                    "cffi-embedded plugin")
    exe = tmp_path_factory.mktemp("c_host") / "load_python_plugin"
    cmd = [cc, "-O1", "-Wall", "-Werror", "-I", str(ABI_DIR), str(C_HOST_SRC), "-o", str(exe), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return exe


def _embedded_python_env() -> dict[str, str]:
    """What the interpreter started inside the C program needs to find the stdlib, numpy and cffi."""
    env = {k: v for k, v in os.environ.items() if k != "EPHOST_TEST_FAULT"}
    home = sys.base_prefix if sys.base_prefix == sys.base_exec_prefix else \
        f"{sys.base_prefix}{os.pathsep}{sys.base_exec_prefix}"
    env["PYTHONHOME"] = home
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *site.getsitepackages()])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))
    return env


@pytest.mark.parametrize("plugin_version", [3, V])
def test_c_host_loads_the_python_plugin(c_host, plugins, plugin_version):
    proc = subprocess.run([str(c_host), str(plugins.example[plugin_version])], env=_embedded_python_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.splitlines() == [
        f"requested: {plugin_version}",  # GetApi(min(plugin, host)); the C host is built at the current ABI
        "factories: 1",
        "name: ExampleEP",
        "vendor: ephost-tests",
        "version: 1.0.0",
        "devices: 1",
        f"ep: ExampleEP (declared v{plugin_version})",
        "released: 1",
    ]


# ---- the Python host loading the C plugin -----------------------------------------------------------

@pytest.fixture(scope="module")
def live(c_plugin):
    """ExampleC_LiveObjects of the C plugin (dlopen of the same path shares the loaded library)."""
    f = cffi.FFI()
    f.cdef("int ExampleC_LiveObjects(void);")
    lib = f.dlopen(str(c_plugin))
    # The closure keeps `lib` (and so the dlopen handle) alive: a bare function pointer would
    # outlive it, and the library could be unloaded and mapped elsewhere before the next call.
    return lambda: lib.ExampleC_LiveObjects()


@pytest.mark.parametrize("host", list(abi.SUPPORTED_VERSIONS))
def test_python_host_loads_the_c_plugin(c_plugin, live, host):
    base = live()
    with Environment(api_version=host) as env:
        reg = env.register_plugin("c", c_plugin)
        assert env.api.requested == [host]
        [f] = reg.factories
        assert (f.name, f.vendor, f.plugin_version) == ("ExampleCEP", "ephost-tests", "1.0.0")
        assert f.slots.declared == V and f.slots.struct_size == ffi.sizeof("EpFactory")
        assert f.negotiated == host
        assert [(d.device_type, d.device_id, d.name, d.memory_name) for d in f.devices] == [
            (abi.DEVICE_CPU, 0, "example-c-cpu", "Cpu")]
        assert set(f.slots.present) == {"GetName", "GetVendor", "GetVersion", "GetSupportedDevices",
                                        "CreateEp", "ReleaseEp"}
        assert live() == base + 1
        with raw_ep(reg, f) as ep:
            assert live() == base + 2
            assert ep.declared == V and ep.negotiated == host
            expected = {"GetName", "GetCapability", "CreateKernel"}
            if host >= 2:
                expected.add("IsConcurrentRunSupported")
            if host >= 6:
                expected.add("Compile")
            assert set(ep.present) == expected
            assert ffi.string(ep.GetName(ep.ptr)) == b"ExampleCEP"
            if host >= 2:
                out = ffi.new("int32_t*", 0)
                assert ep.IsConcurrentRunSupported(ep.ptr, out) == ffi.NULL and out[0] == 1
    assert live() == base


def test_c_plugin_claims_only_float_adds_of_one_shape(c_plugin):
    values = [
        Value("a"), Value("b"), Value("c"),                            # 0..2: float32 (2, 3)
        Value("row", shape=(1, 3)), Value("bc"),                       # 3, 4: broadcasting
        Value("i", elem_type=7), Value("j", elem_type=7), Value("k", elem_type=7),  # 5..7: int64
        Value("u", shape=(-1, 3)), Value("v", shape=(-1, 3)), Value("w", shape=(-1, 3)),  # 8..10: unknown dim
        Value("r", shape=None), Value("m"), Value("s"),                # 11: unknown rank; 12, 13
    ]
    nodes = [
        Node("add_ok", "Add", (0, 1), (2,)),
        Node("add_broadcast", "Add", (0, 3), (4,)),
        Node("add_int64", "Add", (5, 6), (7,)),
        Node("add_unknown_dim", "Add", (8, 9), (10,)),
        Node("add_unknown_rank", "Add", (11, 0), (12,)),
        Node("mul", "Mul", (0, 1), (13,)),
        Node("add_custom_domain", "Add", (0, 1), (13,), domain="com.example"),
        Node("add_ok_again", "Add", (2, 1), (13,)),
    ]
    graph = GraphView(values, nodes)
    with Environment() as env:
        reg = env.register_plugin("c", c_plugin)
        with raw_ep(reg, reg.factories[0]) as ep:
            assert claimed_nodes(ep, graph) == [0, 7]
            with pytest.raises(EpError, match=r"^CreateKernel failed \(NOT_IMPLEMENTED\): ExampleCEP: no "
                                              r"kernel for node 'mul' \(float32 Add of one shape only\)$"):
                with kernel(ep, graph, 5):
                    pass
            with pytest.raises(EpError, match=r"^CreateKernel failed \(INVALID_ARGUMENT\): ExampleCEP: "
                                              r"CreateKernel: node index out of range$"):
                with kernel(ep, graph, 99):
                    pass


@pytest.mark.parametrize("host", [3, 4, V])
def test_c_kernel_adds_and_asks_for_the_stream_only_from_v4(c_plugin, live, host):
    base = live()
    graph = add_graph((2, 3), (2, 3))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    with Environment(api_version=host) as env:
        reg = env.register_plugin("c", c_plugin)
        with raw_ep(reg, reg.factories[0]) as ep, kernel(ep, graph, 0) as k:
            assert live() == base + 3
            assert k.declared == V and set(k.present) == {"Compute", "Release"}
            with KernelContext([a, b]) as ctx:
                compute(k, ctx)
            np.testing.assert_array_equal(ctx.outputs[0], a + b)
            if host >= 4:
                assert ctx.sync_stream_calls >= 1
            else:
                assert ctx.sync_stream_calls == 0, "a v3 host has no KernelContext_GetSyncStream"
            with KernelContext([a, np.ones((3, 2), np.float32)]) as bad, pytest.raises(
                    EpError, match=r"^Compute failed \(INVALID_ARGUMENT\): ExampleCEP: Add inputs differ in "
                                   r"shape \(no broadcasting\)$"):
                compute(k, bad)
            assert 0 not in bad.outputs
    assert live() == base


def test_c_plugin_rejects_options(c_plugin, live):
    base = live()
    with Environment() as env:
        reg = env.register_plugin("c", c_plugin)
        with pytest.raises(EpError, match=r"^ExampleCEP: CreateEp failed \(INVALID_ARGUMENT\): ExampleCEP: "
                                          r"unknown option 'device_id'; this EP takes none$"):
            with raw_ep(reg, reg.factories[0], {"device_id": "0"}):
                pass
    assert live() == base


# ---- end to end through the session -----------------------------------------------------------------

def _add_model(shape_b=(2, 3)) -> bytes:
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, list(shape_b))
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"], name="add0")], "add", [a, b], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("host", [3, V])
def test_session_runs_the_c_add_kernel(c_plugin, live, host):
    from host.runtime import session as session_mod

    base = live()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3), dtype=np.float32)
    b = rng.standard_normal((2, 3), dtype=np.float32)
    with Environment(api_version=host) as env:
        env.register_plugin("c", c_plugin)
        with session_mod.InferenceSession(_add_model(), providers=["ExampleCEP"], env=env) as sess:
            assert sess.node_assignment() == {"add0": "ExampleCEP"}
            [out] = sess.run(None, {"a": a, "b": b})
            np.testing.assert_array_equal(out, a + b)
        # Broadcasting is not the C plugin's: the node falls back to the CPU EP and still adds.
        row = rng.standard_normal((1, 3), dtype=np.float32)
        with session_mod.InferenceSession(_add_model((1, 3)), providers=["ExampleCEP"], env=env) as sess:
            assert sess.node_assignment() == {"add0": "CPUExecutionProvider"}
            np.testing.assert_allclose(sess.run(None, {"a": a, "b": row})[0], a + row, rtol=1e-6)
    assert live() == base
