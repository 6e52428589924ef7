"""Regression tests for the bugs the property tests found, one test each, smallest reproducer.

The comment above each test says what the bug was. A bug that is still open is marked
xfail(strict=True, reason=...): when it gets fixed, strict xfail fails the suite until the mark
(and any workaround a property test carries for it) is removed.
"""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from host.errors import GraphCaptureError, InvalidArgument
from host.plugins import hostapi
from host.runtime.session import InferenceSession, RunOptions
from plugin_cuda.options import OptionError, parse_options
from tests.conftest import built_plugin
from tests.property import harness as h


def chain_model() -> onnx.ModelProto:
    """Z = relu(X + Y) * X over (2, 3): every node on ExampleEP."""
    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZ")
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "chain", [x, y], [z]),
                             opset_imports=[helper.make_opsetid("", 17)])


def expected(x, y):
    return np.maximum(x + y, 0) * x


def bound(sess, x, y, z):
    b = sess.io_binding()
    b.bind_input("X", x)
    b.bind_input("Y", y)
    b.bind_output("Z", z)
    return b


def arrays(fill_x=1.0):
    return (np.full((2, 3), fill_x, np.float32), np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32))


@pytest.fixture
def env5():
    with h.example_env(5, [5]) as env:
        yield env


# ---- host/runtime/graph_capture.py ------------------------------------------------------------------------------
# Was: host/runtime/graph_capture.py GraphCapture.__init__ looks only at plan.eps: an EP asked to capture that got no
# node is dropped from the plan, and the capture request with it, silently (ALL_NODES_ON_EP says: refuse the
# session) (fixed in 4a23a5c).
def test_capture_requested_with_no_node_on_the_ep_is_refused(env5):
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    z = helper.make_tensor_value_info("Z", TensorProto.FLOAT, [3, 2])
    m = helper.make_model(helper.make_graph([helper.make_node("Transpose", ["X"], ["Z"], name="tr")], "g", [x], [z]),
                          opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(GraphCaptureError, match=r"^graph capture on ExampleEP requires all nodes on the EP; "
                                                r"offending node\(s\): 'tr' \(Transpose on CPUExecutionProvider\)"):
        InferenceSession(m, providers=[("ExampleEP", {"enable_graph": "1"})], env=env5).close()


# Was: host/runtime/graph_capture.py GraphCapture._replay stamps a verified binding with (id(binding), binding.version):
# a new IOBinding at a collected one's address with as many binds skips the buffer check and replays into the
# old buffers (fixed in 4a23a5c).
def test_replay_check_survives_binding_address_reuse(env5):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env5)
    try:
        x, y, z = arrays()
        s.run_with_iobinding(bound(s, x, y, z))  # warm-up and capture with x, y, z
        x2, y2, z2 = arrays(fill_x=2.0)
        b2 = None
        for _ in range(100):
            b = bound(s, x, y, z)
            s.run_with_iobinding(b)  # a replay: (id(b), b.version) is now "verified"
            old = id(b)
            del b  # no cycle: freed at once, and the next IOBinding most likely takes its address
            b2 = s.io_binding()
            if id(b2) == old:
                break
            b2 = None
        if b2 is None:
            pytest.skip("the allocator never reused a binding's address")
        b2.bind_input("X", x2)
        b2.bind_input("Y", y2)
        b2.bind_output("Z", z2)  # as many binds as the dead binding: the same stamp
        with pytest.raises(GraphCaptureError, match=r"^graph 0 was captured with input 'X' at a fixed buffer; it moved"):
            s.run_with_iobinding(b2)
    finally:
        s.close()


# Was: host/runtime/graph_capture.py GraphCapture.run (and InferenceSession.run) check gpu_graph_id only when the
# session captures; otherwise the raw value goes to the EP's OnRunStart, and ExampleEP fails with an untyped
# EpError(FAIL) (fixed in 4a23a5c).
@pytest.mark.parametrize("version", [2, 5])
def test_malformed_graph_id_is_invalid_argument_without_capture(version):
    # v2: no graph slots at all; v5: IsGraphCaptured left NULL. Both: capture off in the host.
    opts = {"enable_graph": "1"} if version == 2 else {"enable_graph": "1", "null_slots": "IsGraphCaptured"}
    with h.example_env(version, [version]) as env:
        s = InferenceSession(chain_model(), providers=[("ExampleEP", opts)], env=env)
        try:
            assert not s.capture.enabled
            ro = RunOptions()
            ro.add_run_config_entry("gpu_graph_id", "abc")
            with pytest.raises(InvalidArgument, match=r"^run option gpu_graph_id must be an integer >= -1"):
                s.run_with_iobinding(bound(s, *arrays()), ro)
        finally:
            s.close()


# ---- host/plugins/ep.py -----------------------------------------------------------------------------------------
# Was: host/plugins/ep.py PluginEp._create_ep registers the session options (SESSION_OPTIONS.make) before CreateEp and
# drops them only in close(): a refused CreateEp leaks the entry (fixed in 4a23a5c).
def test_refused_create_ep_leaves_no_session_options(env5):
    before = len(hostapi.SESSION_OPTIONS)
    for _ in range(3):
        with pytest.raises(InvalidArgument, match=r"unknown option\(s\) \['bogus'\] for ExampleEP"):
            InferenceSession(chain_model(), providers=[("ExampleEP", {"bogus": "1"})], env=env5)
    gc.collect()
    assert len(hostapi.SESSION_OPTIONS) == before


# Was: host/plugins/ep.py PluginEp._create_allocator appends a weakref.finalize per session to
# factory.allocator_finalizers and nothing prunes the dead ones until the plugin is unregistered: the list grows
# with every session (fixed in 4a23a5c).
def test_allocator_finalizers_do_not_accumulate(env5):
    factory = env5.plugin("ex5").factories[0]
    for _ in range(5):
        InferenceSession(chain_model(), providers=["ExampleEP"], env=env5).close()
    gc.collect()
    assert [f for f in factory.allocator_finalizers if f.alive] == []
    assert len(factory.allocator_finalizers) <= 1


# Was: host/plugins/ep.py _kv_array turns option keys/values into C strings without a check: an embedded NUL truncates
# the key ('ops\x00junk' is applied as 'ops') (fixed in 4a23a5c).
def test_option_key_with_nul_is_invalid_argument(env5):
    with pytest.raises(InvalidArgument, match=r"ops"):
        InferenceSession(chain_model(), providers=[("ExampleEP", {"ops\x00junk": "Add"})], env=env5).close()


# Was: host/plugins/ep.py _kv_array encodes option keys/values with str.encode(): a value UTF-8 cannot encode (a lone
# surrogate) raises a bare UnicodeEncodeError (fixed in 4a23a5c).
def test_option_value_not_encodable_is_invalid_argument(env5):
    with pytest.raises(InvalidArgument, match=r"min_runs"):
        InferenceSession(chain_model(), providers=[("ExampleEP", {"min_runs": "\ud800"})], env=env5).close()


# ---- host/plugins/loader.py, host/plugins/hostapi.py ------------------------------------------------------------------
# Was: host/plugins/loader.py PluginRegistration makes a logger per registration (hostapi.LOGGERS.make) and close()
# never drops it: LOGGERS grows forever (fixed in 4a23a5c).
def test_unregistering_releases_the_logger(env5):
    before = len(hostapi.LOGGERS)
    for i in range(3):
        env5.register_plugin(f"again{i}", built_plugin("example", 5))
        env5.unregister_plugin(f"again{i}")
    assert len(hostapi.LOGGERS) == before


# ---- tests/plugins/example_ep.py ---------------------------------------------------------------------------
# Was: tests/plugins/example_ep.py: with Ep.CreateAllocator NULL the host uses the factory's allocator, which
# has no EP (alloc.ep is None), so memory freed during a capture is released while the recorded graph still
# writes into it (use-after-free on every replay) (fixed in 4a23a5c).
def test_capture_with_factory_allocator_keeps_graph_memory(env5):
    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1", "null_slots": "CreateAllocator"})],
                         env=env5)
    try:
        x, y, z = arrays()
        b = bound(s, x, y, z)
        s.run_with_iobinding(b)  # capture: the intermediates A and B are freed during this run
        sentinels = [np.full(24, 0xAB, np.uint8) for _ in range(16)]  # 24 bytes: the size of A and B
        x[...] = 2.0
        s.run_with_iobinding(b)
        np.testing.assert_allclose(z, expected(x, y), rtol=1e-6)
        assert sum(int((t != 0xAB).any()) for t in sentinels) == 0, "the replay wrote into freed memory"
    finally:
        s.close()


# Was: tests/plugins/example_ep.py ExampleEp.__init__ parses min_runs with int(): 'abc' gives EpError(FAIL)
# 'invalid literal for int()', not an InvalidArgument naming the option (fixed in 4a23a5c).
def test_malformed_example_option_names_the_option(env5):
    with pytest.raises(InvalidArgument, match=r"min_runs"):
        InferenceSession(chain_model(), providers=[("ExampleEP", {"min_runs": "abc"})], env=env5).close()


# ---- plugin_cuda/options.py ----------------------------------------------------------------------------
# Was: plugin_cuda/options.py _int/_pointer use Python's int(), which also takes '1_000', non-ASCII digits and
# '0x_10': not 'a decimal integer' / '0x-hex' (fixed in 4a23a5c).
@pytest.mark.parametrize("raw", [{"arena.max_mem": "1_000"}, {"arena.max_mem": "\u0663"},
                                 {"min_num_runs_before_cuda_graph_capture": "\uff12"},
                                 {"user_compute_stream": "0x_10"}, {"user_compute_stream": "1_6"}])
def test_cuda_numbers_are_plain_ascii(raw):
    with pytest.raises(OptionError, match=next(iter(raw))):
        parse_options(raw, 1)


@pytest.mark.xfail(strict=True, reason="tests/plugins/example_ep.py ExampleEp keeps graphs, warm-up counts and the "
                                       "capture in progress per graph id only; the host keeps graphs per thread "
                                       "(IsGraphCaptured/ReplayGraph answer for the calling thread): a second "
                                       "thread's capture of the same id records nothing, and its replays write into "
                                       "the first thread's buffers, never into its own")
def test_threads_capturing_the_same_graph_id_get_their_own_graphs(env5):
    import threading

    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env5)
    results: dict[int, np.ndarray] = {}

    def worker(i: int) -> None:
        x, y, z = arrays(fill_x=i + 1.0)
        b = bound(s, x, y, z)
        s.run_with_iobinding(b)  # capture of graph 0 on this thread
        x[...] = i + 10.0
        z[...] = np.nan
        s.run_with_iobinding(b)  # replay of this thread's graph 0
        results[i] = z - expected(x, y)

    # Both threads alive till the end, so that they are surely two threads; runs one at a time.
    turn = [threading.Event(), threading.Event()]
    done = threading.Barrier(2)

    def in_turn(i: int) -> None:
        turn[i].wait(timeout=60)
        try:
            worker(i)
        finally:
            if i == 0:
                turn[1].set()
            done.wait(timeout=60)

    try:
        ts = [threading.Thread(target=in_turn, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        turn[0].set()
        for t in ts:
            t.join()
        assert sorted(results) == [0, 1]
        for i, diff in results.items():
            assert np.all(np.abs(diff) < 1e-5), f"thread {i}: its replay did not produce its outputs"
    finally:
        s.close()


# Was: host/runtime/graph_capture.py keyed graphs by threading.get_ident(), which a new thread can inherit from
# a dead one (fixed: a thread-local token whose entries go with the thread).
def test_new_thread_does_not_inherit_a_dead_threads_graphs(env5):
    import threading

    s = InferenceSession(chain_model(), providers=[("ExampleEP", {"enable_graph": "1"})], env=env5)
    seen: dict[str, object] = {}

    def capture() -> None:
        seen["ident"] = threading.get_ident()
        x, y, z = arrays()
        s.run_with_iobinding(bound(s, x, y, z))

    def probe() -> None:
        seen["reused"] = threading.get_ident() == seen["ident"]
        if not seen["reused"]:
            return
        seen["inherited"] = sorted(s.capture.signatures)
        x, y, z = arrays(fill_x=3.0)
        try:
            s.run_with_iobinding(bound(s, x, y, z))
            seen["ok"] = bool(np.allclose(z, expected(x, y)))
        except GraphCaptureError as exc:
            seen["ok"] = str(exc)

    try:
        t = threading.Thread(target=capture)
        t.start()
        t.join()
        for _ in range(50):  # a few threads until one gets the dead thread's ident
            t = threading.Thread(target=probe)
            t.start()
            t.join()
            if seen["reused"]:
                break
        else:
            pytest.skip("no thread ident was reused")
        assert seen["inherited"] == [] and seen["ok"] is True, seen
    finally:
        s.close()


def test_runs_from_short_lived_threads_do_not_accumulate_state(env5):
    """Was a bug: Executor kept a RunState (kernel contexts, a plugin stream per EP) for every thread
    that ever ran, until the session closed. Now a thread's state and streams go when it ends."""
    import threading

    s = InferenceSession(chain_model(), providers=["ExampleEP"], env=env5)
    x = np.ones((2, 3), np.float32)
    try:
        def run_in_a_thread() -> None:
            t = threading.Thread(target=lambda: s.run(None, {"X": x, "Y": x}))
            t.start()
            t.join()

        gc.collect()
        contexts, streams = len(hostapi.CONTEXTS), h.record(5).live["EpSyncStream"]
        for _ in range(8):
            run_in_a_thread()
        gc.collect()
        assert (len(hostapi.CONTEXTS), h.record(5).live["EpSyncStream"]) == (contexts, streams)
        (z,) = s.run(None, {"X": x, "Y": x})  # the session goes on, on this thread
        np.testing.assert_array_equal(z, expected(x, x))
    finally:
        s.close()
