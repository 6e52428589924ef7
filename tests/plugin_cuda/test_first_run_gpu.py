"""Issue 29: a compiled plan's first run does no per-stream work (plugin_cuda/plan/warmup.py).

At session creation each static-shape plan runs once on the stream the session's first run gets, so
that run finds its instance (arena, packed launches, cuBLAS handle, cuDNN setups) ready. Counted by
wrapping Plan._instance (where an instance is made); results are compared with onnx.reference.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest

from host.cli import zoo
from host.runtime import epcontext
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.plugin_cuda.test_plan import MODELS, feeds_for, reference
from tests.spies import record_calls

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
OPTIONS = {"use_tf32": "0"}
CASES = {"transformer": MODELS["transformer"], "mlp-2x512-b512": MODELS["mlp-2x512-b512"],
         "cnn": lambda: zoo.cnn(batch=2, size=32)}  # cuDNN convolutions


@pytest.fixture
def instances(monkeypatch) -> list:
    """The streams Plan._instance made an instance for, in order."""
    from plugin_cuda.plan import plan as plan_module

    return record_calls(monkeypatch, plan_module.Plan, "_instance")


def _context_model(genv, model, tmp_path):
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    so = SessionOptions()
    so.add_session_config_entry(epcontext.ENABLE, "1")
    with InferenceSession(str(source), so, providers=[(CUDA, OPTIONS)], env=genv) as s:
        return s.context_model


@pytest.mark.parametrize("from_context", [False, True], ids=["plain", "context"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_run_1_finds_its_plan_instances_made_at_creation(cp, genv, tmp_path, instances, name, from_context):
    from plugin_cuda.plan import warmup

    model = CASES[name]()
    path = _context_model(genv, model, tmp_path) if from_context else model
    warmed, made = warmup.stats["warmed"], len(instances)
    t0 = time.perf_counter()
    with InferenceSession(path if from_context else model.SerializeToString(), providers=[(CUDA, OPTIONS)],
                          env=genv) as s:
        creation = time.perf_counter() - t0
        if from_context:
            assert s.fallbacks["context_loaded"] >= 1 and s.fallbacks["context_recompiled"] == 0
        at_creation = len(instances) - made
        assert at_creation >= 1 and warmup.stats["warmed"] - warmed == at_creation, warmup.stats
        times = []
        for k in range(3):
            feeds = feeds_for(model, 80 + k)
            t = time.perf_counter()
            got = s.run(None, feeds)[0]
            times.append((time.perf_counter() - t) * 1e3)
            assert len(instances) - made == at_creation, f"run {k + 1} made a plan instance (per-stream work)"
            np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
    print(f"{name} {'context' if from_context else 'plain'}: creation {creation:.3f} s, runs "
          f"{', '.join(f'{t:.2f}' for t in times)} ms")


def test_no_warm_up_on_a_callers_stream(cp, genv, instances):
    """user_compute_stream: nothing is queued on the caller's stream before the caller runs."""
    from plugin_cuda.plan import warmup

    model = MODELS["transformer"]()
    stream = cp.cuda.Stream(non_blocking=True)
    skipped, made = warmup.stats["skipped"], len(instances)
    with InferenceSession(model.SerializeToString(), providers=[(CUDA, {**OPTIONS, "user_compute_stream": str(stream.ptr)})],
                          env=genv) as s:
        assert warmup.stats["skipped"] > skipped and len(instances) == made
        feeds = feeds_for(model, 90)
        np.testing.assert_allclose(s.run(None, feeds)[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
        assert len(instances) > made  # run 1 made it, as before


def test_a_failing_warm_up_leaves_the_work_to_run_1(cp, genv, instances, monkeypatch):
    from plugin_cuda.plan import plan as plan_module
    from plugin_cuda.plan import warmup

    def broken(self, stream, input_ptrs, output_ptrs):
        self._instance(stream)  # made, then given up: forget_stream must drop it
        raise RuntimeError("injected warm-up failure")

    monkeypatch.setattr(plan_module.Plan, "warm", broken)
    model = MODELS["mlp-2x512-b512"]()
    failed, made = warmup.stats["failed"], len(instances)
    with InferenceSession(model.SerializeToString(), providers=[(CUDA, OPTIONS)], env=genv) as s:
        assert warmup.stats["failed"] > failed
        at_creation = len(instances) - made
        feeds = feeds_for(model, 95)
        np.testing.assert_allclose(s.run(None, feeds)[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
        assert len(instances) - made == 2 * at_creation  # run 1 made each plan's instance again


@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_per_node_kernels_run_once_at_creation(cp, genv, name):
    """compiled_plan=0: every node is a per-node kernel; each with known shapes runs at creation
    (plugin_cuda/kernel_warmup.py), and the session still computes what onnx.reference does."""
    from plugin_cuda import kernel_warmup

    model = CASES[name]()
    before = dict(kernel_warmup.stats)
    t0 = time.perf_counter()
    with InferenceSession(model.SerializeToString(), providers=[(CUDA, {**OPTIONS, "compiled_plan": "0"})],
                          env=genv) as s:
        creation = time.perf_counter() - t0
        done = {k: kernel_warmup.stats[k] - before[k] for k in before}
        assert done["warmed"] >= 1, done
        times = []
        for k in range(2):
            feeds = feeds_for(model, 97 + k)
            t = time.perf_counter()
            got = s.run(None, feeds)[0]
            times.append((time.perf_counter() - t) * 1e3)
            np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
    print(f"{name} per-node kernels: {done}; creation {creation:.3f} s, runs "
          f"{', '.join(f'{t:.2f}' for t in times)} ms")


def _embedding_model(batch=2, seq=8, expand=False) -> onnx.ModelProto:
    """ids -> Gather(table) -> Where(mask, ., 0) -> MatMul -> Relu: the Gather, Cast and Where are
    per-node kernels (a plan lowers none of them), the MatMul and Relu a compiled partition.
    `expand`: a second output, a (1, 1, 16) row expanded to Shape(Gather's output), as BERT expands its
    token types to the ids' shape (a per-node Expand whose target the host's shape program computes)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    table = numpy_helper.from_array(rng.standard_normal((50, 16)).astype(np.float32), "table")
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["m", "axes"], ["m3"]),
             helper.make_node("Where", ["m3", "e", "zero"], ["em"]),
             helper.make_node("MatMul", ["em", "w"], ["y0"]), helper.make_node("Relu", ["y0"], ["y"])]
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, 16])]
    initializers = [table, w, zero, axes]
    if expand:
        initializers.append(numpy_helper.from_array(rng.standard_normal((1, 1, 16)).astype(np.float32), "row"))
        nodes += [helper.make_node("Shape", ["e"], ["e_shape"]), helper.make_node("Expand", ["row", "e_shape"], ["rows"])]
        outputs.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, [batch, seq, 16]))
    graph = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, seq]),
                                               helper.make_tensor_value_info("mask", TensorProto.INT64, [batch, seq])],
                              outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # the GPU machine's onnxruntime refuses newer IRs
    return model


def test_a_context_replays_its_per_node_warm_ups_in_the_background(cp, genv, tmp_path):
    """The saving session's per-node warm-ups go into the context as recipes (kernel_prefetch.py); a
    session from it replays them from CompileFromContext on, and computes what onnxruntime does."""
    ort = pytest.importorskip("onnxruntime")
    from plugin_cuda import kernel_prefetch
    from plugin_cuda.plan import saved
    from tests.context_files import context_blobs

    model = _embedding_model()
    ctx = _context_model(genv, model, tmp_path)
    recipes = [r for blob in context_blobs(ctx) for r in saved.unpack(blob).warm]
    assert {r["op"] for r in recipes} >= {"Gather", "Where"}, recipes
    before = dict(kernel_prefetch.stats)
    with InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv) as s:
        assert s.fallbacks["context_loaded"] >= 1 and s.fallbacks["context_recompiled"] == 0
        done = {k: kernel_prefetch.stats[k] - before[k] for k in before}
        assert done["replayed"] >= 2 and done["failed"] == 0, done
        rng = np.random.default_rng(7)
        feeds = {"ids": rng.integers(0, 50, (2, 8)).astype(np.int64), "mask": rng.integers(0, 2, (2, 8)).astype(np.int64)}
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)


_CHILD = r"""
import json, os, sys
import numpy as np
from host.runtime import epcontext
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from plugin_cuda import cupy_cache
mode, path, out = sys.argv[1:4]
so = SessionOptions()
if mode == "save":
    so.add_session_config_entry(epcontext.ENABLE, "1")
with InferenceSession(path, so, providers=[("CUDAExecutionProvider", {"use_tf32": "0"})]) as s:
    rng = np.random.default_rng(7)
    feeds = {"ids": rng.integers(0, 50, (2, 8)).astype(np.int64), "mask": rng.integers(0, 2, (2, 8)).astype(np.int64)}
    np.save(out, s.run(None, feeds)[0])
    print(json.dumps({"context_model": str(s.context_model), "loaded": s.fallbacks["context_loaded"],
                      "stats": cupy_cache.stats}))
"""


def _child(mode: str, path, out, cupy_dir) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUPY_CACHE_DIR=str(cupy_dir), EPHOST_CACHE_DIR=str(cupy_dir.parent / f"ephost-{mode}"))
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(path), str(out)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_context_session_loads_the_per_node_kernels_cupy_compiled_when_it_was_saved(cp, tmp_path):
    """On a cold CuPy cache, the saving process compiles the per-node kernels (its cache fills); the
    context carries what CuPy made (cupy_cache.py), so a fresh process with another empty CuPy cache
    loads them from the context: none of them is compiled again (written to its cache), and the outputs
    are onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    from plugin_cuda.plan import saved
    from tests.context_files import context_blobs

    model = _embedding_model()
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    saving, loading = tmp_path / "cupy-save", tmp_path / "cupy-load"
    saving.mkdir()
    loading.mkdir()
    made = _child("save", source, tmp_path / "save.npy", saving)
    compiled = {p.name for p in saving.iterdir() if p.suffix == ".cubin"}
    assert compiled, "the saving process compiled no CuPy kernel: nothing for this test to carry"
    payloads = {k: v for blob in context_blobs(made["context_model"]) for k, v in saved.unpack(blob).cupy.items()}
    assert payloads and set(payloads) <= compiled, (sorted(payloads), sorted(compiled))
    got = _child("load", made["context_model"], tmp_path / "load.npy", loading)
    assert got["loaded"] >= 1 and got["stats"]["served"] >= len(payloads), got
    again = {p.name for p in loading.iterdir() if p.suffix == ".cubin"}
    assert not again & set(payloads), f"compiled again from a context that carried them: {sorted(again & set(payloads))}"
    rng = np.random.default_rng(7)
    feeds = {"ids": rng.integers(0, 50, (2, 8)).astype(np.int64), "mask": rng.integers(0, 2, (2, 8)).astype(np.int64)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(np.load(tmp_path / "load.npy"), want, rtol=1e-4, atol=1e-4)
    print(f"payloads carried: {len(payloads)} ({sum(map(len, payloads.values()))} bytes); compiled after loading: "
          f"{sorted(again)}")


def test_dynamic_per_node_kernels_are_warmed_at_a_probe_size(cp, genv):
    """With dynamic batch and sequence, the per-node Gather, Cast, Unsqueeze, Where and Expand run at
    creation with every symbolic dim 7 (kernel_warmup.PROBE_DIM; the Expand's computed target is its
    output's dims, kernel_warmup.host_fills), so a later shape whose dims are all > 1 finds
    CuPy's kernels compiled: no kernel is compiled or loaded from CuPy's cache in its first run (the
    first run of a new shape on a fresh machine compiled them, docs/dynamic_shapes.md). The session's
    first shape, (1, 1), may compile: CuPy's variants for size-1 axes, which are those a warm-up at
    size 1 would have made (the test then fails at (3, 11)). Run alone, as a fresh process: CuPy keeps
    what it compiled in memory for the process, so another test's kernels can hide a miss."""
    from plugin_cuda import cupy_cache, kernel_warmup

    if cupy_cache.install() is None:
        pytest.skip("this CuPy has no kernel cache backend hook to observe its compiles through")
    ort = pytest.importorskip("onnxruntime")
    model = _embedding_model("batch", "seq", expand=True)
    before = kernel_warmup.stats["warmed"]
    with InferenceSession(model.SerializeToString(), providers=[(CUDA, OPTIONS)], env=genv) as s:
        assert kernel_warmup.stats["warmed"] - before >= 4  # Gather, Cast, Where, Expand (Unsqueeze: a view)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(3)
        for batch, seq in ((1, 1), (3, 11), (5, 4)):
            feeds = {"ids": rng.integers(0, 50, (batch, seq)), "mask": rng.integers(0, 2, (batch, seq))}
            with cupy_cache.recording() as compiled:
                got = s.run(None, feeds)
            assert batch == 1 or not compiled, f"CuPy compiled or loaded {sorted(compiled)} at {batch}x{seq}"
            for mine, theirs in zip(got, want.run(None, feeds), strict=True):
                np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)
