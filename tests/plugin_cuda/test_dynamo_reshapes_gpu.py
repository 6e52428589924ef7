"""The dynamo exporter's computed Reshape targets inside compiled partitions, on a GPU (issue 23).

A GPT-2-like graph in the dynamo exporter's form (tests/plugin_cuda/dynamo_models.py) and a real
GPT-2 exported by torch's dynamo exporter (2 layers, hidden 64: tests/models/make_hf_dynamic.py SMALL;
needs torch and transformers, which the GPU machine has) run on the CUDA EP at several shapes against
onnxruntime's CPU provider. Before, each Reshape(allowzero=1) with a target from the host's shape
program split the compiled partitions (9 on the 2-layer GPT-2, 49 on GPT-2 small); now the data nodes
between the embedding lookup and the output are one partition, planned per shape signature.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.plugin_cuda import dynamo_models
from tests.plugin_cuda.test_plan import _plan_functions

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
SHAPES = [(1, 16), (8, 128), (3, 50), (8, 128), (8, 8)]  # (8, 8): batch = seq = the head size


def cuda_session(model: bytes, genv):
    from host.runtime.session import InferenceSession

    sess = InferenceSession(model, providers=[(CUDA, {"use_tf32": "0"})], env=genv)
    fns = [f for f in _plan_functions() if f.describe().get("dynamic")]
    return sess, fns


def compiled_partitions(sess) -> int:
    return sum(1 for n in sess.plan.nodes if n.members)


def test_a_gpt2_like_dynamo_graph_is_one_partition_planned_per_shape(genv):
    ort = pytest.importorskip("onnxruntime")
    from plugin_cuda.device import nvrtc

    model = dynamo_models.gpt2_block(layers=2).SerializeToString()
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    sess, fns = cuda_session(model, genv)
    assert compiled_partitions(sess) == 1, [(n.op_type, n.name) for n in sess.plan.nodes]
    assert all(n.members for n in sess.plan.nodes)  # nothing per node: the shape arithmetic is the host's
    compiles = []
    for batch, seq in SHAPES:
        feeds = dynamo_models.feeds(batch, seq)
        got = sess.run(None, feeds)[0]
        np.testing.assert_allclose(got, ref.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
        compiles.append(nvrtc.stats["compiles"])
    (fn,) = fns
    d = fn.describe()
    assert d["signatures"] == 4 and d["builds"] == 4 and d["literal_builds"] == 0, (d, fn.last_symbolic_error)
    assert all(c == compiles[0] for c in compiles), compiles  # sizes are kernel arguments: one module


@pytest.fixture(scope="module")
def gpt2_dynamo(tmp_path_factory):
    """GPT-2 (2 layers, hidden 64, random weights) exported by torch's dynamo exporter, opset 18."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import onnx

    from tests.models import make_hf_dynamic as hf

    path = tmp_path_factory.mktemp("gpt2_dynamo") / "gpt2_dynamo.onnx"
    hf._export_dynamo(torch, hf.make_model(torch, "gpt2", hf.SMALL), path, hf.SMALL["vocab"])
    model = onnx.load(str(path))
    model.ir_version = min(model.ir_version, 10)  # the GPU machine's onnxruntime refuses newer IRs
    return model.SerializeToString()


def test_dynamo_gpt2_runs_as_one_partition_against_onnxruntime(genv, gpt2_dynamo):
    ort = pytest.importorskip("onnxruntime")
    from tests.models import make_hf_dynamic as hf

    ref = ort.InferenceSession(gpt2_dynamo, providers=["CPUExecutionProvider"])
    sess, fns = cuda_session(gpt2_dynamo, genv)
    steps = [(n.op_type, n.ep.name if n.ep else "CPU", len(n.members or ())) for n in sess.plan.nodes]
    print("gpt2_dynamo plan:", steps)
    # Left outside: the int64 input_ids Reshape and the embedding Gather (per-node CUDA kernels), and
    # the causal mask's bool LessOrEqual / Expand / Where (no plan lowering yet).
    assert compiled_partitions(sess) == 1, steps
    assert not [s for s in steps if s[1] == "CPU"], steps
    rng = np.random.default_rng(0)
    for batch, seq in SHAPES[:3]:
        feeds = {"input_ids": rng.integers(0, hf.SMALL["vocab"], (batch, seq)).astype(np.int64)}
        got = sess.run(None, feeds)[0]
        want = ref.run(None, feeds)[0]
        assert got.shape == want.shape == (batch, seq, hf.SMALL["hidden"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert [fn.describe()["signatures"] for fn in fns] == [3]
