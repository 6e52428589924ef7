"""host/optimizer/quick.py: the families' triggers match the families, and a first session of a model no
pass can change imports neither onnxscript's optimizer nor onnx-ir (in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from host.optimizer import GraphOptimizationLevel, optimize
from host.optimizer.quick import FAMILY_TRIGGERS, nothing_to_do
from host.optimizer.rules import FAMILIES

ROOT = Path(__file__).resolve().parents[3]


def test_the_trigger_table_is_the_families():
    assert FAMILY_TRIGGERS == {f.name: (f.triggers, f.requires) for f in FAMILIES}


def test_the_lazy_order_names_each_family_and_keeps_the_trigger_tables_order():
    """host/optimizer/rules: ORDER's names are the families' own, in the trigger table's order."""
    from host.optimizer import rules

    assert [f.name for f in FAMILIES] == list(rules.NAMES) == list(FAMILY_TRIGGERS)
    ops = {"Softmax", "MatMul", "LayerNormalization"}
    assert [n for n in rules.NAMES if rules.may_fire(n, ops)] == [f.name for f in FAMILIES if f.may_fire(ops)]


def test_a_first_session_imports_only_the_rule_modules_of_families_that_may_fire(tmp_path):
    """The zoo transformer block (LayerNormalization, Erf, Softmax, MatMul): no QDQ, Conv+BN, HardSwish,
    RMSNorm or rotary module, nor onnxscript's RMSNorm and rotary fusions; its own fusions still apply."""
    from host.cli import zoo

    path = tmp_path / "block.onnx"
    onnx.save(zoo.transformer_block(seq=8, hidden=32, heads=4, ffn=64), path)
    unused = ["host.optimizer.rules.qdq", "host.optimizer.rules.qdq_nbits", "host.optimizer.rules.qdq_dynamic",
              "host.optimizer.rules.conv_bn", "host.optimizer.rules.hardswish", "host.optimizer.rules.rms_norm",
              "host.optimizer.rules.rotary", "onnxscript.rewriter.rules.fusion._rms_normalization",
              "onnxscript.rewriter.rules.fusion._rotary_embedding"]
    used = ["host.optimizer.rules.layer_norm", "host.optimizer.rules.gelu", "host.optimizer.rules.attention",
            "host.optimizer.rules.matmul", "host.optimizer.rules.skip_layer_norm"]
    code = ("import json, sys, host\nso = host.SessionOptions()\n"
            "so.add_session_config_entry('session.ephost.optimized_model_cache', '0')\n"
            "s = host.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n"
            "print(json.dumps([sorted(m for m in sys.argv[2:] if m in sys.modules), s.optimization.summary()]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), *unused, *used], cwd=ROOT, capture_output=True,
                         text=True, env=os.environ.copy(), check=True)
    loaded, summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == sorted(used)
    assert "fuse Attention" in summary and "fuse Gelu" in summary and "fuse SkipLayerNormalization" in summary


def _conv_relu() -> onnx.ModelProto:
    """Conv -> Relu -> MaxPool: nothing to fold, fuse or remove."""
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_model_no_pass_changes_is_left_as_the_pipeline_leaves_it():
    model = _conv_relu()
    assert nothing_to_do(model)
    result = optimize(model, GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert result.report == [] and result.model.SerializeToString() == model.SerializeToString()


def test_a_first_session_of_such_a_model_imports_no_optimizer_and_matches_onnxruntime(tmp_path):
    path = tmp_path / "conv.onnx"
    onnx.save(_conv_relu(), path)
    code = ("import json, sys\nimport numpy as np, host\n"
            "so = host.SessionOptions()\nso.add_session_config_entry('session.ephost.optimized_model_cache', '0')\n"
            "s = host.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n"
            "x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)\n"
            "np.save(sys.argv[2], s.run(None, {'x': x})[0])\n"
            "print(json.dumps([m for m in ('onnx_ir', 'onnxscript.rewriter', 'onnxscript.optimizer') "
            "if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "y.npy")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ}, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-5, atol=1e-5)
