"""Per-node warm-up recipes (plugin_cuda/kernel_prefetch.py) without a GPU: what is recorded, how a
context carries them (plan/saved.py "warm"), and the background replay's order against CreateKernel,
run 1 and the EP's close. The replay itself (CuPy) runs in the GPU suite (test_first_run_gpu.py)."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abi import fused_blob
from plugin_cuda import kernel_prefetch, kernel_warmup
from plugin_cuda.device import algo_cache, nvrtc
from plugin_cuda.plan import compute, saved
from tests.abi.test_fused_blob import sample


def _node(op="Gather", attrs=None, name="g0"):
    return types.SimpleNamespace(op_type=op, domain="", opset=13, name=name, attrs=attrs or {"axis": 0})


def _adapter(constants=None, cublas=False):
    return types.SimpleNamespace(needs_cublas=cublas, needs_cudnn=False, constants=constants or {},
                                 present=(True,))


SPECS = [((30522, 768), np.dtype(np.float32)), ((8, 128), np.dtype(np.int64))]


def _record(ep, node, specs, adapter):
    kernel_prefetch.record(ep, kernel_prefetch.recipe_of(node, specs, adapter))


def test_a_warm_up_leaves_one_recipe_per_distinct_kernel_call():
    ep = types.SimpleNamespace(warm_recipes={})
    _record(ep, _node(name="a"), SPECS, _adapter())
    _record(ep, _node(name="b"), SPECS, _adapter())  # the same call but for its name
    _record(ep, _node(attrs={"axis": 1}), SPECS, _adapter())
    recipes = list(ep.warm_recipes.values())
    assert [(r["name"], r["attrs"]) for r in recipes] == [("a", {"axis": 0}), ("g0", {"axis": 1})]
    assert recipes[0]["inputs"] == [[[30522, 768], "<f4"], [[8, 128], "<i8"]]


def test_kernels_with_library_handles_or_large_constants_are_not_recorded():
    ep = types.SimpleNamespace(warm_recipes={})
    _record(ep, _node("MatMul"), SPECS, _adapter(cublas=True))
    big = np.zeros(kernel_prefetch.MAX_CONSTANT_ELEMENTS + 1, np.int64)
    _record(ep, _node("Reshape"), SPECS, _adapter(constants={1: big}))
    _record(ep, _node("Tile", attrs={"x": object()}), SPECS, _adapter())
    assert ep.warm_recipes == {}
    _record(types.SimpleNamespace(), _node(), SPECS, _adapter())  # an EP without recipes: nothing


values = st.recursive(
    st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False, width=32), st.text(max_size=8),
              st.binary(max_size=8), st.none(), st.booleans()),
    lambda inner: st.lists(inner, max_size=4), max_leaves=8)
arrays = st.builds(lambda shape, dtype: (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape),
                   st.lists(st.integers(0, 4), max_size=3), st.sampled_from([np.int64, np.float32, np.bool_]))


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(values, arrays))
def test_attributes_and_constants_decode_as_they_were_given(value):
    import json

    back = kernel_prefetch.decode(json.loads(json.dumps(kernel_prefetch._encode(value))))
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and back.shape == value.shape
        np.testing.assert_array_equal(back, value)
    else:
        assert back == value


def test_a_context_carries_the_recipes_and_starts_their_replay(monkeypatch):
    monkeypatch.setattr(nvrtc, "_provided", {})
    monkeypatch.setattr(algo_cache, "_choices", {})
    monkeypatch.setattr(algo_cache, "_state", {"versions": "", "loaded": True})
    recipes = [{"op": "Gather", "domain": "", "opset": 13, "name": "g0", "attrs": {"axis": 0},
                "inputs": [[[4, 2], "<f4"], [[3], "<i8"]], "constants": {}, "present": [True]}]
    blob = saved.pack(saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90", warm=recipes))
    assert saved.unpack(blob).warm == recipes
    assert saved.unpack(saved.pack(saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90"))).warm == []
    started = []
    ep = types.SimpleNamespace(factory=types.SimpleNamespace(compute_capability=lambda device_id: "90"), device_id=0,
                               prefetch=types.SimpleNamespace(start=started.append))
    compute.subgraph_from_context(ep, "CUDA_fused_0", blob)
    assert started == [recipes]


def test_a_warm_list_that_is_not_a_list_is_a_damaged_context():
    blob = saved.pack(saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90"))
    from tests.plugin_cuda.test_saved_plan import _repack

    with pytest.raises(saved.PlanBlobError, match=r"'warm' is a dict; expected a list"):
        saved.unpack(_repack(blob, lambda head: head.update(warm={})))


def test_the_replay_runs_once_per_recipe_and_is_waited_for(monkeypatch):
    gate, done, threads = threading.Event(), [], set()

    def slow_replay(ep, recipe):
        gate.wait(5)
        done.append(recipe["name"])
        threads.add(threading.current_thread().name)
        return True

    monkeypatch.setattr(kernel_prefetch, "replay", slow_replay)
    pre = kernel_prefetch.Prefetch(ep=None)
    recipes = [{"op": op, "name": op.lower(), "attrs": {}} for op in ("Cast", "Where", "And", "Or", "Not")]
    assert pre.start(recipes[:2])
    assert pre.covers(dict(recipes[0], name="other")) and not pre.covers(recipes[2]) and not pre.covers(None)
    assert not pre.start([dict(recipes[0], name="again")]), "the same call, under way: nothing new"
    assert pre.start(recipes[2:])
    assert done == [] and len(pre._threads) == 2 * kernel_prefetch.MAX_THREADS  # MAX_THREADS per start
    gate.set()
    pre.join()
    assert sorted(done) == sorted(r["name"] for r in recipes)  # each once
    assert threads and not pre._threads
    assert not pre.start("not a list") and not pre.start([1, None])
    pre.join()  # nothing to wait for


def _warm_up_ep(events, covered=False, saves=True):
    prefetch = types.SimpleNamespace(join=lambda: events.append("join"), covers=lambda recipe: covered, done=set())
    return types.SimpleNamespace(prefetch=prefetch, first_stream=lambda: "state", warm_recipes={},
                                 saves_contexts=saves, opts=types.SimpleNamespace(has_user_compute_stream=False))


def _graph_and_node():
    value = types.SimpleNamespace(shape=(4, 2), elem_type=1)
    return types.SimpleNamespace(values=[value]), types.SimpleNamespace(
        op_type="Relu", domain="", opset=14, name="r", attrs={}, inputs=(0,))


def test_create_kernel_waits_for_the_replay_before_its_own_call(monkeypatch):
    """kernel_warmup.warm_up joins the EP's replay first (no kernel compiled by two threads), then makes
    its own call, covered or not (left out, run 1 compiled the kernels again on the H200)."""
    events = []
    monkeypatch.setattr(kernel_warmup, "run", lambda ep, adapter, specs, state, fills=None: events.append(("run", specs)))
    graph, node = _graph_and_node()
    before = dict(kernel_warmup.stats)
    for covered in (True, False):
        ep = _warm_up_ep(events, covered=covered)
        assert kernel_warmup.warm_up(ep, graph, node, _adapter())
        assert events == ["join", ("run", [((4, 2), np.dtype(np.float32))])]
        assert len(ep.warm_recipes) == 1
        events.clear()
    assert kernel_warmup.stats["prefetched"] - before["prefetched"] == 1
    ep = _warm_up_ep(events, saves=False)  # no context to write, none replayed: no recipe made
    assert kernel_warmup.warm_up(ep, graph, node, _adapter())
    assert ep.warm_recipes == {}


def test_a_recipe_that_does_not_replay_is_counted_not_raised(monkeypatch):
    state = object()
    ep = types.SimpleNamespace(first_stream=lambda: state, opts=types.SimpleNamespace(has_user_compute_stream=False))
    before = dict(kernel_prefetch.stats)
    assert not kernel_prefetch.replay(ep, {"op": "NoSuchOp", "domain": "", "opset": 1, "name": "x", "attrs": {},
                                           "inputs": [], "constants": {}, "present": []})
    assert not kernel_prefetch.replay(ep, {"op": "Gather"})  # a recipe without its fields
    assert kernel_prefetch.stats["failed"] - before["failed"] == 2
    ep.first_stream = lambda: None  # a run has started: nothing made ahead
    assert not kernel_prefetch.replay(ep, {"op": "Gather"})
    assert kernel_prefetch.stats["skipped"] - before["skipped"] == 1
