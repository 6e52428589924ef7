"""Real exports (tests/models: BERT, GPT-2, ViT, Llama, MobileNetV3 from both torch.onnx exporters, and
ResNet-18 exported on first use) on
the CUDA EP with the default optimization level (GPU tests; the fixture check runs anywhere).

Per fixture:
- eager outputs match onnxruntime's CPU provider on the original model (rtol 1e-3, atol 1e-4, and the
  atol scaled to outputs smaller than 1), with TF32 off (use_tf32=0) so float32 GEMMs are float32;
- on the plan path, every partition the EP fuses compiles (no per-node fallback warning);
- every node the host does not count as a shape computation (a node with a non-int64 output) runs on
  the CUDA EP, which is what graph capture's ALLOW_CPU_FOR_SHAPES policy needs;
- with enable_cuda_graph=1 the first bound run captures; the replay equals the eager session's
  output, and a replay after new values are written into the bound input buffers equals eager on
  those values (the graph recomputes, it does not return the captured result).

Set EPHOST_REAL_MODELS_REPORT=<file> to append one JSON line per model (node counts, where they ran).
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import numpy as np
import onnx
import pytest

from host.runtime.session import InferenceSession
from tests.models import available_models, generated_models, load

CUDA = "CUDAExecutionProvider"
INT64 = 7  # the host's SHAPE_ELEM_TYPES: what shape arithmetic produces
MODELS = available_models()
# ResNet-18 is exported on first use (tests/models: too large to check in), where torchvision is.
NO_TORCHVISION = importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None
ALL_MODELS = MODELS + [pytest.param(name, marks=pytest.mark.skipif(
    NO_TORCHVISION, reason="torch and torchvision export this fixture on first use; not installed"))
    for name in generated_models()]


def ort_reference(path, feeds):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the reference for the real-model tests")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def off_cuda_data_nodes(session) -> list[str]:
    """Nodes not on the CUDA EP whose outputs are not all int64 (data, not shape arithmetic)."""
    plan = session.plan
    offending = []
    for n in plan.nodes:
        on_cuda = n.ep is not None and n.ep.name == CUDA
        shape_only = all(plan.elem_types[v] == INT64 for v in n.outputs if v >= 0)
        if not on_cuda and not shape_only:
            offending.append(f"{n.name} ({n.op_type})")
    return offending


def new_feeds(feeds: dict, seed: int) -> dict:
    """Different values of the same shapes: token ids permuted (they stay in the vocabulary), masks
    kept, float inputs redrawn."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, x in feeds.items():
        if x.dtype.kind == "f":
            out[name] = rng.standard_normal(x.shape).astype(x.dtype)
        elif "mask" in name:
            out[name] = x
        else:
            out[name] = rng.permutation(x.reshape(-1)).reshape(x.shape)
    return out


def assert_close(got, want, rtol, atol, msg):
    """allclose at (rtol, atol), and at an atol scaled down to the output's magnitude when that is
    below 1: the MobileNetV3 fixture's logits are ~2e-7, where a bare atol of 1e-4 checks nothing."""
    scale = min(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=msg)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=f"{msg} (atol scaled by {scale:.1e})")


def report(record: dict) -> None:
    path = os.environ.get("EPHOST_REAL_MODELS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


# The CUDA EP runs claimed partitions as compiled plans (plugin_cuda/plan) by default, and node by
# node through plugin_cuda/kernels with compiled_plan=0: both paths are held to the same goals.
PATHS = {"plans": {}, "kernels": {"compiled_plan": "0"}}


@pytest.mark.gpu
@pytest.mark.parametrize("path_kind", list(PATHS))
@pytest.mark.parametrize("name", ALL_MODELS)
def test_real_model_runs_on_cuda_and_matches_onnxruntime(cp, genv, name, path_kind):
    path, feeds, _ = load(name)
    want = ort_reference(path, feeds)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = InferenceSession(str(path), providers=[(CUDA, {"use_tf32": "0", **PATHS[path_kind]})], env=genv)
        got = dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))
    # Every partition the EP fused compiles into a plan (masked attention included): none falls back.
    assert [str(w.message) for w in caught if "could not be compiled" in str(w.message)] == []
    for out_name, ref in want.items():
        assert_close(got[out_name], ref, 1e-3, 1e-4, f"{name}: {out_name}")
    assignment = s.node_assignment()
    on_cuda = sum(ep == CUDA for ep in assignment.values())
    report({"model": name, "path": path_kind, "original_nodes": len(onnx.load(str(path)).graph.node), "nodes": len(assignment),
            "on_cuda": on_cuda, "ops": sorted({n.op_type for n in s.plan.nodes}),
            "off_cuda": sorted(f"{k} ({v})" for k, v in assignment.items() if v != CUDA)})
    assert off_cuda_data_nodes(s) == [], f"{name}: data nodes off the CUDA EP"
    s.close()


def bind(cp, session, feeds, specs):
    b = session.io_binding()
    ins = {k: cp.asarray(v) for k, v in feeds.items()}
    outs = {k: cp.zeros(shape, dtype) for k, (shape, dtype) in specs.items()}
    for k, v in ins.items():
        b.bind_input(k, v)
    for k, v in outs.items():
        b.bind_output(k, v)
    cp.cuda.get_current_stream().synchronize()
    return b, ins, outs


@pytest.mark.gpu
@pytest.mark.parametrize("path_kind", list(PATHS))
@pytest.mark.parametrize("name", ALL_MODELS)
def test_real_model_captures_and_replays_like_eager(cp, genv, name, path_kind):
    path, feeds, _ = load(name)
    options = {"use_tf32": "0", **PATHS[path_kind]}
    eager = InferenceSession(str(path), providers=[(CUDA, options)], env=genv)
    names = [o.name for o in eager.get_outputs()]
    first = dict(zip(names, eager.run(None, feeds)))
    second_feeds = new_feeds(feeds, seed=1)
    second = dict(zip(names, eager.run(None, second_feeds)))
    assert any(not np.array_equal(first[k], second[k]) for k in names), f"{name}: new inputs change nothing"

    g = InferenceSession(str(path), providers=[(CUDA, {**options, "enable_cuda_graph": "1"})], env=genv)
    b, ins, outs = bind(cp, g, feeds, {k: (v.shape, v.dtype) for k, v in first.items()})
    g.run_with_iobinding(b)  # warm-up runs, then capture, then one launch of the graph
    assert g.fallbacks["graph_captured"] == 1, f"{name}: not captured ({dict(g.fallbacks)})"
    for k in names:
        assert_close(cp.asnumpy(outs[k]), first[k], 1e-5, 1e-6, f"{name} capture")
    g.run_with_iobinding(b)  # a replay
    for k in names:
        assert_close(cp.asnumpy(outs[k]), first[k], 1e-5, 1e-6, f"{name} replay")
    for k, v in second_feeds.items():
        ins[k][...] = cp.asarray(v)
    cp.cuda.get_current_stream().synchronize()
    g.run_with_iobinding(b)
    for k in names:
        assert_close(cp.asnumpy(outs[k]), second[k], 1e-5, 1e-6, f"{name} replay on new inputs")
    g.close()
    eager.close()


def test_fixtures_are_present():
    """The GPU tests above are parametrized by the fixtures: an empty list would pass vacuously."""
    assert len(MODELS) >= 5, MODELS
