"""The header parser, the append-only rule and the golden layouts of every released version."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import abi
from abi import layouts
from abi.header import HEADER_PATH, cdef, header, parse
from tests.abi.conftest import ROOT

HEADER_TEXT = HEADER_PATH.read_text()
VERSIONS = list(abi.SUPPORTED_VERSIONS)
TABLES = [s.name for s in header().structs if s.is_table]


def _edit(text: str, after: str, insert: str) -> str:
    """The header text with `insert` placed on a new line after the (unique) line containing `after`."""
    lines = text.splitlines()
    hits = [i for i, ln in enumerate(lines) if after in ln]
    assert len(hits) == 1, f"{after!r} is not a unique line of ep_abi.h"
    lines.insert(hits[0] + 1, insert)
    return "\n".join(lines) + "\n"


def _bump(text: str, version: int) -> str:
    return re.sub(r"#define EP_ABI_VERSION \d+", f"#define EP_ABI_VERSION {version}", text)


# ---- the parser -----------------------------------------------------------------------------------

def test_every_member_line_carries_a_since_tag():
    h = header()
    body_lines = 0
    inside = False
    for line in HEADER_TEXT.splitlines():
        s = line.strip()
        if re.match(r"^(typedef\s+)?struct\s+\w+\s*\{$", s):
            inside = True
        elif inside and s.startswith("}"):
            inside = False
        elif inside and s and not s.startswith("/*"):
            body_lines += 1
            assert re.search(r"/\*\s*since\s+\d+(,\s*required)?\s*\*/$", s), f"no since tag: {s!r}"
    assert body_lines == sum(len(st.members) for st in h.structs)
    for st in h.structs:
        for m in st.members:
            assert abi.ABI_MIN_VERSION <= m.since <= abi.ABI_VERSION, f"{st.name}.{m.name} since {m.since}"


def test_parser_rejects_a_member_without_since_tag():
    text = "typedef struct Foo {\n  uint32_t struct_size; /* since 1 */\n  int32_t x;\n} Foo;\n"
    with pytest.raises(ValueError, match=r"^ep_abi.h: member without a since tag in Foo: 'int32_t x;'$"):
        parse(text)


def test_tables_start_with_struct_size_and_version():
    h = header()
    assert set(TABLES) >= {"EpApi", "EpApiBase", "EpFactory", "Ep", "EpKernel", "EpAllocator",
                           "EpDataTransfer", "EpSyncStream", "EpNotification"}
    for st in h.structs:
        if any(m.is_slot for m in st.members):
            assert st.is_table, f"{st.name} has function slots but does not start with struct_size, version"
        if st.is_table:
            first, second = st.members[:2]
            assert (first.decl, first.since) == ("uint32_t struct_size;", st.since), st.name
            assert (second.decl, second.since) == ("uint32_t version;", st.since), st.name
    assert abi.TABLES == tuple(TABLES)


@pytest.mark.parametrize("struct", [s.name for s in header().structs])
def test_since_tags_never_decrease(struct):
    sinces = [m.since for m in header().struct(struct).members]
    assert sinces == sorted(sinces), f"{struct}: a member was inserted, not appended: {sinces}"


def test_since_table_matches_the_version_line():
    assert abi.since("EpApi", "KernelContext_GetSyncStream") == 4
    assert abi.since("Ep", "Sync") == abi.since("Ep", "IsConcurrentRunSupported") == 2
    assert {abi.since("Ep", s) for s in ("IsGraphCaptureEnabled", "IsGraphCaptured", "ReplayGraph",
                                         "GetGraphCaptureNodeAssignmentPolicy")} == {3}
    assert abi.since("Ep", "ReleaseCapturedGraph") == 4
    assert abi.since("Ep", "ReplayGraphWithSync") == 5
    assert abi.since_table()["EpFactory"]["CreateEp"] == (1, True)
    assert abi.since_table()["EpFactory"]["GetVersion"] == (1, False)
    assert abi.slots_at("Ep", 2)[-2:] == ["Sync", "IsConcurrentRunSupported"]
    assert abi.since("Ep", "Compile") == abi.since("EpApi", "Graph_AddNodesToFuse") == 6
    assert abi.since_table()["EpApi"]["Graph_AddNodesToFuse"] == (6, True)
    assert abi.since_table()["EpNodeComputeInfo"] == {
        "CreateState": (6, False), "Compute": (6, True), "ReleaseState": (6, False), "Release": (6, True),
        "GetContext": (7, False)}
    # v7: saved compiled partitions, all optional (an EP that saves nothing fills none of them).
    assert abi.slots_at("Ep", 7)[-2:] == ["CompileFromContext", "GetCompiledModelCompatibilityInfo"]
    assert abi.since_table()["EpFactory"]["ValidateCompiledModelCompatibilityInfo"] == (7, False)
    assert abi.COMPATIBILITY_NAMES == {0: "EP_NOT_APPLICABLE", 1: "EP_SUPPORTED_OPTIMAL",
                                       2: "EP_SUPPORTED_PREFER_RECOMPILATION", 3: "EP_UNSUPPORTED"}
    assert abi.slots_at("EpCallFrame", 6) == ["AllocateOutput", "AllocScratch", "FreeScratch"]
    assert abi.slots_at("EpNodeComputeInfo", 5) == []


# ---- cdef(v) --------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_cdef_cuts_each_table_at_its_version(version):
    ffi = abi.ffi_for(version)
    text = cdef(version)
    for table in TABLES:
        if not header().struct(table).exists_at(version):
            # A struct newer than the version is only a name there: no size, no members.
            assert f"typedef struct {table} {table};" in text
            with pytest.raises((ValueError, getattr(ffi, "error", ValueError)), match="unknown size|know the size"):  # in-line / out-of-line FFI
                ffi.sizeof(table)
            continue
        for m in header().struct(table).members:
            if m.since <= version:
                assert ffi.offsetof(table, m.name) >= 0
            else:
                assert m.decl not in text, f"{table}.{m.name} (since {m.since}) leaked into cdef({version})"
                with pytest.raises(KeyError):
                    ffi.offsetof(table, m.name)
        last = header().struct(table).cut(version)[-1]
        assert ffi.sizeof(table) == ffi.offsetof(table, last.name) + ffi.sizeof(ffi.typeof(f"struct {table}")
                                                                                 .fields[-1][1].type)


def test_tables_grow_with_each_version_that_adds_slots():
    for table in TABLES:
        present = [v for v in VERSIONS if header().struct(table).exists_at(v)]
        sizes = [abi.ffi_for(v).sizeof(table) for v in present]
        for v, (before, after) in enumerate(zip(sizes, sizes[1:]), start=present[0] + 1):
            added = [m.name for m in header().struct(table).members if m.since == v]
            assert (after > before) is bool(added), f"{table} v{v}: {before} -> {after}, added {added}"


def test_cdef_of_matches_abi_cdef():
    for v in VERSIONS:
        assert layouts.cdef_of(header(), v) == cdef(v)


def test_unknown_version_is_refused():
    with pytest.raises(ValueError,
                       match=rf"^ABI version {abi.ABI_VERSION + 1} is not one this package describes; "
                             rf"allowed: 1\.\.{abi.ABI_VERSION}$"):
        abi.ffi_for(abi.ABI_VERSION + 1)


# ---- golden layouts -------------------------------------------------------------------------------

def test_golden_file_covers_every_released_version_and_struct():
    golden = layouts.load_golden()
    assert sorted(golden, key=int) == [str(v) for v in VERSIONS]
    for v in VERSIONS:
        assert set(golden[str(v)]) == {s.name for s in header().structs if s.exists_at(v)}
    # The v6 structs are absent from every earlier release, present from 6 on.
    for name in ("EpFrameTensor", "EpCallFrame", "EpNodeComputeInfo"):
        assert [v for v in VERSIONS if name in golden[str(v)]] == [v for v in VERSIONS if v >= 6]


@pytest.mark.parametrize("version", VERSIONS)
def test_layout_equals_golden(version):
    golden = layouts.load_golden()[str(version)]
    now = layouts.compute([version])[str(version)]
    assert now == golden


def test_current_header_passes_every_layout_rule():
    assert layouts.check_header_text(HEADER_TEXT) == []


def test_golden_values_are_the_c_compiler_view():
    """Spot checks against sizes fixed by the C rules (LP64): a change here is a real ABI break."""
    golden = layouts.load_golden()
    assert golden["1"]["EpApiBase"] == {"size": 24, "offsets": {"struct_size": 0, "version": 4, "GetApi": 8,
                                                                "GetVersionString": 16}}
    assert golden["3"]["EpApi"]["size"] == 8 + 9 * 8
    assert golden["4"]["EpApi"]["size"] == 8 + 10 * 8
    assert golden["5"]["Ep"]["offsets"]["ReplayGraphWithSync"] == 8 + 14 * 8
    assert golden["5"]["Ep"]["size"] == 8 + 15 * 8
    assert golden["6"]["Ep"]["offsets"]["Compile"] == 8 + 15 * 8
    assert golden["6"]["EpApi"]["offsets"]["Graph_AddNodesToFuse"] == 8 + 10 * 8
    assert golden["6"]["EpFrameTensor"] == {"size": 24, "offsets": {"data": 0, "dims": 8, "rank": 16,
                                                                    "elem_type": 20}}
    assert golden["6"]["EpCallFrame"]["size"] == 8 + 2 * 8 + 4 * 4 + 7 * 8
    assert golden["6"]["EpCallFrame"]["offsets"]["inputs"] == 40
    assert golden["6"]["EpNodeComputeInfo"]["size"] == 8 + 4 * 8
    assert golden["1"]["EpTensor"] == {"size": 40, "offsets": {
        "data": 0, "shape": 8, "ndim": 16, "elem_type": 20, "device_type": 24, "device_id": 28, "nbytes": 32}}


# ---- the check function on edited headers -------------------------------------------------------

def test_check_detects_a_slot_inserted_in_the_middle():
    text = _edit(HEADER_TEXT, "EpStatus* (*OnRunStart)(struct Ep* self",
                 "  EpStatus* (*Inserted)(struct Ep* self); /* since 5 */")
    problems = layouts.check_header_text(text)
    ep = layouts.load_golden()["5"]["Ep"]
    assert any(p.startswith("Ep.OnRunEnd (since 1) follows Ep.Inserted (since 5)") for p in problems), \
        problems
    off = ep["offsets"]["OnRunEnd"]
    assert f"v5: offsetof(Ep, OnRunEnd) is {off + 8}; released as {off}" in problems
    assert f"v5: sizeof(Ep) is {ep['size'] + 8}; released as {ep['size']}" in problems
    # Releases before 5 are untouched: the insert is cut out of their declarations.
    assert not any(p.startswith(("v1:", "v2:", "v3:", "v4:")) for p in problems), problems


def test_check_detects_a_future_slot_inserted_in_the_middle():
    """A slot of the next version in the middle leaves released ones alone but moves their slots in it."""
    nxt = abi.ABI_VERSION + 1
    text = _bump(_edit(HEADER_TEXT, "EpStatus* (*Sync)(struct Ep* self)",
                       f"  EpStatus* (*Inserted)(struct Ep* self); /* since {nxt} */"), nxt)
    problems = layouts.check_header_text(text)
    off = layouts.load_golden()[str(abi.ABI_VERSION)]["Ep"]["offsets"]["IsConcurrentRunSupported"]
    assert f"v{nxt}: offsetof(Ep, IsConcurrentRunSupported) is {off + 8}; v{abi.ABI_VERSION} has {off} " \
           "(a member was inserted before it, not appended)" in problems
    assert not any(p.startswith(f"v{abi.ABI_VERSION}:") for p in problems)


def test_check_detects_a_type_change_in_a_released_struct():
    text = HEADER_TEXT.replace("  int32_t ndim;         /* since 1 */\n  int32_t elem_type;",
                               "  int64_t ndim;         /* since 1 */\n  int32_t elem_type;")
    assert text != HEADER_TEXT
    problems = layouts.check_header_text(text)
    assert "v1: offsetof(EpTensor, elem_type) is 24; released as 20" in problems
    assert "v1: sizeof(EpTensor) is 48; released as 40" in problems


def test_check_detects_a_removed_slot():
    text = "\n".join(ln for ln in HEADER_TEXT.splitlines() if "(*Flush)" not in ln) + "\n"
    problems = layouts.check_header_text(text)
    assert any(p.startswith("v1: members of EpSyncStream are ") for p in problems), problems


def test_check_accepts_a_slot_appended_for_a_new_version():
    nxt = abi.ABI_VERSION + 1
    text = _bump(_edit(HEADER_TEXT, "(*GetCompiledModelCompatibilityInfo)",
                       f"  EpStatus* (*NewThing)(struct Ep* self); /* since {nxt} */"), nxt)
    assert layouts.check_header_text(text) == []
    now = layouts.compute_from_text(text)
    assert now[str(nxt)]["Ep"]["offsets"]["NewThing"] == now[str(abi.ABI_VERSION)]["Ep"]["size"]


def test_check_detects_a_new_struct_inserted_into_a_released_version():
    """A struct tagged with a released version is new in that release: refused."""
    text = HEADER_TEXT.replace("typedef struct EpFrameTensor {",
                               "typedef struct EpLate {\n  int32_t x; /* since 5 */\n} EpLate;\n\n"
                               "typedef struct EpFrameTensor {")
    assert text != HEADER_TEXT
    assert "v5: struct EpLate is new in a released version" in layouts.check_header_text(text)


def test_write_adds_a_new_version_and_refuses_to_rewrite_a_released_one(tmp_path):
    golden = layouts.load_golden()
    current = layouts.compute()
    latest = str(abi.ABI_VERSION)
    without_v5 = {k: v for k, v in golden.items() if k != latest}
    assert layouts.merged_for_write(without_v5, current) == golden

    tampered = json.loads(json.dumps(golden))
    tampered["2"]["Ep"]["size"] += 8
    with pytest.raises(layouts.LayoutError,
                       match=r"^refusing to rewrite released layouts:\n  v2: sizeof\(Ep\) "):
        layouts.merged_for_write(tampered, current)

    path = tmp_path / "golden.json"
    layouts.write(path, tampered)
    proc = subprocess.run([sys.executable, "-m", "abi.layouts", "--write", "--golden", str(path)], cwd=ROOT,
                          capture_output=True, text=True)
    size = golden["2"]["Ep"]["size"]
    assert proc.returncode == 1 and f"v2: sizeof(Ep) is {size}; released as {size + 8}" in proc.stderr
    assert layouts.load_golden(path) == tampered, "a refused --write must leave the file alone"

    layouts.write(path, without_v5)
    proc = subprocess.run([sys.executable, "-m", "abi.layouts", "--write", "--golden", str(path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f"added: {latest}")
    assert layouts.load_golden(path) == golden


def test_check_cli_on_the_checked_in_header():
    proc = subprocess.run([sys.executable, "-m", "abi.layouts", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_import_abi_is_cheap():
    """`import abi` parses the header but builds no FFI and computes no layouts."""
    code = ("import sys, abi; print(int('abi.layouts' in sys.modules), abi.ffi_for.cache_info().currsize, "
            "int('numpy' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0", "0"]
