"""Compiled partitions with symbolic dims on a GPU: a plan per input-shape signature, its bounded
cache, shared constants, auto-graph per signature and threads (plugin_cuda/plan/signatures.py).

The reference is onnxruntime's CPU provider on the same model and inputs; TF32 is off so float32
results compare tightly. The model is the BERT-like encoder with dynamic batch and sequence of
tests/models/dynamic.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.models import dynamic
from tests.plugin_cuda.test_plan import _plan_functions

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
SHAPES = [(1, 16), (8, 128), (3, 50), (8, 128), (1, 16)]


@pytest.fixture(scope="module")
def model():
    return dynamic.bert_like().SerializeToString()


@pytest.fixture(scope="module")
def ort_session(model):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def cuda_session(model, genv, **options):
    from host.runtime.session import InferenceSession

    opts = {"use_tf32": "0", **{k: str(v) for k, v in options.items()}}
    sess = InferenceSession(model, providers=[(CUDA, opts)], env=genv)
    fns = [f for f in _plan_functions() if f.describe().get("dynamic")]
    return sess, fns


def check(sess, ort_session, batch, seq, seed=0):
    feeds = dynamic.bert_feeds(batch, seq, seed=seed)
    got = sess.run(None, feeds)[0]
    want = ort_session.run(None, feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_each_new_shape_gets_a_plan_and_a_shape_seen_before_reuses_it(model, genv, ort_session):
    from plugin_cuda.device import nvrtc

    sess, fns = cuda_session(model, genv)
    assert fns, "no compiled partition with symbolic dims: the encoder ran per node"
    compiles = []
    for batch, seq in SHAPES:
        check(sess, ort_session, batch, seq)
        compiles.append(nvrtc.stats["compiles"])
    for fn in fns:
        d = fn.describe()
        assert d["builds"] == 3 and d["signatures"] == 3, d
    assert compiles[3] == compiles[2] and compiles[4] == compiles[3]  # shapes seen before compile nothing
    # Every shape after the first plans alike: sizes are kernel arguments, so the module is the first's
    assert compiles[2] == compiles[1] == compiles[0], compiles
    assert all(fn.describe()["literal_builds"] == 0 for fn in fns), [fn.last_symbolic_error for fn in fns]
    on_cpu = {n.op_type for n in sess.plan.nodes if n.ep is None}
    assert not on_cpu & {"MatMul", "FusedMatMul", "Attention", "LayerNormalization", "SkipLayerNormalization"}, on_cpu


def test_weights_are_uploaded_once_for_every_shape(model, genv, ort_session):
    sess, fns = cuda_session(model, genv)
    check(sess, ort_session, 2, 8)
    held = [fn.constants.nbytes for fn in fns]
    assert sum(held) > 0
    for batch, seq in [(4, 32), (5, 7)]:
        check(sess, ort_session, batch, seq)
    assert [fn.constants.nbytes for fn in fns] == held


def test_the_plan_cache_is_bounded_and_evicted_plans_are_closed(model, genv, ort_session):
    sess, fns = cuda_session(model, genv, plan_shape_cache=2)
    seen = []
    for batch, seq in [(1, 8), (2, 9), (3, 10), (4, 11), (1, 8)]:
        check(sess, ort_session, batch, seq)
        seen.extend(p for fn in fns for p in fn.cache.plans() if p not in seen)
    for fn in fns:
        assert len(fn.cache) <= 2 and fn.cache.stats["evictions"] >= 3
        assert fn.cache.stats["builds"] == 5  # (1, 8) came back after it was evicted
    live = {id(p) for fn in fns for p in fn.cache.plans()}
    assert all(p.closed for p in seen if id(p) not in live)


def test_auto_graph_captures_per_signature_and_replays_fresh_inputs(model, genv, ort_session):
    sess, fns = cuda_session(model, genv, plan_auto_graph=1, min_num_runs_before_cuda_graph_capture=1)
    for batch, seq in [(2, 16), (3, 20), (2, 16)]:
        for seed in range(3):  # past the warm-up: each replay must read this call's input
            check(sess, ort_session, batch, seq, seed=seed)
    captures = sum(p.stats["captures"] for fn in fns for p in fn.cache.plans())
    assert captures >= 2


def test_threads_with_different_shapes_get_right_answers(model, genv, ort_session):
    sess, fns = cuda_session(model, genv)
    errors = []

    def worker(k):
        try:
            for i in range(6):
                batch, seq = SHAPES[(i + k) % len(SHAPES)]
                check(sess, ort_session, batch, seq, seed=k)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]


def test_plan_dynamic_shapes_0_keeps_the_per_node_path(model, genv, ort_session):
    sess, fns = cuda_session(model, genv, plan_dynamic_shapes=0)
    assert not fns
    check(sess, ort_session, 3, 50)
