"""ABI v7: a context file beside the model (embed mode 0, the default) is mapped, not read, and the
bytes reach CompileFromContext without a copy; the host keeps them until the partition's release.

Through the example plugin, whose compile_from_context is wrapped here to see what it is handed.
"""

from __future__ import annotations

import mmap

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from host.runtime import epcontext
from host.runtime.session import InferenceSession
from tests.abi.test_epcontext import EP, EP_OPTIONS, env7, onnxruntime_reference, save, source, x_input
from tests.context_files import context_files
from tests.plugins import example_ep

__all__ = ["env7", "source"]  # fixtures, imported for pytest


@pytest.fixture
def handed(monkeypatch):
    """What each compile_from_context call was given: (type, read-only, first bytes)."""
    seen = []
    original = example_ep.ExampleEp.compile_from_context

    def spy(self, fused, blob):
        seen.append((type(blob), memoryview(blob).readonly, bytes(blob[:8])))
        return original(self, fused, blob)

    monkeypatch.setattr(example_ep.ExampleEp, "compile_from_context", spy)
    return seen


def test_a_context_file_is_handed_over_as_a_read_only_view_of_its_mapping(env7, source, handed):
    model, path = source
    ctx_path, _ = save(env7, path)  # embed mode 0 by default
    files = context_files(ctx_path)
    assert len(files) == 2
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 2
        assert [(t, ro) for t, ro, _ in handed] == [(memoryview, True)] * 2
        assert [head for _, _, head in handed] == [f.read_bytes()[:8] for f in files]
        parts = list(s._partitioner.partitions)
        kept = [obj for part in parts for obj in part._kept]
        assert len(kept) == 2 and all(isinstance(obj, mmap.mmap) and not obj.closed for obj in kept)
        x = x_input()
        np.testing.assert_allclose(s.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)
    assert len(parts) == 2 and all(part._released and not part._kept for part in parts), "let go at release"


def test_embedded_contexts_are_handed_over_without_a_copy_too(env7, source, handed):
    model, path = source
    ctx_path, _ = save(env7, path, **{epcontext.EMBED_MODE: "1"})
    assert context_files(ctx_path) == []
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 2
        assert [(t, ro) for t, ro, _ in handed] == [(memoryview, True)] * 2
        kept = [obj for part in s._partitioner.partitions for obj in part._kept]
        assert len(kept) == 2 and all(isinstance(obj, bytes) for obj in kept)
        x = x_input(1)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)


def test_saving_again_replaces_a_mapped_context_file_whole(env7, source):
    """A session keeps its mapping of the old file; a second save writes a new file in its place
    (os.replace), so the running session's bytes never change under it and the next session reads the
    new ones."""
    model, path = source
    ctx_path, _ = save(env7, path)
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        inode = [f.stat().st_ino for f in context_files(ctx_path)]
        save(env7, path)
        assert [f.stat().st_ino for f in context_files(ctx_path)] != inode
        x = x_input(2)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s2:
        assert s2.fallbacks["context_loaded"] == 2


@pytest.mark.filterwarnings("ignore:compiled context of .* not used:RuntimeWarning")
def test_an_empty_or_missing_context_file_is_compiled_again(env7, source):
    model, path = source
    ctx_path, _ = save(env7, path)
    first, second = context_files(ctx_path)
    first.write_bytes(b"")  # a file of 0 bytes cannot be mapped: the EP is handed no bytes and refuses
    second.unlink()
    with InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert (s.fallbacks["context_loaded"], s.fallbacks["context_recompiled"]) == (0, 2)
        x = x_input(3)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)


def test_the_default_embed_mode_is_onnxruntimes(env7, source):
    assert epcontext.ContextOptions.from_entries({}).embed_mode == 0
    assert epcontext.ContextOptions.from_entries({epcontext.EMBED_MODE: "1"}).embed_mode == 1
    _, path = source
    ctx_path, _ = save(env7, path, **{epcontext.FILE_PATH: str(path.with_name("x_ctx.onnx"))})
    assert [f.name for f in context_files(ctx_path)] == ["x_ctx_ExampleEP_fused_0.bin", "x_ctx_ExampleEP_fused_1.bin"]


_NO_OPTIMIZER = r"""
import sys
import build, abi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
with Environment() as env:
    env.register_plugin("ex7", str(build.build_python_plugin("example", abi.ABI_VERSION)))
    with InferenceSession(sys.argv[1], providers=[("ExampleEP", {"fuse": "1", "ops": "Add,Relu,Mul"})], env=env) as s:
        assert s.fallbacks["context_loaded"] == 2, dict(s.fallbacks)
# host.optimizer.deferred leaves placeholders for two modules it defers; onnx-ir itself is never imported.
print(sorted(m for m in ("onnx_ir", "onnxscript.ir", "host.optimizer.fallback", "host.optimizer.pipeline")
             if m in sys.modules))
"""


def test_a_context_session_does_not_import_the_optimizer(env7, source):
    """A context model is not optimized again, and its EPContext nodes need no expansion: onnx-ir and
    onnxscript (0.4 s on the H200's host) stay unimported."""
    import subprocess
    import sys

    import build

    _, path = source
    ctx_path, _ = save(env7, path)
    out = subprocess.run([sys.executable, "-c", _NO_OPTIMIZER, str(ctx_path)], capture_output=True, text=True,
                         cwd=build.ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _gather_model():
    """Gather (on the CPU EP) from a 2000 x 3 table the graph reads, then Add and Relu on ExampleEP: the
    table is a weight of the context model's own graph."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.linspace(-1, 1, 6000, dtype=np.float32).reshape(2000, 3), "table")
    small = numpy_helper.from_array(np.float32([[0.5, -0.25, 2.0]]), "small")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"], axis=0), helper.make_node("Add", ["g", "x"], ["a"]),
             helper.make_node("Add", ["a", "small"], ["b"]), helper.make_node("Relu", ["b"], ["y"])]
    graph = helper.make_graph(nodes, "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2]),
                                                helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [table, small])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


FEEDS = {"ids": np.array([1999, 7], np.int64), "x": np.float32([[1, -2, 3], [-4, 5, -6]])}
GATHER_OPTIONS = {"fuse": "1", "ops": "Add,Relu"}


@pytest.fixture
def gather_ctx(env7, tmp_path):
    import onnxruntime as ort

    model = _gather_model()
    path = tmp_path / "gather.onnx"
    onnx.save(model, str(path))
    ctx_path, _ = save(env7, path, GATHER_OPTIONS)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    return ctx_path, want


def test_the_graphs_own_large_weights_are_mapped_from_the_weights_file(env7, gather_ctx):
    ctx_path, want = gather_ctx
    proto = onnx.load(str(ctx_path), load_external_data=False)
    where = {t.name: t.data_location for t in proto.graph.initializer}
    assert where == {"table": onnx.TensorProto.EXTERNAL, "small": onnx.TensorProto.DEFAULT}  # small stays inline
    assert ctx_path.stat().st_size < 10_000
    with InferenceSession(str(ctx_path), providers=[(EP, GATHER_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 1
        table = s.graph.initializers["table"]
        assert not table.flags.writeable and not table.flags.owndata  # a view of the mapped file
        assert s.contexts.mapped["table"] is table
        np.testing.assert_array_equal(table, np.linspace(-1, 1, 6000, dtype=np.float32).reshape(2000, 3))
        np.testing.assert_allclose(s.run(None, FEEDS)[0], want, rtol=1e-6)
        full = s.contexts.with_weights(s.graph.model)  # what an expansion by the optimizer is given
        data = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
        np.testing.assert_array_equal(data["table"], table)
        assert s.graph.model.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL  # not changed


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_weights_file_that_cannot_hold_the_graphs_weights_is_a_model_error(env7, gather_ctx, damage):
    from host.errors import ModelError

    ctx_path, _ = gather_ctx
    weights = epcontext.kept_weights_file(ctx_path)
    if damage == "missing":
        weights.unlink()
        pattern = r"^the weights of the context model: cannot map '.*gather_ctx\.weights' \("
    else:
        weights.write_bytes(weights.read_bytes()[:1000])
        pattern = (r"^initializer 'table' \(float32, dims \[2000, 3\]\): bytes \d+\.\.\d+ of '.*gather_ctx\.weights' "
                   r"\(1000 bytes\) do not hold it; expected the file written with the context model$")
    with pytest.raises(ModelError, match=pattern):
        InferenceSession(str(ctx_path), providers=[(EP, GATHER_OPTIONS)], env=env7)


@pytest.mark.filterwarnings("ignore:compiled context of .* not used:RuntimeWarning")
def test_a_refused_context_is_compiled_with_the_mapped_weights_read_in(env7, gather_ctx):
    from tests.property.scenario import damage

    ctx_path, want = gather_ctx
    damage(ctx_path, "corrupt")
    with InferenceSession(str(ctx_path), providers=[(EP, GATHER_OPTIONS)], env=env7) as s:
        assert (s.fallbacks["context_loaded"], s.fallbacks["context_recompiled"]) == (0, 1)
        np.testing.assert_allclose(s.run(None, FEEDS)[0], want, rtol=1e-6)


def test_with_embedded_contexts_the_graphs_own_weights_stay_in_the_model(env7, tmp_path):
    """Embed mode 1 keeps a model that loads from bytes: its contexts and its graph's own weights are in it
    (only the kept subgraphs' weights are beside it, for a recompile)."""
    import onnxruntime as ort

    model = _gather_model()
    path = tmp_path / "gather.onnx"
    onnx.save(model, str(path))
    ctx_path, _ = save(env7, path, GATHER_OPTIONS, **{epcontext.EMBED_MODE: "1"})
    proto = onnx.load(str(ctx_path), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in proto.graph.initializer)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    with InferenceSession(ctx_path.read_bytes(), providers=[(EP, GATHER_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 1 and not s.contexts.mapped
        np.testing.assert_allclose(s.run(None, FEEDS)[0], want, rtol=1e-6)
