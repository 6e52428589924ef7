"""Golden layouts: size and member offsets of every struct of ep_abi.h, for every ABI version.

`golden_layouts.json` is checked in. A released version's layout must never change, and a
struct may only grow at its end: each version's members keep their offsets in every later
version. `check_header_text()` applies both rules to any header text (tests feed it edited
copies of ep_abi.h); `compute()` gives the layouts of the header as it is.

    python -m abi.layouts --check     # exit 1 and list the differences if the header broke a rule
    python -m abi.layouts --write     # record a NEW version; refuses to rewrite a released one

Not imported by `import abi`: computing layouts builds one cffi FFI per version.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cffi

import abi
from abi.header import HEADER_PATH, Header, _struct_text, header, parse

GOLDEN_PATH = Path(__file__).with_name("golden_layouts.json")

# {version: {struct: {"size": int, "offsets": {member: int}}}}; JSON keys are strings.
Layouts = dict[str, dict[str, dict]]


class LayoutError(ValueError):
    """The header breaks a layout rule (a released layout changed, or a struct grew in the middle)."""


def cdef_of(h: Header, version: int) -> str:
    """cffi declarations of header `h` at `version` (what `abi.header.cdef` does for ep_abi.h)."""
    parts = [f"#define {k} {v}" for k, v in h.constants.items()]
    parts += list(h.opaque)
    parts += [_struct_text(s, version) for s in h.structs]
    parts += list(h.exports)
    return "\n".join(parts) + "\n"


def layout_of(ffi: cffi.FFI, h: Header, version: int) -> dict[str, dict]:
    """Size and member offsets of every struct of `h` as `ffi` (declared at `version`) lays it out."""
    out: dict[str, dict] = {}
    for s in h.structs:
        if not s.exists_at(version):
            continue  # a struct newer than `version` has no layout there
        ctype = f"struct {s.name}"
        out[s.name] = {
            "size": ffi.sizeof(ctype),
            "offsets": {m.name: ffi.offsetof(ctype, m.name) for m in s.cut(version)},
        }
    return out


def compute(versions=None) -> Layouts:
    """Layouts of ep_abi.h for `versions` (default: every supported version), from `abi.ffi_for`."""
    h = header()
    versions = abi.SUPPORTED_VERSIONS if versions is None else versions
    return {str(v): layout_of(abi.ffi_for(v), h, v) for v in versions}


def compute_from_text(text: str) -> Layouts:
    """Layouts of a header text for versions 1..its EP_ABI_VERSION (parsed afresh, nothing cached)."""
    h = parse(text)
    top = h.constants.get("EP_ABI_VERSION")
    if top is None:
        raise LayoutError("header text defines no EP_ABI_VERSION")
    low = h.constants.get("EP_ABI_MIN_VERSION", 1)
    result: Layouts = {}
    for v in range(low, top + 1):
        ffi = cffi.FFI()
        ffi.cdef(cdef_of(h, v))
        result[str(v)] = layout_of(ffi, h, v)
    return result


def load_golden(path: Path = GOLDEN_PATH) -> Layouts:
    with Path(path).open() as fh:
        return json.load(fh)["versions"]


def diff_released(golden: Layouts, current: Layouts) -> list[str]:
    """Differences between the recorded (released) versions and the current layouts."""
    problems = []
    for v, structs in golden.items():
        now = current.get(v)
        if now is None:
            problems.append(f"v{v}: released version is no longer described by the header")
            continue
        for name, want in structs.items():
            got = now.get(name)
            if got is None:
                problems.append(f"v{v}: struct {name} disappeared")
                continue
            if got["size"] != want["size"]:
                problems.append(f"v{v}: sizeof({name}) is {got['size']}; released as {want['size']}")
            if list(got["offsets"]) != list(want["offsets"]):
                problems.append(f"v{v}: members of {name} are {list(got['offsets'])}; "
                                f"released as {list(want['offsets'])}")
            for member, off in want["offsets"].items():
                if member in got["offsets"] and got["offsets"][member] != off:
                    problems.append(f"v{v}: offsetof({name}, {member}) is {got['offsets'][member]}; "
                                    f"released as {off}")
        for name in sorted(set(now) - set(structs)):
            problems.append(f"v{v}: struct {name} is new in a released version")
    return problems


def diff_append_only(current: Layouts) -> list[str]:
    """Members of version v must keep their offsets in every later version (growth at the end only)."""
    problems = []
    versions = sorted(current, key=int)
    for i, v in enumerate(versions):
        for later in versions[i + 1:]:
            for name, lay in current[v].items():
                newer = current[later].get(name)
                if newer is None:
                    problems.append(f"v{later}: struct {name} of v{v} disappeared")
                    continue
                for member, off in lay["offsets"].items():
                    got = newer["offsets"].get(member)
                    if got != off:
                        problems.append(f"v{later}: offsetof({name}, {member}) is {got}; v{v} has {off} "
                                        f"(a member was inserted before it, not appended)")
    return problems


def diff_since_order(h: Header) -> list[str]:
    """Since tags must never decrease along a struct: a newer member after an older one means an insert."""
    problems = []
    for s in h.structs:
        for prev, cur in zip(s.members, s.members[1:]):
            if cur.since < prev.since:
                problems.append(f"{s.name}.{cur.name} (since {cur.since}) follows {s.name}.{prev.name} "
                                f"(since {prev.since}); members may only be appended")
    return problems


def check_header_text(text: str, golden: Layouts | None = None) -> list[str]:
    """Every layout rule applied to a header text; an empty list means it is compatible."""
    golden = load_golden() if golden is None else golden
    h = parse(text)
    current = compute_from_text(text)
    return diff_since_order(h) + diff_released(golden, current) + diff_append_only(current)


def merged_for_write(golden: Layouts, current: Layouts) -> Layouts:
    """Golden layouts with the versions that are new in `current` added; released ones must not move."""
    problems = diff_released(golden, current) + diff_append_only(current)
    if problems:
        raise LayoutError("refusing to rewrite released layouts:\n  " + "\n  ".join(problems))
    merged = dict(golden)
    for v, lay in current.items():
        merged.setdefault(v, lay)
    return dict(sorted(merged.items(), key=lambda kv: int(kv[0])))


def write(path: Path, layouts: Layouts) -> None:
    doc = {
        "comment": "Generated by `python -m abi.layouts --write`; released versions must never change.",
        "versions": layouts,
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare the header with the golden layouts")
    mode.add_argument("--write", action="store_true", help="record versions that are new in the header")
    p.add_argument("--golden", type=Path, default=GOLDEN_PATH, help="golden JSON file (default: %(default)s)")
    args = p.parse_args(argv)
    golden = load_golden(args.golden) if args.golden.exists() else {}
    text = HEADER_PATH.read_text()
    if args.check:
        problems = check_header_text(text, golden)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    try:
        merged = merged_for_write(golden, compute_from_text(text))
    except LayoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    added = sorted(set(merged) - set(golden), key=int)
    write(args.golden, merged)
    print(f"{args.golden}: versions {', '.join(merged)}; added: {', '.join(added) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
