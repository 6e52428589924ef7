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
import re

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
    with h.example_env(TOP, [TOP]):
        rt = sdk.runtime(h.example_module(TOP))
        saved = (rt.version, rt.api, list(rt._factories))
        try:
            yield rt
        finally:
            rt.version, rt.api, rt._factories[:] = saved


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


def create(rt, base, room: int = 4, num=None):
    """Runs the entry; `num` (default: a fresh count holding a stale 7) is left as the entry set it."""
    factories = rt.ffi.new("EpFactory*[]", max(room, 1))
    num = rt.ffi.new("size_t*", 7) if num is None else num
    rt._create_locked(rt.ffi.NULL, base, rt.ffi.NULL, factories, room, num)
    return factories, int(num[0])


# What the host does wrong (its EpApiBase: none, or one whose GetApi(version) answers NULL or a table;
# the room it gives for factories) -> the SDK's whole message and status code.
REFUSALS = [
    ("null_base", None, 4, "CreateEpFactories got a NULL EpApiBase", abi.EP_INVALID_ARGUMENT),
    *[("null_api", v, 4, f"host returned no EpApi for version {v}", abi.EP_FAIL) for v in (1, 3, TOP)],
    ("table", TOP, 0, "plugin makes 1 factories; host allows 0", abi.EP_FAIL),
]


@pytest.mark.parametrize("base_kind, version, room, message, code", REFUSALS,
                         ids=[f"{r[0]}-v{r[1]}-room{r[2]}" for r in REFUSALS])
def test_each_refusal_has_its_whole_text_and_code_and_counts_no_factory(base_kind, version, room, message, code):
    with plugin_runtime() as rt:
        if base_kind == "null_base":
            base = rt.ffi.NULL
        else:
            base, _cb = api_base(rt, version, answer_null=base_kind == "null_api")
        num = rt.ffi.new("size_t*", 7)  # a stale count: the refusal must leave 0
        with pytest.raises(sdk.PluginError, match="^" + re.escape(message) + "$") as caught:
            create(rt, base, room, num)
        assert caught.value.code == code
        assert num[0] == 0


@pytest.mark.parametrize("room", [1, 2])
def test_room_for_as_many_factories_as_the_plugin_makes_is_enough(room):
    with plugin_runtime() as rt:
        base, _cb = api_base(rt, TOP)
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
