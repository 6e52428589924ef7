"""The CUDA plugin's saved contexts (ABI v7) on a GPU: a zoo transformer saved with EPContext nodes,
loaded back without Ep.Compile, same numbers as onnx.reference; a changed compatibility string plans
again (prefer recompilation); another EP's string is refused."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest

from abi import sdk
from host.runtime import epcontext
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.context_files import context_blobs, edit_contexts
from tests.plugin_cuda.test_plan import MODELS, feeds_for, reference

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
OPTIONS = {"use_tf32": "0"}


def _save(genv, model, tmp_path):
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    so = SessionOptions()
    so.add_session_config_entry(epcontext.ENABLE, "1")
    t0 = time.perf_counter()
    with InferenceSession(str(source), so, providers=[(CUDA, OPTIONS)], env=genv) as s:
        seconds = time.perf_counter() - t0
        return s.context_model, seconds


def _set_compatibility(path, text: str) -> None:
    proto = onnx.load(str(path))
    for p in proto.metadata_props:
        if p.key == f"ep_compatibility_info.{CUDA}":
            p.value = text
    onnx.save(proto, str(path))


@pytest.mark.parametrize("name", ["transformer", "mlp-2x512-b512"])
def test_context_model_loads_without_compiling(cp, genv, tmp_path, name):
    model = MODELS[name]()
    ctx, saving = _save(genv, model, tmp_path)
    nodes = [n for n in onnx.load(str(ctx)).graph.node if n.op_type == "EPContext"]
    assert nodes, "the CUDA plugin saved no context"
    meta = {p.key: p.value for p in onnx.load(str(ctx)).metadata_props}
    fields = sdk.compatibility_fields(meta[f"ep_compatibility_info.{CUDA}"], CUDA)
    assert fields["cc"] == str(cp.cuda.Device(0).compute_capability)
    t0 = time.perf_counter()
    with InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv) as s:
        loading = time.perf_counter() - t0
        assert s.fallbacks["context_loaded"] == len(nodes) and s.fallbacks["context_recompiled"] == 0
        for k in range(2):
            feeds = feeds_for(model, 40 + k)
            np.testing.assert_allclose(s.run(None, feeds)[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
    print(f"{name}: session with saving {saving:.2f} s, from the context model {loading:.2f} s")


def test_prefer_recompilation_and_unsupported(cp, genv, tmp_path):
    model = MODELS["transformer"]()
    ctx, _ = _save(genv, model, tmp_path)
    meta = {p.key: p.value for p in onnx.load(str(ctx)).metadata_props}
    saved = meta[f"ep_compatibility_info.{CUDA}"]
    _set_compatibility(ctx, saved.replace("cc=", "cc=1"))  # another architecture
    with InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv) as s:
        assert s.fallbacks["context_recompiled"] >= 1 and s.fallbacks["context_loaded"] == 0
        feeds = feeds_for(model, 50)
        np.testing.assert_allclose(s.run(None, feeds)[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
    _set_compatibility(ctx, "OtherEP;format=1")
    with pytest.raises(epcontext.ContextError, match=r"^compiled context of '.*' cannot be used: "
                                                     r"CUDAExecutionProvider answers EP_UNSUPPORTED"):
        InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv)


# -- the compiled plan in the context (plan/saved.py) ------------------------------------------------------

@pytest.fixture
def cold(monkeypatch, tmp_path):
    """A process as if new: empty NVRTC and algorithm caches on disk and in memory."""
    from plugin_cuda.device import algo_cache, nvrtc

    count = [0]

    def reset():
        count[0] += 1
        monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path / f"cache{count[0]}"))  # a new, empty cache
        nvrtc.clear()
        algo_cache.clear()
        return dict(nvrtc.stats), dict(algo_cache.stats)

    return reset


def _lowering_counter(monkeypatch) -> dict:
    """Counts and times Plan.build's lowering and code generation (what a context does not save)."""
    from plugin_cuda.plan import plan as plan_module

    seen = {"lower": 0, "codegen": 0, "seconds": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seen[name] += 1
                seen["seconds"] += time.perf_counter() - t0
        return wrapper

    monkeypatch.setattr(plan_module, "lower", timed("lower", plan_module.lower))
    monkeypatch.setattr(plan_module.codegen, "generate", timed("codegen", plan_module.codegen.generate))
    return seen


@pytest.mark.parametrize("name", ["transformer", "mlp-2x512-b512"])
def test_context_reloads_with_no_nvrtc_compile_and_the_same_bits(cp, genv, tmp_path, cold, monkeypatch, name):
    from plugin_cuda.device import algo_cache, nvrtc
    from plugin_cuda.plan import saved

    model = MODELS[name]()
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    so = SessionOptions()
    so.add_session_config_entry(epcontext.ENABLE, "1")
    cold()
    feeds = [feeds_for(model, 60 + k) for k in range(2)]
    with InferenceSession(str(source), so, providers=[(CUDA, OPTIONS)], env=genv) as s:
        ctx = s.context_model
        first = [s.run(None, f)[0] for f in feeds]
    blobs = context_blobs(ctx)
    plans = [saved.unpack(b) for b in blobs]
    assert plans and all(p.format == saved.FORMAT and p.modules for p in plans), [len(p.modules) for p in plans]
    if name == "mlp-2x512-b512":  # its GEMMs run on cuBLASLt with RELU_BIAS epilogues: the heuristic's answers
        assert any(k.startswith("cublaslt|") for p in plans for k in p.algos), [p.algos for p in plans]
    before, searched = cold()  # a new process: nothing in memory, an empty disk cache
    seen = _lowering_counter(monkeypatch)
    t0 = time.perf_counter()
    with InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv) as s:
        loading = time.perf_counter() - t0
        assert s.fallbacks["context_loaded"] == len(blobs) and s.fallbacks["context_recompiled"] == 0
        assert nvrtc.stats["compiles"] == before["compiles"], "a saved context compiled with NVRTC"
        assert nvrtc.stats["provided"] - before["provided"] >= len(blobs)
        again = [s.run(None, f)[0] for f in feeds]
        assert algo_cache.stats["searches"] == searched["searches"], "a saved context searched again"
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)  # the same kernels and GEMM algorithms: the same bits
    np.testing.assert_allclose(again[0], reference(model, feeds[0])[0], rtol=1e-4, atol=1e-4)
    print(f"{name}: {len(blobs)} contexts, {sum(len(b) for b in blobs)} bytes; loaded in {loading:.3f} s with "
          f"{seen['lower']} lowerings + {seen['codegen']} code generations ({seen['seconds'] * 1e3:.1f} ms)")


@pytest.mark.parametrize("damage", ["another compute capability", "truncated", "a flipped module byte"])
def test_a_context_the_plugin_refuses_is_compiled_again(cp, genv, tmp_path, cold, damage):
    from plugin_cuda.plan import saved

    def edit(blob: bytes) -> bytes:
        if damage == "another compute capability":
            plan = saved.unpack(blob)
            plan.cc = "10"
            return saved.pack(plan)
        if damage == "truncated":
            return blob[:len(blob) // 2]
        return blob[:-7] + bytes([blob[-7] ^ 0xFF]) + blob[-6:]

    model = MODELS["transformer"]()
    ctx, _ = _save(genv, model, tmp_path)
    edit_contexts(ctx, edit)
    cold()
    with pytest.warns(RuntimeWarning, match=r"^compiled context of '.*' not used \(.*CompileFromContext"):
        s = InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv)
    with s:
        assert s.fallbacks["context_recompiled"] >= 1 and s.fallbacks["context_loaded"] == 0
        feeds = feeds_for(model, 70)
        np.testing.assert_allclose(s.run(None, feeds)[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-4)


def test_dynamic_shape_partition_reloads_and_plans_per_signature(cp, genv, tmp_path, cold):
    ort = pytest.importorskip("onnxruntime")
    from tests.models import dynamic

    model = dynamic.bert_like()
    ctx, _ = _save(genv, model, tmp_path)
    assert any(n.op_type == "EPContext" for n in onnx.load(str(ctx)).graph.node)
    cold()
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with InferenceSession(str(ctx), providers=[(CUDA, OPTIONS)], env=genv) as s:
        assert s.fallbacks["context_loaded"] >= 1 and s.fallbacks["context_recompiled"] == 0
        for batch, seq in [(2, 16), (3, 40), (2, 16)]:
            feeds = dynamic.bert_feeds(batch, seq)
            got = s.run(None, feeds)[0]
            np.testing.assert_allclose(got, want.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
