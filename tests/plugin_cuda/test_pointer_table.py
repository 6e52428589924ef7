"""plan._pointer_table: the device address tables of the pointer-batched attention products
(cublasGemmBatchedEx), checked against the strided calls they replace, element by element."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from plugin_cuda.plan.plan import _pointer_table
from plugin_cuda.plan.symint import SymInt


def _strided(g, bases, sizes) -> list:
    """Matrix addresses as the strided calls reach them: call k's matrix j of operand i."""
    strides = (g.stride_a, g.stride_b, g.stride_c)
    return [[bases[i] + (off[i] + j * strides[i]) * sizes[i] for off in g.calls for j in range(g.batch)]
            for i in range(3)]


def test_a_table_lists_every_matrix_of_every_strided_call_in_call_order():
    # 3 calls (batch items) of 4 heads; offsets and one stride symbolic, as in a plan with dynamic axes
    g = SimpleNamespace(calls=[(0, 5, 7), (100, 200, 300), (SymInt(1100, "S0*100"), 1300, 1700)],
                        stride_a=SymInt(64, "S1"), stride_b=64, stride_c=128, batch=4)
    bases, sizes = [1 << 40, (1 << 40) + 4096, 1 << 41], (4, 4, 2)
    table = _pointer_table(g, bases, sizes)
    assert table.dtype == np.uint64 and table.shape == (3, 12) and table.flags["C_CONTIGUOUS"]
    assert table.tolist() == _strided(g, bases, sizes)


def test_a_single_call_table_has_its_batch():
    g = SimpleNamespace(calls=[(0, 0, 0)], stride_a=8, stride_b=16, stride_c=32, batch=3)
    assert _pointer_table(g, [0, 0, 0], (2, 2, 4)).tolist() == [[0, 16, 32], [0, 32, 64], [0, 128, 256]]
