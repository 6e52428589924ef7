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
