"""The host survives any plugin: one hostile C plugin (hostile_plugin.c), one rule broken per case.

Cases are generated from the header's slot tables (abi.since_table): every slot of every plugin
table with a NULL pointer, every slot that returns something with an error (an error status, an
absurd int, a name that is not UTF-8), every plugin table with a wrong version (too low, a future
generation) and a truncated struct_size, every host function called with bad arguments; plus
named special cases (absurd ranks and dims, lying counts, kept contexts, missing outputs, a data
object as entry symbol, ...). Each case asserts:

- a typed EphostError (never a raw Python exception, never a crash, never wrong numbers) whose
  message names the plugin or its EP and the slot; or success where the ABI says the slot is
  optional or the host never calls it (the plugin reports which slots were called);
- zero live plugin objects afterwards (the plugin counts what it creates and what the host
  releases), except where the host cannot release a table it had to reject (listed below);
- no host status leaked, and a surviving host: each subprocess ends by running a CPU-only
  session and the plugin without faults.

Cases that cannot crash run in batches; those that could crash an unfixed host run alone.
"""

from __future__ import annotations

import re

import pytest

import abi
from host.plugins.hostapi import ffi
from tests.hostile.conftest import run_batches

HOST_TABLES = ("EpApi", "EpApiBase", "EpCallFrame")  # tables the host fills: abused, not nulled
PLUGIN_TABLES = tuple(t for t, slots in abi.since_table().items() if slots and t not in HOST_TABLES)
# Cases of the ABI v6 compile path also run the "fuse" scenario (Adds compiled, call frames).
V6 = {"EpNodeComputeInfo", "EpCallFrame", "Ep.Compile", "EpApi.Graph_AddNodesToFuse", "kept_frame",
      "frame_rank_huge", "nullout:Ep.Compile"}
# ... and of the ABI v7 saved contexts the "context" scenario too (the model saved, then loaded).
V7 = {"Ep.CompileFromContext", "Ep.GetCompiledModelCompatibilityInfo", "EpFactory.ValidateCompiledModelCompatibilityInfo",
      "EpNodeComputeInfo.GetContext", "nullout:Ep.CompileFromContext", "compat_absurd"}
# A compute info the host rejects or cannot set up is not an error: the partition's nodes run
# as per-node kernels, with a warning that names the cause.
FALLS_BACK = "EpNodeComputeInfo"

# Tables whose only release is their own Release slot: rejected for a bad version or size, the
# host cannot call it safely, so the plugin keeps them (documented in docs/plugin_contract.md).
SELF_RELEASED = ("EpSyncStream", "EpNotification", "EpDataTransfer", "EpKernel", "EpNodeComputeInfo")


# Slots the host calls only when the one it prefers is NULL (slot -> preferred slot).
FALLBACKS = {"EpFactory.CreateAllocator": "Ep.CreateAllocator",
             "EpFactory.CreateSyncStreamForDevice": "Ep.CreateSyncStreamForDevice",
             "EpAllocator.Alloc": "EpAllocator.AllocOnStream", "Ep.ReplayGraph": "Ep.ReplayGraphWithSync",
             "Ep.Sync": "Ep.ReplayGraphWithSync"}


def _returns(table: str, slot: str) -> str:
    decl = next(m.decl for m in abi.header().struct(table).members if m.name == slot)
    return decl.split("(")[0].strip()


def slot_cases() -> list[dict]:
    cases = []
    for table in PLUGIN_TABLES:
        for slot, (_since, required) in abi.since_table()[table].items():
            qual = f"{table}.{slot}"
            cases.append({"name": f"null:{qual}", "spec": f"null={table}@{ffi.offsetof(table, slot)}",
                          "kind": "null", "table": table, "slot": slot, "required": required})
            if _returns(table, slot) in ("EpStatus*", "int32_t", "const char*"):
                spec = f"fail={qual}"
                if qual in FALLBACKS:  # reached only when the slot the host prefers is NULL
                    pt, ps = FALLBACKS[qual].split(".")
                    spec += f";null={pt}@{ffi.offsetof(pt, ps)}"
                cases.append({"name": f"fail:{qual}", "spec": spec, "kind": "fail", "table": table,
                              "slot": slot, "count": [qual]})
        for what, spec in (("version0", f"version={table}:0"), ("version-future", f"version={table}:1000"),
                           ("size8", f"size={table}:8")):
            cases.append({"name": f"{what}:{table}", "spec": spec, "kind": "table", "table": table})
    for table in HOST_TABLES:
        for slot in abi.since_table()[table]:
            cases.append({"name": f"abuse:{table}.{slot}", "spec": f"abuse={table}.{slot}", "kind": "abuse"})
    for qual in ("EpFactory.CreateEp", "EpFactory.CreateDataTransfer", "Ep.CreateKernel", "Ep.CreateAllocator",
                 "Ep.CreateSyncStreamForDevice", "EpSyncStream.CreateNotification", "EpAllocator.AllocOnStream",
                 "Ep.Compile", "EpNodeComputeInfo.CreateState", "Ep.CompileFromContext"):
        cases.append({"name": f"nullout:{qual}", "spec": f"nullout={qual}", "kind": "special"})
    return cases


# Special cases: (spec, expected error type or "ok", anchored pattern of the message or None).
OWNER = r"(EP 'HostileEP' of )?plugin 'hostile' \([^)]*\)"
SPECIAL = {
    "rank_huge": ("KernelError", r"^node 'add0' \(Add\) on HostileEP failed \(INVALID_ARGUMENT\): KernelContext_GetOutput: "
                                 r"rank 2147483647 is not allowed; expected 0\.\.64$"),
    "dims_negative": ("KernelError", r"^node 'add0' \(Add\) on HostileEP failed \(FAIL\): KernelContext_GetOutput: "
                                     r"output 0 of node 'add0': dims \[-3, 2\] have a negative dimension"),
    "dims_overflow": ("KernelError", r"^node 'add0' \(Add\) on HostileEP failed \(FAIL\): KernelContext_GetOutput: "
                                     r"output 0 of node 'add0': dims \[1099511627776, 1099511627776, 16\] hold "),
    "no_output": ("KernelError", rf"^node 'add0' \(Add\) on {OWNER} returned OK without producing output 0 \('A'\)"),
    "kept_context": ("ok", None),
    "claim_lies": ("EpError", rf"^{OWNER}: CreateKernel for node 'relu' \(Relu\) failed \(NOT_IMPLEMENTED\)"),
    "badutf8_device": ("PluginLoadError", rf"^{OWNER}: EpFactory.GetSupportedDevices device 0 name is not valid UTF-8"),
    "badutf8_memory": ("PluginLoadError",
                       rf"^{OWNER}: EpFactory.GetSupportedDevices device 0 memory_info.name is not valid UTF-8"),
    "devices_huge": ("PluginLoadError", rf"^{OWNER}: EpFactory.GetSupportedDevices reported 1099511627776 devices; "),
    # Its nodes fall back to the CPU EP (main scenario); buffers bound on its device cannot be read.
    "devices_zero": ("EpError", r"^no data transfer can copy from \(1, 0\) to \(0, 0\)$"),
    "factories_huge": ("PluginLoadError", rf"^{OWNER}: reported 1099511627776 factories; at most 8 allowed$"),
    "second_factory_bad": ("AbiVersionError", rf"^{OWNER}: EpFactory declares ABI version 0; "),
    "bogus=Ep.GetCapability": ("EpError", rf"^{OWNER}: GetCapability: the plugin returned a status the host did "
                                          r"not create"),
    "concurrent_absurd": ("EpError", rf"^{OWNER}: Ep.IsConcurrentRunSupported returned 12345; expected 0 or 1$"),
    "fail=CreateEpFactories": ("PluginLoadError", rf"^{OWNER}: CreateEpFactories failed \(FAIL\): "),
    "fail=ReleaseEpFactory": ("ok", None),  # logged, teardown goes on
    "nullret=EpFactory.GetName": ("PluginLoadError", rf"^{OWNER}: EpFactory.GetName returned NULL"),
    "nullret=Ep.GetName": ("ok", None),  # documented default: the factory's name
    "kept_frame": ("ok", None),
    "compat_absurd": ("EpError", r"^plugin 'hostile': ValidateCompiledModelCompatibilityInfo answered 77; "
                                 r"expected one of "),
    "frame_rank_huge": ("KernelError", r"^fused node '[^']+' \(nodes 'add0'\) on HostileEP failed \(INVALID_ARGUMENT\): "
                                       r"AllocateOutput: rank 2147483647 is not allowed; expected 0\.\.64$"),
}
# Cases that could crash a host without the checks: one subprocess each.
ALONE = {"rank_huge", "dims_overflow", "kept_context", "entry_data", "kept_frame", "frame_rank_huge"}


def _is_v6(case: dict) -> bool:
    return any(part in V6 for part in re.split(r"[:.=]", case["name"])) or case["name"] in V6 or any(
        case["name"].endswith(v) for v in V6)

ALL_CASES = slot_cases() + [{"name": k, "spec": k, "kind": "special"} for k in SPECIAL]


@pytest.fixture(scope="module")
def results(hostile_libs):
    lib = hostile_libs["hostile"]
    def scenarios(c):
        if c["name"] in V7 or any(c["name"].endswith(v) for v in V7):
            return ["main", "context"]
        return ["main", "graph", "fuse"] if _is_v6(c) else ["main", "graph"]

    batched = [dict(c, scenarios=scenarios(c)) for c in ALL_CASES if c["name"] not in ALONE]
    batches = [(lib, batched[i::3]) for i in range(3)]
    batches += [(lib, [dict(c, scenarios=["fuse"] if _is_v6(c) else ["main"])]) for c in ALL_CASES
                if c["name"] in ALONE]
    batches.append((hostile_libs["hostile_data_entry"], [{"name": "entry_data", "spec": "", "scenarios": ["main"]}]))
    return run_batches(batches)


def _common(r: dict) -> None:
    assert r["outcome"] != "crash", r["message"]
    assert not r["outcome"].startswith("raw:"), f"raw exception: {r}"
    assert r["outcome"] != "WrongResult", r
    assert r["statuses"] == 0, f"host statuses leaked: {r}"


def _leaks_allowed(case: dict) -> bool:
    rejected = case["kind"] == "table" or (case["kind"] == "null" and case["slot"] == "Release")
    return rejected and case["table"] in SELF_RELEASED


def _check_leaks(case: dict, r: dict) -> None:
    if _leaks_allowed(case) or case["name"] == "null:EpNodeComputeInfo.ReleaseState":
        assert r["live"] <= 2, r  # one per rejected table (the main model has two partitions), or per state
        return
    assert r["live"] == 0, f"live plugin objects after teardown: {r['report']}"
    orphans_ok = case["name"] == "null:EpFactory.ReleaseAllocator"  # no slot to release it: its factory does
    assert r["orphans"] == 0 or orphans_ok, f"objects only freed by their parent: {r['report']}"


def _names_owner(message: str) -> bool:
    return "plugin 'hostile'" in message or "on HostileEP" in message


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c["kind"] in ("null", "fail")], ids=lambda c: c["name"])
def test_slot(results, case):
    r = results[case["name"]]
    _common(r)
    qual = f"{case['table']}.{case['slot']}"
    if case["kind"] == "null" and case["required"] and case["table"] == FALLS_BACK:
        assert r["outcome"] == "ok", r
        assert any(f"mandatory slot {qual} is NULL" in w for w in r["warnings"]), r
    elif case["kind"] == "null" and case["required"]:
        assert r["outcome"] == "AbiVersionError", r
        assert re.search(rf"^{OWNER}: mandatory slot {re.escape(qual)} is NULL$", r["message"]), r
    elif case["kind"] == "null" and case["name"] == "null:EpFactory.CreateDataTransfer":
        assert r["outcome"] == "EpError", r
        assert re.search(rf"^no data transfer can copy from \(0, 0\) to \(1, 0\); {OWNER} gave none "
                         r"\(EpFactory.CreateDataTransfer is NULL or returned no table\)$", r["message"]), r
    elif case["kind"] == "null":
        assert r["outcome"] == "ok", f"an optional slot left NULL must take its documented default: {r}"
    elif r["calls"][qual] == 0:
        assert r["outcome"] == "ok", r  # the host never called it (a later case makes sure some are)
    elif r["outcome"] == "ok":
        # Only teardown (logged) and compilation (a warning, then per-node kernels) may go on.
        assert any(case["slot"] in m for m in r["logged"] + r.get("warnings", [])), f"an error from {qual} vanished: {r}"
    else:
        assert r["outcome"] in ("EpError", "PluginLoadError", "KernelError", "OutOfMemoryError",
                                "GraphCaptureError", "AbiVersionError"), r
        assert _names_owner(r["message"]) and case["slot"] in r["message"], r
    _check_leaks(case, r)


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c["kind"] == "table"], ids=lambda c: c["name"])
def test_table_version_and_size(results, case):
    r = results[case["name"]]
    _common(r)
    table = case["table"]
    if table == FALLS_BACK:
        assert r["outcome"] == "ok" and any(table in w for w in r["warnings"]), r
        _check_leaks(case, r)
        return
    assert r["outcome"] == "AbiVersionError", r
    if case["name"].startswith("size8"):
        assert re.search(rf"^{OWNER}: {table}\.struct_size is 8 bytes; version \d needs at least \d+$",
                         r["message"]), r
    else:
        assert re.search(rf"^{OWNER}: {table} declares ABI version (0|1000)", r["message"]), r
    _check_leaks(case, r)


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c["kind"] == "abuse"], ids=lambda c: c["name"])
def test_host_function_refuses_bad_arguments(results, case):
    """The plugin calls the host function with NULLs, bogus handles, bad ranks, non-UTF-8 keys and
    fails the run itself ("host accepted a bad call") when the host answers OK."""
    r = results[case["name"]]
    _common(r)
    assert r["outcome"] == "ok", r
    _check_leaks(case, r)


@pytest.mark.parametrize("name", sorted(SPECIAL), ids=str)
def test_special(results, name):
    r = results[name]
    _common(r)
    kind, pattern = SPECIAL[name]
    assert r["outcome"] == kind, r
    if pattern is not None:
        assert re.search(pattern, r["message"]), r
    _check_leaks({"kind": "special", "name": name}, r)
    if name == "fail=ReleaseEpFactory":
        assert any("ReleaseEpFactory failed" in m for m in r["logged"]), r


@pytest.mark.parametrize("name", ["nullout:" + q for q in (
    "EpFactory.CreateEp", "EpFactory.CreateDataTransfer", "Ep.CreateKernel", "Ep.CreateAllocator",
    "Ep.CreateSyncStreamForDevice", "EpSyncStream.CreateNotification", "EpAllocator.AllocOnStream",
    "Ep.Compile", "EpNodeComputeInfo.CreateState", "Ep.CompileFromContext")])
def test_ok_without_an_object(results, name):
    """A creating slot that answers OK but gives nothing: a typed error, or the documented default
    where the object is optional (no stream: the EP runs without one)."""
    r = results[name]
    _common(r)
    if name == "nullout:Ep.CreateSyncStreamForDevice" or name == "nullout:EpNodeComputeInfo.CreateState":
        assert r["outcome"] == "ok", r  # no stream, a NULL state: both allowed
    elif name in ("nullout:Ep.Compile", "nullout:Ep.CompileFromContext"):
        assert r["outcome"] == "ok" and any("returned a NULL EpNodeComputeInfo table" in w for w in r["warnings"]), r
    else:
        assert r["outcome"] in ("PluginLoadError", "EpError", "OutOfMemoryError"), r
        assert _names_owner(r["message"]), r
    _check_leaks({"kind": "special", "name": name}, r)


def test_entry_symbol_that_is_data(results, hostile_libs):
    r = results["entry_data"]
    _common(r)
    assert r["outcome"] == "PluginLoadError", r
    assert re.search(r"^plugin '[^']*libephost_hostile_data_entry.so': entry symbol CreateEpFactories is not a "
                     r"function \(ELF symbol type STT_OBJECT\)", r["message"]), r


def test_every_batch_survives(results):
    survivors = {k: v for k, v in results.items() if k.startswith("<survivor>")}
    assert len(survivors) == 9  # 3 batches, 5 cases alone, the data-entry library
    for r in survivors.values():
        assert r["outcome"] == "ok", r
        if "live" in r:
            assert r["live"] == 0, r


def test_every_slot_is_covered(results):
    """Every slot of every table in the header has a NULL case and, where it returns something, a
    failure case that the host actually reached; every host function has an abuse case."""
    names = set(results)
    missing_null, never_called = set(), set()
    for table, slots in abi.since_table().items():
        if not slots or table in HOST_TABLES:
            continue
        for slot in slots:
            qual = f"{table}.{slot}"
            if f"null:{qual}" not in names:
                missing_null.add(qual)
    assert missing_null == set(), missing_null
    abused = {c["name"][6:] for c in ALL_CASES if c["kind"] == "abuse"}
    assert abused == {f"{t}.{s}" for t in HOST_TABLES for s in abi.since_table()[t]}
    called = {c["name"][5:] for c in ALL_CASES if c["kind"] == "fail" and results[c["name"]]["calls"][c["name"][5:]]}
    for c in ALL_CASES:
        if c["kind"] == "fail" and c["name"][5:] not in called:
            never_called.add(c["name"][5:])
    # Slots the host never calls in these scenarios, by design: CanCopy (copies go through
    # CopyTensors), Flush/OnSessionRunEnd (no flushing host), Sync (v5 replays sync on the EP's own
    # stream), WaitOnDevice (one device stream: consumers on the host wait on the host).
    expected_uncalled = {"EpDataTransfer.CanCopy", "EpSyncStream.Flush", "EpSyncStream.OnSessionRunEnd",
                         "EpNotification.WaitOnDevice"}
    assert never_called == expected_uncalled, never_called ^ expected_uncalled
    tables_in_header = {t for t, s in abi.since_table().items() if s}
    assert tables_in_header == set(PLUGIN_TABLES) | set(HOST_TABLES)
