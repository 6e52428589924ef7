"""Which per-node kernels a session warms at creation, and at which sizes (plugin_cuda/kernel_warmup.py).

Pure Python: the specs are what the warm-up feeds a kernel; the GPU side is in test_first_run_gpu.py."""

from types import SimpleNamespace

import numpy as np
import pytest

from plugin_cuda.kernel_warmup import PROBE_DIM, host_fills, input_specs

FLOAT, INT64 = 1, 7


def _graph(*values):
    return SimpleNamespace(values=[SimpleNamespace(shape=shape, elem_type=t) for shape, t in values])


def _node(op_type, inputs, domain=""):
    return SimpleNamespace(op_type=op_type, inputs=inputs, domain=domain)


def test_static_inputs_keep_their_shapes():
    graph = _graph(((2, 3), FLOAT), ((3,), FLOAT))
    assert input_specs(graph, _node("MatMul", [0, 1])) == [((2, 3), np.float32), ((3,), np.float32)]


@pytest.mark.parametrize("op", ["Gather", "Where", "Cast", "Mul"])
def test_symbolic_dims_of_checked_ops_take_the_probe_size(op):
    # BERT's embedding Gather: indices (batch, seq) int64 into a (vocab, hidden) table.
    graph = _graph(((30, 8), FLOAT), ((-1, None), INT64))
    specs = input_specs(graph, _node(op, [0, -1, 1]))
    assert specs == [((30, 8), np.float32), None, ((PROBE_DIM, PROBE_DIM), np.int64)]
    assert PROBE_DIM > 1  # a dim of 1 warms the variant CuPy runs for size-1 axes only


@pytest.mark.parametrize("op, domain", [("MatMul", ""), ("Attention", "com.microsoft"), ("Gather", "com.example")])
def test_symbolic_dims_of_other_ops_are_not_warmed(op, domain):
    graph = _graph(((-1, 4), FLOAT), ((4, 4), FLOAT))
    assert input_specs(graph, _node(op, [0, 1], domain)) is None


@pytest.mark.parametrize("shape, elem_type", [(None, FLOAT), ((0, 4), FLOAT), ((2, 4), 0)])
def test_unknown_rank_type_or_empty_input_is_not_warmed(shape, elem_type):
    assert input_specs(_graph((shape, elem_type)), _node("Add", [0, 0])) is None


def _expand_graph(out_shape):
    graph = _graph(((1, None), INT64), ((2,), INT64), (out_shape, INT64))
    return graph, SimpleNamespace(op_type="Expand", inputs=[0, 1], outputs=[2], domain="")


def test_a_computed_expand_target_takes_its_outputs_dims_at_the_probe_size():
    # BERT's token types: (1, seq) expanded to the ids' (batch, seq), a target the host computes.
    graph, node = _expand_graph((-1, None))
    fills = host_fills(graph, node, input_specs(graph, node))
    assert list(fills) == [1] and fills[1].tolist() == [PROBE_DIM, PROBE_DIM]
    graph, node = _expand_graph((4, -1))
    assert host_fills(graph, node, input_specs(graph, node))[1].tolist() == [4, PROBE_DIM]


def test_an_expand_without_an_output_rank_broadcasts_to_the_probe_size():
    graph, node = _expand_graph(None)
    assert host_fills(graph, node, input_specs(graph, node))[1].tolist() == [PROBE_DIM, PROBE_DIM]


def test_other_ops_take_zeros():
    graph = _graph(((-1, 4), FLOAT), ((2,), INT64))
    node = SimpleNamespace(op_type="Reshape", inputs=[0, 1], outputs=[0], domain="")
    assert host_fills(graph, node, input_specs(graph, node)) == {}
