"""What the CUDA plugin keeps per stream is dropped when the host releases the stream (no GPU
needed: the plan and graph manager are driven with stand-ins).

CUDA gives a destroyed stream's address to the next stream created, so anything kept by stream
address (a plan's packed launches with that stream's cuBLAS handle, a thread's graphs and private
pools) must go when the stream does, or the next thread runs on a dead stream's handle."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from plugin_cuda.graphs import Captured, GraphManager
from plugin_cuda.plan.plan import Plan


class _Closable:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


class _Pool:
    def __init__(self):
        self.freed = 0

    def free_all_blocks(self):
        self.freed += 1


def test_plan_forgets_a_released_stream():
    plan = Plan()
    kept, other = _Closable(), _Closable()
    plan._instances.update({0x1000: kept, 0x2000: other})
    plan.forget_stream(0x1000)
    assert kept.closed == 1 and 0x1000 not in plan._instances
    assert other.closed == 0 and 0x2000 in plan._instances
    plan.forget_stream(0x1000)  # twice, or a stream the plan never ran on: nothing happens
    plan.forget_stream(0x3000)
    assert kept.closed == 1


def test_plan_makes_an_epilogue_gemm_once_for_every_stream():
    plan = Plan()
    made = []

    def make():
        made.append(_Closable())
        return made[-1]

    firsts = []
    threads = [threading.Thread(target=lambda: firsts.append(plan.epilogue_gemm(("graph", 1), make)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(g is made[0] for g in firsts)
    assert plan.epilogue_gemm(("graph", 2), make) is made[1]
    plan.close()
    assert [g.closed for g in made] == [1, 1]


def _manager():
    return GraphManager(SimpleNamespace(opts=SimpleNamespace(enable_cuda_graph=True)))


def _state():
    return SimpleNamespace(stream=SimpleNamespace(synchronize=lambda: None))


def test_graph_manager_releases_the_threads_of_a_released_stream():
    gm = _manager()
    mine, theirs = _state(), _state()
    done = threading.Event()
    slots = {}

    def thread_with(state, key):
        t = gm._t()
        t.state = state
        t.pools[0] = _Pool()
        t.graphs[0] = Captured(graph=object(), state=state, keep=[1])
        slots[key] = t
        done.wait()

    workers = [threading.Thread(target=thread_with, args=(st, k)) for st, k in ((mine, "a"), (theirs, "b"))]
    for w in workers:
        w.start()
    while len(slots) < 2:
        pass
    a, b = slots["a"], slots["b"]
    pool_a = a.pools[0]
    gm.forget_state(mine)
    assert a not in gm._threads and b in gm._threads
    assert pool_a.freed == 1 and a.graphs == {} and a.pools == {} and not a.listed
    assert b.graphs and b.pools[0].freed == 0
    done.set()
    for w in workers:
        w.join()


def test_a_thread_whose_graphs_were_released_is_listed_again_when_it_runs():
    gm = _manager()
    state = _state()
    t = gm._t()
    t.state = state
    gm.forget_state(state)
    assert gm._threads == []
    assert gm._t() is t and gm._threads == [t]  # close() will release it


def test_a_capture_on_a_released_stream_is_found_by_its_graph():
    gm = _manager()
    state, other = _state(), _state()
    t = gm._t()
    t.state = other  # the thread ran on another stream last, but a graph of its holds this one
    t.graphs[3] = Captured(graph=object(), state=state, keep=[])
    gm.forget_state(state)
    assert t.graphs == {} and gm._threads == []
