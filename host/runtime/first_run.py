"""One-time host work a session's first run would do, done at its creation (issue 29: the first
run after loading is as fast as the hundredth).

- cffi parses a C type string (`ffi.new("EpCallFrame*")`) with pycparser the first time the process
  sees it, and with the ABI header's hundreds of typedefs in front that costs milliseconds per
  string (70 ms of a ResNet-50 run 1 on the H100 machine). The strings a run of a session with
  plugin EPs uses are parsed here; `tests/host/test_first_run.py` checks that run 1 parses none.
- threadpoolctl's scan of the loaded BLAS libraries (12 ms there) runs here instead of in run 1,
  after the session's plugins have loaded theirs.
"""

from __future__ import annotations

from cffi import CDefError

from host.plugins.hostapi import ffi
from host.runtime import threads

__all__ = ["RUN_TYPES", "prepare"]

# The C types of a run: call frames (compiled partitions), kernel contexts (per-node kernels),
# a thread's sync streams and the run options handed to OnRunStart/OnRunEnd.
RUN_TYPES = ("EpCallFrame", "EpCallFrame*", "EpFrameTensor[]", "EpKernelContext*", "EpKernelIO", "EpKernelIO*",
             "EpTensor[]", "EpSyncStream", "EpSyncStream**", "EpRunOptions", "EpRunOptions*", "int64_t[]")


def prepare(plan, bounds_blas: bool) -> None:
    """Parse the run's C types when `plan` has plugin EPs; scan the BLAS libraries when its runs are
    bounded (`bounds_blas`)."""
    if plan.eps:
        for name in RUN_TYPES:
            try:
                ffi.typeof(name)  # cached by cffi for the process
            # not declared (CDefError from an in-line FFI, ffi.error from an out-of-line one): no run uses it
            except (CDefError, getattr(ffi, "error", CDefError)):
                continue
    if bounds_blas:
        threads.POOLS.libraries()
