"""run() on captured graphs, one per bucket: shape buckets with graph capture (docs/dynamic_shapes.md).

With `session.ephost.shape_buckets` set and an EP that captures graphs, `InferenceSession.run` pads
the feeds to a bucket and, instead of running eagerly, replays that bucket's graph: per thread and
padded shape, the session keeps staging buffers on the capturing EP's device (allocated through its
allocator), binds them to an internal IOBinding, copies each run's feeds into them and the outputs
out of them. The first run of a shape runs eagerly (it learns the output shapes); the next ones go
through GraphCapture (warm-up, capture, then replays). The staging entries are bounded like the
graphs (`session.ephost.graphs_per_id`, LRU); evicting one releases its graph, whose buffers go.
Used only where the EP can release graphs (ABI v4) and the outputs are tensors.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from host.plugins.ep import CPU_LOCATION
from host.runtime.graph_capture import run_flags
from host.runtime.tensor import Allocation, DeviceTensor


class Staging:
    """One padded shape's fixed buffers and the binding that holds them."""

    def __init__(self, session, feeds: dict[int, np.ndarray], outputs: dict[str, object]):
        ep = session.capture.ep
        self.binding = session.io_binding()
        names = {v: k for k, v in session.plan.input_ids.items()}
        self.inputs = {names[vid]: _buffer(ep, v.shape, v.dtype) for vid, v in feeds.items()}
        for name, buf in self.inputs.items():
            self.binding.bind_input(name, buf)
        for name, value in outputs.items():
            self.binding.bind_output(name, _buffer(ep, value.shape, value.dtype))


def _buffer(ep, shape: tuple, dtype: np.dtype):
    """Memory from the capturing EP's allocator: host arrays it owns, or a DeviceTensor on its device."""
    dtype = np.dtype(dtype)
    if ep.location == CPU_LOCATION:
        return np.empty(shape, dtype)
    alloc = Allocation(ep.allocator, max(math.prod(shape) * dtype.itemsize, 1), None, ep.owner)
    return DeviceTensor(alloc.ptr, shape, dtype, ep.location[0], ep.location[1], alloc)


class BucketGraphs:
    """The staging entries of one session, per thread, least recently used first."""

    def __init__(self, session):
        self.session = session
        self.limit = max(session.capture.per_id, 1)
        self._tls = threading.local()

    @classmethod
    def create(cls, session) -> BucketGraphs | None:
        """None where replays cannot serve run(): no capture, an EP that cannot release graphs (its
        evicted staging would leave a graph on freed buffers), or outputs that are not tensors."""
        cap = session.capture
        if not cap.enabled or cap.ep.slots.ReleaseCapturedGraph is None or session.plan.object_ids:
            return None
        return cls(session)

    def run(self, feeds: dict[int, object], ids: list[int], ro):
        """The outputs `ids` of a run on `feeds` (already padded), as host arrays;
        None when this run cannot use a graph: gpu_graph_id=-1, feeds that are not host arrays, or
        disable_synchronize_execution_providers=1 (the outputs are read back right after the replay,
        which must then have finished)."""
        gid, sync = run_flags(ro)
        if gid == -1 or not sync or not all(isinstance(v, np.ndarray) for v in feeds.values()):
            return None
        entries = self._entries()
        shape = tuple(sorted((vid, v.shape, v.dtype.str) for vid, v in feeds.items()))
        entry = entries.get(shape)
        if entry is None:
            return self._first_run(entries, shape, feeds, ids, ro)
        entries.move_to_end(shape)
        ex = self.session.executor
        names = {v: k for k, v in self.session.plan.input_ids.items()}
        for vid, value in feeds.items():
            target = entry.inputs[names[vid]]
            if isinstance(target, np.ndarray):
                np.copyto(target, value)
            else:
                ex.copy_into(target, value, names[vid])
        self.session.capture.run(entry.binding, ro)
        outs = entry.binding.get_output_values()
        by_id = dict(zip((self.session.plan.output_ids[n] for n in entry.binding.output_names()), outs))
        # Views of the staging (host EPs): the caller gets copies, as for every view run() returns
        # (InferenceSession._run copies arrays that do not own their data; unpad's slices never do).
        return [ex.to_host(by_id[i]) for i in ids]

    def _first_run(self, entries: OrderedDict, shape: tuple, feeds: dict, ids: list[int], ro) -> list:
        """An eager run that gives the output shapes the new staging entry needs (evicting the oldest)."""
        session = self.session
        st = session._execute(feeds, {}, ro, graph_id="-1")
        outputs = {name: st.values[vid] for name, vid in session.plan.output_ids.items()}
        if len(entries) >= self.limit:
            _, old = entries.popitem(last=False)
            session.capture.forget(old.binding)
        entries[shape] = Staging(session, feeds, outputs)
        to_host = session.executor.to_host
        return [to_host(st.values[i]) for i in ids]

    def _entries(self) -> OrderedDict:
        entries = getattr(self._tls, "entries", None)
        if entries is None:
            entries = self._tls.entries = OrderedDict()
        return entries

    def close(self) -> None:
        self._tls = threading.local()
