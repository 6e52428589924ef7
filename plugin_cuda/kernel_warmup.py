"""A per-node CUDA kernel's first call, made at session creation (issue 29: run 1 as fast as run 100).

The per-node kernels (plugin_cuda/kernels, the nodes outside compiled partitions) run CuPy code
that CuPy compiles with NVRTC at its first call per dtype and layout: 0.48 s of BERT's run 1 on the
H100 (its embedding Gathers, Casts, Wheres), when CuPy's disk cache is cold. A node whose inputs
all have known, non-empty shapes and types is therefore run once when its kernel is made, on the
stream the session's first run will get (CudaEp.first_stream), with zero-filled inputs (zero: a
valid index for every Gather-like op) and scratch outputs, freed after the stream synchronises.
Any failure is ignored: the kernel is left as it was and its first real call does the work.
Not done on a caller's `user_compute_stream` or once a run has started. A warm-up that succeeds
leaves a recipe that a saved context carries, with CuPy's compiled kernels for it (cupy_cache.py), so
that a session made from it loads the same CuPy code early, in a background thread
(kernel_prefetch.py), which a warm-up waits for first.
"""

from __future__ import annotations

import numpy as np

from abi.dtypes import to_numpy

__all__ = ["run", "stats", "warm_up"]

stats = {"warmed": 0, "failed": 0, "skipped": 0, "prefetched": 0}  # kernels, per process (tests read them)


def warm_up(ep, graph, node, adapter) -> bool:
    """Run `adapter`'s kernel once on zeros (see the module docstring); True when it did."""
    from plugin_cuda import cupy_cache, kernel_prefetch

    first = getattr(ep, "first_stream", None)  # None: a stand-in EP (CPU tests)
    state = None if first is None or ep.opts.has_user_compute_stream else first()
    specs = input_specs(graph, node) if state is not None else None
    if state is None or specs is None:
        stats["skipped"] += 1
        return False
    prefetch = getattr(ep, "prefetch", None)
    # A recipe only where a context will carry it or one was replayed (its JSON costs µs per kernel).
    wanted = getattr(ep, "saves_contexts", False) or (prefetch is not None and prefetch.done)
    recipe = kernel_prefetch.recipe_of(node, specs, adapter) if wanted else None
    if prefetch is not None:
        # A context's replay first: this call then finds the code compiled (no kernel compiled by two
        # threads). The call itself is still made: left to the replay alone, run 1 compiled the
        # per-node kernels again on the H200 (BERT 0.47 s), though the replay had run the same calls.
        if prefetch.covers(recipe):
            stats["prefetched"] += 1
        prefetch.join()
    fills = host_fills(graph, node, specs)
    try:
        if recipe is None:
            run(ep, adapter, specs, state, fills)
            payloads = {}
        else:  # what CuPy compiles or loads for it goes into the context too (cupy_cache.py)
            cupy_cache.install()
            with cupy_cache.recording() as payloads:
                run(ep, adapter, specs, state, fills)
    except Exception:  # noqa: BLE001 - see the module docstring: the first real call does it
        stats["failed"] += 1
        return False
    stats["warmed"] += 1
    kernel_prefetch.record(ep, recipe, payloads)
    return True


# The size a symbolic dim (dynamic batch, sequence) takes in a warm-up. CuPy compiles an elementwise
# kernel per dtype and per rank left after it merges contiguous axes and drops size-1 ones, so a
# dim of 1 warms a different variant from the one every later size > 1 runs: at a new shape of a
# dynamic export on a fresh machine, CuPy compiled the per-node kernels in front of BERT's plan
# again (274 ms at 8x128 after 1x16; docs/dynamic_shapes.md). 7: > 1, small, not a power of two.
PROBE_DIM = 7
# Ops warmed at probe sizes: CuPy code that checks its shapes (broadcasting, indexing) and fails
# cleanly on sizes that do not fit. A raw kernel fed sizes its inputs do not satisfy could read out
# of bounds, and a device fault ends the CUDA context, not just the warm-up.
PROBE_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Sqrt", "Exp", "Log", "Tanh", "Sigmoid", "Erf",
    "Relu", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Where",
    "Cast", "Gather", "Expand", "Unsqueeze", "Squeeze", "Reshape", "Concat", "Transpose", "Min", "Max",
})


def input_specs(graph, node) -> list | None:
    """(shape, dtype) per input (None for an absent optional one), symbolic dims set to PROBE_DIM
    for PROBE_OPS; None when a rank or a type is unknown, a dim is 0 (an index 0 would then be out
    of range) or symbolic in another op."""
    probe = node.op_type in PROBE_OPS and node.domain in ("", "ai.onnx")
    specs = []
    for v in node.inputs:
        if v < 0:
            specs.append(None)
            continue
        value = graph.values[v]
        shape = value.shape
        symbolic = shape is not None and any(d is None or d < 0 for d in shape)
        if shape is None or any(d == 0 for d in shape) or not value.elem_type or symbolic and not probe:
            return None
        specs.append((_probed(shape), to_numpy(value.elem_type)))
    return specs


def _probed(shape) -> tuple:
    """`shape` with each symbolic dim (None or negative) at PROBE_DIM."""
    return tuple(PROBE_DIM if d is None or d < 0 else int(d) for d in shape)


def host_fills(graph, node, specs) -> dict:
    """Input position -> the host value a warm-up feeds instead of zeros, where zeros would make the
    call fail before it reaches CuPy: an Expand whose target the host's shape program computes (BERT's
    token types and mask, [batch, seq]) takes its output's dims, symbolic ones at PROBE_DIM, so the
    broadcasting copy a later shape runs is compiled (87 ms of BERT's 8x128 first run otherwise)."""
    if node.op_type != "Expand" or len(specs) < 2 or specs[1] is None or len(specs[1][0]) != 1:
        return {}
    rank = specs[1][0][0]
    out = graph.values[node.outputs[0]].shape
    if out is None or len(out) != rank:
        return {1: np.full(rank, PROBE_DIM, np.int64)}
    return {1: np.array(_probed(out), np.int64)}


def run(ep, adapter, specs, state, fills=None) -> None:
    """`adapter`'s kernel once on zeros of `specs` on `state`'s stream, its blocks freed after.
    `fills`: host inputs given other values than zeros (host_fills)."""
    fills = fills or {}
    cp = ep.cupy
    host = adapter.kernel.host_inputs
    with ep.device, state.stream:
        ep.enter_run(state)  # the EP's allocator for every block made here, as in a run
        try:
            inputs = []
            for i, spec in enumerate(specs):
                const = adapter.constants.get(i)  # a host input's constant (shapes, axes)
                if spec is None or const is not None:
                    inputs.append(None if spec is None else const)
                elif i in fills:
                    inputs.append(fills[i])
                else:
                    inputs.append(np.zeros(*spec) if i in host else cp.zeros(*spec))
            adapter.kernel.compute(_Call(ep, adapter, inputs, state))
        finally:
            ep.leave_run()
        state.stream.synchronize()  # done before the blocks go back to the pool


class _Call:
    """What a kernel sees during compute (plugin.KernelCall), with outputs the kernel's own."""

    def __init__(self, ep, adapter, inputs, state):
        self.inputs = inputs
        self.num_outputs = len(adapter.present)
        self.cublas = state.cublas if adapter.needs_cublas else None
        self.cudnn = state.cudnn if adapter.needs_cudnn else None
        self._ep = ep
        self._present = adapter.present
        self._outs = {}

    def wants(self, index: int) -> bool:
        return index < len(self._present) and self._present[index]

    def output(self, index: int, shape, dtype):
        arr = self._outs.get(index)
        if arr is None:
            arr = self._outs[index] = self._ep.cupy.empty(tuple(int(d) for d in shape), np.dtype(dtype))
        return arr

    def scratch(self, nbytes: int):
        return self._ep.memory.malloc(nbytes)
