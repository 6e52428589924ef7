"""What a plugin library offers this host, without running a model (`ephost plugin-info PATH`).

The plugin is registered in a fresh Environment under a temporary name. For each factory the
report gives its names and versions, its devices, and every slot of the tables that can be
reached without a model: the EpFactory table, and the Ep table of an EP created with no options
on the first device (released right after). A slot is *present* when the host may call it: the
negotiated version and the table's struct_size cover it and the pointer is not NULL.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import abi
from host.errors import EpError, EphostError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from host.plugins.loader import Factory, PluginRegistration, Slots, negotiate

_NAMES = itertools.count(1)
_DEVICE_TYPES = {abi.DEVICE_CPU: "CPU", abi.DEVICE_GPU: "GPU"}


def _absent_reason(slots: Slots, name: str, since: int) -> str | None:
    if slots.has(name):
        return None
    if since > slots.negotiated:
        return f"needs v{since}"
    if slots.struct_size < ffi.offsetof(slots.table, name) + ffi.sizeof("void*"):
        return "beyond struct_size"
    return "NULL"


def _slot_rows(slots: Slots) -> list[dict]:
    rows = []
    for name, (since, required) in abi.since_table()[slots.table].items():
        reason = _absent_reason(slots, name, since)
        rows.append({"slot": name, "since": since, "required": required, "present": reason is None,
                     "absent_reason": reason})
    return rows


def _table(slots: Slots) -> dict:
    return {"declared_version": slots.declared, "negotiated_version": slots.negotiated,
            "struct_size": slots.struct_size, "slots": _slot_rows(slots)}


def _ep_table(reg: PluginRegistration, f: Factory) -> dict:
    """The Ep table of an EP made with no options on the factory's first device."""
    if not f.devices:
        return {"error": "the factory reports no device, so no EP can be created"}
    out = ffi.new("Ep**")
    owner = f"EP '{f.name}' of plugin '{reg.name}' ({reg.path})"
    try:
        status = f.slots.CreateEp(f.ptr, f.device_structs, 1, ffi.NULL, 0, ffi.NULL, reg.logger, out)
        hostapi.check(status, f"{owner}: CreateEp", EpError)
        return _table(negotiate("Ep", out[0], reg.env.api_version, owner))
    except EphostError as exc:
        return {"error": str(exc)}
    finally:
        if out[0] != ffi.NULL:
            f.slots.ReleaseEp(f.ptr, out[0])


def _factory(reg: PluginRegistration, f: Factory) -> dict:
    return {
        "ep_name": f.name,
        "vendor": f.vendor,
        "plugin_version": f.plugin_version,
        "declared_version": f.slots.declared,
        "negotiated_version": f.negotiated,
        "devices": [{"device_type": _DEVICE_TYPES.get(d.device_type, str(d.device_type)),
                     "device_id": d.device_id, "vendor_id": d.vendor_id, "name": d.name,
                     "memory": d.memory_name} for d in f.devices],
        "tables": {"EpFactory": _table(f.slots), "Ep": _ep_table(reg, f)},
    }


def plugin_info(path: str | Path, api_version: int = abi.ABI_VERSION) -> dict:
    """Register the plugin at `path` in a fresh Environment serving `api_version` and describe it.

    Raises PluginLoadError (or AbiVersionError) when the library cannot be registered.
    """
    with Environment(api_version=api_version) as env:
        reg = env.register_plugin(f"plugin-info-{next(_NAMES)}", path)
        return {
            "path": reg.path,
            "host_api_version": api_version,
            "host_abi_range": [abi.ABI_MIN_VERSION, abi.ABI_VERSION],
            "factories": [_factory(reg, f) for f in reg.factories],
        }


def _columns(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_plugin_info(info: dict) -> str:
    """An aligned text report of `plugin_info()`."""
    lines = [f"plugin: {info['path']}",
             f"host API version: {info['host_api_version']} "
             f"(supports {info['host_abi_range'][0]}..{info['host_abi_range'][1]})"]
    for f in info["factories"]:
        lines.append("")
        lines.append(f"factory {f['ep_name']}")
        lines += _columns([["vendor", f["vendor"]],
                           ["plugin version", f["plugin_version"] or "-"],
                           ["declared ABI", str(f["declared_version"])],
                           ["negotiated ABI", str(f["negotiated_version"])],
                           ["devices", str(len(f["devices"]))]])
        if f["devices"]:
            rows = [["#", "type", "id", "vendor", "name", "memory"]]
            rows += [[str(i), d["device_type"], str(d["device_id"]), f"{d['vendor_id']:#06x}", d["name"],
                      d["memory"]] for i, d in enumerate(f["devices"])]
            lines += _columns(rows, indent="    ")
        for name, table in f["tables"].items():
            lines.append("")
            if "error" in table:
                lines.append(f"  {name}: not available: {table['error']}")
                continue
            lines.append(f"  {name} (declared v{table['declared_version']}, "
                         f"negotiated v{table['negotiated_version']}, struct_size {table['struct_size']})")
            rows = [["slot", "since", "required", "present"]]
            rows += [[s["slot"], str(s["since"]), "yes" if s["required"] else "no",
                      "yes" if s["present"] else f"no ({s['absent_reason']})"] for s in table["slots"]]
            lines += _columns(rows, indent="    ")
    return "\n".join(lines)
