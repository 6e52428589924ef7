"""Property 7: each side's version gate on its own, at its edges.

- The host's one gate (`host.plugins.loader.negotiate`) over fabricated plugin tables: declared
  versions drawn across their edges (0, 1, the host's version and its neighbours, 999 the last
  before the next generation, 1000 and beyond, the uint32 maximum), struct sizes across theirs,
  and mandatory slots NULLed in every table at every version. The expected outcome comes from an
  independent model built on the golden layouts, not on the code under test.
- The host's gate against an over-eager plugin (EPHOST_TEST_FAULT=eager_slots: every table
  carries every slot the plugin was built with, whatever the host serves): no slot beyond the
  negotiated version is called, and the fallback table still holds.
- The plugin SDK's gate against an over-eager host (an EpApi table offering slots beyond the
  negotiated version, also one whose version field claims more): the SDK asks GetApi(min(compiled,
  host)), uses no host function beyond it, and installs no slot beyond it in any table it hands out.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import abi
from abi import sdk
from host.errors import AbiVersionError, GraphCaptureError, PluginLoadError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from host.plugins.loader import negotiate
from tests.conftest import built_plugin
from tests.property import fallback_table as ft
from tests.property import harness as h
from tests.property import scenario
from tests.property import strategies as s
from tests.property.test_gating import assert_gated

GOLDEN = json.loads((Path(abi.__file__).parent / "golden_layouts.json").read_text())["versions"]
TOP = max(s.VERSIONS)
NEXT = abi.ABI_NEXT_GENERATION
UINT32_MAX = 2**32 - 1
OWNER = "plugin 'edge' (edge.so)"


def golden_size(table: str, version: int) -> int:
    return GOLDEN[str(version)][table]["size"]


def golden_slots(table: str, version: int) -> list[str]:
    return [k for k in GOLDEN[str(version)][table]["offsets"] if k not in ("struct_size", "version")]


def required(table: str) -> set[str]:
    return {k for k, (_, req) in abi.since_table()[table].items() if req}


# ---- fabricated tables -------------------------------------------------------------------------------------
class Fabricated:
    """A plugin table of the host's layout in a buffer of `struct_size` bytes (at least the full
    layout, so the host may read every slot), every slot a distinct non-NULL pointer except `nulls`."""

    def __init__(self, table: str, declared: int, struct_size: int, nulls=()):
        full = ffi.sizeof(table)
        self.buf = ffi.new("char[]", max(struct_size, full) + 8)
        self.ptr = ffi.cast(f"{table}*", self.buf)
        self.ptr.struct_size, self.ptr.version = struct_size, declared
        self.addresses: dict[str, int] = {}
        for i, name in enumerate(abi.since_table()[table]):
            if name in nulls:
                continue
            fn = getattr(self.ptr, name)
            self.addresses[name] = 0x10000 + 16 * i
            setattr(self.ptr, name, ffi.cast(ffi.typeof(fn), self.addresses[name]))


def model(table: str, declared: int, struct_size: int, nulls, host: int) -> tuple[str, object]:
    """("error", anchored message regex) or ("ok", {slot: callable?}) by the documented rules."""
    if declared >= NEXT:
        return "error", (rf"^{re.escape(OWNER)}: {table} declares ABI version {declared}, a future incompatible "
                         rf"generation \(>= {NEXT}\); this host supports 1\.\.{host}$")
    if declared < 1:
        return "error", rf"^{re.escape(OWNER)}: {table} declares ABI version {declared}; this host supports 1\.\.{host}$"
    n = min(declared, host)
    need = golden_size(table, n)
    if struct_size < need:
        return "error", (rf"^{re.escape(OWNER)}: {table}\.struct_size is {struct_size} bytes; version {n} needs at "
                         rf"least {need}$")
    missing = [k for k in golden_slots(table, n) if k in required(table) and k in nulls]
    if missing:
        return "error", rf"^{re.escape(OWNER)}: mandatory slot {table}\.{missing[0]} is NULL$"
    return "ok", {k: (k in golden_slots(table, n) and k not in nulls) for k in abi.since_table()[table]}


def check_negotiate(table: str, declared: int, struct_size: int, nulls, host: int) -> None:
    fab = Fabricated(table, declared, struct_size, nulls)
    kind, want = model(table, declared, struct_size, nulls, host)
    if kind == "error":
        with pytest.raises(AbiVersionError, match=want):
            negotiate(table, fab.ptr, host, OWNER)
        return
    slots = negotiate(table, fab.ptr, host, OWNER)
    assert (slots.table, slots.declared, slots.negotiated, slots.struct_size) == (
        table, declared, min(declared, host), struct_size)
    assert slots.ptr == fab.ptr
    got = {k: slots.has(k) for k in abi.since_table()[table]}
    assert got == want
    for k, callable_ in want.items():
        fn = getattr(slots, k)
        if callable_:  # the very pointer of the table, not another slot's
            assert int(ffi.cast("uintptr_t", fn)) == fab.addresses[k], k
        else:
            assert fn is None, k


PLUGIN_TABLES = tuple(t for t in sdk.PLUGIN_TABLES if t in GOLDEN[str(TOP)])
tables = st.sampled_from(PLUGIN_TABLES)
declared_versions = st.one_of(st.sampled_from([0, 1, TOP - 1, TOP, TOP + 1, NEXT - 1, NEXT, NEXT + 1, UINT32_MAX]),
                              st.integers(0, UINT32_MAX))


def first_version(table: str) -> int:
    """The ABI version that introduced `table` (tables of v6 do not exist at v1..v5)."""
    return min(int(v) for v in GOLDEN if table in GOLDEN[v])


@st.composite
def table_cases(draw):
    table = draw(tables)
    first = first_version(table)
    host = draw(st.sampled_from([v for v in s.VERSIONS if v >= first]))
    declared = draw(st.one_of(declared_versions, st.sampled_from([host - 1, host, host + 1])).filter(
        lambda d: d >= first or d < 1 or d >= NEXT))
    n = min(max(declared, first), host)
    need = golden_size(table, n)
    size = draw(st.sampled_from([need, need - 1, need - 8, need + 8, 8, golden_size(table, TOP), 4096]))
    names = list(abi.since_table()[table])
    nulls = draw(st.lists(st.sampled_from(names), unique=True, max_size=3))
    return table, max(declared, 0), max(size, 0), tuple(nulls), host


@given(case=table_cases())
@example(case=("Ep", 0, golden_size("Ep", 1), (), TOP))
@example(case=("Ep", 1, golden_size("Ep", 1), (), TOP))
@example(case=("Ep", TOP, golden_size("Ep", TOP), (), TOP))
@example(case=("Ep", TOP + 1, golden_size("Ep", TOP), (), TOP))
@example(case=("Ep", NEXT - 1, golden_size("Ep", TOP), (), TOP))
@example(case=("Ep", NEXT, golden_size("Ep", TOP), (), TOP))
@example(case=("Ep", NEXT + 1, golden_size("Ep", TOP), (), TOP))
@example(case=("Ep", UINT32_MAX, golden_size("Ep", TOP), (), TOP))
@example(case=("EpFactory", 3, golden_size("EpFactory", 3) - 1, (), 5))
@example(case=("EpFactory", 3, golden_size("EpFactory", 3), (), 5))
@example(case=("Ep", 2, golden_size("Ep", 2), ("IsConcurrentRunSupported",), 1))
@example(case=("Ep", 5, golden_size("Ep", 2), (), 2))
@settings(deadline=None, max_examples=s.budget(150))
def test_negotiate_follows_the_documented_rules(case):
    check_negotiate(*case)


@pytest.mark.parametrize("table", PLUGIN_TABLES)
def test_every_mandatory_slot_nulled_at_every_version(table):
    """Exhaustive: each mandatory slot NULL, declared and host version each 1..top: refused iff the
    slot exists at the negotiated version."""
    versions = [v for v in s.VERSIONS if v >= first_version(table)]
    for slot in sorted(required(table)):
        for declared in versions:
            for host in versions:
                check_negotiate(table, declared, golden_size(table, TOP), (slot,), host)


def test_a_null_table_is_a_load_error():
    with pytest.raises(PluginLoadError, match=rf"^{re.escape(OWNER)}: returned a NULL Ep table$"):
        negotiate("Ep", ffi.NULL, TOP, OWNER)


# ---- the host's gate against an over-eager plugin -------------------------------------------------------
@contextlib.contextmanager
def fault(name: str):
    old = os.environ.get("EPHOST_TEST_FAULT")
    os.environ["EPHOST_TEST_FAULT"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EPHOST_TEST_FAULT", None)
        else:
            os.environ["EPHOST_TEST_FAULT"] = old


@contextlib.contextmanager
def eager_env(host: int, plugin: int):
    """example_env, with the plugin registered as an over-eager test double."""
    gc.collect()
    h.clear_record(plugin)
    env = Environment(api_version=host)
    try:
        with fault("eager_slots"):
            env.register_plugin(f"ex{plugin}", built_plugin("example", plugin))
        yield env
    finally:
        gc.collect()
        env.close()


def raw_slots(table: str, ptr) -> dict[str, bool]:
    """Which slots of a C table the plugin filled in (non-NULL), as far as the host's layout goes."""
    c = ffi.cast(f"{table}*", ptr)
    size = int(c.struct_size)
    return {k: getattr(c, k) != ffi.NULL for k in abi.since_table()[table]
            if ffi.offsetof(table, k) + ffi.sizeof("void*") <= size}


def handed_out(sess, env) -> list[tuple[str, object]]:
    """Every plugin table the host holds for this session: factory, Ep, kernels, allocator,
    data transfer, sync streams."""
    ep = sess.plan.eps[0] if sess.plan.eps else sess._eps[0]
    out = [("EpFactory", ep.factory.ptr), ("Ep", ep.ptr)]
    out += [("EpKernel", k.ptr) for k in sess._partitioner.kernels]
    if ep.allocator is not None:
        out.append(("EpAllocator", ep.allocator.ptr))
    if ep.transfer is not None:
        out.append(("EpDataTransfer", ep.transfer.ptr))
    out += [("EpSyncStream", st_.ptr) for st_ in ep._streams]
    return out


def newer_scenarios():
    """Scenarios whose plugin is newer than the host (so an over-eager plugin offers more)."""
    pairs = [(a, b) for a in s.VERSIONS for b in s.VERSIONS if a < b]
    return st.sampled_from(pairs).flatmap(lambda p: scenario.scenarios(host=st.just(p[0]), plugin=st.just(p[1])))


@given(sc=newer_scenarios())
@example(sc=None)
@settings(deadline=None, max_examples=s.budget(8))
def test_host_gate_alone_against_an_over_eager_plugin(sc):
    if sc is None:  # the edge: a v1 host, the newest plugin, capture asked for
        sc = scenario.Scenario(h.chain_case(), 1, TOP, (), {"enable_graph": "1", "min_runs": "0"}, 1, 1,
                               [s.RunOpts(None, None), s.RunOpts(None, None), s.RunOpts(None, "1")])
    with eager_env(sc.host, sc.plugin) as env:
        out = scenario.play(sc, env)
    rec = h.record(sc.plugin)
    assert_gated(rec.slot_calls, sc.negotiated, sc.null_slots)
    ev = scenario.model(sc)
    want_session, want_plugin = ft.expected(sc, ev)
    assert out.created is ev.created
    assert +out.session_fallbacks == want_session
    assert +out.record_fallbacks == want_plugin


@pytest.mark.parametrize("host", s.VERSIONS)
def test_over_eager_plugin_really_offers_newer_slots(host):
    """The double is what it claims: its Ep table has the newest slots even on an older host
    (so the test above tests the host's gate, not the SDK's)."""
    with eager_env(host, TOP) as env:
        sess = h.session(h.chain_case(), env, {"enable_graph": "1"})
        try:
            present = raw_slots("Ep", sess._eps[0].ptr)
            assert all(present[k] for k in abi.slots_at("Ep", TOP) if k in present)
            assert sess._eps[0].slots.negotiated == host
        finally:
            sess.close()


# ---- the SDK's gate against an over-eager host ------------------------------------------------------------
def over_eager_table(version: int, claim: str):
    """An EpApi table answering GetApi(version) that offers every slot of the newest layout:
    `claim` "honest" keeps version = `version`; "newer" also writes the newest version number."""
    full = hostapi._api_table(TOP)
    t = ffi.new("EpApi*")
    t.struct_size = ffi.sizeof("EpApi")
    t.version = version if claim == "honest" else TOP
    for name in abi.slots_at("EpApi", TOP):
        setattr(t, name, getattr(full, name))
    return t


@contextlib.contextmanager
def over_eager_host(host: int, plugin: int, claim: str):
    gc.collect()
    h.clear_record(plugin)
    env = Environment(api_version=host)
    keep = {v: over_eager_table(v, claim) for v in range(1, TOP + 1)}
    env.api._tables.update(keep)  # the double: GetApi(v) answers every v with a table offering everything
    env.api.requested.clear()
    try:
        env.register_plugin(f"ex{plugin}", built_plugin("example", plugin))
        yield env
    finally:
        gc.collect()
        env.close()
        del keep


@given(host=s.versions, plugin=s.versions, claim=st.sampled_from(["honest", "newer"]),
       capture=st.booleans())
@example(host=1, plugin=TOP, claim="newer", capture=True)
@example(host=3, plugin=TOP, claim="honest", capture=True)
@example(host=TOP, plugin=3, claim="newer", capture=True)
@example(host=TOP, plugin=TOP, claim="honest", capture=False)  # v4+: one GetSyncStream per kernel call
@settings(deadline=None, max_examples=s.budget(6))
def test_sdk_gate_alone_against_an_over_eager_host(host, plugin, claim, capture):
    n = min(host, plugin)
    case = h.chain_case()
    refs = h.References(case)
    with over_eager_host(host, plugin, claim) as env:
        assert env.api.requested == [n], "the plugin must ask GetApi(min(compiled, host))"
        rt = sdk.runtime(h.example_module(plugin))
        assert rt.version == n
        usable = {k for k in abi.since_table()["EpApi"] if rt.api.has(k)}
        assert usable == set(abi.slots_at("EpApi", n))
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "0"} if capture else {})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                refs.check(sess.run(None, case.feeds), case.feeds, "eager run on an over-eager host")
                b, ins, outs = h.bind(sess, case.feeds, case.outputs)
                sess.run_with_iobinding(b)
                sess.run_with_iobinding(b)
                refs.check([outs[k] for k in refs.names], case.feeds, "bound runs on an over-eager host")
            # What the plugin handed out carries nothing beyond v{n}; the host's gate never had to act.
            for table, ptr in handed_out(sess, env):
                beyond = [k for k, filled in raw_slots(table, ptr).items() if filled and abi.since(table, k) > n]
                assert beyond == [], f"{table} offers slots beyond v{n}: {beyond}"
        finally:
            sess.close()
    rec = h.record(plugin)
    too_new = [k for k in rec.host_calls if k in abi.since_table()["EpApi"] and abi.since("EpApi", k) > n]
    assert too_new == [], f"host functions beyond v{n} were used: {too_new}"
    computes = rec.slot_calls["EpKernel.Compute"]
    assert computes > 0
    assert rec.fallbacks["untagged_scratch"] == (computes if n < ft.SYNC_STREAM_VERSION else 0)
    assert rec.host_calls["KernelContext_GetSyncStream"] == (0 if n < ft.SYNC_STREAM_VERSION else computes)


def short_table(version: int):
    """An EpApi table that says `version` but whose struct_size stops before the v4 slots: a host
    that lies short. The SDK must trust struct_size and take the fallback."""
    t = over_eager_table(version, "honest")
    t.struct_size = golden_size("EpApi", ft.SYNC_STREAM_VERSION - 1)
    return t


@given(host=st.sampled_from([v for v in s.VERSIONS if v >= ft.SYNC_STREAM_VERSION]),
       plugin=st.sampled_from([v for v in s.VERSIONS if v >= ft.SYNC_STREAM_VERSION]))
@settings(deadline=None, max_examples=s.budget(4))
def test_sdk_trusts_struct_size_over_the_version_field(host, plugin):
    n = min(host, plugin)
    case = h.chain_case()
    gc.collect()
    h.clear_record(plugin)
    env = Environment(api_version=host)
    keep = {v: short_table(v) for v in range(1, TOP + 1)}
    env.api._tables.update(keep)
    try:
        env.register_plugin(f"ex{plugin}", built_plugin("example", plugin))
        rt = sdk.runtime(h.example_module(plugin))
        assert not rt.api.has("KernelContext_GetSyncStream")
        assert {k for k in abi.since_table()["EpApi"] if rt.api.has(k)} == set(
            abi.slots_at("EpApi", ft.SYNC_STREAM_VERSION - 1))
        sess = h.session(case, env)
        try:
            h.References(case).check(sess.run(None, case.feeds), case.feeds, f"v{n} host with a short EpApi")
        finally:
            sess.close()
    finally:
        gc.collect()
        env.close()
        del keep
    rec = h.record(plugin)
    assert rec.fallbacks["untagged_scratch"] == rec.slot_calls["EpKernel.Compute"] == len(case.nodes)
    assert rec.host_calls["KernelContext_GetSyncStream"] == 0


# ---- declared versions and sizes of a real plugin, end to end ---------------------------------------------
def _registration_error(fault_name: str, host: int, plugin: int) -> str | None:
    """The anchored message registering the example plugin with `fault_name` must raise (None: it loads)."""
    path = str(built_plugin("example", plugin))
    owner = rf"^plugin 'ex{plugin}' \({re.escape(path)}\): "
    n = min(plugin, host)
    if fault_name == "version_low":
        return owner + rf"EpFactory declares ABI version 0; this host supports 1\.\.{host}$"
    if fault_name == "version_future":
        return owner + (rf"EpFactory declares ABI version {NEXT + 1}, a future incompatible generation "
                        rf"\(>= {NEXT}\); this host supports 1\.\.{host}$")
    if fault_name == "struct_truncated":
        size = GOLDEN[str(plugin)]["EpFactory"]["offsets"]["GetName"]
        return owner + rf"EpFactory\.struct_size is {size} bytes; version {n} needs at least " \
                       rf"{golden_size('EpFactory', n)}$"
    if fault_name == "null_mandatory":
        return owner + r"mandatory slot EpFactory\.GetSupportedDevices is NULL$"
    return None


@pytest.mark.parametrize("fault_name", ["version_low", "version_future", "struct_truncated", "null_mandatory",
                                        "struct_oversized"])
@given(host=s.versions, plugin=s.versions)
@example(host=1, plugin=1)
@example(host=TOP, plugin=TOP)
@settings(deadline=None, max_examples=s.budget(3))
def test_declared_versions_and_sizes_of_a_real_plugin(fault_name, host, plugin):
    want = _registration_error(fault_name, host, plugin)
    gc.collect()
    h.clear_record(plugin)
    env = Environment(api_version=host)
    try:
        with fault(fault_name):
            if want is not None:
                with pytest.raises(AbiVersionError, match=want):
                    env.register_plugin(f"ex{plugin}", built_plugin("example", plugin))
                assert env.plugins == {}
                return
            reg = env.register_plugin(f"ex{plugin}", built_plugin("example", plugin))
        f = reg.factories[0]
        assert (f.slots.declared, f.negotiated) == (plugin, min(host, plugin))
        assert f.slots.struct_size == golden_size("EpFactory", plugin) + 64
        case = h.chain_case()
        sess = h.session(case, env)
        try:
            h.References(case).check(sess.run(None, case.feeds), case.feeds, "oversized EpFactory")
        finally:
            sess.close()
    finally:
        gc.collect()
        env.close()


def test_capture_policy_defaults_to_all_nodes_on_the_ep():
    """GetGraphCaptureNodeAssignmentPolicy NULL: the host assumes ALL_NODES_ON_EP, so even a CPU
    node that only computes a shape (int64) refuses a capturing session."""
    from onnx import TensorProto, helper

    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZ")
    shp = helper.make_tensor_value_info("S", TensorProto.INT64, [2])
    nodes = [helper.make_node("Add", ["X", "Y"], ["Z"], name="add"), helper.make_node("Shape", ["X"], ["S"], name="shape")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x, y], [z, shp]), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    with h.example_env(TOP, [TOP]) as env:
        with pytest.raises(GraphCaptureError, match=r"^graph capture on ExampleEP requires all nodes on the EP; "
                                                    r"offending node\(s\): 'shape' \(Shape on CPUExecutionProvider\)"):
            h.session(m, env, {"enable_graph": "1", "null_slots": "GetGraphCaptureNodeAssignmentPolicy"})
