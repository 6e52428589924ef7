"""A graph view's constants reach a plugin as read-only views of the host's arrays, not copies
(abi/graph_spec.py; abi/ep_abi.h, "Lifetimes"): the host keeps them as long as the view."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from abi.graph_spec import read_graph
from host.plugins.hostapi import ffi
from host.runtime.graphview import GraphView
from host.runtime.model import build_graph


def _model():
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Concat", ["y", "empty"], ["z"], axis=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])], [w, empty])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_constants_are_read_only_views_of_the_host_arrays():
    graph = build_graph(_model())
    view = GraphView(graph)
    spec = read_graph(ffi, view.ptr)
    consts = {v.name: v.constant for v in spec.values if v.constant is not None}
    assert sorted(consts) == ["empty", "w"]
    w = consts["w"]
    np.testing.assert_array_equal(w, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.shares_memory(w, graph.initializers["w"]), "a view of the host's array, not a copy"
    assert not w.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 1.0  # an EP cannot change the host's weights through the view
    assert consts["empty"].shape == (0, 4)
    # The view keeps the host's array alive: dropping the graph's own reference changes nothing.
    del graph.initializers["w"]
    np.testing.assert_array_equal(read_graph(ffi, view.ptr).values[spec.values.index(
        next(v for v in spec.values if v.name == "w"))].constant, np.arange(12, dtype=np.float32).reshape(3, 4))
