"""A CUDA graph per input-shape signature and per bucket, with the CUDA EP (issue 23 item 3). GPU only."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

from host.cli import zoo
from host.runtime import buckets, shape_graphs
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession

CUDA = "CUDAExecutionProvider"
pytestmark = pytest.mark.gpu


def session(genv, model, **config):
    so = SessionOptions()
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return InferenceSession(model, so, providers=[(CUDA, {"enable_cuda_graph": "1", "use_tf32": "0"})], env=genv)


@pytest.fixture(scope="module")
def mlp():
    model = zoo.mlp(layers=3, hidden=64, dynamic_batch=True)
    return model, onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_iobinding_captures_a_graph_per_shape_and_evicts_lru(cp, genv, mlp):
    model, ref = mlp
    s = session(genv, model, **{shape_graphs.CONFIG_KEY: "2"})
    out_name = s.get_outputs()[0].name
    rng = np.random.default_rng(0)
    bufs = {}
    for rows in (2, 5, 2, 7, 5):  # 2, 5 captured; 2 replays; 7 evicts 5; 5 evicts 2
        if rows not in bufs:
            bufs[rows] = (cp.zeros((rows, 64), cp.float32), cp.zeros((rows, 64), cp.float32))
        x, y = bufs[rows]
        host_x = rng.standard_normal((rows, 64)).astype(np.float32)
        x.set(host_x)
        cp.cuda.get_current_stream().synchronize()
        b = s.io_binding()
        b.bind_input("input", x)
        b.bind_output(out_name, y)
        s.run_with_iobinding(b)
        np.testing.assert_allclose(cp.asnumpy(y), ref.run(None, {"input": host_x})[0], rtol=2e-4, atol=2e-4)
    assert s.fallbacks["graph_captured"] == 4 and s.fallbacks["graph_evicted"] == 2
    print("per-shape graphs:", {k: s.fallbacks[k] for k in ("graph_captured", "graph_evicted", "replay_stream_sync")})
    s.close()


def test_run_with_buckets_replays_each_buckets_graph(cp, genv, mlp):
    model, ref = mlp
    s = session(genv, model, **{buckets.CONFIG_KEY: "batch:pow2"})
    assert s.bucket_graphs is not None
    rng = np.random.default_rng(1)
    for rows in (3, 4, 3, 4, 7, 8, 5, 1):  # buckets 4 x4, 8 x3, 1
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        (got,) = s.run(None, {"input": x})
        assert got.shape == (rows, 64)
        np.testing.assert_allclose(got, ref.run(None, {"input": x})[0], rtol=2e-4, atol=2e-4)
    assert s.fallbacks["graph_captured"] == 2  # buckets 4 and 8 (first run eager, second captures)
    print("bucket graphs:", {k: s.fallbacks[k] for k in ("graph_captured", "graph_evicted", "replay_stream_sync")})
    s.close()
