"""A CPU segment's compiled calls recorded once per input signature and replayed (issue 28).

On a small CNN a run is a few dozen compiled calls of a few microseconds each, and the Python around each
of them (the run loop, the chain's checks, NumPy's allocation, cffi pointers) costs as much again:
MobileNetV3 at batch 1 spent about 110 of its 260 us there. A segment whose steps are the compiled
convolutions and their chains (the kernels in REPLAYED) can run as those calls alone, on the same
buffers, every run:

1. **Record** (the signature's second run; the first made the kernels' per-shape closures): the segment
   runs as usual on private copies of its entering values, with `native.LIB` and `native.ptr` wrapped so
   that every compiled call is noted with its arguments (the cffi pointers keep their arrays alive) and
   every pointer with its array. A step is *replayed* when its kernel is in REPLAYED, it made at least
   one call and each of its outputs is an array its calls were given; any other step is *rerun*: its
   kernel runs each time on the recorded arrays, and its outputs are copied into the recorded ones.
2. **Check**: the segment runs once as usual and once replayed, on inputs made different from the
   recorded ones (floats scaled and shifted, integers rolled); the replay is kept only when every
   value the segment hands on has the same bits both ways. Work outside the recorded calls that depends
   on the input would show there.
3. **Replay** (later runs of the signature): the entering values copied into the private copies, the
   calls made with their recorded arguments (a call returning another status than recorded stops the
   replay and the segment runs as usual), rerun steps run, and the values handed on copied out (a
   caller may keep them; the recorded arrays are reused by the next run).

Not done: with a profiler (each node keeps its event), for segments with hoisted nodes or escaping
values, non-array entering values, more than MAX_BYTES of recorded arrays, while another thread holds
the segment's replay (that run goes the usual way), or while `native.use` has swapped in another library
than the one ephost loaded (tests' spies count the usual run's calls). At most MAX_SIGNATURES signatures per segment keep
their recordings (the oldest is dropped).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from host.cpu_ep import native
from host.runtime.fp_errors import ignore_fp_errors, restore_fp_errors

__all__ = ["ENABLED", "MAX_BYTES", "REPLAYED", "SegmentReplay", "stats"]

ENABLED = True  # False: no segment records (tests compare against the usual run)
MAX_BYTES = 32 << 20  # recorded arrays per signature: beyond, compiled calls are not what a run costs
MAX_SIGNATURES = 4
MAX_SEEN = 1024  # signatures whose usual runs are counted (before their recording)
# Kernels whose compiled path is the whole of their work: an allocation and compiled calls (host/cpu_ep).
REPLAYED = frozenset({"_EpilogueChain", "_SqueezeExcite", "Conv"})
_FAILED = object()  # a signature whose recording was refused
_RETRY = object()  # a recording that met an error on its input

stats = {"recorded": 0, "refused": 0, "replayed": 0, "stopped": 0}  # per process (tests read them)


class _Recorder:
    """Stands for native.LIB (and its `ptr`) while a segment records: the recording thread's calls are
    noted (function, arguments, result) and its pointers mapped to their arrays; another thread's pass
    through unnoted."""

    def __init__(self, lib, ptr):
        self._lib = lib
        self._ptr = ptr
        self._thread = threading.get_ident()
        self.calls: list[tuple] = []
        self.arrays: dict[int, tuple] = {}  # id(pointer) -> (pointer, its array)

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not callable(fn):
            return fn
        calls, thread, get_ident = self.calls, self._thread, threading.get_ident

        def call(*args):
            result = fn(*args)
            if get_ident() == thread:
                calls.append((fn, args, result))
            return result

        return call

    def ptr(self, array):
        p = self._ptr(array)
        if threading.get_ident() == self._thread:
            self.arrays[id(p)] = (p, array)
        return p

    def given(self, first: int) -> list:
        """The arrays given to the calls from index `first` on."""
        found = []
        for _, args, _ in self.calls[first:]:
            found += [self.arrays[id(a)][1] for a in args if id(a) in self.arrays]
        return found


class _Program:
    """One signature's recording: actions in step order, the arrays they use, what is handed on."""

    def __init__(self, entering: dict, actions: list, held: dict, kept: tuple, nbytes: int):
        self.entering = entering  # vid -> private copy the recorded calls read
        self.actions = actions    # ("calls", [(fn, args, result)]) or ("rerun", step)
        self.held = held          # vid -> recorded array (every value a rerun step reads or writes)
        self.kept = kept          # vids handed on (copied out at each replay)
        self.nbytes = nbytes


class SegmentReplay:
    """The recordings of one CpuSegment (see the module docstring)."""

    def __init__(self, segment):
        self.segment = segment
        self._programs: OrderedDict = OrderedDict()  # signature -> _Program, or _FAILED
        self._seen: dict = {}  # signature -> usual runs so far
        self._lock = threading.Lock()

    def run(self, values: list) -> bool:
        """Run the segment on `values` by its recording (True), or leave the run to the caller (False)."""
        if not ENABLED or native.LIB is None or native.LIB is not native.LOADED_LIB:
            return False  # a library swapped in by native.use (a test's spy counting calls) runs as usual
        key = self._signature(values)
        if key is None:
            return False
        program = self._programs.get(key)
        if program is _FAILED:
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if program is None:
                return self._maybe_record(key, values)
            return self._replay(program, values)
        finally:
            self._lock.release()

    def _signature(self, values: list):
        key = []
        for vid in self.segment.entering:
            v = values[vid]
            if type(v) is not np.ndarray:
                return None
            key.append((v.shape, v.dtype))
        return tuple(key)

    # -- recording --------------------------------------------------------------------------------------
    def _maybe_record(self, key, values: list) -> bool:
        seen = self._seen.get(key, 0) + 1
        if len(self._seen) >= MAX_SEEN:  # a stream of distinct shapes must not grow this without bound
            self._seen.clear()
        self._seen[key] = seen
        if seen < 2:  # the first run makes the kernels' per-shape closures
            return False
        program = self._record(values)
        if program is _RETRY:  # a step failed on this input: the usual run reports it; record on a later one
            self._seen[key] = 1
            return False
        if program is not None and not self._agrees(program, values):
            program = None
        self._keep(key, program)
        if program is None:
            stats["refused"] += 1
            return False
        stats["recorded"] += 1
        return self._replay(program, values)

    def _keep(self, key, program) -> None:
        self._programs[key] = program if program is not None else _FAILED
        while len(self._programs) > MAX_SIGNATURES:
            self._programs.popitem(last=False)

    def _record(self, values: list):
        seg = self.segment
        lib, real_ptr = native.LIB, native.ptr
        recorder = _Recorder(lib, real_ptr)
        entering = {vid: np.array(values[vid], copy=True, order="C") for vid in seg.entering}
        work = list(values)
        for vid, arr in entering.items():
            work[vid] = arr
        actions, held = [], dict(entering)  # every value a replay writes or a rerun step reads (constants apart)
        native.LIB, native.ptr = recorder, recorder.ptr
        fp_state = ignore_fp_errors()
        try:
            for step in seg.steps:
                first = len(recorder.calls)
                seg.run_step(step, work, free=False)
                outputs = [v for v in step[4] if v >= 0]
                made = recorder.calls[first:]
                given = recorder.given(first)
                if (made and type(step[0].kernel).__name__ in REPLAYED
                        and all(any(work[v] is a for a in given) for v in outputs)):
                    actions.append(("calls", made))
                else:  # its outputs go to arrays of this recording: the next steps' calls read those
                    actions.append(("rerun", step))
                    for v in outputs:
                        if type(work[v]) is np.ndarray:
                            work[v] = np.array(work[v], copy=True, order="C")
                for v in outputs:
                    held[v] = work[v]
        except Exception:  # noqa: BLE001 - the usual run reports it: nothing is recorded
            return _RETRY
        finally:
            native.LIB, native.ptr = lib, real_ptr
            restore_fp_errors(fp_state)
        kept = tuple(v for v in seg.kept if v in held)
        if any(type(held[v]) is not np.ndarray for v in (*kept, *held)):
            return None
        nbytes = sum(a.nbytes for a in held.values())
        if nbytes > MAX_BYTES or not any(kind == "calls" for kind, _ in actions):
            return None
        return _Program(entering, actions, held, kept, nbytes)

    def _agrees(self, program: _Program, values: list) -> bool:
        """The usual run and the replay give the same bits on inputs unlike the recorded ones, the replay
        starting from recorded arrays filled with garbage: work it skips cannot hide behind what the last
        run left there."""
        other = list(values)
        for vid in self.segment.entering:
            changed = _unlike(values[vid])
            if changed is None:
                return False
            other[vid] = changed
        usual = list(other)
        try:
            fp_state = ignore_fp_errors()
            try:
                for step in self.segment.steps:
                    self.segment.run_step(step, usual, free=False)
            finally:
                restore_fp_errors(fp_state)
            _poison(program)
            replayed = list(other)
            if not self._replay(program, replayed, count=False):
                return False
        except Exception:  # noqa: BLE001 - a step that fails on the changed input: no replay
            return False
        for vid in program.kept:
            a, b = usual[vid], replayed[vid]
            if type(a) is not np.ndarray or a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.tobytes() != b.tobytes():
                return False
        return True

    # -- replay -----------------------------------------------------------------------------------------
    def _replay(self, program: _Program, values: list, count: bool = True) -> bool:
        for vid, arr in program.entering.items():
            src = values[vid]
            if type(src) is not np.ndarray or src.shape != arr.shape or src.dtype != arr.dtype:
                return False
            np.copyto(arr, src)
        held = program.held
        fp_state = ignore_fp_errors()
        try:
            for kind, what in program.actions:
                if kind == "calls":
                    for fn, args, result in what:
                        if fn(*args) != result:
                            stats["stopped"] += 1
                            return False  # nothing handed on yet: the usual run starts over
                elif not self._rerun(what, held, values):
                    stats["stopped"] += 1
                    return False
        except Exception:  # noqa: BLE001 - the usual run starts over and reports it with the node's name
            stats["stopped"] += 1
            return False
        finally:
            restore_fp_errors(fp_state)
        for vid in program.kept:
            values[vid] = held[vid].copy()
        if count:
            stats["replayed"] += 1
        return True

    @staticmethod
    def _rerun(step, held: dict, values: list) -> bool:
        _, run, gather, _, outputs, _ = step
        outs = run(*gather(_Held(held, values)))
        for vid, out in zip(outputs, outs):
            if vid < 0:
                continue
            target = held[vid]
            out = np.asarray(out) if isinstance(out, np.generic) else out
            if type(out) is not np.ndarray or out.shape != target.shape or out.dtype != target.dtype:
                return False
            np.copyto(target, out)
        return True


class _Held:
    """What a rerun step's getters index like the run's value list: the recorded arrays, and the run's own
    values (initializers) for the rest."""

    __slots__ = ("held", "values")

    def __init__(self, held: dict, values: list):
        self.held, self.values = held, values

    def __getitem__(self, vid):
        arr = self.held.get(vid)
        return self.values[vid] if arr is None else arr


def _poison(program: _Program) -> None:
    """Fill the recorded arrays the segment computes (not its entering copies, nor what shares their
    memory) with values no run makes: NaN, or 0x5A bytes."""
    inputs = list(program.entering.values())
    for vid, arr in program.held.items():
        if vid in program.entering or any(np.may_share_memory(arr, x) for x in inputs):
            continue
        if arr.dtype.kind in "fc":
            arr.fill(np.nan)
        elif arr.flags.c_contiguous:
            arr.view(np.uint8).fill(0x5A)
        else:
            arr.fill(0)


def _unlike(v):
    """An array of v's shape and type with other contents (None where none can be made)."""
    if type(v) is not np.ndarray or v.size == 0:
        return None
    if v.dtype.kind == "f":
        out = (v.astype(np.float64) * 0.75 + 0.5).astype(v.dtype)
    elif v.dtype.kind in "iub" and v.size > 1:
        out = np.roll(v.reshape(-1), 1).reshape(v.shape)
    else:
        return None
    return None if np.array_equal(out, v) and v.dtype.kind != "f" else out
