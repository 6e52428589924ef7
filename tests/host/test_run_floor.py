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


# -- run()'s plain path (host/runtime/plain_run.py) ------------------------------------------------

def _session(nodes, outputs, **options):
    from onnx import TensorProto, helper

    import host

    graph = helper.make_graph(nodes, "plain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, None]) for n in outputs])
    so = host.SessionOptions()
    for key, value in options.items():
        setattr(so, key, value)
    return host.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                 so)


def _passthrough_session(**options):
    """y: the feed itself (Identity); r: a view of it (Reshape); z: a new array."""
    from onnx import helper

    shape = helper.make_node("Constant", [], ["shape"], value_ints=[3, 2])
    nodes = [helper.make_node("Identity", ["x"], ["y"]), shape, helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Relu", ["x"], ["z"])]
    return _session(nodes, ["y", "r", "z"], **options)


X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2


def test_plain_path_runs_and_returns_the_callers_own_arrays():
    sess = _passthrough_session()
    assert sess._plain_run is not None

    def general_only(*_):
        raise AssertionError("the general path ran")

    sess._feeds = general_only  # a plain call must not reach it
    y, r, z = sess.run(None, {"x": X})
    np.testing.assert_array_equal(y, X)
    np.testing.assert_array_equal(r, X.reshape(3, 2))
    np.testing.assert_array_equal(z, np.maximum(X, 0))
    assert y is not X and not np.shares_memory(y, X) and not np.shares_memory(r, X)
    assert y.flags.owndata and r.flags.owndata
    assert sess.run([], {"x": X})[0] is not X


def test_plain_path_gives_what_the_general_path_gives():
    sess = _passthrough_session()
    plain = sess.run(None, {"x": X})
    general = sess.run(["y", "r", "z"], {"x": X})  # names: the general path
    for a, b in zip(plain, general):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("feeds", "message"), [
    ({"x": X.astype(np.float64)}, r"^input 'x': expected dtype float32"),
    ({"x": X, "extra": X}, r"^unknown input name\(s\) \['extra'\]; model inputs: \['x'\]$"),
    ({}, r"^missing input\(s\) \['x'\]; model inputs: \['x'\]$"),
])
def test_feeds_the_plain_path_refuses_get_the_general_paths_errors(feeds, message):
    from host.errors import InvalidArgument

    sess = _passthrough_session()
    with pytest.raises(InvalidArgument, match=message):
        sess.run(None, feeds)


def test_a_closed_session_still_refuses_to_run():
    from host.errors import InvalidArgument

    sess = _passthrough_session()
    sess.close()
    with pytest.raises(InvalidArgument, match=r"^this InferenceSession is closed$"):
        sess.run(None, {"x": X})


def test_profiling_sessions_take_the_general_path(tmp_path):
    sess = _passthrough_session(enable_profiling=True, profile_file_prefix=str(tmp_path / "p"))
    assert sess._plain_run is None
    np.testing.assert_array_equal(sess.run(None, {"x": X})[2], np.maximum(X, 0))
