"""A static-shape plan's first run, done at session creation (issue 29: run 1 as fast as run 100).

What a plan's first call on a stream pays does not depend on the input values: its arena, its
packed launches, the stream's cuBLAS handle, the cuDNN setups and workspaces, and CUDA loading
(lazily, CUDA_MODULE_LOADING=LAZY being the default) the cuBLAS/cuDNN kernels the plan calls. So at
creation the plan runs once on the stream the session's first run will get (CudaEp.first_stream),
reading zero-filled inputs and writing scratch outputs, both freed right after. A failure here
changes nothing: the plan's instance is dropped and run 1 does the work, raising what it raised
before.

Not done: for a symbolic-shape partition (no signature is known before its first call), on a
caller's own stream (user_compute_stream: no work is queued there before the caller runs), or
once the host has taken the first stream.
"""

from __future__ import annotations

from contextlib import ExitStack

__all__ = ["warm_up"]

stats = {"warmed": 0, "failed": 0, "skipped": 0}  # plans, per process (tests read them)


def warm_up(ep, plan) -> bool:
    """Run `plan` once on the EP's first stream (see the module docstring); True when it did."""
    first = getattr(ep, "first_stream", None)  # None: a stand-in EP (CPU tests)
    state = None if first is None or ep.opts.has_user_compute_stream else first()
    if state is None:
        stats["skipped"] += 1
        return False
    try:
        _warm(ep, plan, state)
    except Exception:  # noqa: BLE001 - see the module docstring: run 1 does it, as before
        stats["failed"] += 1
        plan.forget_stream(state.ptr)
        return False
    stats["warmed"] += 1
    return True


def _warm(ep, plan, state) -> None:
    values = plan.prog.values
    cp = ep.cupy
    with ExitStack() as scope:
        scope.enter_context(ep.device)
        scope.enter_context(state.stream)  # the pool hands out blocks of this stream
        sizes = [max(values[v].nbytes, 1) for v in (*plan.prog.inputs, *plan.prog.outputs)]
        blocks = [ep.memory.malloc(n) for n in sizes]
        for block, n in zip(blocks, sizes):
            cp.cuda.runtime.memsetAsync(int(block.ptr), 0, n, state.ptr)
        ptrs = [int(b.ptr) for b in blocks]
        n_in = len(plan.prog.inputs)
        ep.enter_run(state)  # the run's allocator, as PlanFunction._run has it
        try:
            plan.warm(state.ptr, ptrs[:n_in], ptrs[n_in:])
        finally:
            ep.leave_run()
        state.stream.synchronize()  # done before the blocks go back to the pool
