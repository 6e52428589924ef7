"""QLinearConv's int32 bias (ops_quant.ChannelBias): added in float32 where every bias value is a float32, in float64
otherwise; either way the exact sum rounded once to float32, as the float64 add always gave (sums past 2**24
included: one IEEE add rounds once)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from host.cpu_ep.ops_quant import ChannelBias


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k = draw(st.sampled_from([1, 9, 27, 72, 258, 300]))
    channels = draw(st.integers(1, 4))
    bound = k * 255 * 255  # the largest |accumulator| of windows of k centered 8-bit products
    acc = rng.integers(-bound, bound + 1, (1, channels, 3, 5))
    acc[0, 0, 0, :2] = (-bound, bound)
    room = (1 << 24) - bound  # the largest |bias| for which every sum stays below 2**24
    edge = draw(st.sampled_from([max(room, 0), max(room, 0) + 1, 1 << 24, (1 << 24) + 1, 1 << 30, 100]))
    bias = rng.integers(-edge, edge + 1, channels).astype(np.int32)
    bias[0] = edge if draw(st.booleans()) else -edge
    return acc, bias, k


@settings(max_examples=80, deadline=None)
@given(case=cases())
def test_the_bias_gives_the_exact_sum_rounded_once(case):
    acc, bias, k = case
    want = (acc.astype(np.float64) + bias.astype(np.float64).reshape(1, -1, 1, 1)).astype(np.float32)
    # the accumulator's float type: float32 where exact_float takes it (every window's sum below 2**24)
    for dtype in (np.float32, np.float64) if k * 255 * 255 < 1 << 24 else (np.float64,):
        got = acc.astype(dtype)
        ChannelBias(bias, 4).add_to(got)
        np.testing.assert_array_equal(got.astype(np.float32), want)
