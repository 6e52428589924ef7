"""Device copies of the shape program's values, made once per input-shape signature (issue 23).

A value the host's shape program computes (position ids, a mask's scale, an expanded index) and a
device EP reads as data (not at an input the op reads on the host: abi/host_inputs.py) used to be
copied to the device at every run. The program hands every run of a signature the same read-only
array (shape_program.ShapeProgram.with_values), so a copy made once can be reused while that array
lives: the cache is keyed by (value id, device) and the array's identity, holds the array itself
(an id is never reused while its object is held), and keeps at most `capacity` arrays per key, the
least recently used going first, as the program's own cache does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class ProgramCopies:
    """Per (value id, location): the device copies of the last `capacity` arrays seen there."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.made = 0  # copies made (cache misses), for tests and profiles
        self._copies: dict[tuple, OrderedDict] = {}
        self._lock = threading.Lock()

    def get(self, vid: int, location, value):
        """The copy of `value` (the program's array) at `location`, or None."""
        with self._lock:
            entries = self._copies.get((vid, location))
            entry = None if entries is None else entries.get(id(value))
            if entry is None or entry[0] is not value:
                return None
            entries.move_to_end(id(value))
            return entry[1]

    def put(self, vid: int, location, value, moved):
        """Keep `moved` as the copy of `value`; returns the copy every caller must use (a racing
        thread's, when it stored one first)."""
        with self._lock:
            entries = self._copies.setdefault((vid, location), OrderedDict())
            entry = entries.get(id(value))
            if entry is not None and entry[0] is value:
                return entry[1]
            entries[id(value)] = (value, moved)
            self.made += 1
            while len(entries) > self.capacity:
                entries.popitem(last=False)
            return moved

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._copies.values())
