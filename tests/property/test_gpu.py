"""GPU variants of properties 1 (same answers, eager and replayed), 3 (fallbacks) and 5 (no leaks)
with the CUDA plugin (built at ABI v5; the host serves v1..v5). GPU only: `pytest -m gpu`.

Tolerances are harness.TIGHT / harness.LOOSE with use_tf32=0: CuPy's float32 elementwise kernels
are correctly rounded except exp (Sigmoid, a few ulp), and cuBLAS/reductions sum in another order.
"""

from __future__ import annotations

import gc
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abi
from abi import sdk
from host.errors import EphostError, GraphCaptureError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property import strategies as s

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
CUDA_MODULE = f"_ephost_cuda_v{abi.ABI_VERSION}"  # the module name build.py gives the CUDA plugin
CUDA_ABI = abi.ABI_VERSION  # build.py builds the CUDA plugin at the newest ABI
STREAM_SYNC = abi.since("Ep", "ReplayGraphWithSync")  # replays sync their own stream from here on
COMPILE = abi.since("Ep", "Compile")  # fused partitions compile from here on


@pytest.fixture(scope="module")
def cp():
    from plugin_cuda.plugin import probe_devices

    cupy, names, reason = probe_devices()
    if cupy is None or not names:
        pytest.skip(f"needs CuPy and a CUDA GPU: {reason}")
    return cupy


def cuda_record() -> sdk.Record:
    return sdk.runtime(CUDA_MODULE).record


class cuda_env:
    """An Environment serving `host` with the CUDA plugin registered; closed after a gc.collect()."""

    def __init__(self, host: int, path):
        self.host, self.path = host, path

    def __enter__(self) -> Environment:
        gc.collect()
        self.env = Environment(api_version=self.host)
        try:
            self.env.register_plugin("cuda", self.path)
        except BaseException:
            self.env.close()
            raise
        return self.env

    def __exit__(self, *exc) -> None:
        gc.collect()
        self.env.close()


@st.composite
def cuda_session_options(draw, graph: bool | None = None) -> dict[str, str]:
    """Valid options that keep fp32 math (use_tf32=0) and vary streams and memory."""
    opts = {"use_tf32": "0"}
    for key in ("do_copy_in_default_stream", "use_ep_level_unified_stream", "arena.use_cuda_mempool"):
        if draw(st.booleans()):
            opts[key] = draw(st.sampled_from(["0", "1"]))
    enable = draw(st.booleans()) if graph is None else graph
    if enable:
        opts["enable_cuda_graph"] = "1"
        opts["min_num_runs_before_cuda_graph_capture"] = str(draw(st.integers(0, 2)))
    return opts


def bind_cupy(cp, sess, feeds, out_shapes):
    b = sess.io_binding()
    ins = {k: cp.asarray(v) for k, v in feeds.items()}
    outs = {k: cp.zeros(shape, cp.float32) for k, shape in out_shapes.items()}
    for k, v in ins.items():
        b.bind_input(k, v)
    for k, v in outs.items():
        b.bind_output(k, v)
    # The session orders its streams after CuPy's current stream; wait anyway, so that the copies
    # above are done before a capture starts.
    cp.cuda.get_current_stream().synchronize()
    return b, ins, outs


def refill_cupy(cp, ins, feeds) -> None:
    for k, v in feeds.items():
        ins[k][...] = cp.asarray(v)
    cp.cuda.get_current_stream().synchronize()


def outputs_of(cp, names, outs) -> list[np.ndarray]:
    cp.cuda.Device().synchronize()  # replays with sync off leave the work queued
    return [cp.asnumpy(outs[n]) for n in names]


def captured_nodes_off_cuda(case, env, opts) -> list[str]:
    """Nodes the CUDA EP does not take (the CPU EP runs them), from a session without capture."""
    plain = {k: v for k, v in opts.items() if k not in ("enable_cuda_graph", "min_num_runs_before_cuda_graph_capture")}
    sess = InferenceSession(case.model, providers=[(CUDA, plain)], env=env)
    try:
        return [n for n, ep in sess.node_assignment().items() if ep != CUDA]
    finally:
        sess.close()


# ---- property 1 -----------------------------------------------------------------------------------
@given(case=s.graphs(max_nodes=5), host=s.versions, opts=cuda_session_options())
@settings(deadline=None, max_examples=s.budget(15))
def test_gpu_eager_runs_match_references(cp, cuda_plugin_path, case, host, opts):
    refs = h.References(case)
    with cuda_env(host, cuda_plugin_path) as env:
        sess = InferenceSession(case.model, providers=[(CUDA, opts)], env=env)
        try:
            # Several runs: with enable_cuda_graph the EP warms up and captures even when the host
            # cannot replay (v1/v2): every one of them must still compute.
            for i in range(4):
                feeds = case.feeds if i % 2 == 0 else case.feeds2
                refs.check(sess.run(None, feeds), feeds, f"CUDA eager run {i} (host v{host}, {opts})")
        finally:
            sess.close()


@given(case=s.graphs(max_nodes=5), host=st.sampled_from([3, 4, 5, 6]), opts=cuda_session_options(graph=True),
       ro=s.run_options)
@settings(deadline=None, max_examples=s.budget(15))
def test_gpu_replay_matches_references(cp, cuda_plugin_path, case, host, opts, ro):
    refs = h.References(case)
    with cuda_env(host, cuda_plugin_path) as env:
        off = captured_nodes_off_cuda(case, env, opts)
        if set(off) == set(case.nodes):
            return  # nothing runs on the GPU: CuPy buffers could not even be copied (no CUDA EP in the plan)
        try:
            sess = InferenceSession(case.model, providers=[(CUDA, opts)], env=env)
        except GraphCaptureError as exc:
            # ALLOW_CPU_FOR_SHAPES: only nodes with int64 outputs may stay on the CPU; ours are float.
            assert off, f"capture refused although every node is on the CUDA EP: {exc}"
            for name in off:
                assert f"'{name}' ({case.nodes[name]} on CPUExecutionProvider)" in str(exc)
            return
        assert not off or not sess.plan.eps, f"nodes {off} on the CPU and yet capture accepted"
        try:
            b, ins, outs = bind_cupy(cp, sess, case.feeds, case.outputs)
            sess.run_with_iobinding(b, ro.make())
            refs.check(outputs_of(cp, refs.names, outs), case.feeds, "CUDA capturing run")
            captures = sess.capture.enabled and ro.gid != -1
            assert sess.fallbacks["graph_captured"] == int(captures)
            refill_cupy(cp, ins, case.feeds2)
            for o in outs.values():
                o[...] = cp.nan
            sess.run_with_iobinding(b, ro.make())
            refs.check(outputs_of(cp, refs.names, outs), case.feeds2, "CUDA replay" if captures else "CUDA bound run")
            if captures:
                key = ("replay_stream_sync" if host >= STREAM_SYNC else "replay_device_sync") if ro.sync else "replay_async"
                assert sess.fallbacks[key] == 1
        finally:
            sess.close()


# ---- property 3 -----------------------------------------------------------------------------------
def _chain_case():
    return s.elementwise_graphs(min_nodes=2, max_nodes=4)


@given(case=_chain_case(), host=s.versions, graph=st.booleans(), unified=st.booleans(),
       bound_runs=st.lists(s.run_options, max_size=4))
@settings(deadline=None, max_examples=s.budget(8))  # each example compiles a plan (NVRTC): ~10 s on an H100
def test_gpu_fallbacks_match_the_table(cp, cuda_plugin_path, case, host, graph, unified, bound_runs):
    opts = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if graph else {}),
            **({"use_ep_level_unified_stream": "1"} if unified else {})}
    rec = cuda_record() if CUDA_MODULE in sdk.runtimes() else None
    if rec is not None:
        rec.clear()
    with cuda_env(host, cuda_plugin_path) as env:
        rec = cuda_record()
        sess = InferenceSession(case.model, providers=[(CUDA, opts)], env=env)
        try:
            on_plan = bool(sess.plan.eps)
            b, _, _ = bind_cupy(cp, sess, case.feeds, case.outputs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                for ro in bound_runs:
                    sess.run_with_iobinding(b, ro.make())
            cp.cuda.Device().synchronize()
            got = +Counter(sess.fallbacks)
        finally:
            sess.close()
    # The model: the CUDA EP implements every slot; it claims concurrent runs only with stream-tagged
    # scratch (n >= 4) and without a unified stream; it captures on every graph id but -1.
    want = Counter()
    concurrent = not on_plan or (host >= 4 and not unified)
    want["concurrent_runs" if concurrent else "serialised_runs"] += 1
    if on_plan and host < 3:
        want["no_graph_capture"] += 1
    capture = on_plan and graph and host >= 3
    seen: set[int] = set()
    for ro in bound_runs:
        if not capture or ro.gid == -1:
            continue
        if ro.gid not in seen:
            seen.add(ro.gid)
            want["graph_captured"] += 1
        elif ro.sync:
            want["replay_stream_sync" if host >= STREAM_SYNC else "replay_device_sync"] += 1
        else:
            want["replay_async"] += 1
    assert got == +want
    plugin = +Counter(rec.fallbacks)
    if host < 4:
        plugin.pop("untagged_scratch", None)  # per kernel that asks for scratch: none of these does today
    want_plugin = Counter()
    if host < CUDA_ABI:
        want_plugin[f"host_api_v{host}"] += 1
    if 2 <= host < 4:  # IsConcurrentRunSupported exists but no GetSyncStream: no claim, counted per EP
        want_plugin["no_concurrent_run_claim"] += 1
    if host < COMPILE:  # the CUDA EP fuses; an older host gets its per-node kernels, once per GetCapability
        want_plugin["kernels_instead_of_compile"] += 1
    assert plugin == +want_plugin


# ---- property 5 -----------------------------------------------------------------------------------
GPU_STEPS = ("create", "run", "bound", "bound", "release", "close", "drop")


def _gpu_play(cp, data, env) -> None:
    sessions: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(data.draw(st.integers(1, 8), label="steps")):
            kind = data.draw(st.sampled_from(GPU_STEPS), label="step")
            if kind == "create" or not sessions:
                case = data.draw(s.graphs(max_nodes=4), label="graph")
                opts = data.draw(cuda_session_options(), label="options")
                try:
                    sessions.append([InferenceSession(case.model, providers=[(CUDA, opts)], env=env), case, None])
                except EphostError:
                    pass
                continue
            i = data.draw(st.integers(0, len(sessions) - 1), label="session index")
            sess, case, bound = sessions[i]
            try:
                if kind == "run":
                    sess.run(None, case.feeds)
                elif kind == "bound":
                    if bound is None:
                        bound = sessions[i][2] = bind_cupy(cp, sess, case.feeds, case.outputs)
                    sess.run_with_iobinding(bound[0], data.draw(s.run_options, label="run options").make())
                elif kind == "release":
                    sess.capture.release(data.draw(st.integers(0, 3), label="graph id"))
                elif kind == "close":
                    sess.close()
                    sessions.pop(i)
                else:
                    sessions.pop(i)
                    del sess, bound
                    gc.collect()
            except EphostError:
                pass
        cp.cuda.Device().synchronize()
        sessions.clear()


@given(data=st.data(), host=s.versions)
@settings(deadline=None, max_examples=s.budget(15))
def test_gpu_no_leaks(cp, cuda_plugin_path, data, host):
    gc.collect()
    pool = cp.get_default_memory_pool()
    used = pool.used_bytes()
    statuses, contexts = len(hostapi.STATUSES), len(hostapi.CONTEXTS)
    before = +Counter(cuda_record().live) if CUDA_MODULE in sdk.runtimes() else Counter()
    with cuda_env(host, cuda_plugin_path) as env:
        registered = +Counter(cuda_record().live)
        _gpu_play(cp, data, env)  # in a function: no local keeps a session or a CuPy buffer alive
        gc.collect()
        cp.cuda.Device().synchronize()
        assert +Counter(cuda_record().live) == registered, "CUDA plugin objects alive after every session went"
        assert (len(hostapi.STATUSES), len(hostapi.CONTEXTS)) == (statuses, contexts)
    assert +Counter(cuda_record().live) == before
    assert pool.used_bytes() == used, "CuPy's default memory pool holds memory the sessions took"
