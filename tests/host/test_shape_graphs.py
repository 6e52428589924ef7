"""A captured graph per input-shape signature (issue 23 item 3), with the example plugin's recorded
replay: one capture per shape, replays for repeats, the LRU bound (evictions release graphs in the
EP), strict mode, threads, an EP that cannot release, and the refused ids and options."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

import abi
import host
from host.errors import GraphCaptureError, InvalidArgument
from host.plugins.ep import CPU_LOCATION
from host.runtime import shape_graphs
from host.runtime.session import InferenceSession, RunOptions
from tests.conftest import example_record
from tests.plugins.example_ep import MOCK_DEVICE_ENV

RELEASE = "Ep.ReleaseCapturedGraph"


def dynamic_chain():
    """Z = relu(X + Y) * X over [batch, 3] (every node on the example EP)."""
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 3]) for n in "XYZ"]
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "chain", vi[:2], vi[2:]),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def reference():
    return onnxruntime.InferenceSession(dynamic_chain().SerializeToString(), providers=["CPUExecutionProvider"])


def env_for(example_plugin, version=5):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(version))
    return env


def session(env, per_id=None):
    so = host.SessionOptions()
    if per_id is not None:
        so.add_session_config_entry(shape_graphs.CONFIG_KEY, str(per_id))
    return InferenceSession(dynamic_chain(), so, providers=[("ExampleEP", {"enable_graph": "1", "min_runs": "1"})],
                            env=env)


class Buffers:
    """Fixed input and output buffers per batch size, as a caller of CUDA graphs keeps them."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.by_rows: dict[int, tuple] = {}

    def run(self, sess, binding, rows, ro=None):
        if rows not in self.by_rows:
            self.by_rows[rows] = tuple(np.zeros((rows, 3), np.float32) for _ in range(3))
        x, y, z = self.by_rows[rows]
        x[...] = self.rng.standard_normal(x.shape)  # new data in the bound buffers, every run
        y[...] = self.rng.standard_normal(y.shape)
        binding.bind_input("X", x)
        binding.bind_input("Y", y)
        binding.bind_output("Z", z)
        sess.run_with_iobinding(binding, ro)
        return {"X": x.copy(), "Y": y.copy()}, z


def test_a_graph_per_shape_replayed_for_repeats(example_plugin, reference):
    env = env_for(example_plugin)
    rec = example_record(5)
    rec.clear()
    sess = session(env)
    b, bufs = sess.io_binding(), Buffers()
    replays = []
    for rows in (2, 4, 2, 5, 4):
        feeds, z = bufs.run(sess, b, rows)
        np.testing.assert_allclose(z, reference.run(None, feeds)[0], rtol=1e-6)
        replays.append(rec.slot_calls["replayed_steps"])
    assert sess.fallbacks["graph_captured"] == 3  # one per shape
    assert replays == [0, 0, 3, 3, 6]  # the second 2-row and 4-row runs replayed their graphs (3 nodes)
    ids = sess.capture.graphs(0)
    assert [shape[0][1] for shape in ids] == [(2, 3), (5, 3), (4, 3)]  # LRU order
    assert sorted(ids.values())[0] == 0 and len(set(ids.values())) == 3
    assert all(i >= shape_graphs.INTERNAL_BASE for i in ids.values() if i != 0)
    assert rec.slot_calls[RELEASE] == 0
    sess.close()
    assert rec.slot_calls[RELEASE] == 3  # close releases every shape's graph
    env.close()


def test_the_bound_evicts_least_recently_used_and_releases_it(example_plugin, reference):
    env = env_for(example_plugin)
    rec = example_record(5)
    rec.clear()
    sess = session(env, per_id=2)
    b, bufs = sess.io_binding(), Buffers(1)
    for rows in (2, 4, 2, 5, 4, 2):
        feeds, z = bufs.run(sess, b, rows)
        np.testing.assert_allclose(z, reference.run(None, feeds)[0], rtol=1e-6)
    # 2, 4 captured; 2 replayed; 5 evicts 4; 4 evicts 2; 2 evicts 5.
    assert sess.fallbacks["graph_captured"] == 5
    assert sess.fallbacks["graph_evicted"] == 3 == rec.slot_calls[RELEASE]
    assert [s[0][1] for s in sess.capture.graphs(0)] == [(4, 3), (2, 3)]
    assert len(sess.capture.graphs(0)) == 2
    sess.close()
    env.close()


def test_same_shapes_at_a_new_address_stay_an_error(example_plugin):
    env = env_for(example_plugin)
    sess = session(env)
    b, bufs = sess.io_binding(), Buffers(2)
    bufs.run(sess, b, 2)
    bufs.run(sess, b, 4)
    b.bind_input("X", np.zeros((2, 3), np.float32))
    b.bind_input("Y", bufs.by_rows[2][1])
    b.bind_output("Z", bufs.by_rows[2][2])
    with pytest.raises(GraphCaptureError, match=r"^graph 0 was captured with input 'X' at a fixed buffer; it moved "
                                                r"from address 0x[0-9a-f]+ to 0x[0-9a-f]+\. Copy new data into"):
        sess.run_with_iobinding(b)
    sess.close()
    env.close()


def test_strict_mode_keeps_one_graph_per_id(example_plugin):
    env = env_for(example_plugin)
    sess = session(env, per_id=0)
    b, bufs = sess.io_binding(), Buffers(3)
    bufs.run(sess, b, 2)
    with pytest.raises(GraphCaptureError, match=r"^graph 0 was captured with input 'X' at a fixed buffer; it "
                                                r"(moved from|changed shape)"):
        bufs.run(sess, b, 4)
    ro = RunOptions()
    ro.add_run_config_entry("gpu_graph_id", "1")  # the ONNX Runtime way: another id for another shape
    bufs.run(sess, b, 4, ro)
    assert sorted(sess.capture.signatures) == [0, 1]
    sess.close()
    env.close()


def test_threads_keep_their_own_graphs(example_plugin, reference):
    env = env_for(example_plugin)
    sess = session(env)
    seen, errors = {}, []

    def worker(gid):
        try:
            ro = RunOptions()
            ro.add_run_config_entry("gpu_graph_id", str(gid))
            b, bufs = sess.io_binding(), Buffers(gid)
            for rows in (1, 3, 1, 3):
                feeds, z = bufs.run(sess, b, rows, ro)
                np.testing.assert_allclose(z, reference.run(None, feeds)[0], rtol=1e-6)
            seen[gid] = {other: len(sess.capture.graphs(other)) for other in (1, 2)}
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    # Distinct ids: the example EP keys its recordings by id alone (the CUDA EP keys them per thread).
    threads = [threading.Thread(target=worker, args=(gid,)) for gid in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == {1: {1: 2, 2: 0}, 2: {1: 0, 2: 2}}
    assert sess.fallbacks["graph_captured"] == 4
    sess.close()
    gc.collect()
    env.close()


def test_an_ep_that_cannot_release_runs_new_shapes_eagerly_when_full(example_plugin, reference):
    env = env_for(example_plugin, 3)  # ReleaseCapturedGraph is ABI v4
    sess = session(env, per_id=1)
    b, bufs = sess.io_binding(), Buffers(4)
    bufs.run(sess, b, 2)
    with pytest.warns(RuntimeWarning, match=r"^ExampleEP \(ABI v3\) cannot release a captured graph, and "
                                            r"gpu_graph_id 0 holds 1"):
        feeds, z = bufs.run(sess, b, 4)
    np.testing.assert_allclose(z, reference.run(None, feeds)[0], rtol=1e-6)
    assert sess.fallbacks["graphs_per_id_full_eager"] == 1 and sess.fallbacks["graph_captured"] == 1
    sess.close()
    env.close()


def test_reserved_ids_and_bad_config_are_refused(example_plugin):
    env = env_for(example_plugin)
    sess = session(env)
    b, _ = sess.io_binding(), None
    ro = RunOptions()
    ro.add_run_config_entry("gpu_graph_id", str(shape_graphs.INTERNAL_BASE))
    with pytest.raises(InvalidArgument, match=r"^run option gpu_graph_id must be an integer >= -1 and < 1073741824 "
                                              r"\(larger ids name the per-shape graphs"):
        Buffers().run(sess, b, 2, ro)
    sess.close()
    with pytest.raises(InvalidArgument, match=r"^session config 'session.ephost.graphs_per_id' = '-1': expected a "
                                              r"decimal integer >= 0"):
        session(env, per_id=-1)
    env.close()


# ---- run() with shape buckets replays a graph per bucket (host/runtime/bucket_graphs.py) ----------------
def bucket_session(env, per_id=None):
    so = host.SessionOptions()
    so.add_session_config_entry("session.ephost.shape_buckets", "batch:pow2")
    if per_id is not None:
        so.add_session_config_entry(shape_graphs.CONFIG_KEY, str(per_id))
    return InferenceSession(dynamic_chain(), so, providers=[("ExampleEP", {"enable_graph": "1", "min_runs": "1"})],
                            env=env)


def _feeds(rng, rows):
    return {n: rng.standard_normal((rows, 3)).astype(np.float32) for n in "XY"}


@pytest.fixture(params=["host", "mock_device"])
def bucket_env(request, example_plugin):
    old = os.environ.get(MOCK_DEVICE_ENV)
    if request.param == "mock_device":
        os.environ[MOCK_DEVICE_ENV] = "1"  # read at registration: staging buffers in "device" memory
    try:
        env = env_for(example_plugin)
    finally:
        os.environ.pop(MOCK_DEVICE_ENV, None)
        if old is not None:
            os.environ[MOCK_DEVICE_ENV] = old
    yield env
    gc.collect()
    env.close()


def test_run_with_buckets_replays_each_buckets_graph(bucket_env, reference):
    rec = example_record(5)
    rec.clear()
    sess = bucket_session(bucket_env)
    rng = np.random.default_rng(5)
    results = []
    for rows in (3, 4, 3, 4, 5, 7, 1, 8):  # buckets 4, 4, 4, 4, 8, 8, 1, 8
        feeds = _feeds(rng, rows)
        (z,) = sess.run(None, feeds)
        assert z.shape == (rows, 3)
        np.testing.assert_allclose(z, reference.run(None, feeds)[0], rtol=1e-6)
        results.append(z)
    # Per bucket: the first run is eager (it sizes the staging), the second captures, then replays.
    assert sess.fallbacks["graph_captured"] == 2  # buckets 4 and 8; 1 ran once
    assert rec.slot_calls["replayed_steps"] == 3 * 3  # bucket 4: runs 3 and 4; bucket 8: run 8
    assert not np.shares_memory(results[2], results[3])  # results are the caller's, not the staging
    if sess.capture.ep.location != CPU_LOCATION:  # the mock device: feeds copied into device staging
        assert rec.host_calls[f"copy {abi.DEVICE_CPU}->{abi.DEVICE_GPU}"] >= 3 * 2
    sess.close()


def test_run_with_buckets_evicts_staging_and_its_graph(example_plugin, reference):
    env = env_for(example_plugin)
    rec = example_record(5)
    rec.clear()
    sess = bucket_session(env, per_id=1)
    rng = np.random.default_rng(6)
    for rows in (2, 2, 2, 4, 4, 2, 2):  # bucket 2 captured; 4 evicts it (released); 2 evicts 4
        feeds = _feeds(rng, rows)
        np.testing.assert_allclose(sess.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-6)
    assert sess.fallbacks["graph_captured"] == 3
    assert rec.slot_calls[RELEASE] == sess.fallbacks["graph_evicted"] == 2
    eager = RunOptions()
    eager.add_run_config_entry("gpu_graph_id", "-1")
    before = rec.slot_calls["replayed_steps"]
    feeds = _feeds(rng, 2)
    np.testing.assert_allclose(sess.run(None, feeds, eager)[0], reference.run(None, feeds)[0], rtol=1e-6)
    assert rec.slot_calls["replayed_steps"] == before  # -1: eager, as without buckets
    unsynced = RunOptions()
    unsynced.add_run_config_entry("disable_synchronize_execution_providers", "1")
    np.testing.assert_allclose(sess.run(None, feeds, unsynced)[0], reference.run(None, feeds)[0], rtol=1e-6)
    assert rec.slot_calls["replayed_steps"] == before  # outputs are read at once: no asynchronous replay
    sess.close()
    env.close()


def test_random_shapes_follow_an_lru_reference(example_plugin, reference):
    """30 runs over 6 sizes with room for 3 graphs: captures, evictions (= releases in the EP) and the
    graphs kept equal those of a plain LRU model of the same sequence; every result is onnxruntime's."""
    from collections import OrderedDict

    env = env_for(example_plugin)
    rec = example_record(5)
    rec.clear()
    sess = session(env, per_id=3)
    b, bufs = sess.io_binding(), Buffers(7)
    lru, captures, evictions = OrderedDict(), 0, 0
    for rows in np.random.default_rng(11).integers(1, 7, 30):
        rows = int(rows)
        if rows in lru:
            lru.move_to_end(rows)
        else:
            captures += 1
            if len(lru) == 3:
                lru.popitem(last=False)
                evictions += 1
            lru[rows] = True
        feeds, z = bufs.run(sess, b, rows)
        np.testing.assert_allclose(z, reference.run(None, feeds)[0], rtol=1e-6)
    assert (sess.fallbacks["graph_captured"], sess.fallbacks["graph_evicted"]) == (captures, evictions)
    assert rec.slot_calls[RELEASE] == evictions
    assert [s[0][1][0] for s in sess.capture.graphs(0)] == list(lru)
    sess.close()
    env.close()
