"""Parse `ep_abi.h` into constants, structs and per-member since tags.

The header is the single source of truth; everything else (cffi declarations
for any version, the since-table, golden layouts) is derived from it here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

HEADER_PATH = Path(__file__).with_name("ep_abi.h")

_DEFINE = re.compile(r"^#define\s+(EP_\w+)\s+(-?\d+)\s*$")
_STRUCT_OPEN = re.compile(r"^(typedef\s+)?struct\s+(\w+)\s*\{\s*$")
_STRUCT_CLOSE = re.compile(r"^\}\s*(\w*)\s*;\s*$")
_MEMBER = re.compile(r"^(?P<decl>.+?;)\s*/\*\s*since\s+(?P<since>\d+)(?P<req>,\s*required)?\s*\*/\s*$")
_FUNC_PTR_NAME = re.compile(r"\(\s*\*\s*(\w+)\s*\)")
_PLAIN_NAME = re.compile(r"(\w+)\s*;$")
_OPAQUE = re.compile(r"^typedef\s+struct\s+(\w+)\s+(\w+)\s*;")
_EXPORT = re.compile(r"^EpStatus\*\s+\w+\(.*\);$")


@dataclass(frozen=True)
class Member:
    """One struct member: its C declaration, name and the version that added it."""

    decl: str
    name: str
    since: int
    required: bool
    is_slot: bool


@dataclass(frozen=True)
class Struct:
    """A struct of the header; a *table* starts with struct_size and version."""

    name: str
    members: tuple[Member, ...]
    typedef: bool

    @property
    def is_table(self) -> bool:
        names = [m.name for m in self.members[:2]]
        return names == ["struct_size", "version"]

    @property
    def since(self) -> int:
        """The version that added the struct: that of its oldest member."""
        return min(m.since for m in self.members)

    def exists_at(self, version: int) -> bool:
        return self.since <= version

    def cut(self, version: int) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.since <= version)


@dataclass(frozen=True)
class Header:
    constants: dict[str, int]
    opaque: tuple[str, ...]
    structs: tuple[Struct, ...]
    exports: tuple[str, ...]

    def struct(self, name: str) -> Struct:
        for s in self.structs:
            if s.name == name:
                return s
        raise KeyError(f"no struct {name!r} in ep_abi.h; known: {[s.name for s in self.structs]}")


def _member(line: str) -> Member | None:
    m = _MEMBER.match(line)
    if not m:
        return None
    decl = m.group("decl")
    fp = _FUNC_PTR_NAME.search(decl)
    name = fp.group(1) if fp else _PLAIN_NAME.search(decl).group(1)
    return Member(decl, name, int(m.group("since")), bool(m.group("req")), fp is not None)


def parse(text: str) -> Header:
    """Parse header text written in the one-member-per-line style of ep_abi.h."""
    constants: dict[str, int] = {}
    opaque: list[str] = []
    structs: list[Struct] = []
    exports: list[str] = []
    current: tuple[str, bool, list[Member]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if current is not None:
            close = _STRUCT_CLOSE.match(line)
            if close:
                structs.append(Struct(current[0], tuple(current[2]), current[1]))
                current = None
                continue
            member = _member(line)
            if member is None and line and not line.startswith("/*"):
                raise ValueError(f"ep_abi.h: member without a since tag in {current[0]}: {line!r}")
            if member is not None:
                current[2].append(member)
            continue
        if m := _DEFINE.match(line):
            constants[m.group(1)] = int(m.group(2))
        elif m := _STRUCT_OPEN.match(line):
            current = (m.group(2), bool(m.group(1)), [])
        elif m := _OPAQUE.match(line):
            opaque.append(line)
        elif _EXPORT.match(line):
            exports.append(line)
    return Header(constants, tuple(opaque), tuple(structs), tuple(exports))


@functools.lru_cache(maxsize=1)
def header() -> Header:
    return parse(HEADER_PATH.read_text())


def _struct_text(s: Struct, version: int) -> str:
    if not s.exists_at(version):
        # Newer than `version`: only its name exists, so older declarations stay byte-identical.
        return f"typedef struct {s.name} {s.name};" if s.typedef else f"struct {s.name};"
    body = "\n".join("  " + m.decl for m in s.cut(version))
    if s.typedef:
        return f"typedef struct {s.name} {{\n{body}\n}} {s.name};"
    return f"struct {s.name} {{\n{body}\n}};"


@functools.cache
def cdef(version: int, exports: bool = True) -> str:
    """cffi declarations of the ABI at `version`: each table cut at its last slot with since <= version."""
    h = header()
    parts = [f"#define {k} {v}" for k, v in h.constants.items()]
    parts += list(h.opaque)
    parts += [_struct_text(s, version) for s in h.structs]
    if exports:
        parts += list(h.exports)
    return "\n".join(parts) + "\n"
