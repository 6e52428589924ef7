"""run() for the calls that need none of the general path's per-run decisions.

A session whose plan is all on the CPU EP, without shape buckets, graph capture or profiling, called
with all its outputs (no names), no RunOptions and plain array feeds (host/runtime/plain_feeds.py),
does the same work at every run: `PlainRun` is that work, worked out once per session (the output
ids, which outputs are non-tensor values). Anything else, a bad feed included, answers None and the
caller takes the general path, which runs it or raises its usual error, so results and errors are
the general path's. At one row, the general path's front costs about as much as onnxruntime's whole
run of a small model (docs/quantization_ml.md, per-run cost).
"""

from __future__ import annotations

import numpy as np

from host.runtime import types


class PlainRun:
    """The plain run of one session (see the module doc); `of` says whether the session has one."""

    __slots__ = ("_session", "_plain", "_count", "_ids", "_objects", "_default_ro")

    def __init__(self, session, default_run_options):
        self._session = session
        self._plain = session._plain_inputs
        self._count = len(session.input_metas)
        self._ids = tuple(session._all_output_ids)
        self._objects = session.plan.object_ids
        self._default_ro = default_run_options

    @classmethod
    def of(cls, session, default_run_options) -> PlainRun | None:
        """The session's plain run, None where every run must take the general path."""
        if (session._profiling or session.buckets is not None or session.plan.eps or session.capture.enabled
                or len(session._plain_inputs) != len(session.input_metas)):
            return None
        return cls(session, default_run_options)

    def __call__(self, feeds) -> list | None:
        """The run's outputs, or None when these feeds need the general path."""
        if type(feeds) is not dict or len(feeds) != self._count:
            return None
        plain, fed = self._plain, {}
        for name, value in feeds.items():
            entry = plain.get(name)
            if entry is None or not entry.accepts(value):
                return None
            fed[entry.vid] = value
        session = self._session
        if session._closed:
            return None
        values = session._execute(fed, {}, self._default_ro).values
        return self._outputs(values, fed)

    def _outputs(self, values: list, fed: dict) -> list:
        """As the general path returns them: host values; arrays the caller's own (views of other
        arrays and feeds passed straight through are copied)."""
        out, objects = [], self._objects
        for vid in self._ids:
            value = values[vid]
            if vid in objects:
                out.append(types.host_value(value, self._session.executor.to_host))
                continue
            if type(value) is not np.ndarray:
                value = self._session.executor.to_host(value)
            if isinstance(value, np.ndarray) and (not value.flags.owndata or _is_feed(value, fed)):
                value = value.copy()
            out.append(value)
        return out


def _is_feed(value, fed: dict) -> bool:
    for v in fed.values():
        if value is v:
            return True
    return False


__all__ = ["PlainRun"]
