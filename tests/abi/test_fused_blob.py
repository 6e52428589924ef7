"""abi.fused_blob: a FusedGraph saved as a context and read back (ABI v7), refused when damaged."""

from __future__ import annotations

import numpy as np
import pytest

from abi import fused_blob
from abi.graph_spec import FusedGraph, GraphSpec, NodeSpec, ValueSpec


def sample() -> FusedGraph:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    values = [ValueSpec("x", 1, (-1, 3), 1), ValueSpec("w", 1, (2, 3), 3, w), ValueSpec("t", 1, (-1, 3), 0),
              ValueSpec("y", 7, None, 2)]
    attrs = {"alpha": 0.25, "axis": -1, "mode": "constant", "perm": [1, 0], "scales": [0.5, 2.0],
             "names": ["a", "b"], "value": np.array([[1, 2]], np.int64), "empty": []}
    nodes = [NodeSpec(0, "mul0", "Mul", "", 17, (0, 1), (2,), attrs),
             NodeSpec(1, "cast1", "Cast", "com.example", 1, (2, -1), (3,), {"to": 7})]
    graph = GraphSpec(nodes, values, [ValueSpec("x", 1, (None, 3), 1)], [ValueSpec("y", 7, None, 2)], (0,), (3,), "g")
    return FusedGraph("EP_fused_0", graph)


def _same_value(a: ValueSpec, b: ValueSpec) -> None:
    assert (a.name, a.elem_type, a.shape, a.kind) == (b.name, b.elem_type, b.shape, b.kind)
    assert (a.constant is None) == (b.constant is None)
    if a.constant is not None:
        assert a.constant.dtype == b.constant.dtype
        np.testing.assert_array_equal(a.constant, b.constant)


def test_round_trip_keeps_every_field():
    fused = sample()
    back = fused_blob.from_bytes(fused_blob.to_bytes(fused))
    assert (back.name, back.graph.name) == ("EP_fused_0", "g")
    for a, b in zip(fused.graph.values, back.graph.values, strict=True):
        _same_value(a, b)
    for a, b in zip([*fused.graph.inputs, *fused.graph.outputs], [*back.graph.inputs, *back.graph.outputs],
                    strict=True):
        _same_value(a, b)
    assert (back.graph.input_ids, back.graph.output_ids) == ((0,), (3,))
    for a, b in zip(fused.graph.nodes, back.graph.nodes, strict=True):
        assert (a.index, a.name, a.op_type, a.domain, a.opset, a.inputs, a.outputs) == (
            b.index, b.name, b.op_type, b.domain, b.opset, b.inputs, b.outputs)
        assert set(a.attrs) == set(b.attrs)
        for k, v in a.attrs.items():
            if isinstance(v, np.ndarray):
                assert b.attrs[k].dtype == v.dtype
                np.testing.assert_array_equal(b.attrs[k], v)
            else:
                assert b.attrs[k] == v and type(b.attrs[k]) is type(v), k


@pytest.mark.parametrize(("damage", "pattern"), [
    (lambda b: b"garbage" * 9, r"^not a fused graph \(63 bytes\): no EPHOST-FUSED-GRAPH header$"),
    (lambda b: b[:40], r"^truncated fused graph: the header needs \d+ bytes, \d+ follow$"),
    (lambda b: b[:-30], r"^not a readable fused graph \(\d+ bytes\): BadZipFile: "),
])
def test_damaged_bytes_are_refused(damage, pattern):
    with pytest.raises(fused_blob.BlobError, match=pattern):
        fused_blob.from_bytes(damage(fused_blob.to_bytes(sample())))
