"""The optimizer inside InferenceSession: options, optimized_model_filepath, zoo models, the CLI."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from hypothesis import given, settings

from host.cli import zoo
from host.cli.app import main
from host.errors import InvalidArgument
from host.optimizer import GraphOptimizationLevel, optimize
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.host.optimizer.common import float_arrays, ops

L = GraphOptimizationLevel


def _options(level=None, path=None) -> SessionOptions:
    so = SessionOptions()
    if level is not None:
        so.graph_optimization_level = level
    if path is not None:
        so.optimized_model_filepath = path
    return so


def test_default_level_is_all():
    assert SessionOptions().graph_optimization_level == L.ORT_ENABLE_ALL
    with InferenceSession(zoo.mlp(layers=2, hidden=8)) as sess:
        assert sess.optimization.level == L.ORT_ENABLE_ALL
        assert sorted({n.op_type for n in sess.plan.nodes}) == ["Gemm", "Relu"]


@pytest.mark.parametrize("level", [L.ORT_ENABLE_BASIC, 1, "basic"])
def test_level_accepts_enum_int_and_name(level):
    assert _options(level).graph_optimization_level is L.ORT_ENABLE_BASIC


def test_level_rejects_other_values():
    with pytest.raises(InvalidArgument, match="^graph_optimization_level 5 is not a level; allowed: "):
        _options(5)


def test_optimized_model_filepath_writes_the_optimized_model(tmp_path):
    path = tmp_path / "opt.onnx"
    model = zoo.transformer_block(seq=4, hidden=16, heads=2, ffn=32)
    with InferenceSession(model, _options(path=str(path))) as sess:
        nodes = len(sess.plan.nodes)
    saved = onnx.load(str(path))
    onnx.checker.check_model(saved)
    assert saved.SerializeToString() == optimize(model, L.ORT_ENABLE_ALL).model.SerializeToString()
    assert len(saved.graph.node) == nodes < len(model.graph.node)
    # The saved model loads and gives the original's answers.
    x = np.random.default_rng(0).standard_normal((1, 4, 16)).astype(np.float32)
    with InferenceSession(str(path), _options(0)) as again, InferenceSession(model, _options(0)) as plain:
        np.testing.assert_allclose(again.run(None, {"input": x})[0], plain.run(None, {"input": x})[0],
                                   rtol=1e-4, atol=1e-5)


def test_optimized_model_filepath_with_optimization_disabled_writes_the_model(tmp_path):
    path = tmp_path / "same.onnx"
    model = zoo.mlp(layers=2, hidden=8)
    InferenceSession(model, _options(0, str(path))).close()
    assert ops(onnx.load(str(path))) == ops(model)


def test_unwritable_optimized_model_filepath_is_an_error(tmp_path):
    bad = tmp_path / "missing_dir" / "x.onnx"
    with pytest.raises(InvalidArgument, match=f"^optimized_model_filepath '{bad}': cannot write the optimized model"):
        InferenceSession(zoo.mlp(layers=1, hidden=4), _options(path=str(bad)))


# ---- zoo models: optimized on the CPU EP == unoptimized ------------------------------------------
ZOO = {
    "mlp": lambda: zoo.mlp(layers=3, hidden=16, batch=2),
    "mlp_gemm": lambda: zoo.mlp(layers=2, hidden=16, use_gemm=True),
    "cnn": lambda: zoo.cnn(batch=2, size=8),
    "transformer17": lambda: zoo.transformer_block(batch=2, seq=6, hidden=16, heads=2, ffn=32),
    "transformer20": lambda: zoo.transformer_block(seq=6, hidden=16, heads=4, ffn=32, opset=20),
    "transformer_dynamic": lambda: zoo.transformer_block(seq=6, hidden=16, heads=2, ffn=32, dynamic_batch=True),
}


@functools.cache
def zoo_sessions(name, level):
    model = ZOO[name]()
    return model, InferenceSession(model, _options(0)), InferenceSession(model, _options(level))


@pytest.mark.parametrize("level", [L.ORT_ENABLE_BASIC, L.ORT_ENABLE_ALL])
@pytest.mark.parametrize("name", sorted(ZOO))
@settings(max_examples=8)
@given(data=__import__("hypothesis").strategies.data())
def test_zoo_model_optimized_equals_unoptimized(name, level, data):
    model, plain, optimized = zoo_sessions(name, level)
    feeds = {}
    for vi in plain.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in vi.shape]
        feeds[vi.name] = data.draw(float_arrays(shape, -2.0, 2.0))
    want, got = plain.run(None, feeds)[0], optimized.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if level == L.ORT_ENABLE_ALL and name.startswith("transformer"):
        assert len(optimized.plan.nodes) <= 10 < len(plain.plan.nodes)


# ---- CLI ---------------------------------------------------------------------------------------------
def test_cli_prints_the_passes(tmp_path, capsys):
    path = tmp_path / "t.onnx"
    onnx.save(zoo.transformer_block(seq=4, hidden=16, heads=2, ffn=32), str(path))
    assert main(["run", str(path), "--random-inputs", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "optimizer (ORT_ENABLE_ALL): 33 -> 10 nodes" in out and "fuse Attention3D" in out
    assert "CPUExecutionProvider: 10 nodes" in out
    assert main(["run", str(path), "--random-inputs", "--verbose", "--optimization-level", "disable"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: disabled" in out and "CPUExecutionProvider: 33 nodes" in out


def test_cli_refuses_an_unknown_level(tmp_path, capsys):
    assert main(["run", "m.onnx", "--optimization-level", "max"]) == 2
    assert "invalid choice: 'max'" in capsys.readouterr().err
