"""The CPU EP's run loop for plans whose every node is on the CPU EP.

The general executor path checks, per input, where the value lives and whether a stream must be
waited on, and `OpKernel.run` enters `np.errstate` per node: a few microseconds per node, which is
most of the time of a small model. With no plugin EP in the plan every value is a NumPy array in
host memory, so this loop hands inputs straight to each kernel's `_run`, under one `np.errstate`
for the whole run, and keeps `run`'s contract: failures become a KernelError naming the node,
NumPy scalars become arrays.
"""

from __future__ import annotations

import numpy as np

from host.errors import EpError, EphostError


def run_plan(nodes, values: list, keep: set[int], value_names: list[str]) -> None:
    """Runs plan `nodes` (all CPU EP) in order over `values` (indexed by value id); frees what each
    node's `frees` lists unless it is in `keep`."""
    ndarray = np.ndarray
    with np.errstate(all="ignore"):
        for node in nodes:
            kernel = node.kernel
            # A profiler (host/runtime/profiling.py) times a kernel by wrapping its `run` on the
            # instance: call that wrapper when it is there.
            fn = kernel.__dict__.get("run") or kernel._run
            args = [values[v] if v >= 0 else None for v in node.inputs]
            try:
                outs = fn(*args)
            except EphostError:
                raise
            except Exception as exc:
                missing = [value_names[v] for v in node.inputs if v >= 0 and values[v] is None]
                if missing:
                    raise EpError(f"value '{missing[0]}' was not produced") from exc
                raise kernel.failure(exc) from exc
            for vid, out in zip(node.outputs, outs):
                if vid >= 0:
                    values[vid] = out if type(out) is ndarray else np.asarray(out)
            for v in node.frees:
                if v not in keep:
                    values[v] = None
