"""The plugin-side SDK: version gates on host functions, trampolines, and the tables expose() builds."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

import abi
from abi import sdk
from host.errors import EpError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from tests.abi.conftest import KernelContext, add_graph, compute, kernel, raw_ep

V = abi.ABI_VERSION


@pytest.fixture
def env_v5(plugins):
    with Environment() as env:
        yield env, env.register_plugin("sdk-v5", plugins.example[V]), sdk.runtime(plugins.example_module(V))


@pytest.fixture
def env_v3(plugins):
    with Environment(api_version=3) as env:
        yield env, env.register_plugin("sdk-v3", plugins.example[V]), sdk.runtime(plugins.example_module(V))


# ---- HostApi: version, struct_size and NULL gates -------------------------------------------------

@pytest.mark.parametrize(("host", "expected"), [(3, False), (4, True), (5, True)])
def test_has_sync_stream_follows_the_host_version(plugins, host, expected):
    with Environment(api_version=host) as env:
        reg = env.register_plugin(f"has-{host}", plugins.example[V])
        rt = sdk.runtime(plugins.example_module(V))
        factory = rt.obj(reg.factories[0].ptr)
        assert factory.api.version == host
        assert factory.api.has("KernelContext_GetSyncStream") is expected
        assert factory.api.has("KernelContext_GetIO")


def _fake_api(version: int, struct_size: int | None = None, null: tuple[str, ...] = ()):
    f5 = abi.ffi_for(V)
    table = f5.new("EpApi*")
    table.version = version
    table.struct_size = f5.sizeof("EpApi") if struct_size is None else struct_size
    fields = dict(f5.typeof("EpApi").fields)
    for name in abi.slots_at("EpApi", V):
        if name not in null:
            # Never called: the gate only looks at the pointer.
            setattr(table, name, f5.cast(fields[name].type, 0x1000))
    rt = types.SimpleNamespace(ffi=f5, record=sdk.Record())
    return rt, table


@pytest.mark.parametrize(("version", "size", "null", "expected"), [
    (4, None, (), True),
    (3, None, (), False),  # a v3 table: the slot is not part of it even if the memory is there
    (4, abi.ffi_for(3).sizeof("EpApi"), (), False),  # claims v4 but is cut at v3's size
    (4, None, ("KernelContext_GetSyncStream",), False),  # present in layout, NULL pointer
])
def test_has_checks_version_struct_size_and_null(version, size, null, expected):
    rt, table = _fake_api(version, size, null)
    api = sdk.HostApi(rt, table, version)
    assert api.has("KernelContext_GetSyncStream") is expected
    assert api.has("CreateStatus")


def test_call_and_sync_stream_without_the_slot():
    rt, table = _fake_api(3)
    api = sdk.HostApi(rt, table, 3)
    with pytest.raises(AttributeError,
                       match="^host EpApi v3 has no usable slot 'KernelContext_GetSyncStream'$"):
        api.call("KernelContext_GetSyncStream", ffi.NULL, ffi.NULL)
    assert api.sync_stream(ffi.NULL) is None
    assert rt.record.fallbacks["untagged_scratch"] == 1
    assert rt.record.host_calls["KernelContext_GetSyncStream"] == 0


# ---- trampolines: every exception becomes a status ------------------------------------------------

def _create_ep_status(reg, options: dict[str, str]):
    f = reg.factories[0]
    kv = ffi.new("EpKeyValue[]", len(options))
    keep = []
    for i, (k, v) in enumerate(options.items()):
        keep += [ffi.new("char[]", k.encode()), ffi.new("char[]", v.encode())]
        kv[i].key, kv[i].value = keep[-2], keep[-1]
    out = ffi.new("Ep**")
    status = f.slots.CreateEp(f.ptr, f.device_structs, 1, kv, len(options), ffi.NULL, reg.logger, out)
    assert out[0] == ffi.NULL
    return status


def test_plugin_error_keeps_its_code(env_v5, plugins):
    _, reg, rt = env_v5
    before = len(hostapi.STATUSES)
    status = _create_ep_status(reg, {"bogus": "1"})
    mod = plugins.example_module(V)
    with pytest.raises(EpError, match=f"^CreateEp failed \\(INVALID_ARGUMENT\\): {mod}: EpFactory.CreateEp "
                                      r"failed: unknown option\(s\) \['bogus'\] for ExampleEP; "
                                      r"allowed: \[") as info:
        hostapi.check(status, "CreateEp")
    assert info.value.code == abi.EP_INVALID_ARGUMENT
    assert len(hostapi.STATUSES) == before, "check() must release the status"
    assert rt.record.live["Ep"] == 0


def test_any_exception_becomes_ep_fail(env_v5, plugins, monkeypatch):
    from tests.plugins import example_ep

    def broken(self, *args):
        return 1 / 0

    monkeypatch.setattr(example_ep.ExampleFactory, "create_ep", broken)
    _, reg, _ = env_v5
    status = _create_ep_status(reg, {})
    mod = plugins.example_module(V)
    with pytest.raises(EpError, match=f"^CreateEp failed \\(FAIL\\): {mod}: EpFactory.CreateEp "
                                      r"failed: division by zero$") as info:
        hostapi.check(status, "CreateEp")
    assert info.value.code == abi.EP_FAIL


def test_unknown_self_pointer(env_v5, caplog):
    _, reg, rt = env_v5
    f = reg.factories[0]
    stranger = ffi.new("EpFactory*")
    out = ffi.new("Ep**")
    status = f.slots.CreateEp(stranger, f.device_structs, 1, ffi.NULL, 0, ffi.NULL, reg.logger, out)
    with pytest.raises(EpError, match=r"^CreateEp failed \(INVALID_ARGUMENT\): .*: EpFactory.CreateEp "
                                      r"failed: EpFactory.CreateEp called with an unknown EpFactory "
                                      r"pointer$"):
        hostapi.check(status, "CreateEp")
    with caplog.at_level(logging.ERROR, logger="ephost.sdk"):
        assert f.slots.GetName(stranger) == ffi.NULL  # pointer slots answer NULL
        assert f.slots.IsStreamAware(stranger) == 0  # int slots answer 0
        f.slots.ReleaseEp(f.ptr, ffi.cast("Ep*", stranger))  # an unknown Ep is ignored
    expected = "EpFactory.GetName failed: EpFactory.GetName called with an unknown EpFactory pointer"
    assert any(expected in r.getMessage() for r in caplog.records)
    # The real factory still answers.
    assert ffi.string(f.slots.GetName(f.ptr)) == b"ExampleEP"
    assert rt.record.slot_calls["EpFactory.CreateEp"] >= 1


def test_kernel_exception_becomes_a_status(env_v5):
    _, reg, rt = env_v5
    graph = add_graph()
    a = np.ones((2, 3), np.float32)
    with raw_ep(reg, reg.factories[0], {"fail_node": "add0"}) as ep, kernel(ep, graph, 0) as k:
        with KernelContext([a, a]) as ctx, pytest.raises(
                EpError, match=r"^Compute failed \(FAIL\): .*: EpKernel.Compute failed: injected kernel "
                               r"failure in node 'add0'$"):
            compute(k, ctx)
    assert 0 not in ctx.outputs, "the failing kernel must not have asked for its output"
    assert rt.record.live["EpKernel"] == 0


# ---- expose(): slots beyond the negotiated version stay NULL --------------------------------------

@pytest.mark.parametrize("host", list(abi.SUPPORTED_VERSIONS))
def test_expose_leaves_newer_slots_null(plugins, host):
    with Environment(api_version=host) as env:
        reg = env.register_plugin(f"expose-{host}", plugins.example[V])
        with raw_ep(reg, reg.factories[0]) as ep:
            table = ep.ptr  # read the raw C table, past the host's own gate
            assert table.version == V
            assert table.struct_size == abi.ffi_for(V).sizeof("Ep")
            for slot, (since, _) in abi.since_table()["Ep"].items():
                is_set = getattr(table, slot) != ffi.NULL
                assert is_set is (since <= host), f"Ep.{slot} (since {since}) with host v{host}"


def test_null_slots_stay_null_and_the_host_sees_none(env_v5):
    _, reg, _ = env_v5
    with raw_ep(reg, reg.factories[0], {"null_slots": "Sync,OnRunEnd"}) as ep:
        assert ep.ptr.Sync == ffi.NULL and ep.ptr.OnRunEnd == ffi.NULL
        assert ep.Sync is None and ep.OnRunEnd is None
        assert ep.OnRunStart is not None and ep.IsConcurrentRunSupported is not None


def test_extern_python_decls_follow_the_version():
    v2, v5 = sdk.extern_python_decls(2), sdk.extern_python_decls(5)
    assert "_ep_Ep_Sync(" in v2 and "_ep_Ep_IsConcurrentRunSupported(" in v2
    assert "_ep_Ep_ReplayGraph(" not in v2 and "_ep_Ep_ReplayGraph(" in v5
    assert "_ep_Ep_ReplayGraphWithSync(" in v5
    for line in v5.splitlines():
        assert line.startswith('extern "Python" ')
    assert "EpApi" not in {line.split("_ep_")[1].split("_")[0] for line in v5.splitlines()}


# ---- slot-call counting: chosen once at registration, not checked per call -------------------------

class _CapturingFfi:
    """Stands in for a plugin library's ffi: keeps the trampolines def_extern receives."""

    def __init__(self):
        self.real = abi.ffi_for(V)
        self.externs: dict[str, object] = {}
        self.NULL = self.real.NULL

    def def_extern(self, name):
        return lambda fn: self.externs.setdefault(name, fn)

    def __getattr__(self, name):
        return getattr(self.real, name)


class _NullLib:
    """A library whose trampolines are NULL: the C tables are made but never called through C."""

    def __getattr__(self, name):
        return abi.ffi_for(V).NULL


@pytest.mark.parametrize("counted", [False, True])
def test_slot_calls_are_counted_only_when_the_plugin_asked(counted):
    def create_factories(runtime, reg, logger):
        return []

    if counted:
        sdk.count_slot_calls(create_factories)
    fake = _CapturingFfi()
    rt = sdk.serve(fake, _NullLib(), V, create_factories, f"_counting_probe_{counted}")
    factory = sdk.FactoryBase(rt)
    c = rt.expose("EpFactory", factory)
    key = fake.real.cast("void*", c)
    is_stream_aware = fake.externs[sdk.trampoline_name("EpFactory", "IsStreamAware")]
    assert is_stream_aware(key) == 0
    assert is_stream_aware(key) == 0
    assert rt.record.slot_calls["EpFactory.IsStreamAware"] == (2 if counted else 0)
    assert rt.count_calls is counted
