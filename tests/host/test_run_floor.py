"""The cheaper per-run pieces keep the behaviour of what they replace: OpenBLAS's counts set directly
only where threadpoolctl would set them (host/runtime/threads._handles), and floating-point errors
ignored in a CPU segment exactly as under np.errstate(all="ignore") (host/runtime/fp_errors.py)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from threadpoolctl import OpenBLASController, ThreadpoolController

from host.runtime import threads
from host.runtime.fp_errors import ignore_fp_errors, restore_fp_errors


def _openblas():
    libs = [lib for lib in ThreadpoolController().select(user_api="blas").lib_controllers
            if threads._openblas_functions(lib) is not None]
    if not libs:
        pytest.skip("no OpenBLAS with its own threads in this process (the direct calls are for it only)")
    return libs[0]


def test_direct_openblas_calls_set_the_count_threadpoolctl_reads():
    lib = _openblas()
    get, set_count = threads._handles(lib)
    before = lib.get_num_threads()
    try:
        assert set_count(1) is False  # no thread took threadpoolctl's control of OpenBLAS
        assert lib.get_num_threads() == get() == 1
        set_count(2)
        assert lib.get_num_threads() == get() == 2
    finally:
        lib.set_num_threads(before)
        OpenBLASController.clear_controlling_thread()


def test_a_thread_holding_openblas_control_is_respected_as_threadpoolctl_does():
    """While another live thread controls OpenBLAS (its threadpool_limits block), threadpoolctl ignores
    other threads' settings; the direct path must not override it either."""
    lib = _openblas()
    if getattr(type(lib), "_SHARED_STATE", None) is None:
        pytest.skip("this threadpoolctl has no controlling thread (before 3.8)")
    _, set_count = threads._handles(lib)
    before = lib.get_num_threads()
    holding, done = threading.Event(), threading.Event()

    def hold():
        lib.set_num_threads(before)  # takes control
        holding.set()
        done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        holding.wait(10)
        assert type(lib)._SHARED_STATE.controlling_thread is holder
        assert set_count(before + 1) is True  # went through threadpoolctl, which did nothing
        assert lib.get_num_threads() == before
    finally:
        done.set()
        holder.join()
        OpenBLASController.clear_controlling_thread(force=True)
        lib.set_num_threads(before)
        OpenBLASController.clear_controlling_thread()


def test_libraries_other_than_openblas_go_through_threadpoolctl():
    class FakeLib:  # threadpoolctl's LibController surface, as tests/host/test_threads.py fakes it
        internal_api = "mkl"
        num_threads = 3

        def get_num_threads(self):
            return self.num_threads

        def set_num_threads(self, n):
            self.num_threads = n

    lib = FakeLib()
    get, set_count = threads._handles(lib)
    assert set_count(5) is True and get() == 5 == lib.num_threads


def _divide_by_zero():
    return np.float32(1) / np.zeros(1, np.float32)


@pytest.mark.parametrize("outside", [{}, {"divide": "raise"}, {"all": "warn"}])
def test_fp_errors_are_ignored_inside_and_the_callers_state_comes_back(outside):
    with np.errstate(**outside):
        expected = np.geterr()
        token = ignore_fp_errors()
        try:
            inside = np.geterr()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                _divide_by_zero()  # neither a warning nor an error
        finally:
            restore_fp_errors(token)
        assert inside == {"divide": "ignore", "over": "ignore", "under": "ignore", "invalid": "ignore"}
        assert np.geterr() == expected
        if outside.get("divide") == "raise":
            with pytest.raises(FloatingPointError):
                _divide_by_zero()
