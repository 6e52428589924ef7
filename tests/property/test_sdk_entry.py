"""Property 12: the SDK's CreateEpFactories against a broken host, on its own.

The host never sends a NULL EpApiBase, a GetApi that answers NULL, or room for fewer factories
than the plugin makes, so the SDK's own checks of them are only reached by calling the plugin
runtime's entry (`Runtime._create_locked`, what the exported CreateEpFactories runs under its lock)
directly with a hand-made EpApiBase. Each refusal is a PluginError with its whole text and code and
leaves num_factories at 0; a host older than the plugin is recorded once per call as the
host_api_v<N> fallback. The runtime's negotiated state is restored afterwards, so the registered
plugin goes on serving its environment.
"""

from __future__ import annotations

import contextlib

import pytest

import abi
from abi import sdk
from host.plugins import hostapi
from host.plugins.hostapi import ffi
from tests.property import harness as h
from tests.property import strategies as s

TOP = max(s.VERSIONS)


@contextlib.contextmanager
def plugin_runtime():
    """The example plugin's runtime (registered, so loaded), its negotiated state put back after."""
    with h.example_env(TOP, [TOP]) as env:
        rt = sdk.runtime(h.example_module(TOP))
        saved = (rt.version, rt.api, list(rt._factories))
        try:
            yield rt
        finally:
            rt.version, rt.api, rt._factories[:] = saved
        assert env.plugins[f"ex{TOP}"] is not None


def api_base(rt, version: int, answer_null: bool = False):
    """A hand-made EpApiBase, in the plugin's own cffi types: GetApi answers the host's real table for
    the asked version, or NULL."""
    pffi = rt.ffi

    @pffi.callback("const EpApi*(uint32_t)")
    def get_api(v):
        if answer_null:
            return pffi.NULL
        return pffi.cast("const EpApi*", int(ffi.cast("uintptr_t", hostapi._api_table(v))))

    base = pffi.new("EpApiBase*")
    base.struct_size = pffi.sizeof("EpApiBase")
    base.version = version
    base.GetApi = get_api
    return base, get_api


def create(rt, base, max_factories: int = 4):
    factories = rt.ffi.new("EpFactory*[]", max(max_factories, 1))
    num = rt.ffi.new("size_t*", 7)  # a stale count: every outcome must leave its own
    try:
        rt._create_locked(rt.ffi.NULL, base, rt.ffi.NULL, factories, max_factories, num)
    finally:
        assert num[0] in (0, 1)
    return factories, int(num[0])


def test_a_null_api_base_is_refused_and_counts_no_factory():
    with plugin_runtime() as rt:
        pffi = rt.ffi
        num = pffi.new("size_t*", 7)
        with pytest.raises(sdk.PluginError, match="^CreateEpFactories got a NULL EpApiBase$") as caught:
            rt._create_locked(pffi.NULL, pffi.NULL, pffi.NULL, pffi.new("EpFactory*[]", 4), 4, num)
        assert caught.value.code == abi.EP_INVALID_ARGUMENT
        assert num[0] == 0


@pytest.mark.parametrize("host", [1, 3, TOP])
def test_a_host_without_the_negotiated_table_is_refused(host):
    with plugin_runtime() as rt:
        base, _cb = api_base(rt, host, answer_null=True)
        num = rt.ffi.new("size_t*", 7)
        with pytest.raises(sdk.PluginError, match=f"^host returned no EpApi for version {host}$") as caught:
            rt._create_locked(rt.ffi.NULL, base, rt.ffi.NULL, rt.ffi.new("EpFactory*[]", 4), 4, num)
        assert caught.value.code == abi.EP_FAIL
        assert num[0] == 0


@pytest.mark.parametrize("room", [0, 1, 2])
def test_room_for_fewer_factories_than_the_plugin_makes_is_refused(room):
    """The example plugin makes one factory: room for 0 is refused naming both counts; room for
    exactly 1 (or more) is enough."""
    with plugin_runtime() as rt:
        base, _cb = api_base(rt, TOP)
        if room < 1:
            with pytest.raises(sdk.PluginError, match=f"^plugin makes 1 factories; host allows {room}$"):
                create(rt, base, room)
            return
        factories, count = create(rt, base, room)
        assert count == 1 and factories[0] != rt.ffi.NULL
        assert rt.ffi.string(factories[0].GetName(factories[0])).decode() == "ExampleEP"


def test_an_older_host_is_recorded_once_per_creation():
    with plugin_runtime() as rt:
        rec = rt.record
        before = rec.fallbacks["host_api_v3"]
        base, _cb = api_base(rt, 3)
        for i in range(1, 3):
            _, count = create(rt, base)
            assert count == 1 and rt.version == 3
            assert rec.fallbacks["host_api_v3"] - before == i
        base, _cb2 = api_base(rt, TOP)
        create(rt, base)
        assert rec.fallbacks[f"host_api_v{TOP}"] == 0, "a host as new as the plugin is no fallback"


@pytest.mark.parametrize("name", [b"my-registration", None])
def test_a_factory_given_as_an_object_is_exposed_as_its_table(name):
    """A plugin's create_factories may return factory objects instead of tables: the SDK exposes
    each as an EpFactory table (GetName answers through it) and counts it; create_factories gets
    the registration name ("" for NULL) and the host's logger as they came."""
    from tests.plugins.example_ep import ExampleFactory

    with plugin_runtime() as rt:
        pffi = rt.ffi
        seen = []

        def make(runtime, registration, logger):
            seen.append((registration, logger))
            return [ExampleFactory(runtime, logger, "")]

        real, rt._create_factories = rt._create_factories, make
        try:
            base, _cb = api_base(rt, TOP)
            logger = pffi.cast("const EpLogger*", 0x1000)  # never dereferenced by the factory here
            factories = pffi.new("EpFactory*[]", 2)
            num = pffi.new("size_t*", 7)
            reg = pffi.new("char[]", name) if name is not None else pffi.NULL
            live = rt.record.live["EpFactory"]
            rt._create_locked(reg, base, logger, factories, 2, num)
        finally:
            rt._create_factories = real
        assert num[0] == 1 and factories[0] != pffi.NULL
        assert pffi.string(factories[0].GetName(factories[0])).decode() == "ExampleEP"
        assert factories[0].version == rt.compiled_version
        assert rt.record.live["EpFactory"] - live == 1
        assert seen == [((name or b"").decode(), logger)]
        rt.forget(pffi.cast("void*", factories[0]), "EpFactory")
