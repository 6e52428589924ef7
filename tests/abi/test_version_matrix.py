"""Every host API version against every plugin ABI version (7x7), in one process.

For each pair the negotiated version must be min(host, plugin) on both sides, the plugin must ask
for exactly that EpApi, the host must see only slots that exist at that version, the plugin must
take the fallbacks an older host implies, and no slot newer than the negotiated version may ever
be called.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import abi
from abi import sdk
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from tests.abi.conftest import KernelContext, add_graph, claimed_nodes, compute, kernel, raw_ep

VERSIONS = list(abi.SUPPORTED_VERSIONS)
PAIRS = list(itertools.product(VERSIONS, VERSIONS))


def clear_record(module: str) -> None:
    """Forget what a plugin did so far (its runtime exists once the library was first called)."""
    rt = sdk.runtimes().get(module)
    if rt is not None:
        rt.record.clear()


def _assert_no_newer_slot_called(record: sdk.Record, negotiated: int) -> None:
    called = [key for key in record.slot_calls if "." in key]
    assert called, "the plugin recorded no slot call at all"
    too_new = [key for key in called if abi.since(*key.split(".")) > negotiated]
    assert too_new == [], f"slots newer than v{negotiated} were called: {too_new}"


@pytest.mark.parametrize(("host", "plugin"), PAIRS, ids=[f"host{h}-plugin{p}" for h, p in PAIRS])
def test_registration_negotiates_min_version(plugins, host, plugin):
    rt_name = plugins.example_module(plugin)
    negotiated = min(host, plugin)
    clear_record(rt_name)
    with Environment(api_version=host) as env:
        reg = env.register_plugin(f"matrix-{host}-{plugin}", plugins.example[plugin])
        rt = sdk.runtime(rt_name)
        record = rt.record

        assert env.api.requested == [negotiated]
        assert rt.version == negotiated
        assert rt.api.version == negotiated
        assert rt.api.has("KernelContext_GetSyncStream") is (negotiated >= 4)
        assert len(reg.factories) == 1
        f = reg.factories[0]
        assert f.negotiated == negotiated
        assert f.slots.declared == plugin
        assert set(f.slots.present) == set(abi.slots_at("EpFactory", negotiated))
        assert [d.name for d in f.devices] == ["example-cpu"]

        expected_fallbacks = {f"host_api_v{host}": 1} if host < plugin else {}
        assert dict(record.fallbacks) == expected_fallbacks

        with raw_ep(reg, f) as ep:
            assert ep.declared == plugin
            assert ep.negotiated == negotiated
            # The example EP implements every Ep slot; exactly those of the negotiated version appear.
            assert set(ep.present) == set(abi.slots_at("Ep", negotiated))
            for slot, (since, _) in abi.since_table()["Ep"].items():
                assert (getattr(ep, slot) is not None) is (since <= negotiated), slot
            if ep.IsConcurrentRunSupported is not None:
                out = ffi.new("int32_t*", -1)
                assert ep.IsConcurrentRunSupported(ep.ptr, out) == ffi.NULL
                assert out[0] == 1
            if ep.IsGraphCaptureEnabled is not None:
                assert ep.IsGraphCaptureEnabled(ep.ptr) == 0
        _assert_no_newer_slot_called(record, negotiated)
        assert record.live["Ep"] == 0


@pytest.mark.parametrize(("host", "plugin"), PAIRS, ids=[f"host{h}-plugin{p}" for h, p in PAIRS])
def test_kernel_uses_sync_stream_only_when_negotiated(plugins, host, plugin):
    """Seed 000 on the plugin side: KernelContext_GetSyncStream from v4, null-tagged scratch before."""
    negotiated = min(host, plugin)
    with Environment(api_version=host) as env:
        reg = env.register_plugin(f"kernel-{host}-{plugin}", plugins.example[plugin])
        rt = sdk.runtime(plugins.example_module(plugin))
        rt.record.clear()
        graph = add_graph()
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        b = np.full((2, 3), 0.5, np.float32)
        with raw_ep(reg, reg.factories[0]) as ep:
            assert claimed_nodes(ep, graph) == [0]
            with kernel(ep, graph, 0) as k, KernelContext([a, b]) as ctx:
                compute(k, ctx)
        np.testing.assert_array_equal(ctx.outputs[0], a + b)
        record = rt.record
        if negotiated >= 4:
            assert ctx.sync_stream_calls >= 1  # the host callback reads it (maybe more than once)
            assert record.host_calls["KernelContext_GetSyncStream"] == 1
            assert "untagged_scratch" not in record.fallbacks
        else:
            assert ctx.sync_stream_calls == 0
            assert record.host_calls["KernelContext_GetSyncStream"] == 0
            assert record.fallbacks["untagged_scratch"] == 1
        assert record.host_calls["KernelContext_GetIO"] == 1
        assert record.host_calls["KernelContext_GetOutput"] == 1
        _assert_no_newer_slot_called(record, negotiated)
        assert record.slot_calls["EpKernel.Compute"] == 1
        assert record.live["EpKernel"] == 0


@pytest.mark.parametrize(("host", "plugin"), PAIRS, ids=[f"host{h}-plugin{p}" for h, p in PAIRS])
def test_compiled_partitions_only_when_negotiated_v6(plugins, host, plugin):
    """ABI v6 both ways: fused claims and Ep.Compile at v6, per-node kernels below, same answers."""
    from host.runtime.session import InferenceSession
    from tests.abi.test_compiled import _x, chain_model, reference

    negotiated = min(host, plugin)
    model = chain_model(("Add", "Relu", "Mul"))
    with Environment(api_version=host) as env:
        env.register_plugin(f"compile-{host}-{plugin}", plugins.example[plugin])
        record = sdk.runtime(plugins.example_module(plugin)).record
        record.clear()
        with InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"fuse": "1"})], env=env) as s:
            x = _x(seed=10 * host + plugin)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
            assert len(s.plan.nodes) == (1 if negotiated >= 6 else 3)
        assert record.slot_calls["Ep.Compile"] == int(negotiated >= 6)
        assert record.slot_calls["EpNodeComputeInfo.Compute"] == int(negotiated >= 6)
        assert record.slot_calls["EpKernel.Compute"] == (0 if negotiated >= 6 else 3)
        assert record.host_calls["Graph_AddNodesToFuse"] == int(negotiated >= 6)
        _assert_no_newer_slot_called(record, negotiated)


@pytest.mark.parametrize(("host", "plugin"), PAIRS, ids=[f"host{h}-plugin{p}" for h, p in PAIRS])
def test_saved_contexts_only_when_negotiated_v7(plugins, tmp_path, host, plugin):
    """ABI v7 both ways: a context model is written and loaded back at v7; below it the model keeps its
    nodes (GetContext is never called) and loading compiles them as before; same answers everywhere."""
    import onnx

    from host.runtime.options import SessionOptions
    from host.runtime.session import InferenceSession
    from tests.abi.test_compiled import _x, chain_model, reference

    negotiated = min(host, plugin)
    model = chain_model(("Add", "Relu", "Mul"))
    source, target = tmp_path / "m.onnx", tmp_path / "m_ctx.onnx"
    onnx.save(model, str(source))
    so = SessionOptions()
    so.add_session_config_entry("ep.context_enable", "1")
    providers = [("ExampleEP", {"fuse": "1"})]
    with Environment(api_version=host) as env:
        env.register_plugin(f"ctx-{host}-{plugin}", plugins.example[plugin])
        record = sdk.runtime(plugins.example_module(plugin)).record
        record.clear()
        with InferenceSession(str(source), so, providers=providers, env=env) as s:
            assert s.context_model == target
        saved = [n.op_type for n in onnx.load(str(target)).graph.node]
        assert saved == (["EPContext"] if negotiated >= 7 else ["Add", "Relu", "Mul"])
        with InferenceSession(str(target), providers=providers, env=env) as s:
            x = _x(seed=10 * host + plugin)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(model, {"x": x})[0], rtol=1e-6)
            assert s.fallbacks["context_loaded"] == int(negotiated >= 7)
        # Compile: by the saving session, and again by the loading one unless it loaded contexts.
        assert record.slot_calls["Ep.Compile"] == (0 if negotiated < 6 else 2 if negotiated == 6 else 1)
        assert record.slot_calls["Ep.CompileFromContext"] == int(negotiated >= 7)
        assert record.slot_calls["EpNodeComputeInfo.GetContext"] == int(negotiated >= 7)
        _assert_no_newer_slot_called(record, negotiated)
