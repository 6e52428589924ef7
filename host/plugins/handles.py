"""Opaque handles the host lends to plugins, each standing for a host object.

Statuses, kernel contexts, call frames, loggers, session options and open fuse collectors are
all pointers a plugin holds and hands back; the host finds its object from the pointer. One table
type keeps every such mapping with one rule:

- the pointer is a fresh one-byte cffi allocation owned by the table entry, so it stays valid (and
  unique) exactly as long as the entry;
- keys are the pointers themselves: cffi pointers hash and compare by address whatever their C type,
  so a handle cast to another type by the plugin still finds its object, with no cast per lookup;
- adding and removing take the table's lock; lookups are plain dict reads (atomic under the GIL),
  because they sit on the run path (every KernelContext_GetOutput crossing).
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class HandleTable(Generic[T]):
    """Pointers of C type `ctype` lent to plugins, each mapped to one host object."""

    def __init__(self, ffi, ctype: str) -> None:
        self._ffi = ffi
        self._ctype = ctype
        self._items: dict[object, tuple[T, object]] = {}
        self._lock = threading.Lock()

    def add(self, obj: T):
        """A new handle for `obj`; valid until `remove`."""
        holder = self._ffi.new("char[1]")
        handle = self._ffi.cast(self._ctype, holder)
        with self._lock:
            self._items[handle] = (obj, holder)
        return handle

    def bind(self, handle, obj: T) -> None:
        """Map a pointer the host already owns (a graph view's) to `obj` until `remove`."""
        with self._lock:
            self._items[handle] = (obj, None)

    def get(self, handle) -> T | None:
        """The object behind `handle`, or None for a pointer this table did not lend (or took back)."""
        item = self._items.get(handle)
        return None if item is None else item[0]

    def remove(self, handle) -> T | None:
        """Take the handle back; later lookups of it answer None. Unknown handles are ignored."""
        with self._lock:
            item = self._items.pop(handle, None)
        return None if item is None else item[0]

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["HandleTable"]
