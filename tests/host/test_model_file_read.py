"""load_model reads a binary model file through a memory map (host/runtime/model.py: _read_file): the model
is onnx.load's, external data included or left as references, text formats still go through onnx.load,
and a file protobuf cannot read whole is a ModelError naming it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.errors import InvalidArgument, ModelError
from host.runtime.model import load_model


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_binary_file_is_onnx_loads_model(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), path)
    assert load_model(path).SerializeToString() == onnx.load(path).SerializeToString()


@pytest.mark.parametrize("external", [True, False])
def test_external_data_read_or_left_as_references(tmp_path, external):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), path, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    got = load_model(path, external_data=external)
    want = onnx.load(path, load_external_data=external)
    assert got.SerializeToString() == want.SerializeToString()
    (w,) = got.graph.initializer
    assert (w.data_location == TensorProto.EXTERNAL) is not external
    if external:
        np.testing.assert_array_equal(numpy_helper.to_array(w), numpy_helper.to_array(_model().graph.initializer[0]))


def test_a_text_format_file_goes_through_onnx_load(tmp_path):
    path = tmp_path / "m.txtpb"
    onnx.save(_model(), path, format="textproto")
    assert load_model(path).SerializeToString() == _model().SerializeToString()


def test_a_truncated_file_is_a_model_error_naming_it(tmp_path):
    path = tmp_path / "cut.onnx"
    data = _model().SerializeToString()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="cut.onnx' could not be parsed"):
        load_model(path)


def test_an_empty_file_has_no_graph(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(InvalidArgument, match="No graph was found in the protobuf \\(0 bytes\\)"):
        load_model(path)


def test_save_model_replaces_the_file_instead_of_rewriting_it(tmp_path):
    """A reader's memory map of the old file keeps the old bytes (a truncating rewrite would fault it), the
    new file is the new model, and no temporary file is left."""
    import mmap

    from host.runtime.model import save_model

    path = tmp_path / "m.onnx"
    old = _model()
    save_model(old, path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        new = _model()
        new.graph.name = "another"
        new.graph.initializer[0].raw_data = bytes(len(new.graph.initializer[0].raw_data))
        save_model(new, path)
        assert bytes(mapped) == old.SerializeToString()
    assert load_model(path).SerializeToString() == new.SerializeToString()
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_save_model_into_a_missing_folder_raises_and_leaves_nothing(tmp_path):
    from host.runtime.model import save_model

    with pytest.raises(OSError):
        save_model(_model(), tmp_path / "missing" / "m.onnx")
    assert list(tmp_path.iterdir()) == []
