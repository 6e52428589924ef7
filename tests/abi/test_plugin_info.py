"""host.plugins.plugin_info: what a plugin offers this host, and its text report."""

from __future__ import annotations

import os
import re

import pytest

import abi
from abi import sdk
from host.errors import PluginLoadError
from host.plugins.plugin_info import format_plugin_info, plugin_info


def _slots(info: dict, table: str) -> dict[str, dict]:
    return {row["slot"]: row for row in info["factories"][0]["tables"][table]["slots"]}


def test_example_v3(plugins):
    info = plugin_info(plugins.example[3])
    assert info["path"] == str(plugins.example[3])
    assert info["host_api_version"] == abi.ABI_VERSION
    [f] = info["factories"]
    assert (f["ep_name"], f["vendor"], f["plugin_version"]) == ("ExampleEP", "ephost-tests", "1.0.0")
    assert (f["declared_version"], f["negotiated_version"]) == (3, 3)
    assert f["devices"] == [{"device_type": "CPU", "device_id": 0, "vendor_id": 0, "name": "example-cpu",
                             "memory": "Cpu"}]
    for table in ("EpFactory", "Ep"):
        rows = _slots(info, table)
        assert list(rows) == list(abi.since_table()[table]), "every slot of the header is reported, in order"
        for name, row in rows.items():
            since, required = abi.since_table()[table][name]
            assert (row["since"], row["required"]) == (since, required)
            assert row["present"] is (since <= 3), f"{table}.{name}"
            assert row["absent_reason"] == (None if since <= 3 else f"needs v{since}")
    ep = f["tables"]["Ep"]
    assert (ep["declared_version"], ep["negotiated_version"]) == (3, 3)
    assert ep["struct_size"] == abi.ffi_for(3).sizeof("Ep")


def test_example_v5_and_older_host(plugins):
    info = plugin_info(plugins.example[5])
    assert info["factories"][0]["negotiated_version"] == 5
    rows = _slots(info, "Ep")
    assert {name for name, row in rows.items() if row["present"]} == set(abi.slots_at("Ep", 5))
    assert rows["Compile"]["absent_reason"] == "needs v6"

    old = plugin_info(plugins.example[5], api_version=2)
    f = old["factories"][0]
    assert (f["declared_version"], f["negotiated_version"]) == (5, 2)
    present = {name for name, row in _slots(old, "Ep").items() if row["present"]}
    assert present == set(abi.slots_at("Ep", 2))


def test_example_v6_shows_the_compile_slot(plugins):
    info = plugin_info(plugins.example[6])
    rows = _slots(info, "Ep")
    assert {name for name, row in rows.items() if row["present"]} == set(abi.slots_at("Ep", 6))
    assert all(row["present"] for row in _slots(plugin_info(plugins.example[7]), "Ep").values())
    assert (rows["Compile"]["since"], rows["Compile"]["required"]) == (6, False)
    text = format_plugin_info(info)
    compile_line = next(ln for ln in text.splitlines() if ln.split() and ln.split()[0] == "Compile")
    assert compile_line.split()[1:] == ["6", "no", "yes"]
    older = format_plugin_info(plugin_info(plugins.example[6], api_version=5))
    compile_line = next(ln for ln in older.splitlines() if ln.split() and ln.split()[0] == "Compile")
    assert compile_line.split()[1:] == ["6", "no", "no", "(needs", "v6)"]


def test_the_ep_is_released(plugins):
    rt_name = plugins.example_module(4)
    plugin_info(plugins.example[4])
    rt = sdk.runtime(rt_name)
    assert rt.record.live["Ep"] == 0
    assert rt.record.live["EpFactory"] == 0


def test_c_plugin(c_plugin):
    info = plugin_info(c_plugin)
    [f] = info["factories"]
    assert (f["ep_name"], f["declared_version"], f["negotiated_version"]) == ("ExampleCEP", abi.ABI_VERSION, abi.ABI_VERSION)
    rows = _slots(info, "Ep")
    assert {n for n, r in rows.items() if r["present"]} == {"GetName", "GetCapability", "CreateKernel",
                                                            "IsConcurrentRunSupported", "Compile"}
    assert rows["ReplayGraph"]["absent_reason"] == "NULL"


def test_format_is_an_aligned_table(plugins):
    text = format_plugin_info(plugin_info(plugins.example[3]))
    lines = text.splitlines()
    assert lines[0] == f"plugin: {plugins.example[3]}"
    assert "factory ExampleEP" in lines
    assert re.search(r"^  negotiated ABI  3$", text, re.M)
    start = next(i for i, ln in enumerate(lines)
                 if ln.startswith("  Ep (declared v3, negotiated v3, struct_size "))
    header, rows = lines[start + 1], lines[start + 2:]
    assert [r.split()[0] for r in rows] == list(abi.since_table()["Ep"])
    # Every column starts where its heading does.
    for heading in ("since", "required", "present"):
        col = header.index(heading)
        assert all(r[col - 1] == " " and r[col] != " " for r in rows), heading
    release = next(ln for ln in lines if ln.split() and ln.split()[0] == "ReleaseCapturedGraph")
    assert release.split()[1:] == ["4", "no", "no", "(needs", "v4)"]
    replay = next(ln for ln in lines if ln.split() and ln.split()[0] == "ReplayGraph")
    assert replay.split()[1:] == ["3", "no", "yes"]


def test_unloadable_path(tmp_path):
    path = tmp_path / "libnothing.so"
    expected = f"^plugin '{re.escape(os.path.realpath(path))}': no such file$"
    with pytest.raises(PluginLoadError, match=expected):
        plugin_info(path)
