"""Issue 29: what loading a context model skips. The session's graph is built without the weights that
only the compiled partitions read (epcontext.take_unread_initializers), so the checker, shape
inference and GetCapability never see them; a refused context still compiles from the full model.
Outputs are compared with onnxruntime's CPU EP on the source model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import abi
from host.errors import ModelError
from host.plugins.environment import Environment
from host.runtime import epcontext
from host.runtime.session import InferenceSession
from tests.abi.test_compiled import chain_model
from tests.abi.test_epcontext import EP, EP_OPTIONS, OPS, _edit_compatibility, record, save, x_input

V = abi.ABI_VERSION


@pytest.fixture
def env7(plugins):
    with Environment() as env:
        env.register_plugin("ex7", plugins.example[V])
        yield env


@pytest.fixture
def source(tmp_path):
    model = chain_model(OPS)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return model, path


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_weights_read_only_by_contexts_stay_out_of_the_session_graph(env7, source):
    model, path = source  # 'w' is read by the two Adds, both inside compiled partitions
    ctx_path, _ = save(env7, path)
    assert "w" in {t.name for t in onnx.load(str(ctx_path)).graph.initializer}  # kept for recompilation
    record(V).clear()
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 2
        assert "w" not in s.graph.initializers
        assert "w" not in {t.name for t in s.graph.model.graph.initializer}
        x = x_input(3)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _reference(model, x), rtol=1e-6)


def test_a_refused_context_compiles_with_the_weights_of_the_full_model(env7, source):
    model, path = source
    ctx_path, _ = save(env7, path)
    _edit_compatibility(ctx_path, f"{EP};plugin=0.9.0;abi={V};format=1;device=example-cpu")  # prefer recompilation
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert (s.fallbacks["context_loaded"], s.fallbacks["context_recompiled"]) == (0, 2)
        assert "w" in s.graph.initializers
        x = x_input(4)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _reference(model, x), rtol=1e-6)


WIDE = 2048  # 'w' of 8 KiB: over epcontext_save.KEPT_WEIGHTS_MIN_BYTES


@pytest.fixture
def wide(tmp_path):
    model = chain_model(OPS, shape=(2, WIDE))
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return model, path


def _x_wide(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, WIDE)).astype(np.float32)


def _prefer_recompilation(ctx_path) -> None:
    """The saved compatibility string of an older plugin, the external weights left where they are."""
    proto = onnx.load(str(ctx_path), load_external_data=False)
    for p in proto.metadata_props:
        if p.key == "ep_compatibility_info.ExampleEP":
            p.value = f"{EP};plugin=0.9.0;abi={V};format=1;device=example-cpu"
    onnx.save(proto, str(ctx_path))


def test_weights_only_the_kept_subgraphs_read_go_to_a_file_beside_the_model(env7, wide):
    """The context model holds them as ONNX external data (the example plugin's own context keeps its copy);
    a session whose contexts serve never reads the file."""
    model, path = wide
    ctx_path, _ = save(env7, path)
    raw = np.linspace(-1, 1, WIDE, dtype=np.float32).tobytes()
    weights = epcontext.kept_weights_file(ctx_path)
    assert weights.name == "model_ctx.weights" and raw in weights.read_bytes()
    (w,) = [t for t in onnx.load(str(ctx_path), load_external_data=False).graph.initializer if t.name == "w"]
    assert w.data_location == TensorProto.EXTERNAL
    weights.rename(weights.with_suffix(".gone"))
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 2
        x = _x_wide(5)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _reference(model, x), rtol=1e-6, atol=1e-6)


def test_a_refused_context_reads_the_kept_weights_from_their_file(env7, wide):
    model, path = wide
    ctx_path, _ = save(env7, path)
    _prefer_recompilation(ctx_path)
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert (s.fallbacks["context_loaded"], s.fallbacks["context_recompiled"]) == (0, 2)
        x = _x_wide(6)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _reference(model, x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ModelError, match=r"to compile them again are in \['model_ctx.weights'\] beside the model, "
                                         r"and the model was not given as a path"):
        InferenceSession(ctx_path.read_bytes(), providers=[(EP, EP_OPTIONS)], env=env7)
    epcontext.kept_weights_file(ctx_path).unlink()
    with pytest.raises(ModelError, match=r"to compile them again: cannot read \['model_ctx.weights'\]"):
        InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7)


def test_a_plain_model_with_external_data_still_loads_it(env7, tmp_path):
    model = chain_model(OPS, shape=(2, WIDE))
    path = tmp_path / "plain.onnx"
    onnx.save(chain_model(OPS, shape=(2, WIDE)), str(path), save_as_external_data=True, location="plain.data",
              size_threshold=1024)
    assert (tmp_path / "plain.data").is_file()
    with InferenceSession(str(path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        x = _x_wide(7)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _reference(model, x), rtol=1e-6, atol=1e-6)
    (tmp_path / "plain.data").unlink()
    with pytest.raises(ModelError, match=r"the model's external tensors: cannot read \['plain.data'\]"):
        InferenceSession(str(path), providers=[(EP, EP_OPTIONS)], env=env7)


def _model_with_initializers() -> onnx.ModelProto:
    """Initializers read by a node ('a'), by an If branch only ('b'), as a graph output ('c'),
    and by nothing ('unread')."""
    def const(name, value):
        return numpy_helper.from_array(np.full((2,), value, np.float32), name)

    then = helper.make_graph([helper.make_node("Add", ["x", "b"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Mul", ["y", "a"], ["z"])]
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
                              [const("a", 2.0), const("b", 3.0), const("c", 4.0), const("unread", 5.0), zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="k", value="v")
    return model


def test_take_unread_initializers_leaves_what_is_read_in_place():
    model = _model_with_initializers()
    full = onnx.ModelProto()
    full.CopyFrom(model)
    taken = epcontext.take_unread_initializers(model)
    assert [t.name for t in taken] == ["unread"]
    assert [t.name for t in model.graph.initializer] == ["a", "b", "c", "zero"]
    onnx.checker.check_model(model)
    # Everything but the unread initializer is as it was; it comes back whole.
    assert taken[0] == full.graph.initializer[3]
    del full.graph.initializer[3]
    assert model.SerializeToString() == full.SerializeToString()
    # Nothing left to take.
    assert epcontext.take_unread_initializers(model) == []


def _weights_and_shapes_model() -> onnx.ModelProto:
    """MatMul by a large weight, Reshape by a small shape initializer (whose data shape inference
    reads), an If whose branch reads a large initializer, and a large initializer that is also a graph
    input (overridable)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    v = numpy_helper.from_array(rng.standard_normal((4, 512)).astype(np.float32), "v")
    o = numpy_helper.from_array(np.ones((2048,), np.float32), "o")
    shape = numpy_helper.from_array(np.array([4, 2, 256], np.int64), "shape")
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    then = helper.make_graph([helper.make_node("Add", ["r", "v"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4, 512])])
    other = helper.make_graph([helper.make_node("Identity", ["r"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, 512])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Reshape", ["m", "shape"], ["m3"]),
             helper.make_node("ReduceSum", ["m3"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("Flatten", ["m3"], ["r"], axis=1),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Mul", ["y", "y"], ["z"]),
             helper.make_node("ReduceSum", ["o"], ["os"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64]),
                                           helper.make_tensor_value_info("o", TensorProto.FLOAT, [2048])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 512]),
                               helper.make_tensor_value_info("os", TensorProto.FLOAT, [])],
                              [w, v, o, shape, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_checks_run_without_the_weights_and_infer_the_same():
    """build_graph runs the checker and shape inference on a view without the large weights (every model,
    context or not): the same inferred model as inference over the whole model, the model untouched."""
    from onnx import shape_inference

    from host.runtime.model import build_graph

    model = _weights_and_shapes_model()
    before = model.SerializeToString()
    light = build_graph(model)
    assert model.SerializeToString() == before
    full = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    assert light.model.SerializeToString() == full.SerializeToString()  # the same inferred model
    assert light.values["m3"].shape == (4, 2, 256)  # data propagated from the small 'shape' initializer
    assert sorted(light.initializers) == ["o", "shape", "v", "w", "zero"]
    assert [v.name for v in light.inputs] == ["x"]  # 'o' is an input with an initializer: not a required one
